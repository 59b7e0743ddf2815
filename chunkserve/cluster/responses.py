"""Responses out: the replicas' GenerateOutputs as OpenAI's bodies, whole or as server-sent events.

Owns the shape of what a client reads back: /v1/completions' and /v1/chat/completions' choices
(echo, token ids, usage with its cached tokens), logprobs' text (chunkserve/cluster/logprobs.py),
chat's reasoning split (reasoning.py) and tool calls (tool_calls.py), the SSE stream (`data:`
chunks, the usage chunk, an error sent inside a begun stream, `[DONE]`), the Server-Timing
header, and a response's end (each choice's last output, for the tenant's charge). Large bodies
are formatted off the event loop (chunkserve/cluster/prompts.py OFF_LOOP_SIZE)."""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from chunkserve.cluster import metrics as cluster_metrics
from chunkserve.cluster.errors import serve_request_id, server_error
from chunkserve.cluster.logprobs import TokenTexts, chat_logprobs, completion_logprobs, text_length
from chunkserve.cluster.prompts import OFF_LOOP_SIZE, off_loop_if
from chunkserve.cluster.protocol import (
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    ErrorResponse,
    Usage,
)
from chunkserve.cluster.reasoning import ReasoningSplit
from chunkserve.cluster.replica_calls import Outputs, Started, cancel, unless_gone
from chunkserve.cluster.tool_calls import ToolOutput
from chunkserve.replicas.wire import GenerateOutput


class ResponseHead(NamedTuple):
    """What every body of one response carries or follows: its id and model name, the choices per
    prompt (n), whether choices carry their token ids (return_token_ids), and the token texts
    logprobs are written with."""

    request_id: str
    model: str
    n: int
    token_ids: bool
    texts: TokenTexts


