"""Hostile requests sent from a process of their own (tests/test_serve_hostile.py's event-loop
probe): the process measuring the server's latencies then does not also run their clients."""

from __future__ import annotations

import asyncio
import json

import httpx

_prepared: list[tuple[str, str]] = []  # this process's hostile requests, handed over before they are sent


def prepare(hostile: list[tuple[str, str]]) -> int:
    """Keep `hostile` (path, JSON body) in this process for `send`: the measuring process hands
    the large bodies over (encoding and pickling them) before its measured window, not in it."""
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
                return await post(client, "/v1/completions", json.dumps({"prompt": f"x{i}", "temperature": 5}))

        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency + 16)) as client:
            return await asyncio.gather(
                *(post(client, p, b) for p, b in hostile), *(bad(client, i) for i in range(burst))
            )

    return asyncio.run(main())
