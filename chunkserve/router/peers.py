"""Routers that agree (DESIGN §3): each ingress process's prefix router books the other routers'
decisions and completions as its own, milliseconds after they are made, instead of learning the
others' share of a replica's load a routing-stats period late from the replicas' reports.

    router A: on_routed/on_finished ─PeerLog─▶ every FLUSH_S a Batch ─TCP─▶ router B: PeerBook.apply
                                                                          └▶ B's policy: on_routed / on_finished

With k routers each placing a group's first requests before any report shows the others', the
simulator's k = 4 hit fell to 0.70-0.76 of the oracle's; booking each other's decisions brings it
to k = 1's (chunkserve/router/tools/simulate.py `--policy shared`, records simulate-2026-12-06d).

Discovery: each router puts its address in a `Registry` under its deployment and lists the
others every DISCOVER_S, connecting to each new one (serve_router's `GcsRegistry`: Ray's GCS
key-value store, which every Ray cluster runs; no store of our own). A connection carries one
direction: a router sends on the connections it opened and books what arrives on those it
accepted.

Wire: the connecting side sends the listener's secret token (raw bytes, checked before anything
is unpickled), then length-prefixed pickles of plain tuples: first Hello, then Batches.

    Hello(router, held_key)   the sender's id and the key the replicas' `held_by_router` report
                              its requests under (its process's direct.ROUTER_ID)
    Batch(events)             Routed and Finished in the order they happened; the first Batch
                              on a connection holds every decision the sender has open
    Routed(n, replica, chain, prompt_tokens, max_tokens, session, matched)   decision n of the
                              sender, with the tokens it counted as cached (every router books
                              the same work, whatever its own index knows)
    Finished(n)                                                      its request ended

A decision booked twice (the first Batch overlaps the next) counts once; a Finished for one never
booked is ignored. A connection that drops takes its sender's tickets with it (`PeerBook.drop`):
that router's share comes back from the replicas' reports, as before it connected.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import time
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from chunkserve.router.frames import frame, listening_socket, read_frame
from chunkserve.router.policy import PrefixPolicy, Ticket

logger = logging.getLogger("ray.serve")

FLUSH_S = 0.005  # a router's decisions wait at most this long before they go to the others
DISCOVER_S = 2.0  # how often a router lists the others in the registry
CONNECT_TIMEOUT_S = 2.0
FORGET_AFTER = 3  # failed connections in a row after which a registered router is taken as gone
TOKEN_BYTES = 16
MAX_FRAME = 64 << 20
MAX_UNSENT = 8 << 20  # bytes queued to a peer past which it is cut off (it is not reading)


class Routed(NamedTuple):
    n: int  # the sender's decision number
    replica: str
    chain: tuple[int, ...]  # the prompt's prefix hashes
    prompt_tokens: int
    max_tokens: int
    session: int | None
    matched: int  # the prompt tokens the sender counted as cached there (its work, booked as is)


class Finished(NamedTuple):
    n: int


class Hello(NamedTuple):
    router: str
    held_key: str  # where the replicas' held_by_router reports this router's requests


class Batch(NamedTuple):
    events: tuple[Routed | Finished, ...]


class PeerLog:
    """This router's own decisions, numbered, and completions, waiting for the next flush; the
    decisions still open, for a peer that connects late."""

    def __init__(self) -> None:
        self._n = 0
        self.open: dict[int, Routed] = {}
        self._pending: list[Routed | Finished] = []

    def routed(
        self, replica: str, chain: Sequence[int], prompt_tokens: int, max_tokens: int, session, matched: int
    ) -> int:
        self._n += 1
        event = Routed(self._n, replica, tuple(chain), prompt_tokens, max_tokens, session, matched)
        self.open[self._n] = event
        self._pending.append(event)
        return self._n

    def finished(self, n: int) -> None:
        if self.open.pop(n, None) is not None:
            self._pending.append(Finished(n))

    def take(self) -> tuple[Routed | Finished, ...]:
        """The events since the last take, in order."""
        out, self._pending = tuple(self._pending), []
        return out


class PeerBook:
    """The other routers' decisions booked on this router's policy, per sender: its open tickets."""

    def __init__(self, policy: PrefixPolicy):
        self.policy = policy
        self._open: dict[str, dict[int, Ticket]] = {}
        self.held_keys: dict[str, str] = {}  # sender -> its held_by_router key
        self.booked = 0  # decisions booked, ever (a metric and the tests')

    def hello(self, sender: str, held_key: str) -> None:
        self._open.setdefault(sender, {})
        self.held_keys[sender] = held_key

    def apply(self, sender: str, events: Sequence[Routed | Finished], now: float) -> None:
        open_ = self._open.setdefault(sender, {})
        policy = self.policy
        for e in events:
            if type(e) is Routed:
                if e.n in open_ or not policy.has_replica(e.replica):
                    continue
                open_[e.n] = policy.on_routed(
                    e.replica, e.chain, e.prompt_tokens, e.max_tokens, now, e.session, e.matched
                )
                self.booked += 1
            else:
                ticket = open_.pop(e.n, None)
                if ticket is not None:
                    policy.on_finished(ticket)

    def drop(self, sender: str) -> None:
        """The sender's connection is gone: its open decisions leave the loads."""
        for ticket in self._open.pop(sender, {}).values():
            self.policy.on_finished(ticket)
        self.held_keys.pop(sender, None)

    def mirrored_keys(self) -> frozenset[str]:
        """The held_by_router keys of the routers booked here: the replicas' reports of their
        work are not added again."""
        return frozenset(self.held_keys.values())


