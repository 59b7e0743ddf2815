"""chunkserve.cluster.front.HTTPFront on its own: a shared port, the request context, draining, failures
(real sockets, real HTTP through httpx; no Ray cluster: tests/test_serve_front.py has Serve's)."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest
from ray.serve import context as serve_context
from starlette.requests import ClientDisconnect

from chunkserve.cluster.front import HTTPFront, bind
from chunkserve.replicas.engine.distributed import free_port


async def _slow_app(scope, receive, send) -> None:
    """Streams the request context's id, then 5 parts 0.1 s apart."""
    assert scope["type"] == "http"
    ctx = serve_context._get_serve_request_context()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send(
        {
            "type": "http.response.body",
            "body": f"{ctx.request_id} {ctx.route} {ctx.app_name}\n".encode(),
            "more_body": True,
        }
    )
    for i in range(5):
        await asyncio.sleep(0.1)
        await send({"type": "http.response.body", "body": f"{i}\n".encode(), "more_body": i < 4})


def test_a_port_held_by_another_program_is_named():
    port = free_port()
    other = socket.socket()  # no SO_REUSEPORT: the port is not for sharing
    other.bind(("127.0.0.1", port))
    other.listen()
    try:
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            bind("127.0.0.1", port)
    finally:
        other.close()


