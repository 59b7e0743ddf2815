"""The ingress's SSE formatting (chunkserve/cluster/responses.py `sse_response`) and its Server-Timing header, fed
GenerateOutputs directly: which outputs become chunks, and the header the load test reads."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from starlette.requests import ClientDisconnect

from chunkserve.cluster.ingress import TIMING_HEADER
from chunkserve.cluster.loadtest import client
from chunkserve.cluster.logprobs import TokenTexts
from chunkserve.cluster.responses import (
    CompletionFormat,
    ResponseHead,
    exclude_fields,
    server_timing,
    sse_response,
    whole_response,
)
from chunkserve.replicas.wire import GenerateOutput


class _Outputs:
    """A replica's stream after its first output, as the ingress iterates it."""

    def __init__(self, outs: list[GenerateOutput]):
        self.outs, self.cancelled = outs, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for out in self.outs:
            yield out

    def cancel(self) -> None:
        self.cancelled = True


def _out(text: str, ids: tuple[int, ...], finish: str | None = None, tokens: int = 0) -> GenerateOutput:
    return GenerateOutput("r1", text, ids, finish, prompt_tokens=3, cached_tokens=0, completion_tokens=tokens)


def _events(outs: list[GenerateOutput]) -> list[dict]:
    fmt = CompletionFormat(ResponseHead("cmpl-1", "m", 1, False, TokenTexts(None)), [[1, 2, 3]])
    rest = _Outputs(outs[1:])
    response = sse_response([(outs[0], rest)], fmt, include_usage=True, headers={})

    async def body() -> list[str]:
        return [piece async for piece in response.body_iterator]

    lines = [line for piece in asyncio.run(body()) for line in piece.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and not rest.cancelled
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def test_outputs_with_tokens_but_no_text_are_sent_as_vllm_does():
    # a special token or half a character adds no text: the chunk still goes (its text ""), so a
    # client sees each token arrive; an output with neither tokens nor text is dropped
    outs = [
        _out("A", (10,), tokens=1),
        _out("", (11,), tokens=2),
        _out("", (), tokens=2),
        _out("", (12,), tokens=3),
        _out("B", (13,), tokens=4),
        _out("", (), "length", tokens=4),
    ]
    *chunks, usage = _events(outs)
    assert [c["choices"][0]["text"] for c in chunks] == ["A", "", "", "B", ""]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_server_timing_header_reads_back_in_the_load_test():
    header = server_timing(0.0012, 0.0456, 0.0301)
    assert header == "prepare;dur=1.20, first-output;dur=45.60, replica;dur=30.10"
    assert client.TIMING_HEADER == TIMING_HEADER  # (written again there: the tool runs without Serve)
    got = client.server_timing(header)
    assert got.keys() == {"prepare", "first-output", "replica"}
    assert got == pytest.approx({"prepare": 0.0012, "first-output": 0.0456, "replica": 0.0301})


def test_server_timing_parser_takes_other_servers_headers():
    # W3C syntax: metrics without a duration, descriptions, quoted values, odd spacing
    got = client.server_timing('cache;desc="hit", db;dur=53, app ; dur = "47.2" ;desc=x, bad;dur=fast')
    assert got == pytest.approx({"db": 0.053, "app": 0.0472})
    assert client.server_timing(None) is None and client.server_timing("") is None


class _First:
    """A replica call's __anext__: its first output after `delay` seconds, or `error` raised."""

    def __init__(self, delay: float, error: BaseException | None = None):
        self.delay, self.error, self.cancelled = delay, error, 0

    async def __anext__(self):
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return "first"


def test_first_output_past_its_deadline_is_late_on_a_loop_whose_timers_run_early():
    """uvloop (Ray's event loops) keeps a cached millisecond clock, so a timer may fire before
    perf_counter reaches the deadline: that must still be a late request (a 503), never an
    error of the call's own (it was a 500, once in CI)."""
    import time

    import uvloop

    from chunkserve.cluster.replica_calls import Late, first_output

    async def main():
        late = 0
        for _ in range(200):
            call = _First(delay=10)
            try:
                await first_output(call, time.perf_counter() + 0.002)
            except Late:
                late += 1
            assert call.cancelled == 1  # the call is cancelled, not left running
        assert late == 200
        assert await first_output(_First(0), time.perf_counter() + 5) == "first"
        with pytest.raises(TimeoutError, match="its own"):  # the call's own error is not the deadline's
            await first_output(_First(0, TimeoutError("its own")), time.perf_counter() + 5)
        with pytest.raises(Late):  # no time left: late at once
            await first_output(_First(10), time.perf_counter() - 1)

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


class _Recording(CompletionFormat):
    """A completions format noting the thread each body and chunk is formatted on."""

    def __init__(self, prompts: list[list[int]]):
        super().__init__(ResponseHead("cmpl-1", "m", 1, False, TokenTexts(None)), prompts, ["p"] * len(prompts))
        self.threads: list[threading.Thread] = []

    def whole(self, choices):
        self.threads.append(threading.current_thread())
        return super().whole(choices)

    def chunk(self, out, index):
        self.threads.append(threading.current_thread())
        return super().chunk(out, index)


def _echoed(prompt_tokens: int) -> list[GenerateOutput]:
    """A choice whose first output carries its echoed prompt's logprobs (5 most likely each)."""
    entry = (-1.0, tuple((t, -1.0 - t) for t in range(5)))
    first = GenerateOutput(
        "r1", "a", (7,), None, prompt_tokens, 0, 1, (entry,), (None,) + (entry,) * (prompt_tokens - 1)
    )
    return [first, GenerateOutput("r1", "b", (8,), "length", prompt_tokens, 0, 2, (entry,))]


@pytest.mark.parametrize("prompt_tokens, off_loop", [(4, False), (3000, True)])
def test_large_bodies_and_chunks_are_formatted_off_the_event_loop(prompt_tokens, off_loop):
    """The event loop drives every open stream: a whole response or a chunk as large as an echo's
    logprobs (3000 prompt tokens, each with its 5 most likely: 21000 values) is formatted in a
    worker thread, a small one on the loop; the body is the format's either way."""
    outs = _echoed(prompt_tokens)
    prompts = [list(range(prompt_tokens))]
    fmt = _Recording(prompts)

    async def whole():  # (a client that stays: its disconnect never comes)
        return await whole_response(
            [(outs[0], _Outputs(outs[1:]))], fmt, {}, asyncio.get_running_loop().create_future()
        )

    response = asyncio.run(whole())
    want = _Recording(prompts).whole([outs]).model_dump(exclude=exclude_fields(False, usage=True))
    got = json.loads(response.body)
    # (`created` is each formatting's clock second: the two may straddle a second)
    assert abs(got.pop("created") - want.pop("created")) <= 1
    assert got == want and response.media_type == "application/json"
    assert (fmt.threads[0] is not threading.main_thread()) == off_loop

    fmt = _Recording(prompts)
    streamed = sse_response([(outs[0], _Outputs(outs[1:]))], fmt, include_usage=False, headers={})

    async def body() -> list[str]:
        return [piece async for piece in streamed.body_iterator]

    events = asyncio.run(body())
    assert len(events) == 3 and events[-1] == "data: [DONE]\n\n"
    first = json.loads(events[0][len("data: ") :])["choices"][0]
    assert len(first["logprobs"]["tokens"]) == prompt_tokens + 1
    assert [t is not threading.main_thread() for t in fmt.threads] == [off_loop, False]  # (the second: 1 token)


@pytest.mark.parametrize("spec", ["2.4", "2.3"])
def test_a_client_gone_before_the_body_began_aborts_and_charges(spec):
    # the client left while the handler waited: sending the response's start fails (ASGI 2.4:
    # OSError; older: a disconnect is what receive says), so the body's generator never starts and
    # its own finally never runs; the response must still abort the replica's request and end it
    fmt = CompletionFormat(ResponseHead("cmpl-1", "m", 1, False, TokenTexts(None)), [[1, 2, 3]])
    first = _out("A", (10,), tokens=1)
    rest = _Outputs([_out("B", (11,), tokens=2)])
    ended: list[list[GenerateOutput]] = []
    response = sse_response([(first, rest)], fmt, include_usage=False, headers={}, ended=ended.append)

    async def send(message):
        await asyncio.sleep(0)
        raise OSError("the client is gone")

    async def receive():
        return {"type": "http.disconnect"}

    async def call():
        scope = {"type": "http", "asgi": {"spec_version": spec}}
        try:
            await response(scope, receive, send)
        except ClientDisconnect:  # (2.4: the OSError as starlette says it; 2.3: cancelled quietly)
            pass

    asyncio.run(call())
    assert rest.cancelled
    assert ended == [[first]]  # once, with what it had: the first output (1 completion token)
