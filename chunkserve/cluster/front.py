"""HTTPFront: an ingress replica serving its FastAPI app on a port of its node itself.

Through Serve's HTTP proxy a request costs an extra process and two Ray messages each way (the
body pulled from the proxy, each response chunk pushed back to it), a large share of a streamed
request's time to first token when the engine is fast (DESIGN §1). With `ingress.http_port`
set, every ingress replica also listens on that port itself (uvicorn on the replica's own event
loop, the same app and handlers as through the proxy), all of a node's ingress replicas on one
socket address (SO_REUSEPORT: the kernel spreads new connections over them). Serve's proxy
keeps its own port (`http_options.port`) and serves the same API.

A request through the front gets what the proxy would give it: a Serve request context (its
`x-request-id` header or a fresh id, the route, the application), so handle calls, logs and
cancellation behave alike, and the `x-request-id` response header.

uvicorn reads a request's head without a time limit; the front's protocol (_HeadTimeout) closes
a connection whose head is not complete within `ingress.header_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn
from ray.serve import context as serve_context
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("ray.serve")

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that this node's other ingress replicas share.
    ValueError naming the address when it is taken by something else (or cannot be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"ingress.http_port: cannot listen on {host}:{port} ({e.strerror or e}); another program "
            f"holds it, or it is Serve's own http_options.port: pick a free port"
        ) from None
    sock.setblocking(False)
    return sock


class _HeadTimeout(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header read timeout, which uvicorn lacks: a connection
    must send a complete request head within `head_timeout_s` of its opening, and each next
    request's within that of its first byte (uvicorn's keep-alive timeout bounds the idle time
    between requests). Else it is closed, after a 408 if part of a head came (a slow client's
    connections are not held open by a few bytes at a time). A head late behind a response still
    being sent (pipelined) lets that response finish, then closes."""

    head_timeout_s = 10.0  # (HTTPFront makes a subclass with its own)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_begun = False  # bytes of a request head came

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True
        if self._head_timer is None:  # (the connection's first request: armed at its opening)
            self._arm_head()

    def on_headers_complete(self) -> None:
        self._disarm_head()
        self._head_begun = False
        super().on_headers_complete()

    def _arm_head(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # (closes once the response in progress is sent)
            return
        if self._head_begun:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()


_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _Server(uvicorn.Server):
    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        # the replica's process is Ray's: its signals stay with Ray (uvicorn would take SIGINT
        # and SIGTERM when it runs on the main thread)
        return contextlib.nullcontext()


def with_request_context(app: ASGIApp, app_name: str) -> ASGIApp:
    """app under the Serve request context Serve's proxy would set for each HTTP request."""

    async def wrapped(scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request_id = ""
        for key, value in scope.get("headers", ()):
            if key == b"x-request-id":
                request_id = value.decode("latin-1")
        request_id = request_id or str(uuid.uuid4())
        client = scope.get("client")
        serve_context._serve_request_context.set(
            serve_context._RequestContext(
                route=scope.get("path", ""),
                request_id=request_id,
                _internal_request_id=str(uuid.uuid4()),
                app_name=app_name,
                is_http_request=True,
                _client=f"{client[0]}:{client[1]}" if client else "",
            )
        )

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            await app(scope, receive, send_with_id)
        except ClientDisconnect:
            # the client left (the app has answered it, a 499 no one reads; Starlette re-raises
            # after answering): no server error for uvicorn to log with a traceback
            logger.debug("request %s: the client disconnected", request_id)

    return wrapped


class HTTPFront:
    """One ingress replica's HTTP server on a shared (host, port). Made in the replica's
    constructor (a taken port fails the deployment there, naming it), started from it too;
    stop() before the replica goes, failed() for its health check."""

    def __init__(self, host: str, port: int, header_timeout_s: float = 10.0):
        if not header_timeout_s > 0:
            raise ValueError(f"the front's header timeout must be > 0 s, got {header_timeout_s}")
        self.host, self.port = host, port
        # uvicorn makes a protocol per connection from the class: this front's timeout on one of its own
        self._protocol = type("HeadTimeout", (_HeadTimeout,), {"head_timeout_s": header_timeout_s})
        self._sock = bind(host, port)
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self, get_app: Callable[[], ASGIApp], app_name: str) -> None:
        """Serve get_app() on the running event loop (the replica's, where its handlers run),
        called once the constructor calling start() has returned: Serve's ingress wrapper makes
        the app (self.app) only after the user's constructor."""
        self._task = asyncio.get_running_loop().create_task(self._serve(get_app, app_name))

    async def _serve(self, get_app: Callable[[], ASGIApp], app_name: str) -> None:
        await asyncio.sleep(0)
        config = uvicorn.Config(
            with_request_context(get_app(), app_name),
            lifespan="off",  # the app's lifespan is Serve's (run once, by the replica)
            log_config=None,
            access_log=False,
            timeout_keep_alive=30,
            http=self._protocol,
        )
        self._server = _Server(config)
        self._server.should_exit = self._stopping
        logger.info("ingress: serving HTTP on %s:%d beside Serve's proxy", self.host, self.port)
        await self._server.serve(sockets=[self._sock])

    def failed(self) -> BaseException | None:
        """Why the server stopped, if it stopped without being asked to."""
        task = self._task
        if task is None or not task.done() or self._stopping:
            return None
        if task.cancelled():
            return RuntimeError("the HTTP front was cancelled")
        return task.exception() or RuntimeError(f"the HTTP front on {self.host}:{self.port} stopped")

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting connections, then give the open ones up to timeout_s to finish."""
        self._stopping = True
        task = self._task
        if self._server is not None:
            self._server.should_exit = True
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except asyncio.TimeoutError:
                if self._server is not None:
                    self._server.force_exit = True
                task.cancel()
        self._sock.close()
