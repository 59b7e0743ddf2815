"""Reasoning models' thinking apart from their answer: vLLM's --reasoning-parser, as the chat
message's `reasoning_content` beside its `content` (AppConfig.reasoning_parser).

- `deepseek_r1` (DeepSeek-R1 and its distills, whose chat template opens the thinking): the
  output is reasoning up to `</think>`, content after it; a `<think>` at its start is dropped. An
  output with no `</think>` is reasoning all through (cut short while thinking).
- `qwen3` (Qwen3, QwQ): an output that starts with `<think>` is reasoning up to `</think>` (or its
  end, cut short), content after; any other output is content (thinking off).

A request with a guide (structured outputs, or tool_choice `required` / a named function) thinks
freely first where the tokenizer has `<think>` and `</think>` as tokens of their own
(SamplingParams.think, from think_tags): the guide holds the content after `</think>`, as in
vLLM. Where it has not, the guide holds the whole output and it is not split. Under tool_choice
`auto` the tool-call parser reads the content only, as in vLLM.

ReasoningSplit turns one choice's text into (reasoning, content), whole or streamed: streamed,
text that may begin a tag is held back until it is known, and the deltas add up to the whole.
"""

from __future__ import annotations

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def think_tags(tokenizer, parser: str | None, guided: bool) -> tuple[int | None, int] | None:
    """SamplingParams.think of a chat request under `parser`: (start, end) token ids of the tags,
    start None where the template opens the thinking (deepseek_r1); None where nothing is guided,
    no parser is set, or the tags are not tokens of their own (the guide then holds it all)."""
    if parser is None or not guided or tokenizer is None:
        return None
    start, end = (tokenizer.backend.token_to_id(tag) for tag in (START, END))
    if start is None or end is None:
        return None
    return (None if parser == "deepseek_r1" else start), end


def held(text: str, tag: str) -> int:
    """Characters at the end of text that may begin tag."""
    longest = min(len(text), len(tag) - 1)
    return next((n for n in range(longest, 0, -1) if tag.startswith(text[-n:])), 0)


class ReasoningSplit:
    """One choice's output under a reasoning parser: whole(text) -> (reasoning, None when there is
    none; content); streamed, step(delta, final) -> (reasoning delta, content delta), its text
    kept here."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
        self.parser = parser
        self.text = ""
        self.opened: bool | None = None  # the output starts thinking (None: not known yet)
        self.end = -1  # where `</think>` starts, once seen
        self.sent_reasoning = self.sent_content = 0  # characters of text streamed as each

    def whole(self, text: str) -> tuple[str | None, str]:
        reasoning, content = ReasoningSplit(self.parser).step(text, final=True)
        return reasoning or None, content

    def _reasoning_start(self) -> int | None:
        """Where the reasoning starts in the text (after a leading `<think>`), None while not known."""
        if self.opened is None:
            if START.startswith(self.text) and len(self.text) < len(START):
                return None  # (it may still be `<think>`)
            self.opened = self.text.startswith(START) or self.parser == "deepseek_r1"
        return len(START) if self.text.startswith(START) else 0

    def step(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        start = self._reasoning_start()
        if start is None:
            if not final:
                return "", ""
            self.opened = self.parser == "deepseek_r1"  # a short output that began like `<think>`
            start = 0
        if not self.opened:  # content all through
            out, self.sent_content = self.text[self.sent_content :], len(self.text)
            return "", out
        self.sent_reasoning = max(self.sent_reasoning, start)
        if self.end < 0:
            found = self.text.find(END, start)
            if found >= 0:
                self.end, self.sent_content = found, found + len(END)
        if self.end < 0:  # still thinking: hold back what may begin `</think>`
            upto = len(self.text) - (0 if final else held(self.text, END))
            out, self.sent_reasoning = self.text[self.sent_reasoning : upto], max(self.sent_reasoning, upto)
            return out, ""
        reasoning = self.text[self.sent_reasoning : self.end] if self.sent_reasoning < self.end else ""
        self.sent_reasoning = max(self.sent_reasoning, self.end)
        out, self.sent_content = self.text[self.sent_content :], len(self.text)
        return reasoning, out
