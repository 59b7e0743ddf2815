"""The direct stream: an ingress's requests to a model replica, and their outputs back, over a TCP
connection of their own instead of Serve's handle calls (DESIGN §4).

Through Serve a streamed request costs the handle's routing, an actor call into the replica's
wrapper and a Ray message for each output, several ms before the first token where the engine
answers in ~15. Here the ingress picks the replica itself (PrefixAffinityRouter.route_direct,
the same policy) and writes the request on a connection it keeps to that replica; the replica
runs the same `generate` and writes each output back on it. Serve still places, health-checks,
scales and routes everything else (and takes a request when the replica is full).

Frames: a 4-byte big-endian length, then a pickle of one message (chunkserve/replicas/wire.py;
each side sends only its own and drops a connection that sends it anything else). A connection
begins with the replica's token (16 random bytes it publishes in its routing stats, which only
Ray's cluster members read): nothing is unpickled from a peer that has not sent it.

    ingress -> replica  StreamOpen(sid, GenerateRequest)   StreamCancel(sid)
    replica -> ingress  StreamOutput(sid, GenerateOutput)  ... then one of
                        StreamEnd(sid)   StreamFull(sid)   StreamError(sid, kind, message)
                                                           kind: refused | engine_died | failed

A stream's sid is the ingress's, unique on its connection. A connection that drops ends every
stream on it: the replica aborts them in its engine, the ingress's get StreamLost.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from chunkserve.replicas.wire import (
    STREAM_REPLIES,
    STREAM_REQUESTS,
    GenerateOutput,
    GenerateRequest,
    StreamCancel,
    StreamEnd,
    StreamError,
    StreamFull,
    StreamOpen,
    StreamOutput,
    StreamReply,
    StreamRequest,
    check,
)
from chunkserve.router.frames import frame, listening_socket, read_frame

logger = logging.getLogger("ray.serve")

TOKEN_BYTES = 16
MAX_FRAME = 256 << 20  # a frame's bytes: a prompt of a million tokens with logprobs fits
WRITE_HIGH_WATER = 1 << 20  # a stream waits for the socket past this many unsent bytes


class StreamLost(ConnectionError):
    """The connection to the replica dropped (its actor died, or the network)."""


class ReplicaFull(Exception):
    """The replica holds max_ongoing_requests already: the request goes through Serve's queue."""


@dataclass(frozen=True)
class Address:
    """Where a replica takes direct streams: published in its routing stats as a plain tuple."""

    host: str
    port: int
    token: bytes

    def as_tuple(self) -> tuple[str, int, str]:
        return (self.host, self.port, self.token.hex())

    @staticmethod
    def from_tuple(t: Any) -> Address | None:
        """The routing stats' `stream_address`, or None when it is absent or malformed."""
        try:
            host, port, token = t
            return Address(str(host), int(port), bytes.fromhex(token))
        except (TypeError, ValueError):
            return None


class _Lost(NamedTuple):
    """A stream's end when its connection dropped (this process's own: never on the wire)."""

    why: str


def _frame(msg: StreamRequest | StreamReply, allowed: frozenset[type]) -> bytes:
    check(msg, allowed, "the direct stream")
    return frame(msg)


async def _read(reader: asyncio.StreamReader) -> Any:
    return await read_frame(reader, MAX_FRAME)


def _reply(writer: asyncio.StreamWriter, msg: StreamReply) -> None:
    writer.write(_frame(msg, STREAM_REPLIES))


