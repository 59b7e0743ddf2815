"""Tool calling: OpenAI's `tools` and `tool_choice` on /v1/chat/completions, as vLLM serves them.

- `required`, or a named function: the output is guided (replicas.guided) by a JSON schema, so it
  always parses. A named function's guide is its `parameters` schema, and the text is the call's
  arguments. `required` takes an array of one or more `{"name", "parameters"}` objects, each one
  of the tools (one at most without `parallel_tool_calls`). The choice's finish reason is then
  `tool_calls`.
- `auto` (OpenAI's default when tools are given): the model writes what it likes, and the
  server's tool-call parser (AppConfig.tool_call_parser, vLLM's --tool-call-parser) finds calls in
  its text. Without one, `auto` is a 400, as in vLLM.
  - `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after any text
    (Hermes, Qwen 2.5 and 3, and the `tiny` preset's chat template).
  - `llama3_json`: the whole output one JSON object `{"name": ..., "parameters": {...}}`, or
    several separated by `;`, after an optional `<|python_tag|>` (Llama 3.1 and later).
  Text that does not parse as calls stays the message's content, as in vLLM.
- `none`: plain text (the template still sees the tools).

ToolOutput turns one choice's text into its message (whole) or into stream deltas. Streamed,
content goes out as it comes until a call may have begun; calls go out whole when the choice
ends (a named function's arguments stream as they come).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Protocol

from replicas.guided import Guide

PARSERS = ("hermes", "llama3_json")  # AppConfig.tool_call_parser


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str) -> dict[str, Any]:
    """A tool call as the response's message carries it (protocol.ToolCall's fields)."""
    return {"id": _call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


# -- guides for forced calls -------------------------------------------------------------------


def tool_guide(tools: list, choice: Any, parallel: bool) -> Guide:
    """The guide of tool_choice `required` (choice the string) or of a named function (choice a
    protocol.NamedToolChoice) over `tools` (protocol.ChatTool); ValueError when the tools'
    `$defs` clash. A schema xgrammar cannot take is found later (Guide.grammar)."""
    if isinstance(choice, str):
        defs: dict[str, Any] = {}
        branches = []
        for tool in tools:
            params = dict(tool.function.parameters or {"type": "object"})
            for name, schema in params.pop("$defs", {}).items():  # refs point at the root: hoist them there
                if defs.setdefault(name, schema) != schema:
                    raise ValueError(f"tools define $defs/{name} differently")
            branches.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                              "parameters": params},
                             "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
    else:
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        schema = fn.parameters or {"type": "object"}
    return Guide("json", json.dumps(schema))


def _forced_calls(text: str) -> list[dict[str, Any]] | None:
    """`required`'s output (a JSON array of {"name", "parameters"}) as calls; None if it does not
    parse (cut short by max_tokens)."""
    try:
        items = json.loads(text)
        return [_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


# -- parsers for `auto` --------------------------------------------------------------------------


class ToolCallParser(Protocol):
    def start(self, text: str) -> int | None:
        """Where calls begin in the text so far (None: not yet)."""

    def held(self, text: str) -> int:
        """Characters at the end of the text so far that may begin a call (not streamed yet)."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole text -> (content, calls); ([the text], []) where no calls parse."""


def _arguments(obj: dict, *keys: str) -> str:
    """A call's arguments as JSON text (from the first of keys the object has; an object, or
    JSON text of one)."""
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(args, dict):
        raise TypeError("arguments must be an object")
    return json.dumps(args, ensure_ascii=False)


class HermesParser:
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def start(self, text: str) -> int | None:
        i = text.find(self.START)
        return None if i < 0 else i

    def held(self, text: str) -> int:
        return next((n for n in range(min(len(text), len(self.START) - 1), 0, -1) if self.START.startswith(text[-n:])), 0)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = self.start(text)
        if start is None:
            return text, []
        try:
            calls = []
            for body in self._BLOCK.findall(text, start):
                obj = json.loads(body)
                calls.append(_call(obj["name"], _arguments(obj, "arguments", "parameters")))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []
        return (text[:start] if text[:start].strip() else None), calls


class Llama3JsonParser:
    TAG = "<|python_tag|>"

    def start(self, text: str) -> int | None:
        body = text.lstrip()
        return len(text) - len(body) if body.startswith(("{", self.TAG)) else None

    def held(self, text: str) -> int:
        body = text.lstrip()
        return len(text) if self.TAG.startswith(body) else 0  # (all whitespace: held too)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = self.start(text)
        if start is None:
            return text, []
        body, decoder, calls, i = text[start:].removeprefix(self.TAG), json.JSONDecoder(), [], 0
        try:
            while True:
                i = _skip(body, i)
                obj, i = decoder.raw_decode(body, i)
                calls.append(_call(obj["name"], _arguments(obj, "parameters", "arguments")))
                i = _skip(body, i)
                if i == len(body):
                    return None, calls
                if body[i] != ";":
                    return text, []
                i += 1
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def parser(name: str) -> ToolCallParser:
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[name]()


# -- one choice's output --------------------------------------------------------------------------


class ToolOutput:
    """One choice's text under tool_choice `required`, a named function, or `auto` with a parser.

    whole(text, finish) -> (content, calls, finish reason) of the message; streamed, step(delta,
    finish) -> (the delta's fields, its finish reason) for each output, its text so far kept here.
    """

    def __init__(self, choice: Any, parser: ToolCallParser | None):
        self.named = None if isinstance(choice, str) else choice.function.name
        self.forced = choice == "required" or self.named is not None
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text streamed as content
        self.started = False  # calls may have begun: the rest is held

    @classmethod
    def of(cls, choice: Any, parser_name: str | None) -> ToolOutput | None:
        """The output of a choice under a request's effective tool_choice (None: plain text)."""
        if choice == "none" or (choice == "auto" and parser_name is None):
            return None
        return cls(choice, parser(parser_name) if choice == "auto" else None)

    def whole(self, text: str, finish: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        if self.named is not None:
            return None, [_call(self.named, text)], finish
        if self.forced:
            calls = _forced_calls(text)
            return (text, [], finish) if calls is None else (None, calls, "tool_calls")
        content, calls = self.parser.parse(text)
        return content, calls, "tool_calls" if calls else finish

    def step(self, delta: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        self.text += delta
        if self.named is not None:  # the arguments stream as they come, after a first delta that names the call
            if not self.started:
                self.started = True
                call = {"index": 0, "id": _call_id(), "type": "function",
                        "function": {"name": self.named, "arguments": delta}}
            else:
                call = {"index": 0, "function": {"arguments": delta}}
            return ({"tool_calls": [call]} if delta or "id" in call else {}), finish
        if not self.forced and not self.started:
            start = self.parser.start(self.text)
            self.started = start is not None
            end = start if self.started else len(self.text) - (0 if finish else self.parser.held(self.text))
            if not self.text[:end].strip():  # leading whitespace waits for content (none before calls)
                end = self.sent
            out = {"content": self.text[self.sent:end]} if end > self.sent else {}
            self.sent = max(self.sent, end)
            if not self.started and finish is not None and self.sent < len(self.text):
                out = {"content": out.get("content", "") + self.text[self.sent:]}
                self.sent = len(self.text)
        else:
            out = {}
        if finish is None or (not self.forced and not self.started):
            return out, finish
        content, calls, finish = self.whole(self.text, finish)
        if calls:
            return {**out, "tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, finish
        rest = (content or "")[self.sent:]  # no calls after all: the held text is content
        return ({"content": out.get("content", "") + rest} if out.get("content") or rest else out), finish
