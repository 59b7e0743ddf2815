"""The ingress's response counts (chunkserve/cluster/metrics.py CountResponses, installed with the
ingress's error handlers by chunkserve/cluster/errors.py) on a small FastAPI app called through
ASGI: a request whose client left before its answer is counted once, as a 499, never a 5xx."""

from __future__ import annotations

import asyncio

import pytest
from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import PlainTextResponse

from chunkserve.cluster import errors, metrics
from chunkserve.cluster.metrics import HttpCounts


def _app(started: asyncio.Event) -> FastAPI:
    app = FastAPI()
    errors.install(app)

    @app.get("/ok")
    async def ok():
        return PlainTextResponse("ok")

    @app.post("/waits")
    async def waits(request: Request):  # reads a body that never comes (Serve cancels it once the client leaves)
        started.set()
        await request.body()

    @app.get("/gone")
    async def gone():
        raise ClientDisconnect()

    return app


async def _call(app, path: str, method: str = "GET") -> None:
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [], "http_version": "1.1", "scheme": "http", "server": ("t", 80), "root_path": ""}  # fmt: skip
    never = asyncio.Event()

    async def receive():
        await never.wait()

    async def send(message):
        pass

    await app(scope, receive, send)


@pytest.mark.parametrize("how", ["cancelled", "ClientDisconnect"])
def test_a_client_gone_before_the_answer_is_one_499(monkeypatch, how):
    counts = HttpCounts()
    monkeypatch.setattr(metrics, "HTTP", counts)

    async def main():
        started = asyncio.Event()
        app = _app(started)
        await _call(app, "/ok")
        if how == "cancelled":
            task = asyncio.create_task(_call(app, "/waits", "POST"))
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(ClientDisconnect):
                await _call(app, "/gone")

    asyncio.run(main())
    route = "/waits" if how == "cancelled" else "/gone"
    assert dict(counts.responses) == {("/ok", "200"): 1, (route, "499"): 1}