def test_fronts_share_a_port_and_each_answers():
    async def main():
        port = free_port()
        fronts = [HTTPFront("127.0.0.1", port)]
        fronts[0].start(lambda: _slow_app, "app")
        async with httpx.AsyncClient(timeout=10) as client:  # the first answers alone
            assert (await client.get(f"http://127.0.0.1:{port}/", headers={"connection": "close"})).status_code == 200
        fronts.append(HTTPFront("127.0.0.1", port))  # the second binds the same port: SO_REUSEPORT
        fronts[1].start(lambda: _slow_app, "app")
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"http://127.0.0.1:{port}/a/b", headers={"x-request-id": "given-id"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "given-id"
            assert r.text.splitlines() == ["given-id /a/b app", "0", "1", "2", "3", "4"]
            r = await client.get(f"http://127.0.0.1:{port}/")  # no id sent: one made for the request
            rid = r.headers["x-request-id"]
            assert len(rid) == 36 and r.text.startswith(f"{rid} / app")
        # stop the first: the second keeps the port and answers alone
        await fronts[0].stop(5)
        async with httpx.AsyncClient(timeout=10) as client:
            for _ in range(4):  # new connections each time: none lands on the stopped one
                assert (
                    await client.get(f"http://127.0.0.1:{port}/", headers={"connection": "close"})
                ).status_code == 200
        await fronts[1].stop(5)
        assert fronts[0].failed() is None and fronts[1].failed() is None  # asked to stop: no failure
        with pytest.raises(httpx.ConnectError):
            await httpx.AsyncClient().get(f"http://127.0.0.1:{port}/")

    asyncio.run(main())


def test_stop_finishes_open_requests_and_takes_no_new_ones():
    async def main():
        port = free_port()
        front = HTTPFront("127.0.0.1", port)
        front.start(lambda: _slow_app, "app")
        async with httpx.AsyncClient(timeout=10) as client:
            await client.get(f"http://127.0.0.1:{port}/warm")
            slow = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/slow", headers={"connection": "close"}))
            await asyncio.sleep(0.15)  # its response has begun
            stopping = asyncio.create_task(front.stop(5))
            await asyncio.sleep(0.05)
            with pytest.raises(httpx.ConnectError):  # no new connection is taken while it drains
                await httpx.AsyncClient().get(f"http://127.0.0.1:{port}/late")
            r = await slow
            assert r.status_code == 200 and r.text.splitlines()[1:] == ["0", "1", "2", "3", "4"]
            await stopping

    asyncio.run(main())


def test_a_front_that_stops_by_itself_is_a_failure():
    async def main():
        front = HTTPFront("127.0.0.1", free_port())

        def no_app():
            raise RuntimeError("no app")

        front.start(no_app, "app")
        assert front.failed() is None  # still starting
        await asyncio.sleep(0.05)
        failed = front.failed()
        assert isinstance(failed, RuntimeError) and "no app" in str(failed)
        await front.stop(1)
        assert front.failed() is None

    asyncio.run(main())


def test_a_client_gone_is_no_server_error(caplog):
    # the ingress answers a client's disconnect (ClientDisconnect, re-raised by Starlette after
    # its 499) as no server error: uvicorn logs no traceback for it
    async def leaves(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        raise ClientDisconnect()

    async def fails(scope, receive, send) -> None:
        raise RuntimeError("a bug")

    async def main(app) -> int:
        port = free_port()
        front = HTTPFront("127.0.0.1", port)
        front.start(lambda: app, "app")
        async with httpx.AsyncClient(timeout=10) as client:
            status = (await client.get(f"http://127.0.0.1:{port}/")).status_code
        await front.stop(5)
        return status

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        assert asyncio.run(main(leaves)) == 499
        assert not [r for r in caplog.records if r.name == "uvicorn.error"]
        assert asyncio.run(main(fails)) == 500  # a server error still is one
        assert [r.message for r in caplog.records if r.name == "uvicorn.error"] == ["Exception in ASGI application\n"]


async def _ok_app(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _read_to_eof(reader: asyncio.StreamReader) -> bytes:
    """What the server sends until it closes the connection (a test's bound: 30 s)."""
    return await asyncio.wait_for(reader.read(), 30)


def test_a_request_head_not_complete_within_the_header_timeout_is_closed():
    async def main():
        port = free_port()
        front = HTTPFront("127.0.0.1", port, header_timeout_s=1.0)
        front.start(lambda: _ok_app, "app")
        await asyncio.sleep(0.05)
        partial = await asyncio.open_connection("127.0.0.1", port)
        partial[1].write(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # and no more
        silent = await asyncio.open_connection("127.0.0.1", port)  # sends nothing at all
        closed = asyncio.ensure_future(_read_to_eof(partial[0]))
        closed_silent = asyncio.ensure_future(_read_to_eof(silent[0]))
        async with httpx.AsyncClient(timeout=10) as client:  # meanwhile another connection is served
            r = await client.get(f"http://127.0.0.1:{port}/")
            assert r.status_code == 200 and r.text == "ok"
        assert not closed.done() and not closed_silent.done()  # (the slow ones are held until their timeout)
        assert (await closed).startswith(b"HTTP/1.1 408 ")  # then told and closed
        assert await closed_silent == b""  # (nothing sent: nothing to answer, closed)
        for _, writer in (partial, silent):
            writer.close()
        await front.stop(5)

    asyncio.run(main())


def test_a_slow_head_finished_within_the_timeout_is_served_and_each_request_gets_its_own():
    async def main():
        port = free_port()
        front = HTTPFront("127.0.0.1", port, header_timeout_s=2.0)
        front.start(lambda: _ok_app, "app")
        await asyncio.sleep(0.05)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n\r\n"
        for i in range(0, len(head), 8):  # a byte at a time, in pieces, ~0.6 s in all
            writer.write(head[i : i + 8])
            await asyncio.sleep(0.1)
        first = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 30)  # (its last chunk)
        assert first.startswith(b"HTTP/1.1 200 ") and b"\r\nok\r\n" in first
        await asyncio.sleep(1.5)  # kept alive past the first head's timeout: the next head's is its own
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert (await _read_to_eof(reader)).startswith(b"HTTP/1.1 408 ")
        writer.close()
        await front.stop(5)

    asyncio.run(main())


def test_the_header_timeout_must_be_positive():
    with pytest.raises(ValueError, match="header timeout must be > 0 s, got 0"):
        HTTPFront("127.0.0.1", free_port(), header_timeout_s=0)
