"""How fast one client process can drive requests: against a trivial streaming endpoint.

A stub server in a process of its own answers every POST at once with a prebuilt stream of
`tokens` SSE chunks, a usage chunk and [DONE] (no model behind it), so what limits the rate
is the client: its HTTP stack, SSE parsing and bookkeeping. Reported as the request and chunk
rates one client reaches, at a given concurrency, and its CPU use: a load test whose offered
load approaches these needs more clients (`--clients` on a Ray cluster).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import multiprocessing as mp
from collections.abc import Iterator

from chunkserve.cluster.loadtest.client import ClientOptions, run_client
from chunkserve.cluster.loadtest.metrics import summarize
from chunkserve.cluster.loadtest.render import Request


def _body(tokens: int) -> bytes:
    chunk = json.dumps(
        {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    )
    usage = json.dumps(
        {
            "id": "x",
            "choices": [],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": tokens,
                "total_tokens": 8 + tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )
    return "".join([f"data: {chunk}\n\n"] * tokens + [f"data: {usage}\n\n", "data: [DONE]\n\n"]).encode()


def _serve(ports: mp.Queue, tokens: int) -> None:
    body = _body(tokens)
    head = (
        f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {len(body)}\r\n"
        "x-chunkserve-replica: stub\r\n\r\n"
    ).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in header.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        ports.put(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


@contextlib.contextmanager
def stub_server(tokens: int = 128) -> Iterator[str]:
    """The stub in a process of its own, for the duration: yields its base URL."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(ports, tokens), daemon=True)
    proc.start()
    try:
        yield f"http://127.0.0.1:{ports.get(timeout=60)}"
    finally:
        proc.kill()
        proc.join(10)


def measure(tokens: int = 128, concurrency: int = 64, seconds: float = 5.0) -> dict:
    """One client against the stub for `seconds`: requests and chunks a second it completed."""
    with stub_server(tokens) as url:
        n = max(1000, math.ceil(concurrency * seconds * 200))
        reqs = [Request(i, tokens, prompt=[1, 2, 3]) for i in range(n)]
        res = asyncio.run(
            run_client(
                reqs, [0.0] * n, [url], ClientOptions(model="stub"), max_concurrency=concurrency, max_duration=seconds
            )
        )
    done = [r for r in res.records if r.ok]
    report = summarize([res])
    return {
        "bench": "client_capacity",
        "tokens_per_request": tokens,
        "concurrency": concurrency,
        "seconds": res.duration,
        "completed": len(done),
        "client_max_request_rate": len(done) / res.duration,
        "client_max_chunks_per_s": sum(len(r.itl) + 1 for r in done) / res.duration,
        "client_cpu_util": res.cpu_s / res.duration,
        "median_itl_ms": report["median_itl_ms"],
    }