# -- the replica's side ----------------------------------------------------------------------
class StreamServer:
    """One replica's listener. generate(request) is the replica's own stream; room() says whether
    it takes another request now (else the ingress gets StreamFull)."""

    def __init__(
        self,
        host: str,
        generate: Callable[[GenerateRequest], AsyncGenerator[GenerateOutput, None]],
        room: Callable[[], bool],
    ):
        self._sock = listening_socket(host, 1024)
        self.address = Address(host, self._sock.getsockname()[1], secrets.token_bytes(TOKEN_BYTES))
        self._generate, self._room = generate, room
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self._sock)

    def close(self) -> None:
        """Take no more connections and end the open ones (their streams abort in the engine)."""
        if self._server is not None:
            self._server.close()
        self._sock.close()
        for task in list(self._conns):
            task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._conns.add(me)
        streams: dict[int, asyncio.Task] = {}
        try:
            token = await reader.readexactly(TOKEN_BYTES)
            if not hmac.compare_digest(token, self.address.token):
                logger.warning(
                    "direct stream: a connection from %s without the token", writer.get_extra_info("peername")
                )
                return
            while True:
                match await _read(reader):
                    case StreamOpen(sid, request):
                        if sid in streams or not self._room():
                            _reply(writer, StreamFull(sid))
                            continue
                        streams[sid] = asyncio.create_task(self._run(sid, request, writer, streams))
                    case StreamCancel(sid):
                        task = streams.get(sid)
                        if task is not None:
                            task.cancel()
                    case other:
                        raise TypeError(f"{type(other).__name__} {other!r:.100} from the ingress")
        except (asyncio.IncompleteReadError, ConnectionError, OSError, asyncio.CancelledError):
            pass  # the ingress went (or the replica closes): its streams are aborted below
        except Exception:
            logger.exception("direct stream: a bad frame; closing the connection")
        finally:
            for task in list(streams.values()):
                task.cancel()  # generate's own cleanup aborts each in the engine
            await asyncio.gather(*streams.values(), return_exceptions=True)
            writer.close()
            self._conns.discard(me)

    async def _run(
        self, sid: int, request: GenerateRequest, writer: asyncio.StreamWriter, streams: dict[int, asyncio.Task]
    ) -> None:
        gen = self._generate(request)
        try:
            async for out in gen:
                _reply(writer, StreamOutput(sid, out))
                if writer.transport.get_write_buffer_size() > WRITE_HIGH_WATER:
                    await writer.drain()
            _reply(writer, StreamEnd(sid))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not writer.is_closing():
                _reply(writer, StreamError.of(sid, e))
        finally:
            streams.pop(sid, None)
            await gen.aclose()  # (a cancelled stream: generate's finally aborts it now, not at GC)


# -- the ingress's side ----------------------------------------------------------------------
class DirectStream:
    """One request's outputs from its replica: an async iterator of GenerateOutput, as Serve's
    streaming response is (cancel() aborts it in the replica). Its first __anext__ raises
    ReplicaFull if the replica did not take it; StreamLost if the connection dropped; the
    replica's ValueError (refused) or EngineDied as they were raised there."""

    def __init__(self, conn: _Connection, sid: int, on_close: Callable[[], None]):
        self._conn, self._sid, self._on_close = conn, sid, on_close
        self._queue: asyncio.Queue[StreamReply | _Lost] = asyncio.Queue()
        self._closed = False

    def __aiter__(self) -> DirectStream:
        return self

    async def __anext__(self) -> GenerateOutput:
        if self._closed:
            raise StopAsyncIteration
        msg = await self._queue.get()
        if type(msg) is StreamOutput:  # (the common case first, without the match's tests)
            return msg.output
        self._close()
        match msg:
            case StreamEnd():
                raise StopAsyncIteration
            case StreamFull():
                raise ReplicaFull()
            case _Lost(why):
                raise StreamLost(why)
            case StreamError() as error:
                raise error.exception()
        raise TypeError(f"{type(msg).__name__} {msg!r:.100} in a direct stream")

    def cancel(self) -> None:
        """Abort the request in its replica (nothing if it has ended)."""
        if not self._closed:
            self._close()
            self._conn.send(StreamCancel(self._sid))

    def _deliver(self, msg: StreamReply | _Lost) -> None:
        self._queue.put_nowait(msg)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn.streams.pop(self._sid, None)
            self._on_close()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_lost: Callable[[], None]):
        self.reader, self.writer, self._on_lost = reader, writer, on_lost
        self.streams: dict[int, DirectStream] = {}
        self.lost: str | None = None
        self._task = asyncio.create_task(self._receive())

    def send(self, msg: StreamRequest) -> None:
        frame = _frame(msg, STREAM_REQUESTS)
        if self.lost is None:
            self.writer.write(frame)

    async def _receive(self) -> None:
        try:
            while True:
                msg = await _read(self.reader)
                if type(msg) not in STREAM_REPLIES:
                    raise TypeError(f"{type(msg).__name__} {msg!r:.100} from the replica")
                stream = self.streams.get(msg.sid)
                if stream is not None:
                    stream._deliver(msg)
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as e:
            self._lose(f"the connection to the replica dropped ({type(e).__name__})")
        except Exception as e:
            logger.exception("direct stream: a bad frame from the replica")
            self._lose(f"a bad frame from the replica ({type(e).__name__})")
        except asyncio.CancelledError:
            self._lose("the ingress closed the connection")
            raise

    def _lose(self, why: str) -> None:
        self.lost = why
        self.writer.close()
        self._on_lost()
        for stream in list(self.streams.values()):
            stream._deliver(_Lost(why))

    def close(self) -> None:
        self._task.cancel()


