"""Guided decoding (structured outputs): a request's tokens kept inside a grammar.

vLLM's and SGLang's structured outputs, through the same grammar engine (xgrammar): a JSON
schema, any JSON object, a regular expression, one of a list of strings, or an EBNF grammar. Per
step, each guided row's grammar state gives the tokens that may come next, as a bitmask over the
vocabulary [W = ceil(V / 32)] int32 filled on the host; the logits of every other token become
-inf before anything reads them (sampling, and logprobs, as in vLLM). Once the row's token is
known the state takes it (LLMEngine._settle). A grammar that has ended allows only the end of
text (the model's EOS tokens).

Compiling a grammar against a vocabulary takes milliseconds to seconds (xgrammar precomputes
which tokens each grammar position can take), so the replica compiles it off the step loop
(Guides.compile, cached per guide) before the request reaches the engine.

Special tokens other than EOS (chat-turn markers, BOS, ...) are never allowed: their text is not
part of the output, so a grammar must not count it (xgrammar would read a byte-level tokenizer's
`<|user|>` as those eight characters).
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import xgrammar

    from chunkserve.replicas.model.tokenizer import Tokenizer

__all__ = ["Guide", "Guides", "allowed_mask", "fill_bitmask", "mask_logits"]

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar text longer than this is refused


@dataclass(frozen=True)
class Guide:
    """What a request's output must match (SamplingParams.guided).

    kind "json": spec is a JSON schema (its JSON text); "json_object": any JSON object (spec
    unused); "regex": a regular expression the whole output matches; "choice": spec is a tuple of
    strings, the output exactly one of them; "grammar": an EBNF grammar (xgrammar's / GBNF form,
    rule `root`). any_whitespace: in JSON, any whitespace between tokens (vLLM's default), else
    the compact form only."""

    kind: str
    spec: str | tuple[str, ...] = ""
    any_whitespace: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"guided decoding kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            if (
                not isinstance(self.spec, tuple)
                or not self.spec
                or not all(isinstance(s, str) and s for s in self.spec)
            ):
                raise ValueError("guided choice takes a non-empty list of non-empty strings")
            if sum(map(len, self.spec)) > MAX_SPEC_CHARS:
                raise ValueError(f"guided choices exceed {MAX_SPEC_CHARS} characters")
        elif not isinstance(self.spec, str):
            raise ValueError(f"guided {self.kind} takes a string, got {type(self.spec).__name__}")
        elif len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"guided {self.kind} exceeds {MAX_SPEC_CHARS} characters")
        elif self.kind in ("json", "regex", "grammar") and not self.spec:
            raise ValueError(f"guided {self.kind} must not be empty")
        if self.kind not in ("json", "json_object"):  # (JSON's alone: one compiled grammar per spec)
            object.__setattr__(self, "any_whitespace", True)

    def grammar(self) -> xgrammar.Grammar:
        """The guide as an xgrammar Grammar (no vocabulary yet); ValueError saying what is wrong
        with a schema, regex or grammar that does not parse."""
        xgr = _xgrammar()
        try:
            if self.kind in ("json", "json_object"):  # json_object: an object, as OpenAI's JSON mode
                schema = self.spec if self.kind == "json" else '{"type": "object"}'
                return _strict_strings(xgr, xgr.Grammar.from_json_schema(schema, any_whitespace=self.any_whitespace))
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "choice":
                # each choice a string literal (JSON's escapes are EBNF's)
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(s) for s in self.spec))
            return xgr.Grammar.from_ebnf(self.spec)
        except RuntimeError as e:  # xgrammar raises its parsers' errors as RuntimeError
            raise ValueError(f"guided {self.kind}: {_message(e)}") from None


# xgrammar 0.2.9 writes a string of bounded length (maxLength, minLength) as characters other than
# the quote, the backslash, CR and LF, so control characters came out raw: invalid JSON (Python's
# and JavaScript's parsers refuse it; seen with the random-weight model). Its unbounded strings
# exclude U+0000-U+001F as JSON says; bounded ones are made to as well, by rewriting that
# character class in the grammar's EBNF.
_LAX_CHARS = r"[^\"\\\r\n]"
_STRICT_CHARS = r"[^\0-\x1f\"\\]"


def _strict_strings(xgr, grammar):
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LAX_CHARS, _STRICT_CHARS)) if _LAX_CHARS in text else grammar


def _message(e: Exception) -> str:
    """xgrammar's error text without its log prefix ('[time] file.cc:line: ')."""
    text = str(e).strip()
    text = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _xgrammar():
    import xgrammar  # (imported on first use: about 1.6 s, with transformers)

    return xgrammar


def load_grammar_engine() -> None:
    """Import the grammar engine now, before serving: its import holds the interpreter lock for
    long stretches, which at a first structured-output request stalled the ingress's event loop
    (and so its streams) for up to a quarter of a second."""
    _xgrammar()


class Guides:
    """One engine's grammars: the vocabulary's token info, and the grammars compiled for it (the
    last MAX_COMPILED of them kept, so distinct schemas do not grow the replica's memory without
    bound); matcher() makes a request's grammar state (Sequence.matcher)."""

    MAX_COMPILED = 256

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        xgr = _xgrammar()
        stop_ids = tuple(t for t in stop_token_ids if 0 <= t < vocab_size)
        if not stop_ids:
            raise ValueError("guided decoding needs an end-of-text token in the vocabulary")
        self._info = _tokenizer_info(xgr, tokenizer, vocab_size, stop_ids)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=8, cache_enabled=False)
        self._compiled: OrderedDict[Guide, xgrammar.CompiledGrammar] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # compile() runs in the replica's threads, matcher() in the step's

    def compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        """The guide compiled for this vocabulary (cached; thread-safe). ValueError for a guide
        that does not parse."""
        with self._lock:
            hit = self._compiled.get(guide)
            if hit is not None:
                self._compiled.move_to_end(guide)
                return hit
        compiled = self._compiler.compile_grammar(guide.grammar())  # (outside the lock: it may take seconds)
        with self._lock:
            compiled = self._compiled.setdefault(guide, compiled)
            self._compiled.move_to_end(guide)
            while len(self._compiled) > self.MAX_COMPILED:
                self._compiled.popitem(last=False)
            return compiled

    def matcher(self, guide: Guide) -> xgrammar.GrammarMatcher:
        """A fresh grammar state for one request."""
        return _xgrammar().GrammarMatcher(self.compile(guide))


