"""chunkserve/router/peers.py: routers that book each other's decisions. The book on two policies
(no cluster), then two PrefixAffinityRouters sharing over TCP, found through a real Ray's GCS."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from chunkserve.router.hashing import chunk_hashes
from chunkserve.router.peers import Batch, Finished, Peer, PeerBook, PeerLink, PeerLog, RegistryGone, Routed
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, ReplicaView

C = 4
REPLICAS = [f"rep{i}" for i in range(6)]


def _policy() -> PrefixPolicy:
    p = PrefixPolicy(PolicyConfig(chunk_size=C), seed=0)
    p.update_replicas(ReplicaView(r) for r in REPLICAS)
    return p


def _requests(n: int, seed: int = 0):
    rng = random.Random(seed)
    groups = [[rng.randrange(1000) for _ in range(8 * C)] for _ in range(5)]
    for _ in range(n):
        prompt = rng.choice(groups) + [rng.randrange(1000) for _ in range(C)]
        yield tuple(chunk_hashes(prompt, C, 32, "m")), len(prompt), rng.randrange(4, 64)


def test_a_book_holds_the_other_routers_loads_and_chains():
    # router A decides and logs; router B books A's log: B's loads and predicted chains are A's
    a, b = _policy(), _policy()
    log, book = PeerLog(), PeerBook(b)
    book.hello("A", "held-A")
    now, tickets = 1.0, {}
    for i, (chain, prompt, max_tokens) in enumerate(_requests(40)):
        r = a.choose(chain, prompt, max_tokens, now)[0]
        ticket = a.on_routed(r, chain, prompt, max_tokens, now)
        tickets[log.routed(r, chain, prompt, max_tokens, None, ticket.matched)] = (ticket, chain, r)
        if i % 3 == 2:  # some finish meanwhile
            n = min(tickets)
            a.on_finished(tickets.pop(n)[0])
            log.finished(n)
    events = log.take()
    assert log.take() == ()  # taken once
    book.apply("A", events, now)
    assert [b.load(r) for r in REPLICAS] == [a.load(r) for r in REPLICAS] and sum(a.load(r) for r in REPLICAS) > 0
    for _, chain, r in tickets.values():
        assert b.index.depth(r, chain) == a.index.depth(r, chain) > 0
    # a late joiner's first Batch (every open decision) overlapping the flushed ones counts once
    book.apply("A", tuple(log.open.values()), now)
    assert [b.load(r) for r in REPLICAS] == [a.load(r) for r in REPLICAS]
    assert book.booked == 40 and book.mirrored_keys() == {"held-A"}
    # A's completions reach B; a Finished for a decision B never booked is ignored
    for n, (ticket, _, _) in list(tickets.items())[:5]:
        a.on_finished(ticket)
        log.finished(n)
    book.apply("A", (*log.take(), Finished(10_000)), now)
    assert [b.load(r) for r in REPLICAS] == [a.load(r) for r in REPLICAS]
    # A's connection drops: its open decisions leave B's loads, its reports count again
    book.drop("A")
    assert [b.load(r) for r in REPLICAS] == [0.0] * len(REPLICAS) and book.mirrored_keys() == frozenset()


def test_a_decision_for_a_replica_the_book_does_not_know_is_skipped():
    b = _policy()
    book = PeerBook(b)
    book.apply("A", (Routed(1, "gone", (1, 2), 100, 8, None, 0), Routed(2, "rep0", (1, 2), 100, 8, None, 64)), 0.0)
    assert b.load("rep0") == 100 - 64 + 4 * 8  # the sender's matched tokens: its work, as it booked it
    assert book.booked == 1 and not b.has_replica("gone")
    assert Batch((Finished(2),)).events == (Finished(2),)


def test_a_link_whose_registry_is_gone_closes_quietly(caplog):
    # a router left running in a process whose Ray shut down (a handle in a test's driver, a
    # script's): its next listing ends the link, with no warning every DISCOVER_S after
    class Gone:
        def __init__(self):
            self.calls = 0

        def put(self, router, address):
            self.calls += 1
            if self.calls > 1:
                raise RegistryGone("Ray is not initialized in this process")

        def others(self, router):
            return {}

        def remove(self, router):
            raise RegistryGone("Ray is not initialized in this process")

    async def main():
        registry = Gone()
        link = PeerLink(Peer("A", "held-A", "127.0.0.1"), PeerLog(), PeerBook(_policy()), registry)
        await link.start()  # (puts once: fine), then its discover loop's first listing finds it gone
        for _ in range(100):
            await asyncio.sleep(0.01)
            if link._closed:
                break
        assert link._closed and registry.calls == 2
        await asyncio.sleep(0.01)
        assert all(t.done() for t in link._tasks)

    with caplog.at_level("WARNING"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "registry" in r.getMessage()]


# -- two routers over TCP, a real Ray's GCS as the registry ----------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)  # (a fresh one: not a cluster already running here)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_two_routers_book_each_others_decisions_over_the_wire(ray_local):
    from tests.test_serve_router import _route, _router_env

    FakeReplica, pending, _ = _router_env()

    async def until(cond, timeout_s=10.0):
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "the other router never caught up"
            await asyncio.sleep(0.01)

    async def main():
        reps = [FakeReplica(f"rep{i}") for i in range(4)]
        a, b = _sharing(reps), _sharing(reps)
        await until(lambda: a._link is not None and b._link is not None)
        await until(lambda: bool(a._link.peers()) and bool(b._link.peers()))

        def loads(r):
            return [r._policy.load(f"rep{i}") for i in range(4)]

        # A routes: B books each decision within milliseconds, its chain predicted where A sent it
        prompts = [list(range(8 * C)) + [n] for n in range(6)]
        chosen = [await _route(a, pending(p, n)) for n, p in enumerate(prompts)]
        await until(lambda: loads(b) == loads(a))
        assert sum(loads(a)) > 0 and b._book.booked == 6
        chain = tuple(chunk_hashes(prompts[0], C, 32, "tiny"))
        assert b._policy.index.depth(chosen[0], chain) == a._policy.index.depth(chosen[0], chain) > 0
        # the replicas' reports of A's requests are not added to B's loads again
        assert b._book.mirrored_keys() == {a._link.held_key}
        # B routes too: A books it
        await _route(b, pending(list(range(100, 100 + 8 * C)), 50))
        await until(lambda: loads(a) == loads(b))
        # A's requests end: B's loads follow
        for n in range(6):
            a.on_request_completed(None, f"internal-{n}")
        await until(lambda: loads(b) == loads(a))
        assert sum(loads(a)) > 0  # (B's own request is still open)
        # A's connection to B is cut: B releases A's decisions; A's next listing reconnects and
        # its first Batch books every open one again, once
        await _route(a, pending(prompts[1], 60))
        await until(lambda: loads(b) == loads(a))
        a._link._out.pop(b._link.router).close()
        await until(lambda: loads(b) != loads(a))
        await a._link.discover()
        await until(lambda: loads(b) == loads(a))
        # a router joining late books what is open at the others when it connects
        c = _sharing(reps)
        await until(lambda: c._link is not None and len(c._book.held_keys) == 2)
        await until(lambda: loads(c) == loads(a) == loads(b))
        # a router killed without removing its entry: after a few refused connections it goes
        from chunkserve.replicas.engine.distributed import free_port  # (a port nothing listens on)
        from chunkserve.router.serve_router import GcsRegistry

        registry = GcsRegistry("test", "LLMReplica")
        registry.put("dead", ("127.0.0.1", free_port(), "00" * 16))
        for _ in range(4):
            await a._link.discover()
            await asyncio.sleep(0.2)
        await until(lambda: "dead" not in registry.others(""))
        assert len(registry.others("")) == 3  # the live ones stay
        # a router outside a replica (a driver's, a script's handle) joins only once it routes
        d = _sharing(reps, source="UNKNOWN")
        await asyncio.sleep(0.5)
        assert d._link is None and len(registry.others("")) == 3
        await _route(d, pending(list(range(300, 300 + 8 * C)), 70))
        await until(lambda: d._link is not None and len(registry.others("")) == 4)
        await until(lambda: loads(d) == loads(a) == loads(b) == loads(c))
        for r in (a, b, c, d):
            r._link.close()

    asyncio.run(main())


def _sharing(reps, source="REPLICA"):
    """A PrefixAffinityRouter with share_decisions on, joined to its replicas (which starts its link
    where the handle's source is a replica, as an ingress's is)."""
    from ray.serve._private.common import DeploymentHandleSource

    from chunkserve.router.serve_router import PrefixAffinityRouter

    router = PrefixAffinityRouter(
        deployment_id=reps[0].replica_id.deployment_id,
        handle_source=DeploymentHandleSource[source],
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(chunk_size=C, share_decisions=True)
    router.update_replicas(reps)
    return router
