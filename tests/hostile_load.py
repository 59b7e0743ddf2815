"""Clients of the serve tests that run in a process of their own: the event-loop probe's
(tests/test_serve_hostile.py: the hostile load, and the one measuring the server's latencies
meanwhile) and the soak's reference stream (tests/test_serve_soak.py). The tests' own process is
Ray's driver, whose threads take the interpreter lock at times: a client measured there saw a
stall of about 0.2 s in each run that was not the server's (commit body)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
_prepared: list[tuple[str, str]] = []  # this process's hostile requests, handed over before they are sent


def prepare(hostile: list[tuple[str, str]]) -> int:
    """Keep `hostile` (path, JSON body) in this process for `send`: the test hands the large
    bodies over (encoding and pickling them) before the measured window, not in it."""
    _prepared[:] = hostile
    return len(_prepared)


def send(url: str, burst: int, concurrency: int = 64) -> list[tuple[int, str | None]]:
    """POST each prepared hostile request and `burst` small invalid completions at once (at most
    `concurrency` of the burst in flight); -> each response's (status, its error's param)."""
    hostile = list(_prepared)

    async def post(client: httpx.AsyncClient, path: str, body: str) -> tuple[int, str | None]:
        r = await client.post(f"{url}{path}", content=body.encode(), headers={"Content-Type": "application/json"})
        return r.status_code, r.json().get("error", {}).get("param")

    async def main():
        gate = asyncio.Semaphore(concurrency)

        async def bad(client, i: int):
            async with gate:
                return await post(
                    client, "/v1/completions", json.dumps({"model": MODEL, "prompt": f"x{i}", "temperature": 5})
                )

        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency + 16)) as client:
            return await asyncio.gather(
                *(post(client, p, b) for p, b in hostile), *(bad(client, i) for i in range(burst))
            )

    return asyncio.run(main())


async def _streams(client: httpx.AsyncClient, url: str, body: dict, ended, gaps: list, outputs: list, started=None):
    """POST `body` (a streamed completion) one stream after another until `ended` is set; each
    gap between a stream's chunks into gaps (once `started` is set, when given: this sets it at
    the 8th chunk), each whole stream's token ids into outputs."""
    chunks = 0
    while not ended.is_set():  # a fast machine ends a stream within the window
        ids: list[int] = []
        last = None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, r.status_code
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.monotonic()
                chunks += 1
                if started is not None and chunks == 8:
                    started.set()  # the stream runs: the hostile requests may go
                if last is not None and (started is None or started.is_set()) and not ended.is_set():
                    gaps.append(now - last)
                last = now
                ids += json.loads(line[len("data: ") :])["choices"][0].get("token_ids") or []
        outputs.append(tuple(ids))


def measure(url: str, max_tokens: int, started, ended) -> tuple[list[float], list[float]]:
    """Stream completions one after another and poll /health every 20 ms until `ended` (a
    multiprocessing Event) is set; set `started` once a stream has sent 8 chunks. -> the gaps
    between a stream's chunks and /health's waits, in seconds, both counted from `started` on."""
    body = {
        "model": MODEL,
        "prompt": "x",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    gaps: list[float] = []
    waits: list[float] = []

    async def health(client: httpx.AsyncClient) -> None:
        while not ended.is_set():
            t = time.monotonic()
            assert (await client.get(f"{url}/health")).status_code == 200
            if not ended.is_set():  # (a poll the window's end held up is not the server's wait)
                waits.append(time.monotonic() - t)
            await asyncio.sleep(0.02)

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            streaming = asyncio.create_task(_streams(client, url, body, ended, gaps, [], started))
            while not started.is_set() and not streaming.done():
                await asyncio.sleep(0.01)
            polling = asyncio.create_task(health(client))
            await asyncio.to_thread(ended.wait)
            if streaming.done():  # it failed: raise its error
                await streaming
            await polling
            streaming.cancel()

    asyncio.run(main())
    return gaps, waits


def steady(url: str, body: dict, ended) -> tuple[list[float], list[tuple[int, ...]]]:
    """Back-to-back streams of `body` until `ended` (the soak's reference stream) -> the gaps
    between a stream's chunks, in seconds, and each stream's token ids."""
    gaps: list[float] = []
    outputs: list[tuple[int, ...]] = []

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            await _streams(client, url, body, ended, gaps, outputs)

    asyncio.run(main())
    return gaps, outputs