def _tokenizer_info(xgr, tokenizer: Tokenizer, vocab_size: int, stop_ids: tuple[int, ...]):
    """xgrammar's view of the vocabulary: each token's text as the tokenizer encodes it (byte-level
    or not, detected by xgrammar from the tokenizer's description), special tokens none (so never
    allowed), ids past the tokenizer's vocabulary none either (padded model rows)."""
    from transformers import PreTrainedTokenizerFast  # (an xgrammar dependency)

    backend = tokenizer.backend
    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=vocab_size, stop_token_ids=list(stop_ids)
    )
    special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    vocab = [""] * vocab_size
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if i < vocab_size and i not in special:
            vocab[i] = token
    return xgr.TokenizerInfo(
        vocab,
        vocab_type=detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_ids),
        add_prefix_space=detected.add_prefix_space,
    )


def fill_bitmask(
    matchers: list[xgrammar.GrammarMatcher], vocab_size: int, stop_token_ids: tuple[int, ...], pinned: bool = False
) -> torch.Tensor:
    """[len(matchers), W] int32 on the host (pinned: page-locked, for an asynchronous copy): bit
    t % 32 of word t // 32 set where token t may come next in that matcher's grammar; after its
    end (a request that ignores EOS goes on) the stop tokens only. The matchers are filled on
    xgrammar's threads (BatchGrammarMatcher; the step times it gives are in chunkserve/replicas/tools/records/README.md,
    chunkserve.replicas.tools.bench --guided)."""
    mask = torch.full((len(matchers), -(-vocab_size // 32)), -1, dtype=torch.int32, pin_memory=pinned)
    live = [i for i, m in enumerate(matchers) if not m.is_terminated()]
    if live:
        _batch_matcher().batch_fill_next_token_bitmask([matchers[i] for i in live], mask, indices=live)
    for i in sorted(set(range(len(matchers))) - set(live)):
        mask[i] = 0
        for t in stop_token_ids:
            allow(mask, i, t)
    return mask


@functools.cache
def _batch_matcher():
    # a few threads: several engines (tensor-parallel ranks, replicas) may share a node's cores
    return _xgrammar().BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))


def allow(words: torch.Tensor, row: int, token: int) -> None:
    """Set token's bit in row `row` of a [N, W] int32 bitmask (fill_bitmask's), in place."""
    words[row, token // 32] |= _bit(token % 32)


def _bit(b: int) -> int:
    """Bit b of an int32 word, as the int32 value it gives (bit 31 is the sign)."""
    return 1 << b if b < 31 else -(1 << 31)


def allowed_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 bitmask -> [N, vocab_size] bool, True where the token is allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [N, W, 32]: bit b of word w is token 32 w + b
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] with every token the bitmask [len(rows), W] (host) disallows in row rows[i]
    at -inf (a new tensor; the input is left as it was)."""
    from chunkserve.replicas.engine.transfer import to_device

    dev = logits.device
    if dev.type == "cuda":  # through pinned memory: a pageable copy would wait for the queued steps
        bitmask = (bitmask if bitmask.is_pinned() else bitmask.pin_memory()).to(dev, non_blocking=True)
    allowed = allowed_mask(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.masked_fill(~allowed, float("-inf"))
    index = to_device(rows, dev)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return out
