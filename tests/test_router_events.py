"""Chunk-tree events (chunkserve/router/events.py, chunkserve/replicas/engine/tree_events.py) and the index that
applies them (chunkserve/router/index.PrefixIndex.apply_events): deltas, gaps, epochs, snapshots, and
an index built from deltas against the tree itself."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.replicas.engine import EngineConfig, LLMEngine
from chunkserve.replicas.engine.kv_pool import HostPool, KVPool, KVShape
from chunkserve.replicas.engine.prefix_tree import HOST, PrefixTree
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.engine.tree_events import RouteEvents
from chunkserve.router.events import ANCHOR, ANCHOR_EVERY, EAGER_DEPTH, ChunkLog, PublishConfig, Relay, decode
from chunkserve.router.hashing import cache_seed, chunk_hashes, model_seed
from chunkserve.router.index import PrefixIndex

C = 4  # chunk size of the tree tests
SEED = model_seed("tiny")


def make_tree(
    num_chunks: int,
    route_chunks: int = 3,
    max_delta: int = 4096,
    host_chunks: int = 0,
    anchor_every: int = ANCHOR_EVERY,
    eager_depth: int = EAGER_DEPTH,
) -> PrefixTree:
    """host_chunks: a host tier of that many chunks (tests/test_host_tier.py's kind), or none."""
    pool = KVPool(KVShape(num_layers=1, num_kv_heads=1, chunk_size=C, head_dim=1, dtype=torch.uint8), num_chunks, "cpu")
    tree = PrefixTree(pool, HostPool(pool, host_chunks) if host_chunks else None)
    tree.events = RouteEvents(tree, SEED, PublishConfig(route_chunks, eager_depth, anchor_every, max_delta))
    return tree


def serve(tree: PrefixTree, tokens: list[int], salt: str | None, now: int, max_load: int = 99) -> None:
    """One request through the tree as the scheduler drives it: match, load back up to
    `max_load` chunks of what of it is in the host tier (the scheduler's room), fill the rest
    chunk by chunk (evicting or spilling as needed; a chunk recomputed over its host copy takes
    the node over), finish (its chunks stay cached)."""
    path = tree.match(tokens, len(tokens), salt)
    on_gpu = next((i for i, n in enumerate(path) if n.tier == HOST), len(path))
    tree.acquire(path[:on_gpu], now)
    host_run = path[on_gpu : on_gpu + max_load]
    path = path[: on_gpu + (tree.load(host_run, now) if host_run else 0)]
    for k in range(len(path), len(tokens) // C):
        cid = tree.alloc()
        assert cid is not None  # (prompts fit the pool: every other chunk is evictable)
        # (the root after the alloc: evicting a salt's last chunk takes its root)
        parent = tree.insert(path[-1] if path else tree.root_for(salt), tuple(tokens[k * C : (k + 1) * C]), cid, now)
        path.append(parent)
    if tree.host is not None:
        tree.host.flush()
    tree.release(path, now)


def truth(tree: PrefixTree, route_chunks: int) -> set[int]:
    """The routable hashes of the tree, made from each node's path of tokens as the ingress
    hashes a prompt (not from the events' hashes)."""
    return truth_tiers(tree, route_chunks)[0]


def truth_tiers(tree: PrefixTree, route_chunks: int, anchors: set[int] | None = None) -> tuple[set[int], set[int]]:
    """(the routable hashes of the tree, those of them whose node is in the host tier); `anchors`:
    a set to fill with their hashes by depth (depth: the anchor spacing)."""
    out: set[int] = set()
    host: set[int] = set()
    for salt, root in tree.roots.items():
        stack = [(n, list(n.tokens)) for n in root.children.values()]
        while stack:
            node, tokens = stack.pop()
            if len(tokens) // C > route_chunks:
                continue
            h = chunk_hashes(tokens, C, route_chunks, cache_seed(SEED, salt))[-1]
            out.add(h)
            if anchors is not None and (len(tokens) // C - 1) % tree.events.anchor_every == 0:
                anchors.add(h)
            if node.tier == HOST:
                host.add(h)
            stack.extend((n, tokens + list(n.tokens)) for n in node.children.values())
    return out, host


# -- the log and the relay ---------------------------------------------------------------------------


def test_log_nets_changes_and_snapshots_an_epochs_start_and_an_overflow():
    log = ChunkLog(max_delta=3)
    assert log.take() == (log.epoch, 1, (), ())  # the epoch's first publication: a snapshot
    assert log.take() is None  # nothing changed
    log.stored(1)
    log.stored(2)
    log.evicted(2)  # stored and evicted since the last take: no change
    assert log.take() == (log.epoch, 2, ((2, 2, (1,), (), (1,), ()),), None)  # (1 an anchor, as by default)
    log.evicted(1)
    log.stored(1)  # evicted and stored again: no change, but a publication all the same
    log.stored(3)
    assert log.take() == (log.epoch, 3, ((3, 3, (3,), (), (3,), ()),), None)
    for h in (4, 5, 6, 7):
        log.stored(h)
    epoch, seq, deltas, snapshot = log.take()  # more than max_delta changes: the whole set
    assert (seq, deltas, set(snapshot)) == (4, (), {h | ANCHOR for h in (1, 3, 4, 5, 6, 7)})  # anchors flagged
    old = log.epoch
    log.reset()
    assert log.epoch != old and log.take() == (log.epoch, 1, (), ())


def test_relay_repeats_recent_cuts_and_snapshots_when_due():
    log, relay = ChunkLog(), Relay(max_delta=4, ring_s=5.0, snapshot_s=10.0)
    assert relay.report(0.0) is None  # nothing from the engine yet
    relay.apply(log.take())
    epoch, seq, deltas, snapshot = relay.report(0.0)
    assert (seq, deltas, snapshot) == (
        1,
        ((1, 1, (), (), (), ()),),
        (),
    )  # a new epoch: a snapshot, and the ring from seq 1
    log.stored(10)
    relay.apply(log.take())
    log.stored(11, anchor=False)
    relay.apply(log.take())
    r1 = relay.report(1.0)
    assert r1[1] == 3 and r1[2] == (
        (1, 1, (), (), (), ()),
        (2, 3, (10, 11), (), (10,), ()),
    )  # two publications, one cut
    assert r1[3] == (11, 10 | ANCHOR)  # (snapshots for ring_s after the epoch began; the anchor flagged)
    log.evicted(10)
    relay.apply(log.take())
    r2 = relay.report(6.0)
    assert (
        r2[2] == ((2, 3, (10, 11), (), (10,), ()), (4, 4, (), (10,), (), (10,))) and r2[3] is None
    )  # the ring keeps 5 s of cuts
    assert relay.report(6.0) is r2  # nothing new: the same report
    assert relay.report(6.5)[2] == ((4, 4, (), (10,), (), (10,)),)  # (the cut at 1 s is older than ring_s)
    r3 = relay.report(11.0)  # snapshot_s after the last snapshot
    assert r3[2] == ((4, 4, (), (10,), (), (10,)),) and r3[3] == (11,)
    for h in range(20, 26):  # a cut larger than max_delta: the ring restarts after it, snapshots instead
        log.stored(h)
    relay.apply(log.take())
    r4 = relay.report(11.5)
    assert r4[1] == 5 and r4[2] == () and set(r4[3]) == {11, *(h | ANCHOR for h in range(20, 26))}
    assert relay.report(12.0)[3] is not None and relay.report(17.0)[3] is None  # for ring_s


def test_log_and_relay_carry_tier_changes_netted():
    """A spill or a load is the hash stored again at its new tier (~h: the host tier); a change
    undone before the next take is none; snapshots are tier-coded too."""
    log, relay = ChunkLog(max_delta=4), Relay(max_delta=4, ring_s=5.0, snapshot_s=10.0)
    relay.apply(log.take())
    log.stored(1, anchor=False)
    log.stored(2, anchor=False)
    log.moved(2, host=True)  # stored then spilled since the last take: stored in the host tier
    relay.apply(pub := log.take())
    assert pub[2] == ((2, 2, (1, ~2), (), (), ()),) and (relay.held, relay.host) == ({1, 2}, {2})
    log.moved(1, host=True)
    log.moved(1, host=False)  # spilled and loaded back: no change
    assert log.take() is None
    log.moved(2, host=False)  # loaded back
    log.moved(1, host=True)  # spilled
    relay.apply(pub := log.take())
    assert pub[2] == ((3, 3, (2, ~1), (), (), ()),) and (relay.held, relay.host) == ({1, 2}, {1})
    log.evicted(1)  # (from the host tier: a plain eviction)
    relay.apply(pub := log.take())
    assert pub[2] == ((4, 4, (), (1,), (), ()),) and (relay.held, relay.host) == ({2}, set())
    for h in (5, 6, 7, 8, 9):
        log.stored(h, host=h % 2 == 1, anchor=h == 5)  # (a restart lists spilled nodes in their tier)
    relay.apply(pub := log.take())  # more than max_delta: a snapshot, tier-coded
    assert pub[3] is not None and set(pub[3]) == {2, ~(5 | ANCHOR), 6, ~7, 8, ~9}  # (5: an anchor, flagged)
    assert (relay.held, relay.host) == ({2, 5, 6, 7, 8, 9}, {5, 7, 9})
    report = relay.report(0.0)  # the relay's own snapshot: tier-coded as well
    assert set(report[3]) == {2, ~(5 | ANCHOR), 6, ~7, 8, ~9} and relay.anchors == {5}
    log.moved(5, host=False)
    relay.apply(log.take())
    assert relay.report(1.0)[2][-1] == (6, 6, (5,), (), (), ()) and relay.host == {7, 9}  # loaded back


# -- the index ---------------------------------------------------------------------------------------


def follow(relay_reports, index: PrefixIndex, rid: str = "r") -> list[bool]:
    return [index.apply_events(rid, r, 0.0) for r in relay_reports]


def test_index_applies_deltas_in_order_and_ignores_repeats():
    index = PrefixIndex()
    e = 7
    assert index.apply_events("r", (e, 1, ((1, 1, (1, 2), ()),), None), 0.0)
    assert index.apply_events("r", (e, 2, ((1, 1, (1, 2), ()), (2, 2, (3,), (2,))), None), 0.0)
    assert index.published("r") == {1, 3} and index.synced("r") == (e, 2, True)
    assert index.apply_events("r", (e, 2, ((2, 2, (3,), (2,)),), None), 0.0)  # the same report again
    assert index.published("r") == {1, 3}
    assert index.depth("r", (1, 3, 4)) == 2 and index.holders((1, 3), 4) == ("r",)


def test_a_gap_is_bridged_then_resynced_from_a_snapshot():
    index = PrefixIndex()
    e = 7
    index.apply_events("r", (e, 1, ((1, 1, (1, 2), ()),), None), 0.0)
    # reports 2..3 missed; this one's ring starts at 4: a gap, no snapshot
    assert not index.apply_events("r", (e, 4, ((4, 4, (5,), (1,)),), None), 0.0)
    assert index.gaps == 1 and index.synced("r") == (e, 4, False)
    assert index.published("r") == {2, 5}  # what it could apply (2 was evicted in the missed reports)
    assert not index.apply_events("r", (e, 5, ((5, 5, (6,), ()),), None), 0.0)  # still inexact
    assert index.published("r") == {2, 5, 6} and index.gaps == 1
    # the next snapshot makes it exact, whatever the ring holds
    assert index.apply_events("r", (e, 6, ((6, 6, (7,), ()),), (5, 6, 7)), 0.0)
    assert index.published("r") == {5, 6, 7} and index.holders((2,), 4) == ()
    assert index.synced("r") == (e, 6, True)


def test_the_index_keeps_each_hashs_tier_through_deltas_gaps_and_snapshots():
    index = PrefixIndex()
    e = 7
    assert index.apply_events("r", (e, 1, ((1, 1, (1, 2, 3), ()),), None), 0.0)
    assert index.apply_events("other", (5, 1, ((1, 1, (1, 2), ()),), None), 0.0)
    assert index.host_depths(["r", "other"], (1, 2, 3), [3, 2]) is None  # nobody has a host tier
    # 3 then 2 spilled (stored again as ~h): still held, no second holder entry
    assert index.apply_events("r", (e, 2, ((2, 2, (~3, ~2), ()),), None), 0.0)
    assert index.published("r") == {1, 2, 3} and index.published_host("r") == {2, 3}
    assert index.depths(["r"], (1, 2, 3, 4)) == [3]  # both tiers count as held (cached_tokens)
    assert index.host_depths(["r", "other"], (1, 2, 3, 4), [3, 2]) == [2, 0]
    assert index.host_depths(["r"], (1, 2, 3), [1]) is None  # (its first chunk is on the GPU)
    # 2 loaded back, 4 stored, 3 evicted from the host tier
    assert index.apply_events("r", (e, 3, ((3, 3, (2, 4), (3,)),), None), 0.0)
    assert index.published("r") == {1, 2, 4} and index.published_host("r") == set()
    index.remove_replica("other")
    assert index.holders((1, 2), 4) == ("r",)  # (the reverse map: one entry each)
    # a gap: what it can, tiers included; the next snapshot (tier-coded) makes it exact
    assert not index.apply_events("r", (e, 5, ((5, 5, (~4, ~6), ()),), None), 0.0)
    assert index.published("r") == {1, 2, 4, 6} and index.published_host("r") == {4, 6}
    assert index.apply_events("r", (e, 6, (), (1, ~2, ~7)), 0.0)
    assert index.published("r") == {1, 2, 7} and index.published_host("r") == {2, 7}
    assert index.host_depths(["r"], (1, 2, 7), [3]) == [2]
    # a record of a longer chain than the replica published: its host part is that of the published prefix
    index.record("r", (1, 2, 7, 8, 9), now=1.0)
    assert index.depths(["r"], (1, 2, 7, 8, 9)) == [5] and index.host_depths(["r"], (1, 2, 7, 8, 9), [5]) == [2]
    # a new epoch drops the tiers with the set
    assert index.apply_events("r", (8, 1, ((1, 1, (1,), ()),), None), 2.0)
    assert index.published_host("r") == set() and index.host_depths(["r"], (1, 2), [1]) is None


def test_an_inexact_index_takes_a_snapshot_of_the_seq_it_holds():
    """A router that missed a delta, then saw the next one, holds the latest seq but is inexact:
    an idle replica's next report (no new seq, a periodic snapshot) resyncs it."""
    index = PrefixIndex()
    e = 7
    index.apply_events("r", (e, 1, ((1, 1, (1, 2), ()),), None), 0.0)
    assert not index.apply_events("r", (e, 3, ((3, 3, (4,), ()),), None), 0.0)  # 2 (evicting 1) missed
    assert index.published("r") == {1, 2, 4}
    assert index.apply_events("r", (e, 3, (), (2, 4)), 0.0) and index.published("r") == {2, 4}
    assert index.synced("r") == (e, 3, True)


def test_a_new_epoch_drops_the_old_entries():
    index = PrefixIndex()
    index.apply_events("r", (1, 9, ((9, 9, (1, 2, 3), ()),), None), 0.0)
    index.apply_events("other", (5, 1, ((1, 1, (1,), ()),), None), 0.0)
    # the engine restarted: its ring starts at the new epoch's seq 1, from the empty set
    assert index.apply_events("r", (2, 1, ((1, 1, (4,), ()),), None), 0.0)
    assert index.published("r") == {4} and index.holders((1,), 4) == ("other",)
    # a new epoch whose start this router missed: the old entries go at once; a snapshot resyncs
    assert not index.apply_events("r", (3, 5, ((5, 5, (8,), ()),), None), 0.0)
    assert index.published("r") == {8}
    assert index.apply_events("r", (3, 6, (), (6, 8)), 0.0) and index.published("r") == {6, 8}


def test_a_snapshot_after_an_overflow_resyncs_and_own_records_wait_for_exactness():
    index = PrefixIndex()
    index.record("r", (1, 2, 3), now=5.0)
    index.apply_events("r", (7, 1, ((1, 1, (1,), ()),), None), 4.0)  # exact as of 4: the record (at 5) stays
    assert index.depth("r", (1, 2, 3)) == 3
    log_gap = (7, 3, (), (1, 9))  # an overflow cut: no deltas, a snapshot
    assert index.apply_events("r", log_gap, 6.0) and index.published("r") == {1, 9}
    assert index.own_roots("r") == 0 and index.depth("r", (1, 2, 3)) == 1  # the record is superseded
    index.record("r", (9, 4), now=7.0)
    assert not index.apply_events("r", (7, 5, ((5, 5, (), (9,)),), None), 8.0)  # a gap: records kept
    assert index.own_roots("r") == 1


def test_a_router_that_stalls_past_the_ring_is_exact_again_within_one_snapshot_period():
    log, relay = ChunkLog(), Relay(max_delta=100, ring_s=2.5, snapshot_s=10.0)
    index = PrefixIndex()
    exact = {}
    for t in range(45):  # a change and a report a second
        log.stored(100 + t)
        relay.apply(log.take())
        report = relay.report(float(t))
        stalled = 6 <= t <= 10  # the router's loop stalls for 5 s: longer than the ring
        skipping = t >= 30 and t % 2  # then it sees every other report: the ring covers those
        if not stalled and not skipping:
            exact[t] = index.apply_events("r", report, float(t))
    assert all(exact[t] for t in range(6))
    behind = [t for t, ok in exact.items() if not ok]
    assert behind and behind[0] == 11 and behind[-1] - behind[0] < 10  # resynced by the next snapshot
    assert all(exact[t] for t in exact if t >= 30) and index.gaps == 1
    assert index.published("r") == relay.held


@pytest.mark.parametrize("other_holds_it", [False, True])
def test_after_a_gap_an_unseen_anchors_tier_change_then_eviction_keeps_the_map_whole(other_holds_it):
    # "r"'s first delta (A stored, an anchor) is lost to a lagging router; the next moves A to the
    # host tier (a stored hash already held: listed as no anchor), the one after evicts it. The
    # router applies them approximately: A enters and leaves r's set, and the reverse map, which
    # never listed r for A, keeps what it had (another replica's entry; nothing for r)
    index, a = PrefixIndex(anchor_every=1), 1234
    if other_holds_it:
        assert index.apply_events("s", (7, 1, ((1, 1, (a,), (), (a,), ()),), None), 1.0)
    report = (9, 3, ((2, 2, (~a,), (), (), ()), (3, 3, (), (a,), (), (a,))), None)
    assert not index.apply_events("r", report, 2.0)  # a gap and no snapshot: approximate
    assert index.published("r") == index.published_host("r") == frozenset()
    assert index._digest_holders == ({a: ("s",)} if other_holds_it else {})


# -- against the tree ------------------------------------------------------------------------------

_OP_ARGS = {
    "serve": st.tuples(  # (base prompt, extra chunks of it, salt, most chunks loaded back)
        st.just("serve"),
        st.integers(0, 3),
        st.integers(0, 5),
        st.sampled_from([None, None, "t1", "t2"]),
        st.integers(0, 6),
    ),
    "report": st.tuples(st.just("report"), st.booleans()),  # (True: the lagging router misses it)
    "evict_all": st.just(("evict_all",)),
    "spill_all": st.just(("spill_all",)),  # every cached GPU chunk to the host tier (as room allows)
}
OPS = st.lists(  # serves and reports the most, resets and spills of everything now and then
    st.sampled_from(["serve"] * 5 + ["report"] * 4 + ["evict_all", "spill_all"]).flatmap(_OP_ARGS.__getitem__),
    min_size=20,
    max_size=80,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    OPS,
    st.sampled_from([1, 3, 6, 64]),
    st.sampled_from([0, 6, 40]),
    st.sampled_from([3, 6]),
    st.sampled_from([1, 2, 16]),
)
def test_an_index_built_from_deltas_equals_the_tree(ops, max_delta, host_chunks, route_chunks, anchor_every):
    """Random requests (shared prefixes, salts, eviction under a small pool: with a host tier,
    spills, loads back, recomputes over a host copy and the host tier's own evictions) and pool
    resets on a real PrefixTree; its events through a Relay to two routers' indexes, one seeing
    every report, one missing some. After every report the first equals the tree's routable set
    and each hash's tier, as an index built from that report's snapshot would; the second equals
    them whenever it says it is exact, and after the next snapshot. The reverse map of each holds
    the tree's anchors (depths 1, 1 + anchor_every, ...) and nothing else whenever it is exact."""
    tree = make_tree(
        num_chunks=10,
        route_chunks=route_chunks,
        max_delta=max_delta,
        host_chunks=host_chunks,
        anchor_every=anchor_every,
    )
    relay = Relay(max_delta=max_delta, ring_s=3.0, snapshot_s=5.0)
    every, lagging = PrefixIndex(anchor_every=anchor_every), PrefixIndex(anchor_every=anchor_every)
    bases = [[b * 50 + i for i in range(6 * C)] for b in range(4)]
    t = 0.0
    for now, op in enumerate(ops, 1):
        if op[0] == "serve":
            _, base, extra, salt, max_load = op
            serve(tree, bases[base][: (1 + extra) * C] + [999 - now] * 2, salt, now, max_load)
        elif op[0] == "evict_all":
            tree.evict_all()
        elif op[0] == "spill_all":
            tree.spill_all()
            if tree.host is not None:
                tree.host.flush()
        else:
            events = tree.events.take()
            if events is not None:
                relay.apply(events)
            t += 1.0
            report = relay.report(t)
            anchors: set[int] = set()
            want, want_host = truth_tiers(tree, route_chunks, anchors)
            assert (relay.held, relay.host, relay.anchors) == (want, want_host, anchors)
            assert every.apply_events("r", report, t)
            assert (every.published("r"), every.published_host("r")) == (want, want_host)
            assert every._digest_holders == dict.fromkeys(anchors, ("r",))  # the anchors, and only they
            if report[3] is not None:
                fresh = PrefixIndex(anchor_every=anchor_every)
                assert fresh.apply_events("r", report, t)
                assert (fresh.published("r"), fresh.published_host("r")) == (want, want_host)
                assert fresh._digest_holders == dict.fromkeys(anchors, ("r",))
            if not op[1] and lagging.apply_events("r", report, t):
                assert (lagging.published("r"), lagging.published_host("r")) == (want, want_host)
                assert lagging._digest_holders == dict.fromkeys(anchors, ("r",))
        tree.check([])
    relay.apply(tree.events.take() or (relay.epoch, relay.seq, (), None))
    report = relay.report(t + 10.0)  # snapshot_s later: a snapshot
    assert lagging.apply_events("r", report, t)
    anchors = set()
    assert (lagging.published("r"), lagging.published_host("r")) == truth_tiers(tree, route_chunks, anchors)
    assert lagging._digest_holders == dict.fromkeys(anchors, ("r",))
    lagging.remove_replica("r")
    assert not lagging._digest_holders


def test_the_reverse_map_holds_anchors_only_and_holders_finds_the_deepest_holder():
    """Three replicas' real trees (anchors every 4 chunks, 10 routed) hold one 10-chunk prompt to
    depths 10, 6 and 3, and another prompt each: the index's reverse map lists only the anchors
    (depths 1, 5, 9), one entry a replica; `holders` finds the deepest holder of a prefix that ends
    between two anchors, and the depths are exact."""
    prompt = list(range(10 * C))
    chain = tuple(chunk_hashes(prompt, C, 10, SEED))
    index = PrefixIndex(anchor_every=4)
    for r, depth in (("a", 10), ("b", 6), ("c", 3)):
        tree = make_tree(num_chunks=32, route_chunks=10, anchor_every=4)
        relay = Relay()
        relay.apply(tree.events.take())
        serve(tree, prompt[: depth * C], None, 1)
        own = [1000 * ord(r) + i for i in range(5 * C)]  # (its own prompt: 5 chunks)
        serve(tree, own, None, 2)
        relay.apply(tree.events.take())
        assert index.apply_events(r, relay.report(1.0), 1.0)
        own_chain = chunk_hashes(own, C, 10, SEED)
        assert relay.anchors == {chain[0], chain[4], chain[8]} & set(chain[:depth]) | {own_chain[0], own_chain[4]}
    want = {chain[0]: ("a", "b", "c"), chain[4]: ("a", "b"), chain[8]: ("a",)}
    assert {h: tuple(sorted(s)) for h, s in index._digest_holders.items() if h in chain} == want
    assert len(index._digest_holders) == 3 + 3 * 2  # and each own prompt's depths 1 and 5
    assert index.depths(["a", "b", "c"], chain) == [10, 6, 3]
    assert index.holders(chain, 4) == ("a",)
    assert index.holders(chain[:7] + (1, 2), 4) == ("a",)  # a holds 7 of it, b 6: both past the anchor at 5
    assert set(index.holders(chain[:6] + (1,), 4)) == {"a", "b"}  # both hold all 6 known
    assert index.holders(chain[:4] + (1,), 4) in (("a", "b"), ("b", "a"))  # c holds 3
    assert index.holders(chain[:3] + (1,), 4) and len(index.holders(chain[:3] + (1,), 4)) == 3
    index.remove_replica("a")
    assert {h: tuple(sorted(s)) for h, s in index._digest_holders.items() if h in chain} == {
        chain[0]: ("b", "c"),
        chain[4]: ("b",),
    }
    index.replace_digest("b", chain[:2], as_of=2.0)  # (a digest: every hash an anchor)
    assert index.depths(["b", "c"], chain) == [2, 3]
    assert chain[1] in index._digest_holders and chain[4] not in index._digest_holders


def test_spills_and_loads_reach_the_index_as_tiers():
    """A real tree with a host tier: a prompt's chunks spill (deepest first), the router sees
    them in the host tier at the tail of its chain, and again on the GPU once a request loads
    them back."""
    tree = make_tree(num_chunks=4, route_chunks=4, host_chunks=8)
    relay, index = Relay(), PrefixIndex()
    a, b = list(range(4 * C)), [100 + t for t in range(3 * C)]
    chain = tuple(chunk_hashes(a, C, 4, SEED))

    def report(t: float) -> None:
        relay.apply(tree.events.take())
        assert index.apply_events("r", relay.report(t), t)

    serve(tree, a, None, 1)
    report(1.0)
    assert index.depths(["r"], chain) == [4] and index.host_depths(["r"], chain, [4]) is None
    serve(tree, b, None, 2)  # three chunks: a's last three spill
    report(2.0)
    assert index.published_host("r") == set(chain[1:]) and index.host_depths(["r"], chain, [4]) == [3]
    assert index.depths(["r"], chain) == [4]  # (still held: loaded back, not recomputed)
    serve(tree, a, None, 3, max_load=1)  # loads one back (spilling b's) and recomputes two over their copies
    report(3.0)
    assert (
        index.published_host("r") == set(chunk_hashes(b, C, 4, SEED)) and index.host_depths(["r"], chain, [4]) is None
    )
    assert relay.host == index.published_host("r") and tree.host.counters.host_loads == 1


def test_salted_and_deep_chunks_hash_as_the_ingress_hashes_prompts():
    tree = make_tree(num_chunks=16, route_chunks=2)
    prompt = list(range(4 * C))
    serve(tree, prompt, None, 1)
    serve(tree, prompt, "tenant", 2)
    events = tree.events.take()
    assert events[3] is not None  # the epoch's first publication: a snapshot
    held, _, anchors = decode(events[3])
    plain, salted = chunk_hashes(prompt, C, 2, SEED), chunk_hashes(prompt, C, 2, cache_seed(SEED, "tenant"))
    assert held == {*plain, *salted}  # two chunks deep, not four
    assert anchors == {plain[0], salted[0]}  # (the roots: depth 1 of every ANCHOR_EVERY)
    with pytest.raises(ValueError, match="routing events"):
        tree.digest(model_seed("another"), 2, 100)  # the nodes' hashes are the events'
    assert set(tree.digest(SEED, 2, 100)) == held


def nodes_by_hash(tree: PrefixTree, route_chunks: int) -> dict[int, tuple[int, int | None]]:
    """Each routable node's hash (as the ingress makes it) -> (its depth, its parent's hash)."""
    out: dict[int, tuple[int, int | None]] = {}
    for salt, root in tree.roots.items():
        stack = [(n, list(n.tokens), None) for n in root.children.values()]
        while stack:
            node, tokens, parent = stack.pop()
            if len(tokens) // C > route_chunks:
                continue
            h = chunk_hashes(tokens, C, route_chunks, cache_seed(SEED, salt))[-1]
            out[h] = (len(tokens) // C, parent)
            stack.extend((n, tokens + list(n.tokens), h) for n in node.children.values())
    return out


@pytest.mark.parametrize("host_chunks", [0, 24])
def test_deep_chunks_are_published_once_a_request_reuses_them(host_chunks):
    # routed 6 chunks deep, published eagerly 2 deep: a prompt's own deeper chunks, used once, are
    # not published; a second request over them publishes them (its own tail not); evictions
    # (and spills and loads, with a host tier) keep the set prefix-closed and true to the tree
    tree = make_tree(num_chunks=40 if not host_chunks else 20, route_chunks=6, host_chunks=host_chunks, eager_depth=2)
    index = PrefixIndex()

    def published() -> frozenset[int]:
        events = tree.events.take()
        if events is not None:
            assert index.apply_events("r", events, 0.0)
        return index.published("r")

    a = list(range(100, 100 + 6 * C))
    ha = chunk_hashes(a, C, 6, SEED)
    serve(tree, a, None, 1)
    assert published() == set(ha[:2])
    b = a[: 5 * C] + [7] * C  # a's first 5 chunks, then its own
    serve(tree, b, None, 2)
    assert published() == set(ha[:5])
    assert index.depth("r", tuple(chunk_hashes(b, C, 6, SEED))) == 5  # what a third request would match
    serve(tree, a, None, 3)
    assert published() == set(ha)
    salted = list(range(300, 300 + 6 * C))  # a salt's tree follows the same rule (its own seed)
    serve(tree, salted, "t1", 4)
    serve(tree, salted, "t1", 5)
    assert set(chunk_hashes(salted, C, 6, cache_seed(SEED, "t1"))) <= published()
    for i in range(40):  # churn: prompts sharing 0-5 chunks with a, some twice, evicting
        k = i % 6
        p = a[: k * C] + [1000 + i] * (6 - k) * C
        for t in range(1 + i % 2):
            serve(tree, p, None, 10 + 2 * i + t)
        held, nodes = published(), nodes_by_hash(tree, 6)
        assert held <= nodes.keys()  # nothing the tree lost
        assert {h for h, (d, _) in nodes.items() if d <= 2} <= held  # every eager node
        assert all(parent is None or parent in held for h, (_, parent) in nodes.items() if h in held)
        assert tree.events._latent.keys() == nodes.keys() - held  # the rest waits, none lost track of
        assert index.published_host("r") == held & truth_tiers(tree, 6)[1]  # tiers as the tree's
    tree.evict_all()  # a reset: a new epoch, nothing held
    assert published() == set() and not tree.events._latent


def test_engine_records_route_events_and_a_reset_starts_a_new_epoch():
    engine = LLMEngine.from_config(EngineConfig(model="tiny", device="cpu", kv_cache_tokens=4096, chunk_size=64))
    engine.record_route_events("tiny", 32)
    relay, index = Relay(), PrefixIndex()
    relay.apply(engine.take_route_events())
    prompts = [[(7 * i + g) % 256 for i in range(200)] for g in range(2)]
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
    relay.apply(engine.take_route_events())
    want = {h for p in prompts for h in chunk_hashes(p, 64, 32, "tiny")}  # 3 full chunks each
    assert relay.held == want
    assert index.apply_events("r", relay.report(0.0), 0.0) and index.published("r") == want
    epoch = relay.epoch
    engine.tree.evict_all()
    relay.apply(engine.take_route_events())
    assert relay.epoch != epoch and relay.held == set()
    assert index.apply_events("r", relay.report(1.0), 1.0) and index.published("r") == set()


def test_bench_events_runs_small_and_reports_both_paths(capsys):
    from chunkserve.router.tools import bench_events

    bench_events.main(["--replicas", "4", "--seconds", "2", "--warmup", "1", "--rate", "4", "--spill", "0.5"])
    row = json.loads(capsys.readouterr().out)
    assert row["replicas"] == 4 and row["churn_per_replica_s"] > 0 and row["gaps"] == 0
    for path in ("events", "snapshot"):
        assert row[f"{path}_core_fraction"] > 0 and row[f"{path}_bytes_per_s"] > 0