class StreamClient:
    """The ingress's connections, one per replica address (opened on first use, shared by every
    request to it, on the event loop that opened it)."""

    CONNECT_TIMEOUT_S = 2.0
    UNREACHABLE_S = 30.0  # a replica that could not be connected to is not tried again for this long

    def __init__(self) -> None:
        self._conns: dict[Address, asyncio.Task[_Connection]] = {}
        self._unreachable: dict[Address, float] = {}  # address -> until when (loop time)
        self._next_sid = 0

    def reachable(self, address: Address) -> bool:
        """False for a while after connecting to address failed (a firewall, a replica gone):
        its requests go through Serve meanwhile rather than each waiting on a connect."""
        until = self._unreachable.get(address)
        if until is None:
            return True
        if asyncio.get_running_loop().time() < until:
            return False
        del self._unreachable[address]
        return True

    async def open(self, address: Address, request: GenerateRequest, on_close: Callable[[], None]) -> DirectStream:
        """Send request to the replica at address; its outputs come through the DirectStream.
        on_close() runs once, when the stream ends, fails or is cancelled. StreamLost if the
        replica cannot be reached."""
        try:
            conn = await self._connection(address)
            if conn.lost is not None:
                raise StreamLost(conn.lost)
        except BaseException:
            on_close()
            raise
        self._next_sid += 1
        stream = DirectStream(conn, self._next_sid, on_close)
        conn.streams[stream._sid] = stream
        conn.send(StreamOpen(stream._sid, request))
        return stream

    async def _connection(self, address: Address) -> _Connection:
        task = self._conns.get(address)
        if task is not None and task.done() and (task.cancelled() or task.exception() is not None):
            task = None  # (the last attempt failed: a fresh one)
        if task is None:
            task = self._conns[address] = asyncio.ensure_future(self._connect(address))
        try:
            return await asyncio.shield(task)
        except (OSError, asyncio.TimeoutError) as e:
            if address not in self._unreachable:
                logger.warning(
                    "direct stream: cannot connect to the replica at %s:%d (%s); its requests go through "
                    "Serve for %g s",
                    address.host,
                    address.port,
                    type(e).__name__,
                    self.UNREACHABLE_S,
                )
            self._unreachable[address] = asyncio.get_running_loop().time() + self.UNREACHABLE_S
            raise StreamLost(
                f"cannot reach the replica at {address.host}:{address.port} ({type(e).__name__})"
            ) from None

    async def _connect(self, address: Address) -> _Connection:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(address.host, address.port), self.CONNECT_TIMEOUT_S
        )
        writer.write(address.token)
        return _Connection(reader, writer, lambda: self._drop(address))

    def _drop(self, address: Address) -> None:
        """A lost connection's entry goes (the next request to that replica connects afresh)."""
        task = self._conns.get(address)
        if task is not None and task.done() and not task.cancelled() and task.exception() is None:
            if task.result().lost is not None:
                del self._conns[address]

    def close(self) -> None:
        for task in self._conns.values():
            if task.done() and not task.cancelled() and task.exception() is None:
                task.result().close()
            else:
                task.cancel()
        self._conns.clear()
