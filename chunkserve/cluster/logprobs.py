"""Logprobs in OpenAI's two response forms, from the replicas' per-token entries
(GenerateOutput.logprobs: (the token's logprob, the most likely tokens' (id, logprob))).

A token's text is its id decoded alone (a piece of a multi-byte character decodes to U+FFFD, as
in vLLM); a model without a tokenizer names tokens "token_id:<id>", vLLM's form for that.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from chunkserve.cluster.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob
from chunkserve.replicas.model.tokenizer import Tokenizer

Entry = tuple[float, tuple[tuple[int, float], ...]]


class TokenTexts:
    """Token id -> its text, decoded once."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = (
                f"token_id:{token}"
                if self.tokenizer is None
                else self.tokenizer.decode([token], skip_special_tokens=False)
            )
            if len(self._texts) < 1 << 16:
                self._texts[token] = text
        return text


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[Entry | None],
    texts: TokenTexts,
    offset: int = 0,
    hidden: Container[int] = (),
) -> CompletionLogprobs:
    """/v1/completions' form; offset: characters of the choice's text before these tokens (the
    tokens' texts' lengths count on from it); hidden: positions of tokens whose text the
    choice's text does not hold (a BOS the tokenizer added, special tokens skipped), which count
    no characters. An entry None (an echoed prompt's first token) is a null logprob and null
    alternatives."""
    tokens = [texts(t) for t in token_ids]
    offsets = []
    for i, text in enumerate(tokens):
        offsets.append(offset)
        offset += 0 if i in hidden else len(text)
    top: list[dict[str, float] | None] = []
    for entry in entries:  # most likely first; of tokens that decode alike, the likeliest's
        alts: dict[str, float] | None = None if entry is None else {}
        for t, lp in () if entry is None else entry[1]:
            alts.setdefault(texts(t), lp)
        top.append(alts)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e is None else e[0] for e in entries],
        top_logprobs=top,
        text_offset=offsets,
    )


def text_length(logprobs: CompletionLogprobs, hidden: Container[int] = ()) -> int:
    """Characters of the choice's text that logprobs' tokens stand for (completion_logprobs' hidden)."""
    return sum(len(text) for i, text in enumerate(logprobs.tokens) if i not in hidden)


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[Entry], texts: TokenTexts) -> ChatLogprobs:
    """/v1/chat/completions' form."""

    def top(token: int, logprob: float) -> dict:
        text = texts(token)
        return dict(token=text, logprob=logprob, bytes=list(text.encode("utf-8", errors="replace")))

    return ChatLogprobs(
        content=[
            TokenLogprob(**top(t, lp), top_logprobs=[TopLogprob(**top(b, blp)) for b, blp in best])
            for t, (lp, best) in zip(token_ids, entries, strict=True)
        ]
    )
