"""Tool calling: OpenAI's `tools` and `tool_choice` on /v1/chat/completions, as vLLM serves them.

- `required`, or a named function: the output is guided (chunkserve.replicas.engine.guided) by a JSON schema, so it
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

ToolOutput turns one choice's text into its message (whole) or into stream deltas. Streamed, a
named function's arguments go out as they come, each of `required`'s calls once its object
closes; under `auto` content goes out as it comes until a call may have begun, and each call once
its parser holds it whole (a hermes block closed; llama3_json's at the end).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from chunkserve.cluster.reasoning import held
from chunkserve.replicas.engine.guided import Guide


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
            branches.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": tool.function.name}, "parameters": params},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
    else:
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        schema = fn.parameters or {"type": "object"}
    return Guide("json", json.dumps(schema))


class _ArrayItems:
    """The whole items of a JSON array of objects as its text grows (`required`'s output, which
    its guide keeps a prefix of `[{...}, {...}]`): each object's text once its brace closes."""

    def __init__(self):
        self.pos, self.depth, self.start = 0, 0, -1
        self.in_string = self.escaped = self.closed = False

    def feed(self, text: str) -> list[str]:
        """text: all of it so far -> the items that closed in what is new."""
        items = []
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "[{":
                self.depth += 1
                if self.depth == 2:
                    self.start = i
            elif c in "]}":
                self.depth -= 1
                if self.depth == 1 and self.start >= 0:
                    items.append(text[self.start : i + 1])
                    self.start = -1
                self.closed |= self.depth == 0
        self.pos = len(text)
        return items


def _item_call(item: str) -> dict[str, Any]:
    """An item of `required`'s array, {"name", "parameters"}, as a call (raises: not one)."""
    obj = json.loads(item)
    return _call(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False))


def _block_call(body: str) -> dict[str, Any]:
    """A hermes block's JSON, {"name", "arguments"} (or "parameters"), as a call (raises: not one)."""
    obj = json.loads(body)
    return _call(obj["name"], _arguments(obj, "arguments", "parameters"))