class CompletionFormat:
    """GenerateOutputs -> /v1/completions bodies: stream chunks, the usage chunk, the whole
    response. Choice c is the c-th generate request's output: prompt c // n's choice c % n."""

    def __init__(
        self,
        head: ResponseHead,
        prompts: list[list[int]],
        echo: list[str] | None = None,
        echo_hidden: list[frozenset[int]] | None = None,
        hidden_ids: frozenset[int] = frozenset(),
    ):
        self.id, self.model, self.n, self.token_ids, self.texts = head
        self.prompts = prompts
        self.echo = echo  # per prompt, its text, sent before each of its choices' (completions' echo), or None
        # text_offset counts no characters for these: per echoed prompt, the positions of tokens its
        # echo does not show (a BOS the tokenizer added); generated ids whose text is skipped
        self.echo_hidden = echo_hidden or [frozenset()] * len(prompts)
        self.hidden_ids = hidden_ids
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice: characters of its tokens' texts sent (logprobs' text_offset)

    def _with_prompt(self, outs: list[GenerateOutput], index: int) -> tuple[list[int], list]:
        """Choice index's tokens and logprob entries (from its outputs outs), after its prompt's
        when that is echoed with its logprobs (the first output carries them)."""
        ids, entries = _tokens_and_logprobs(outs)
        if self.echo is not None and outs[0].prompt_logprobs is not None:
            return self.prompts[index // self.n] + ids, list(outs[0].prompt_logprobs) + entries
        return ids, entries

    def _hidden(self, ids: list[int], index: int, echoed: bool) -> set[int]:
        """Positions of ids (choice index's, after its prompt's if echoed) whose text is not in the choice's text."""
        prompt = len(self.prompts[index // self.n]) if echoed else 0
        return set(self.echo_hidden[index // self.n] if echoed else ()) | {
            i for i in range(prompt, len(ids)) if ids[i] in self.hidden_ids
        }

    def chunk(self, out: GenerateOutput, index: int) -> CompletionResponse:
        first = self.echo is not None and index not in self.offsets  # (the echo goes first)
        logprobs, length = None, 0
        if out.logprobs is not None:
            echoed = first and out.prompt_logprobs is not None
            ids, entries = self._with_prompt([out], index) if first else _tokens_and_logprobs([out])
            hidden = self._hidden(ids, index, echoed)
            logprobs = completion_logprobs(ids, entries, self.texts, self.offsets.get(index, 0), hidden)
            length = text_length(logprobs, hidden)
        self.offsets[index] = self.offsets.get(index, 0) + length
        choice = CompletionChoice(
            index=index,
            text=self.echo[index // self.n] + out.text if first else out.text,
            finish_reason=out.finish_reason,
            logprobs=logprobs,
            token_ids=list(out.token_ids) if self.token_ids else None,
        )
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _whole_logprobs(self, outs: list[GenerateOutput], index: int) -> CompletionLogprobs:
        ids, entries = self._with_prompt(outs, index)
        echoed = self.echo is not None and outs[0].prompt_logprobs is not None
        return completion_logprobs(ids, entries, self.texts, hidden=self._hidden(ids, index, echoed))

    def usage(self, lasts: list[GenerateOutput]) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[], usage=Usage.of(lasts, self.n)
        )

    def whole(self, choices: list[list[GenerateOutput]]) -> CompletionResponse:
        echo = self.echo or [""] * len(self.prompts)
        body = [
            CompletionChoice(
                index=i,
                text=echo[i // self.n] + "".join(o.text for o in outs),
                finish_reason=outs[-1].finish_reason,
                token_ids=[t for o in outs for t in o.token_ids] if self.token_ids else None,
                prompt_token_ids=self.prompts[i // self.n] if self.token_ids else None,
                logprobs=None if outs[0].logprobs is None else self._whole_logprobs(outs, i),
            )
            for i, outs in enumerate(choices)
        ]
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=body,
            usage=Usage.of([outs[-1] for outs in choices], self.n),
        )


class ChatFormat(CompletionFormat):
    """GenerateOutputs -> /v1/chat/completions bodies; each choice's first chunk's delta carries the
    role. Under a reasoning parser (chunkserve/cluster/reasoning.py) each choice's thinking is split from its
    content (not for a guided request: its guide holds the whole output); under a tool choice
    (chunkserve/cluster/tool_calls.py) the content goes through a ToolOutput."""

    def __init__(
        self,
        head: ResponseHead,
        prompt: list[int],
        tool_choice: Any = "none",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        super().__init__(head, [prompt])
        self.sent_role: set[int] = set()  # choices whose role went out
        self.tool_choice, self.tool_call_parser = tool_choice, tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.streams: dict[int, tuple[ReasoningSplit | None, ToolOutput | None]] = {}  # per choice, streamed

    def _new(self) -> tuple[ReasoningSplit | None, ToolOutput | None]:
        """A choice's reasoning split and tool output (None: not asked for)."""
        return (
            None if self.reasoning_parser is None else ReasoningSplit(self.reasoning_parser),
            ToolOutput.of(self.tool_choice, self.tool_call_parser),
        )

    def chunk(self, out: GenerateOutput, index: int) -> ChatCompletionChunk | None:
        if index not in self.streams:
            self.streams[index] = self._new()
        split, tools = self.streams[index]
        finish = out.finish_reason
        reasoning, text = ("", out.text) if split is None else split.step(out.text, final=finish is not None)
        if tools is not None:
            delta, finish = tools.step(text, finish)
        elif text or (finish is None and split is None):
            delta = {"content": text}
        else:
            delta = {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if index not in self.sent_role:
            delta = {"role": "assistant", **({} if "tool_calls" in delta else {"content": ""}), **delta}
            self.sent_role.add(index)
        elif not delta and finish is None and not self.token_ids and out.logprobs is None:
            return None  # text held back (it may begin a tag or a tool call): nothing to send yet
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            finish_reason=finish,
            token_ids=list(out.token_ids) if self.token_ids else None,
            logprobs=None if out.logprobs is None else chat_logprobs(out.token_ids, out.logprobs, self.texts),
        )
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage(self, lasts: list[GenerateOutput]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=Usage.of(lasts, self.n)
        )

    def whole(self, choices: list[list[GenerateOutput]]) -> ChatCompletionResponse:
        body = []
        for i, outs in enumerate(choices):
            text, finish = "".join(o.text for o in outs), outs[-1].finish_reason
            split, tools = self._new()
            reasoning, text = (None, text) if split is None else split.whole(text)
            content, calls, finish = (text, [], finish) if tools is None else tools.whole(text, finish)
            if reasoning is not None and content == "":
                content = None  # (all thinking)
            message = ChatChoiceMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
            body.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=finish,
                    token_ids=[t for o in outs for t in o.token_ids] if self.token_ids else None,
                    logprobs=None
                    if outs[0].logprobs is None
                    else chat_logprobs(*_tokens_and_logprobs(outs), self.texts),
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=body,
            usage=Usage.of([outs[-1] for outs in choices], self.n),
            prompt_token_ids=self.prompts[0] if self.token_ids else None,
        )


def _tokens_and_logprobs(outs: list[GenerateOutput]) -> tuple[list[int], list]:
    """A choice's tokens and their logprob entries, over all its outputs."""
    return [t for o in outs for t in o.token_ids], [e for o in outs for e in (o.logprobs or ())]


def exclude_fields(token_ids: bool, usage: bool) -> dict:
    """Fields left out of a body: token ids unless asked for (an extension), `usage` in stream
    chunks unless include_usage (OpenAI then sends `usage: null` in every chunk)."""
    exclude: dict = {} if usage else {"usage": True}
    if not token_ids:
        exclude |= {"prompt_token_ids": True, "choices": {"__all__": {"token_ids", "prompt_token_ids"}}}
    return exclude


Ended = Callable[[list[GenerateOutput]], None]  # a response's end: each choice's last output


def _nothing(lasts: list[GenerateOutput]) -> None:
    pass


def _weight(out: GenerateOutput) -> int:
    """About how many values formatting `out` writes (against OFF_LOOP_SIZE): its text's
    characters and token ids, and each logprob entry's token and its most likely tokens."""
    weight = len(out.text) + len(out.token_ids)
    for entries in (out.logprobs, out.prompt_logprobs):
        if entries and entries[-1] is not None:  # (a prompt's first entry is None)
            weight += len(entries) * (2 + len(entries[-1][1]))
    return weight


def _whole_body(fmt: CompletionFormat, choices: list[list[GenerateOutput]], headers: dict[str, str]) -> Response:
    # pydantic's own JSON (its Rust serializer: a 4.7 MB body of logprobs in 43 ms, where
    # model_dump and json.dumps took 380, the interpreter held throughout)
    body = fmt.whole(choices).model_dump_json(exclude=exclude_fields(fmt.token_ids, usage=True))
    return Response(body, media_type="application/json", headers=headers)


def _event(fmt: CompletionFormat, out: GenerateOutput, index: int, exclude: dict) -> str | None:
    """A choice's output as a `data:` event; None: nothing to send yet (ChatFormat.chunk)."""
    chunk = fmt.chunk(out, index)
    return None if chunk is None else f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


async def whole_response(
    started: list[Started],
    fmt: CompletionFormat,
    headers: dict[str, str],
    gone: asyncio.Future,
    ended: Ended = _nothing,
) -> Response:
    """The whole response, once every choice has ended (`gone`: until_gone); a client gone
    meanwhile, or a replica failed, aborts every choice."""

    async def outputs(first: GenerateOutput, rest: Outputs) -> list[GenerateOutput]:
        return [first] + [out async for out in rest]

    try:
        gathered = asyncio.gather(*(outputs(first, rest) for first, rest in started))
        choices = await unless_gone(gathered, gone)
    except Exception as e:
        cancel(started)  # the client went away, or a replica failed: the replicas abort the requests
        if isinstance(e, ClientDisconnect):
            raise
        raise server_error(e) from None
    except BaseException:
        cancel(started)  # the handler cancelled (the client went away through Serve's proxy)
        raise
    ended([outs[-1] for outs in choices])
    # a large body (an echo's logprobs: up to max_logprob_entries) is formatted in a thread, off
    # the event loop that drives every open stream
    big = sum(_weight(out) for outs in choices for out in outs) > OFF_LOOP_SIZE
    return await off_loop_if(big, _whole_body, fmt, list(choices), headers)


def server_timing(prepare_s: float, first_output_s: float, replica_s: float) -> str:
    """The W3C Server-Timing header of a response, in ms: where its time to first output went.
    prepare: the endpoint's own work before the request left for a replica (body, tokenizing,
    checks); first-output: from then to the first output back here (Serve's routing and the two
    hops included), of which replica: the replica's, from receiving the request to its first
    output (its engine's queue, prefill and the pipe). For n > 1 choices, the slowest's."""
    return (
        f"prepare;dur={prepare_s * 1e3:.2f}, first-output;dur={first_output_s * 1e3:.2f}, "
        f"replica;dur={replica_s * 1e3:.2f}"
    )


def sse_response(
    started: list[Started],
    fmt: CompletionFormat,
    include_usage: bool,
    headers: dict[str, str],
    ended: Ended = _nothing,
) -> StreamingResponse:
    """Server-sent events: `data: {chunk}` per output (a choice's, with its index, as they come),
    the usage chunk if asked, then `data: [DONE]`. As in vLLM, an output that carries tokens is
    sent even when it adds no text (a special token, half a character: its text is ""), so a
    client sees each token arrive; only an output with neither tokens nor text (nothing
    happened) is dropped, unless it ends its choice."""
    exclude = exclude_fields(fmt.token_ids, include_usage)
    request_id = serve_request_id()
    lasts = [first for first, _ in started]
    closed = False

    def close(done: bool) -> None:  # once, from the stream's end or the response's, whichever is first
        nonlocal closed
        if closed:
            return
        closed = True
        if not done:
            cancel(started)  # the client disconnected (or a replica failed): abort in the engines
        ended(lasts)  # (what it generated, also when cut short)

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rest: Outputs) -> None:  # choice i's outputs, then None
            try:
                async for out in rest:
                    await queue.put((i, out))
                await queue.put((i, None))
            except Exception as e:  # noqa: BLE001 - reported in the stream below
                await queue.put((i, e))

        pumps: list[asyncio.Task] = []
        done = False
        try:
            for i, first in enumerate(lasts):  # (a first output may carry an echo's logprobs: a thread's)
                event = await off_loop_if(_weight(first) > OFF_LOOP_SIZE, _event, fmt, first, i, exclude)
                if event is not None:
                    yield event
            pumps = [asyncio.create_task(pump(i, rest)) for i, (_, rest) in enumerate(started)]
            running = len(pumps)
            while running:
                i, out = await queue.get()
                if out is None:
                    running -= 1
                    continue
                if isinstance(out, Exception):
                    raise out
                lasts[i] = out
                if out.text or out.token_ids or out.finish_reason is not None:
                    event = await off_loop_if(_weight(out) > OFF_LOOP_SIZE, _event, fmt, out, i, exclude)
                    if event is not None:
                        yield event
            done = True
        except Exception as e:  # a replica failed mid-stream: the status is sent, so say it in the stream
            error = server_error(e, request_id).detail
            cluster_metrics.HTTP.stream_error(error.code or error.type)
            yield f"data: {ErrorResponse(error=error).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"  # the stream still ends as every stream does (vLLM's too)
            return
        finally:
            for task in pumps:
                task.cancel()
            close(done)
        if include_usage:
            yield f"data: {fmt.usage(lasts).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return _Stream(events(), lambda: close(False), media_type="text/event-stream", headers=headers)


class _Stream(StreamingResponse):
    """A StreamingResponse that calls `closed` when it ends, however: a client that left before
    the body began (its http.response.start failed) leaves the generator unstarted, and an
    unstarted generator's `finally` never runs, so its requests would generate on unaborted and
    uncharged. `closed` must be idempotent (the generator's own end calls it too)."""

    def __init__(self, content: AsyncIterator[str], closed: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._closed = closed

    async def __call__(self, scope: Any, receive: Receive, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._closed()
