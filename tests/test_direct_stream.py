"""The direct stream's two ends over a real loopback socket (chunkserve/replicas/direct_stream.py): outputs in
order, a full replica, errors as raised, cancellation and dropped connections reaching the
replica's generator, and a peer without the token never unpickled."""

from __future__ import annotations

import asyncio
import pickle
import struct

import pytest

from chunkserve.replicas.direct_stream import Address, ReplicaFull, StreamClient, StreamLost, StreamServer
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.wire import EngineDied, GenerateOutput, GenerateRequest, StreamOpen, StreamOutput


def _request(rid: str, n: int = 3, prompt: tuple[int, ...] = (1, 2, 3)) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=n), (), "m")


def _output(i: int, last: bool) -> GenerateOutput:
    return GenerateOutput("r0", f"t{i}", (i,), "length" if last else None, 3, 0, i + 1)


class _Replica:
    """generate() as a replica's: n outputs a request (request_id "bad": a ValueError after none,
    "dead": EngineDied), waiting on `gate` before each when set; records how each ended."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.gate: asyncio.Event | None = None
        self.room = True

    async def generate(self, request: GenerateRequest):
        rid = request.request_id
        self.started.setdefault(rid, asyncio.Event()).set()
        try:
            if rid == "bad":
                raise ValueError("prompt too long: 9 tokens, max_model_len 8")
            if rid == "dead":
                raise EngineDied("the engine failed: killed")
            n = request.params.max_tokens
            for i in range(n):
                if self.gate is not None:
                    await self.gate.wait()
                yield _output(i, i == n - 1)
            self.ended[rid] = "done"
        except (GeneratorExit, asyncio.CancelledError):
            self.ended[rid] = "aborted"
            raise


async def _pair(replica: _Replica) -> tuple[StreamServer, StreamClient]:
    server = StreamServer("127.0.0.1", replica.generate, lambda: replica.room)
    await server.start()
    return server, StreamClient()


def _closer() -> tuple[list[int], object]:
    closed: list[int] = []
    return closed, lambda: closed.append(1)


def test_outputs_in_order_then_end_and_release():
    async def run():
        replica = _Replica()
        server, client = await _pair(replica)
        closed, on_close = _closer()
        outs = [o async for o in await client.open(server.address, _request("a", 5), on_close)]
        assert [o.token_ids for o in outs] == [(i,) for i in range(5)]
        assert outs[-1].finish_reason == "length" and replica.ended == {"a": "done"}
        assert closed == [1]  # released once, at the end
        # many requests at once share one connection, each its own outputs
        streams = [await client.open(server.address, _request(f"c{i}", 2 + i % 3), lambda: None) for i in range(20)]
        got = await asyncio.gather(*(_collect(s) for s in streams))
        got = [[o.token_ids for o in outs] for outs in got]
        assert got == [[(j,) for j in range(2 + i % 3)] for i in range(20)]
        assert len(client._conns) == 1
        client.close()
        server.close()

    asyncio.run(run())


async def _collect(stream) -> list:
    return [o async for o in stream]


def test_full_replica_refuses_and_errors_arrive_as_raised():
    async def run():
        replica = _Replica()
        server, client = await _pair(replica)
        replica.room = False
        closed, on_close = _closer()
        stream = await client.open(server.address, _request("x"), on_close)
        with pytest.raises(ReplicaFull):
            await stream.__anext__()
        assert closed == [1] and "x" not in replica.started  # never run there
        replica.room = True
        with pytest.raises(ValueError, match="max_model_len 8"):
            await _collect(await client.open(server.address, _request("bad"), lambda: None))
        with pytest.raises(EngineDied, match="killed"):
            await _collect(await client.open(server.address, _request("dead"), lambda: None))
        # the connection serves on after errors
        assert len(await _collect(await client.open(server.address, _request("ok", 2), lambda: None))) == 2
        client.close()
        server.close()

    asyncio.run(run())


def test_cancel_aborts_in_the_replica():
    async def run():
        replica = _Replica()
        replica.gate = asyncio.Event()
        server, client = await _pair(replica)
        closed, on_close = _closer()
        stream = await client.open(server.address, _request("long", 100), on_close)
        await replica.started.setdefault("long", asyncio.Event()).wait()
        stream.cancel()
        assert closed == [1]
        for _ in range(200):
            if "long" in replica.ended:
                break
            await asyncio.sleep(0.01)
        assert replica.ended["long"] == "aborted"
        with pytest.raises(StopAsyncIteration):  # a cancelled stream ends
            await stream.__anext__()
        client.close()
        server.close()

    asyncio.run(run())


def test_dropped_connection_ends_streams_on_both_sides():
    async def run():
        replica = _Replica()
        replica.gate = asyncio.Event()
        server, client = await _pair(replica)
        # the ingress goes: the replica's open streams abort
        stream = await client.open(server.address, _request("a", 100), lambda: None)
        await replica.started.setdefault("a", asyncio.Event()).wait()
        client.close()
        for _ in range(200):
            if "a" in replica.ended:
                break
            await asyncio.sleep(0.01)
        assert replica.ended["a"] == "aborted"
        # the replica goes: the ingress's open streams get StreamLost, and so does a new one
        client = StreamClient()
        closed, on_close = _closer()
        stream = await client.open(server.address, _request("b", 100), on_close)
        await replica.started.setdefault("b", asyncio.Event()).wait()
        server.close()
        with pytest.raises(StreamLost):
            await stream.__anext__()
        assert closed == [1] and not client._conns  # the lost connection is forgotten
        assert client.reachable(server.address)
        with pytest.raises(StreamLost, match="cannot reach"):
            await client.open(server.address, _request("c"), lambda: None)
        assert not client.reachable(server.address)  # its requests take Serve's path for a while
        client._unreachable[server.address] = asyncio.get_running_loop().time()  # (the while is over)
        assert client.reachable(server.address)
        client.close()

    asyncio.run(run())


class _Bomb:
    def __reduce__(self):
        return (_BOOM.append, (1,))


_BOOM: list[int] = []


def test_a_peer_without_the_token_is_never_unpickled():
    async def run():
        replica = _Replica()
        server, _ = await _pair(replica)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.address.port)
        data = pickle.dumps(StreamOpen(1, _Bomb()))  # type: ignore[arg-type]
        writer.write(b"\0" * 16 + struct.pack("!I", len(data)) + data)
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on us
        finally:
            assert _BOOM == [] and replica.started == {}
        writer.close()
        server.close()

    asyncio.run(run())


def _raw_frame(msg) -> bytes:
    data = pickle.dumps(msg)
    return struct.pack("!I", len(data)) + data


def test_string_tagged_tuples_are_refused_on_both_ends():
    """Only chunkserve/replicas/wire.py's stream messages cross: neither end sends a bare tuple
    (the frames' old form), and an end that receives one drops the connection without acting on it."""

    async def run():
        replica = _Replica()
        server, client = await _pair(replica)
        replica.gate = asyncio.Event()
        stream = await client.open(server.address, _request("a", 100), lambda: None)
        with pytest.raises(TypeError, match=r"the direct stream: tuple \('cancel', 1\) is not one of its messages"):
            stream._conn.send(("cancel", 1))  # type: ignore[arg-type]
        # the replica's end: a tuple from a peer with the token closes the connection, unrun
        reader, writer = await asyncio.open_connection("127.0.0.1", server.address.port)
        writer.write(server.address.token + _raw_frame(("gen", 2, _request("tuple"))))
        assert await asyncio.wait_for(reader.read(), 10) == b""
        assert "tuple" not in replica.started
        writer.close()
        client.close()
        server.close()

        # the ingress's end: a replica answering with a tuple loses the stream
        async def replica_of_tuples(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(16)
            await r.readexactly(struct.unpack("!I", await r.readexactly(4))[0])  # the request
            w.write(_raw_frame(StreamOutput(1, _output(0, False))) + _raw_frame(("out", 1, _output(1, True))))
            await w.drain()
            await r.read()

        fake = await asyncio.start_server(replica_of_tuples, "127.0.0.1", 0)
        client = StreamClient()
        stream = await client.open(
            Address("127.0.0.1", fake.sockets[0].getsockname()[1], bytes(16)), _request("b"), lambda: None
        )
        assert (await stream.__anext__()).token_ids == (0,)
        with pytest.raises(StreamLost, match="a bad frame from the replica"):
            await stream.__anext__()
        client.close()
        fake.close()

    asyncio.run(run())


def test_address_round_trips_through_routing_stats():
    a = Address("10.0.0.7", 4321, bytes(range(16)))
    assert Address.from_tuple(a.as_tuple()) == a
    assert Address.from_tuple(None) is None and Address.from_tuple(("h", "x", "zz")) is None