def _calls_until_bad(texts: list[str], call_of: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """The texts as calls, up to the first that is not one."""
    calls = []
    for text in texts:
        try:
            calls.append(call_of(text))
        except (json.JSONDecodeError, KeyError, TypeError):
            break
    return calls


# -- parsers for `auto` --------------------------------------------------------------------------


class ToolCallParser(Protocol):
    def start(self, text: str) -> int | None:
        """Where calls begin in the text so far (None: not yet)."""

    def held(self, text: str) -> int:
        """Characters at the end of the text so far that may begin a call (not streamed yet)."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole text -> (content, calls); ([the text], []) where no calls parse."""

    def closed(self, text: str) -> int:
        """How many of parse's calls the text so far holds whole already (streamed before the end)."""


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
    """<tool_call> blocks after any content: the calls are the blocks that parse, up to the first
    that does not (the rest dropped); none parsing: the whole text is content. A block left open
    at the end (cut short) counts if its JSON is whole."""

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
    _CLOSED = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def start(self, text: str) -> int | None:
        i = text.find(self.START)
        return None if i < 0 else i

    def held(self, text: str) -> int:
        return held(text, self.START)

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        start = self.start(text)
        calls = [] if start is None else _calls_until_bad(self._BLOCK.findall(text, start), _block_call)
        if not calls:
            return text, []
        return (text[:start] if text[:start].strip() else None), calls

    def closed(self, text: str) -> int:
        start = self.start(text)
        return 0 if start is None else len(_calls_until_bad(self._CLOSED.findall(text, start), _block_call))


class Llama3JsonParser:
    """The whole output JSON calls, `;` between them, after an optional <|python_tag|>; anything
    else in it: all content. Its calls are known only at the end."""

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

    def closed(self, text: str) -> int:
        return 0


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
    Both give the same message: the stream's deltas add up to the whole.
    - named: the text is the call's arguments (streamed as they come).
    - required: each whole item of the array is a call (streamed as its object closes); the
      finish reason is `tool_calls` once the array closes. Cut short, the whole items are the
      calls, and with none the text is content.
    - auto: the parser's; content streams until a call may begin, each call once the parser
      holds it whole (hermes: its block closed; llama3_json: at the end).
    """

    def __init__(self, choice: Any, parser: ToolCallParser | None):
        self.named = None if isinstance(choice, str) else choice.function.name
        self.required = choice == "required"
        self.parser = parser
        self.text = ""
        self.sent = 0  # auto: characters of text streamed as content
        self.started = False  # named: the call's first delta went out; auto: calls may have begun (the rest is held)
        self.calls = 0  # required and auto: calls streamed
        # required: the array scanned, whether an item that is not a call came
        self.items, self.bad = _ArrayItems(), False

    @classmethod
    def of(cls, choice: Any, parser_name: str | None) -> ToolOutput | None:
        """The output of a choice under a request's effective tool_choice (None: plain text).
        `auto` needs a parser (the ingress answers 400 without one)."""
        if choice == "none":
            return None
        if choice == "auto" and parser_name is None:
            raise ValueError('tool_choice "auto" needs a tool_call_parser')
        return cls(choice, parser(parser_name) if choice == "auto" else None)

    def whole(self, text: str, finish: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        if self.named is not None:
            return None, [_call(self.named, text)], finish
        if self.required:
            items = _ArrayItems()
            calls = _calls_until_bad(items.feed(text), _item_call)
            return (None if calls else text), calls, "tool_calls" if calls and items.closed else finish
        content, calls = self.parser.parse(text)
        return content, calls, "tool_calls" if calls else finish

    def step(self, delta: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        self.text += delta
        if self.named is not None:
            return self._step_named(delta), finish
        if self.required:
            return self._step_required(finish)
        return self._step_auto(finish)

    def _step_named(self, delta: str) -> dict[str, Any]:
        if not self.started:  # the first delta names the call
            self.started = True
            return {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": _call_id(),
                        "type": "function",
                        "function": {"name": self.named, "arguments": delta},
                    }
                ]
            }
        return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}

    def _step_required(self, finish: str | None) -> tuple[dict[str, Any], str | None]:
        items = self.items.feed(self.text)
        calls = [] if self.bad else _calls_until_bad(items, _item_call)
        self.bad |= len(calls) < len(items)  # (no calls after it, as in whole)
        out = {"tool_calls": self._indexed(calls)} if calls else {}
        if finish is None:
            return out, None
        if not self.calls:  # not one call: the text is content
            return {"content": self.text}, finish
        return out, "tool_calls" if self.items.closed else finish

    def _step_auto(self, finish: str | None) -> tuple[dict[str, Any], str | None]:
        out: dict[str, Any] = {}
        if not self.started:
            start = self.parser.start(self.text)
            self.started = start is not None
            end = start if self.started else len(self.text) - (0 if finish else self.parser.held(self.text))
            if self.text[:end].strip() and end > self.sent:  # (leading whitespace waits: none goes before calls)
                out, self.sent = {"content": self.text[self.sent : end]}, end
        if finish is None:
            if self.started and self.parser.closed(self.text) > self.calls:  # calls whole already: out now
                _, calls = self.parser.parse(self.text)
                out["tool_calls"] = self._new_calls(calls[: self.parser.closed(self.text)])
            return out, None
        content, calls, finish = self.whole(self.text, finish)
        if calls:
            new = self._new_calls(calls)
            return ({**out, "tool_calls": new} if new else out), finish
        rest = content[self.sent :]  # no calls: all the text is content, the held part too
        return ({"content": out.get("content", "") + rest} if out or rest else {}), finish

    def _new_calls(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The calls past those streamed, as deltas (see _indexed)."""
        return self._indexed(calls[self.calls :])

    def _indexed(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Calls about to stream, after those streamed, as deltas: each whole, with its index."""
        out = [{"index": self.calls + i, **c} for i, c in enumerate(calls)]
        self.calls += len(out)
        return out