class Peer(NamedTuple):
    """A router as the others see it."""

    router: str  # its id among the deployment's routers
    held_key: str  # where the replicas' held_by_router report its requests (direct.ROUTER_ID)
    host: str  # the address it listens on


class RegistryGone(Exception):
    """The registry is gone for good (this process's Ray shut down): the link closes."""


class Registry(Protocol):
    """Where the routers of one deployment find each other (blocking calls: run off the loop;
    RegistryGone once it never will answer again)."""

    def put(self, router: str, address: tuple[str, int, str]) -> None: ...
    def others(self, router: str) -> dict[str, tuple[str, int, str]]: ...
    def remove(self, router: str) -> None: ...


async def _read(reader: asyncio.StreamReader) -> Any:
    msg = await read_frame(reader, MAX_FRAME)
    if not isinstance(msg, (Hello, Batch)):
        raise ConnectionError(f"a peer sent a {type(msg).__name__}, not a Hello or Batch")
    return msg


class PeerLink:
    """One router's side of the exchange, on the router's event loop: a listener whose
    connections feed `book`, connections to every other router registered, and a flush of `log`
    to them every FLUSH_S. start() once, on that loop; close() when the router goes."""

    def __init__(self, me: Peer, log: PeerLog, book: PeerBook, registry: Registry):
        self.router, self.held_key, host = me
        self.log, self.book, self.registry = log, book, registry
        self._sock = listening_socket(host, 64)
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self.address = (host, self._sock.getsockname()[1], self._token.hex())
        self._out: dict[str, asyncio.StreamWriter] = {}  # peer -> the connection this router sends on
        self._connecting: set[str] = set()
        self._failed: dict[str, int] = {}  # peer -> connection attempts failed in a row
        self._inbound: dict[str, object] = {}  # sender -> its current connection (a marker)
        self._tasks: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None
        self._closed = False

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._accept, sock=self._sock)
        await loop.run_in_executor(None, self.registry.put, self.router, self.address)
        self._spawn(self._flush_loop())
        self._spawn(self._discover_loop())

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        for w in self._out.values():
            w.close()
        self._out.clear()
        for t in self._tasks:
            t.cancel()
        try:
            self.registry.remove(self.router)
        except Exception:  # (the cluster may be going down with this router)
            pass

    def peers(self) -> set[str]:
        """The routers this one sends to."""
        return set(self._out)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- receiving ---------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender, conn = None, object()
        try:
            token = await reader.readexactly(TOKEN_BYTES)
            if not secrets.compare_digest(token, self._token):
                return
            hello = await _read(reader)
            if not isinstance(hello, Hello):
                return
            sender = hello.router
            if sender in self._inbound:  # it reconnected: its first Batch books every open decision again
                self.book.drop(sender)
            self._inbound[sender] = conn
            self.book.hello(sender, hello.held_key)
            while True:
                batch = await _read(reader)
                if isinstance(batch, Batch):
                    self.book.apply(sender, batch.events, time.monotonic())
        except (asyncio.IncompleteReadError, ConnectionError, OSError, pickle.UnpicklingError, asyncio.CancelledError):
            pass
        finally:
            if sender is not None and self._inbound.get(sender) is conn:  # (not a newer connection's)
                del self._inbound[sender]
                self.book.drop(sender)
            writer.close()

    # -- sending -------------------------------------------------------------------------------
    async def _connect(self, peer: str, address: tuple[str, int, str]) -> None:
        try:
            host, port, token = address
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, ValueError, TypeError):
            # a router gone without removing its entry (its process killed): after a few tries its
            # entry goes (a live router puts its own back at each listing)
            self._failed[peer] = self._failed.get(peer, 0) + 1
            if self._failed[peer] >= FORGET_AFTER:
                del self._failed[peer]
                await asyncio.get_running_loop().run_in_executor(None, self.registry.remove, peer)
            return
        finally:
            self._connecting.discard(peer)
        self._failed.pop(peer, None)
        if self._closed or peer in self._out:
            writer.close()
            return
        writer.write(bytes.fromhex(token))
        writer.write(frame(Hello(self.router, self.held_key)))
        # every decision still open, before anything flushed after it: the peer books each once
        writer.write(frame(Batch(tuple(self.log.open.values()))))
        self._out[peer] = writer

    def flush(self) -> None:
        """Send the log's events to every peer (FLUSH_S calls it; tests may too)."""
        events = self.log.take()
        if not events or not self._out:
            return
        data = frame(Batch(events))
        for peer, writer in list(self._out.items()):
            if writer.is_closing() or writer.transport.get_write_buffer_size() > MAX_UNSENT:
                # gone, or too slow to keep up: it drops this router's decisions and counts its
                # share from the reports again (a later listing reconnects, its first Batch exact)
                writer.close()
                del self._out[peer]
                continue
            writer.write(data)

    async def _flush_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(FLUSH_S)
            self.flush()

    async def discover(self) -> None:
        """Put this router's entry (back), and connect to the routers registered and not yet
        connected to."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, self.registry.put, self.router, self.address)
            others = await loop.run_in_executor(None, self.registry.others, self.router)
        except RegistryGone:  # (a router left running in a process whose Ray shut down)
            self.close()
            return
        except Exception as e:  # (the GCS unreachable a moment: tried again)
            logger.warning(f"router peers: listing the registry failed: {e}")
            return
        for peer, address in others.items():
            if peer not in self._out and peer not in self._connecting:
                self._connecting.add(peer)
                self._spawn(self._connect(peer, address))

    async def _discover_loop(self) -> None:
        while not self._closed:
            await self.discover()
            await asyncio.sleep(DISCOVER_S)
