"""The host tier (DESIGN §6): chunks the GPU pool evicts spill to a host pool (here a second CPU
tensor), stay matched in the prefix tree, and come back on a hit instead of being recomputed."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from chunkserve.replicas.engine.kv_pool import HostPool, KVPool, KVShape
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams
from chunkserve.replicas.engine.prefix_tree import GPU, HOST, PrefixTree
from chunkserve.replicas.engine.scheduler import Scheduler
from chunkserve.replicas.engine.sequence import Sequence, Status, Tenancy
from tests import engine_ops

C = 4


def _tree(gpu_chunks: int, host_chunks: int, write_ahead: int = 0) -> PrefixTree:
    pool = KVPool(
        KVShape(num_layers=2, num_kv_heads=2, chunk_size=C, head_dim=3, dtype=torch.float32), gpu_chunks, "cpu"
    )
    return PrefixTree(pool, HostPool(pool, host_chunks), write_ahead=write_ahead)


def _fill(tree: PrefixTree, seq: Sequence, now: int) -> None:
    """Computed K/V for all of `seq`'s tokens (each chunk's slots set to a value of its own
    tokens), its full chunks inserted, as the engine does: chunks taken (spilling others), the
    copies issued, then the K/V written."""
    while seq.num_chunks < -(-seq.num_tokens // C):
        cid = tree.alloc()
        assert cid is not None
        seq.private.append(cid)
    tree.host.flush()
    for k in range(len(seq.nodes), seq.num_chunks):
        tree.pool.kv[:, :, seq.chunk_at(k)] = float(sum(seq.token_ids[k * C : (k + 1) * C]))
    seq.num_computed = seq.num_tokens
    while seq.private and (len(seq.nodes) + 1) * C <= seq.num_computed:
        k = len(seq.nodes)
        parent = seq.nodes[-1] if seq.nodes else tree.root_for(seq.tenancy.cache_salt)
        seq.nodes.append(tree.insert(parent, tuple(seq.token_ids[k * C : (k + 1) * C]), seq.private.pop(0), now))


def _finish(tree: PrefixTree, seq: Sequence, now: int) -> None:
    tree.release(seq.nodes, now)
    for cid in seq.private:
        tree.pool.free(cid)
    seq.nodes, seq.private = [], []


def _seq(rid: str, tokens, salt: str | None = None) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(), 0, tenancy=Tenancy(cache_salt=salt))


def _value(k: int) -> float:  # what _fill writes into the chunk of tokens 4k..4k+3 of range(...)
    return float(sum(range(4 * k, 4 * k + 4)))


def test_an_evicted_chunk_spills_stays_matched_and_loads_back_with_its_kv():
    tree = _tree(gpu_chunks=3, host_chunks=4)
    a = _seq("a", range(12))  # three full chunks: the whole GPU pool
    _fill(tree, a, now=1)
    _finish(tree, a, now=2)
    path = tree.match(list(range(12)), 12)
    assert [n.tier for n in path] == [GPU] * 3
    b = _seq("b", [50 + i for i in range(8)])  # two chunks: a's last two (leaf first) spill
    _fill(tree, b, now=3)
    tree.host.flush()
    tree.check([b])
    assert [n.tier for n in path] == [GPU, HOST, HOST] and tree.num_host == 2
    assert tree.match(list(range(12)), 12) == path  # still matched, in both tiers
    # the host copies hold what the GPU chunks held: every layer's K and V of the chunk
    for k in (1, 2):
        assert torch.equal(tree.host.kv[path[k].chunk_id], torch.full_like(tree.host.kv[0], _value(k)))
    _finish(tree, b, now=4)
    # a's path again: its GPU node acquired, the host ones loaded into fresh GPU chunks (b's spill)
    tree.acquire(path[:1], now=5)
    assert tree.load(path[1:], now=5) == 2
    tree.host.flush()
    assert [n.tier for n in path] == [GPU] * 3 and [n.ref for n in path] == [1, 1, 1]
    again = _seq("again", range(12))
    again.nodes, again.num_computed = list(path), 12
    tree.check([again])
    for k in (1, 2):
        assert torch.equal(
            tree.pool.kv[:, :, path[k].chunk_id],
            torch.full_like(tree.pool.kv[:, :, 0], _value(k)),
        )
    assert tree.num_host == 2  # b's two chunks went to the host in their place
    c = tree.host.counters
    assert (c.host_spills, c.host_loads) == (4, 2) and c.host_copy_bytes == 6 * tree.host.chunk_bytes


def test_chunks_written_ahead_are_evicted_without_a_copy_and_a_load_keeps_its_host_copy():
    tree = _tree(gpu_chunks=6, host_chunks=12, write_ahead=3)
    a = _seq("a", range(12))  # a chain of three chunks, finished: the next in line for eviction
    _fill(tree, a, now=1)
    path = list(a.nodes)
    _finish(tree, a, now=2)
    assert tree.write_ahead() == 0  # three chunks free: no shortage yet
    b = _seq("b", [50 + i for i in range(12)])  # three more, in use: the pool full
    _fill(tree, b, now=3)
    c = tree.host.counters
    # a's leaf, then its chain up (b's chunks are in use); once, until the line changes
    assert tree.write_ahead() == 3 and tree.write_ahead() == 0
    assert c.host_write_ahead == 0 and len(tree.host.pending) == 3  # (counted as flushed)
    tree.host.flush()
    tree.check([b])
    for k, n in enumerate(path):
        assert n.tier == GPU and n.backup >= 0
        assert torch.equal(tree.host.kv[n.backup], torch.full_like(tree.host.kv[0], _value(k)))
    assert (c.host_write_ahead, c.host_spills, c.host_copy_bytes) == (3, 0, 3 * tree.host.chunk_bytes)
    # two chunks taken: a's last two go to the host tier as they are, with no copy
    taken = [tree.alloc(), tree.alloc()]
    assert not tree.host.pending and [n.tier for n in path] == [GPU, HOST, HOST]
    assert (c.host_spills, c.host_spills_ahead, tree.num_host, tree.num_backups) == (0, 2, 2, 1)
    for cid in taken:
        tree.pool.free(cid)
    tree.host.flush()  # (no copy: the step's kernels wait for the write-aheads before, none left)
    tree.check([b])
    # a again: its GPU node acquired (keeping its backup), the host ones loaded; each loaded node
    # keeps the host chunk it came from as its backup
    tree.acquire(path[:1], now=5)
    assert tree.load(path[1:], now=5) == 2
    tree.host.flush()
    again = _seq("again", range(12))
    again.nodes, again.num_computed = list(path), 12
    tree.check([b, again])
    assert [n.tier for n in path] == [GPU] * 3 and all(n.backup >= 0 for n in path)
    for k, n in enumerate(path):
        assert torch.equal(tree.pool.kv[:, :, n.chunk_id], torch.full_like(tree.pool.kv[:, :, 0], _value(k)))
    assert (c.host_loads, tree.num_host, tree.num_backups) == (2, 0, 3)
    # evicted again: no copy at all (its host copies are kept)
    _finish(tree, again, now=6)
    before = c.host_copy_bytes
    taken = [tree.alloc() for _ in range(3)]
    assert not tree.host.pending and [n.tier for n in path] == [HOST] * 3 and c.host_copy_bytes == before
    assert c.host_spills_ahead == 5
    for cid in taken:
        tree.pool.free(cid)
    tree.host.flush()
    tree.check([b])
    _finish(tree, b, now=7)
    assert tree.evict_all() == 6 and tree.host.num_free == 12 and tree.pool.num_free == 6
    tree.check([])


def test_a_full_host_tier_gives_up_a_backup_of_a_chunk_in_use_before_a_cached_leaf():
    tree = _tree(gpu_chunks=3, host_chunks=2)
    a = _seq("a", range(4))
    _fill(tree, a, now=1)
    (a0,) = a.nodes
    _finish(tree, a, now=2)
    b = _seq("b", range(20, 28))
    _fill(tree, b, now=3)
    b0, b1 = b.nodes
    _finish(tree, b, now=4)
    c = _seq("c", range(40, 48))
    _fill(tree, c, now=5)  # a0 and b1 spill: the host tier full
    assert (a0.tier, b0.tier, b1.tier, tree.host.num_free) == (HOST, GPU, HOST, 0)
    # a0 loaded for d: b0 spills for its GPU chunk into b1's host chunk (b1, the older host leaf,
    # removed); a0 keeps its host chunk as its backup
    tree.acquire([], now=6)
    assert tree.load([a0], now=6) == 1
    tree.host.flush()
    d = _seq("d", range(4))
    d.nodes, d.num_computed = [a0], 4
    tree.check([c, d])
    assert b1.parent is None and (a0.tier, b0.tier) == (GPU, HOST) and a0.backup >= 0
    # c done: its leaf spills for the next chunk taken, into a0's backup (a0 is in use), not b0's
    _finish(tree, c, now=7)
    c1 = tree.match(list(range(40, 48)), 8)[1]
    taken = tree.alloc()
    tree.host.flush()
    assert (c1.tier, b0.tier, a0.backup, tree.num_backups) == (HOST, HOST, -1, 0)
    tree.pool.free(taken)
    tree.check([d])


def test_a_full_host_tier_gives_up_copies_before_chunks_held_only_there():
    # a lost backup costs a copy later, a lost host leaf a recompute: a write-ahead takes no host
    # leaf, and a spill gives up a ref-0 node's backup before one
    tree = _tree(gpu_chunks=2, host_chunks=2, write_ahead=1)
    a, b, c, d = (_seq(r, range(10 * k, 10 * k + 4)) for k, r in enumerate("abcd"))
    for now, q in enumerate((a, b, c), start=1):
        _fill(tree, q, now)
        _finish(tree, q, now)
    _fill(tree, d, now=4)  # a0 and b0 spilled (the host tier full); c0 cached, d0 in use
    (a0,), (b0,), (c0,) = (tree.match(q.token_ids, 4) for q in (a, b, c))
    assert (a0.tier, b0.tier, c0.tier, tree.host.num_free, tree.pool.num_free) == (HOST, HOST, GPU, 0, 0)
    # c0 is next in line, but a copy of it would cost a host leaf: none is made
    assert tree.write_ahead() == 0 and tree.num_backups == 0
    assert a0.parent is not None and b0.parent is not None
    _finish(tree, d, now=5)
    # a0 loaded for e (c0 spills for its GPU chunk: the host tier gives up b0, its LRU leaf, with
    # no backup to give instead); a0 keeps its host chunk as its backup, ref 0 once e is done
    e = _seq("e", a.token_ids)
    tree.acquire([], now=6)
    assert tree.load([a0], now=6) == 1
    tree.host.flush()
    e.nodes, e.num_computed = [a0], 4
    tree.check([e])
    assert b0.parent is None and (a0.tier, a0.backup >= 0, c0.tier) == (GPU, True, HOST)
    _finish(tree, e, now=7)
    # a new chunk: d0 spills into a0's backup, not c0's host chunk (c0 is held only there)
    f = _seq("f", range(50, 54))
    _fill(tree, f, now=8)
    (d0,) = tree.match(d.token_ids, 4)
    assert (d0.tier, a0.tier, a0.backup, c0.tier, c0.parent is not None) == (HOST, GPU, -1, HOST, True)
    tree.check([f])


def test_a_request_holding_chunks_loaded_in_a_step_runs_from_the_next():
    # the loads run beside the step that decided them (not waited for): a sequence holding a
    # chunk loaded in this step's schedule, by itself or by another, runs from the next step;
    # one that holds none runs at once
    tree = _tree(gpu_chunks=16, host_chunks=8)
    config = EngineConfig("tiny", max_num_batched_tokens=64, max_num_seqs=8)
    sched = Scheduler(tree, config)
    prefix = list(range(12))
    a = _seq("a", prefix + [99])
    sched.add(a)
    batch = sched.schedule()
    assert [(q.request_id, n) for q, n in batch.prefills] == [("a", 13)]
    sched.advance(batch)  # a's three prefix chunks in the tree
    sched.finish(a, "stop")
    assert tree.spill_all() == 3
    tree.host.flush()
    b, c, d = _seq("b", prefix + [50]), _seq("c", prefix + [60, 61]), _seq("d", [70 + t for t in range(5)])
    for q in (b, c, d):
        sched.add(q)
    first = sched.schedule()
    tree.host.flush()
    assert [(q.request_id, n) for q, n in first.items] == [("d", 5)]
    assert {q.status for q in (b, c, d)} == {Status.RUNNING} and tree.loading == {n.id for n in b.nodes}
    assert (b.num_cached_prompt, b.num_cached_prompt_host) == (12, 12) and c.nodes == b.nodes
    assert (c.num_cached_prompt, c.num_cached_prompt_host) == (12, 0)  # (b's loads, on the GPU for c)
    tree.check([b, c, d])
    sched.advance(first)
    d.output_ids.append(1)  # (its first token, sampled)
    second = sched.schedule()
    assert tree.loading == set() and {q.request_id: n for q, n in second.items} == {"b": 1, "c": 2, "d": 1}


def test_check_catches_a_backup_off_its_list():
    tree = _tree(gpu_chunks=2, host_chunks=2, write_ahead=1)
    a = _seq("a", range(8))
    _fill(tree, a, now=1)
    _finish(tree, a, now=2)
    assert tree.write_ahead() == 1
    tree.host.flush()
    tree.check([])
    (backed,) = [n for n in tree.nodes() if n.backup >= 0]
    tree._backed.clear()
    with pytest.raises(AssertionError, match="not on its list"):
        tree.check([])


def test_the_host_tier_evicts_its_least_recently_used_leaf_and_a_salts_root_goes_with_its_last():
    tree = _tree(gpu_chunks=2, host_chunks=2)
    for i, salt in enumerate(["x", None, None]):  # each two chunks: the GPU pool, then the next spills them
        s = _seq(f"s{i}", [10 * i + t for t in range(8)], salt)
        _fill(tree, s, now=2 * i + 1)
        _finish(tree, s, now=2 * i + 2)
        tree.host.flush()
        tree.check([])
    # s0 ("x") went to the host, then out of it (its leaf first, then its root's child) for s1
    assert set(tree.roots) == {None} and tree.num_host == 2 and tree.num_cached == 2
    assert tree.match([10 + t for t in range(8)], 8)[0].tier == HOST
    assert tree.match(list(range(8)), 8, "x") == []
    assert tree.evict_all() == 4 and tree.pool.num_free == 2 and tree.host.num_free == 2
    tree.check([])


def test_a_chunk_recomputed_while_its_copy_is_in_the_host_tier_takes_its_node():
    tree = _tree(gpu_chunks=2, host_chunks=4)
    a = _seq("a", range(8))
    _fill(tree, a, now=1)
    nodes = list(a.nodes)
    _finish(tree, a, now=2)
    b = _seq("b", [90 + t for t in range(8)])
    _fill(tree, b, now=3)
    _finish(tree, b, now=4)
    tree.host.flush()
    assert [n.tier for n in nodes] == [HOST, HOST]
    # the same tokens computed again (as a piece that loaded none of them would): the host node
    # becomes the new GPU chunk's, its host copy freed, its host child kept below it
    again = _seq("again", range(4))
    _fill(tree, again, now=5)
    tree.host.flush()
    assert again.nodes == nodes[:1] and nodes[0].tier == GPU and nodes[1].tier == HOST
    tree.check([again])


def test_check_catches_a_host_node_with_a_live_sequence():
    tree = _tree(gpu_chunks=2, host_chunks=2)
    a = _seq("a", range(4))
    _fill(tree, a, now=1)
    tree.check([a])
    a.nodes[0].tier = HOST  # as if spilled under its sequence
    with pytest.raises(AssertionError, match="host tier"):
        tree.check([a])


def test_check_catches_a_copy_decided_but_not_issued():
    tree = _tree(gpu_chunks=1, host_chunks=2)
    s = _seq("s", range(4))
    _fill(tree, s, now=1)
    _finish(tree, s, now=1)
    t = _seq("t", range(20, 24))
    t.private.append(tree.alloc())  # s's chunk spilled to give t one: its copy queued
    with pytest.raises(AssertionError, match="not issued"):
        tree.check([t])
    tree.host.flush()
    tree.check([t])


# -- the engine -------------------------------------------------------------------------------

# a GPU pool of 12 chunks of 16 tokens; 8 prefixes of 6 chunks each (4x the pool), each asked
# twice in turn, so a prefix comes back after the others have passed through the pool. One row
# at a time: a load takes GPU chunks only as far as the pool has them beside the running rows
# (Scheduler._admit), so with one row every hit loads whole
SMALL = dict(chunk_size=16, kv_cache_tokens=192, max_model_len=160, max_num_batched_tokens=128, max_num_seqs=1)
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(96)] for _ in range(8)]
    return [p + [rng.randrange(256) for _ in range(3 + r)] for r in range(2) for p in prefixes]


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[int]], list]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    cached: dict[str, tuple[int, int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            cached[out.request_id] = (out.cached_tokens, out.cached_tokens_host)
        engine.check()
    return [got[str(i)] for i in range(len(prompts))], [cached[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def without_tier():
    """The workload without a host tier: (tokens, each request's cached tokens, stats)."""
    engine = LLMEngine.from_model("tiny", **SMALL)
    assert sum(len(p) // 16 for p in _workload()[:8]) >= 4 * engine.pool.num_chunks
    return (*_run(engine, _workload(), PARAMS), engine.stats())


@pytest.mark.parametrize("write_ahead", [None, 0], ids=["write_ahead", "no_write_ahead"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tokens_are_the_same_with_the_host_tier_and_its_hits_are_not_recomputed(
    without_tier, async_scheduling, write_ahead
):
    want, plain_cached, p = without_tier
    tiered = LLMEngine.from_model(
        "tiny",
        **SMALL,
        host_cache_tokens=4096,
        host_write_ahead_tokens=write_ahead,
        async_scheduling=async_scheduling,
    )
    got, cached = _run(tiered, _workload(), PARAMS)
    assert got == want  # K/V copied back is the K/V recomputed
    s = tiered.stats()
    # without the tier every prefix was evicted before it came back; with it, the second ask of
    # each prefix copied its 6 chunks back
    assert p["cached_prompt_tokens"] == 0 and all(c == (0, 0) for c in plain_cached)
    assert cached[:8] == [(0, 0)] * 8 and cached[8:] == [(96, 96)] * 8
    assert s["cached_prompt_tokens"] == s["cached_prompt_tokens_host"] == 8 * 96
    assert s["computed_prompt_tokens"] == p["computed_prompt_tokens"] - 8 * 96
    assert s["host_loads"] == 8 * 6 and s["host_spills"] + s["host_spills_ahead"] >= s["host_loads"]
    copies = s["host_loads"] + s["host_spills"] + s["host_write_ahead"]
    assert s["host_copy_bytes"] == copies * tiered.host.chunk_bytes
    # an eviction copies nothing where the chunk's copy is on the host already: written ahead
    # (half the 12-chunk pool's worth, by default), or the one it was loaded from
    assert s["host_spills_ahead"] > 0
    if write_ahead is None:
        assert tiered.tree.write_ahead_chunks == 6 and s["host_write_ahead"] > 0
    else:
        assert tiered.tree.write_ahead_chunks == s["host_write_ahead"] == 0
    assert s["host_chunks_total"] == 256 and 0 < s["host_chunks_used"] <= 256
    assert tiered.tree.evict_all() > 0
    tiered.check()
    assert tiered.pool.num_free == tiered.pool.num_chunks and tiered.host.num_free == tiered.host.num_chunks


@pytest.mark.gpu
@pytest.mark.parametrize("write_ahead", [None, 0], ids=["write_ahead", "no_write_ahead"])
def test_on_cuda_the_tiers_copies_beside_the_steps_give_the_same_tokens(write_ahead):
    # the copies on their side stream: spills waited for, loads and write-aheads beside the step
    # (a loaded chunk read from the next step on); with asynchronous scheduling, as a GPU runs
    cuda = dict(SMALL, device="cuda", dtype="float32", attention_backend="torch", async_scheduling=True)
    want, _ = _run(LLMEngine.from_model("tiny", **cuda), _workload(), PARAMS)
    tiered = LLMEngine.from_model("tiny", **cuda, host_cache_tokens=4096, host_write_ahead_tokens=write_ahead)
    got, cached = _run(tiered, _workload(), PARAMS)
    assert got == want and cached[8:] == [(96, 96)] * 8
    s = tiered.stats()
    assert s["host_loads"] == 8 * 6 and (s["host_write_ahead"] > 0) is (write_ahead is None)


def test_a_preempted_requests_chunks_spill_and_come_back():
    # a 10-chunk pool: "long" (7 chunks of prompt, growing to 10) preempts "late" (newest) once it
    # outgrows the pool; late's full chunks stay as cache, then spill as long keeps growing, and
    # late, admitted again, loads them back instead of recomputing them
    rng = random.Random(1)
    long_prompt = [rng.randrange(256) for _ in range(100)]
    late_prompt = [rng.randrange(256) for _ in range(40)]
    config = dict(chunk_size=16, kv_cache_tokens=160, max_model_len=160, max_num_batched_tokens=64)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (55, 20)]
    roomy = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=4096)
    want = roomy.generate([long_prompt, late_prompt], params)
    results = {}
    for host in (0, 1024):
        engine = LLMEngine.from_model("tiny", **config, host_cache_tokens=host)
        engine.add_request("long", long_prompt, params[0])
        engine.add_request("late", late_prompt, params[1])
        got: dict[str, list[int]] = {"long": [], "late": []}
        late_nodes, spilled = [], False
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
            engine.check()
            late = engine._seqs.get("late")
            if late is not None and late.nodes and not late_nodes:
                late_nodes = list(late.nodes)  # its prompt's full chunks, as first computed
            spilled |= any(n.tier == HOST for n in late_nodes)
        assert [got["long"], got["late"]] == want
        results[host] = (engine.stats(), spilled, late_nodes)
    (plain, _, _), (tiered, spilled, late_nodes) = results[0], results[1024]
    assert plain["preemptions"] == tiered["preemptions"] >= 1
    assert spilled and tiered["host_loads"] >= 2
    assert tiered["computed_prompt_tokens"] < plain["computed_prompt_tokens"]
    # the nodes late came back to are the ones it computed first, on the GPU again
    assert all(n.tier == GPU and n.parent is not None for n in late_nodes)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def tiered_small(request):
    # a 20-chunk GPU pool over a 6-chunk host pool: both tiers fill and evict
    return LLMEngine.from_model(
        "tiny",
        chunk_size=16,
        kv_cache_tokens=320,
        host_cache_tokens=96,
        max_model_len=160,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        async_scheduling=request.param,
    )


ops = engine_ops.ops(max_length=150, bases=5, max_size=30)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_add_step_abort_keeps_both_tiers_whole(tiered_small, ops):
    engine = tiered_small
    rng = random.Random(7)
    bases = [[rng.randrange(256) for _ in range(150)] for _ in range(4)] + [[5] * 150]
    before = engine.stats()
    engine_ops.drive(engine, ops, lambda base, length: bases[base][:length])
    after = engine.stats()
    assert after["cached_prompt_tokens_host"] - before["cached_prompt_tokens_host"] <= (
        after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    )
    engine.tree.evict_all()
    engine.check()
    assert engine.pool.num_free == engine.pool.num_chunks and engine.host.num_free == engine.host.num_chunks
    assert engine.tree.num_host == engine.tree.num_cached == 0


def test_host_cache_tokens_is_checked_and_off_by_default():
    assert EngineConfig(model="tiny").host_cache_tokens == 0
    assert LLMEngine.from_model("tiny", kv_cache_tokens=1024).host is None
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="host_cache_tokens"):
            EngineConfig(model="tiny", host_cache_tokens=bad)
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=1024, chunk_size=16, host_cache_tokens=100)
    assert engine.host.num_chunks == 7  # (rounded up to whole chunks)
    assert engine.host.kv.shape[0] == 7 and engine.host.kv.shape[1:] == engine.pool.kv[:, :, 0].shape


@pytest.mark.slow  # (five tiny engines: about 40 s on a loaded two-core machine)
def test_bench_host_tier_prints_each_commands_results(capsys):
    from chunkserve.replicas.tools.bench_host_tier import main

    tiny = ["--chunk-size", "16", "--suffix", "4"]
    main(["cached", *tiny, "--kv-cache-tokens", "256", "--tenants", "8", "--requests", "16", "--concurrency", "1"])
    main(["ttft", *tiny, "--prefix", "32", "--repeat", "1"])
    main(["bandwidth", *tiny, "--prefix", "32", "--repeat", "1", "--copy-mib", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cached = {r["run"]: r for r in rows if r["bench"] == "cached"}
    assert set(cached) == {"gpu", "gpu+host", "gpu_all", "summary"}
    assert cached["gpu"]["prefixes_over_pool"] == 4 and cached["gpu"]["host_loads"] == 0
    # the same requests: the tier serves from the host what the pool alone recomputes
    tier, gpu = cached["gpu+host"], cached["gpu"]
    assert tier["cached_prompt_tokens"] > gpu["cached_prompt_tokens"] and tier["cached_prompt_tokens_host"] > 0
    assert tier["prompt_tokens"] == gpu["prompt_tokens"] == cached["gpu_all"]["prompt_tokens"]
    (hit,) = [r for r in rows if r["bench"] == "ttft"]
    chunk_bytes = 4 * 2 * 2 * 16 * 64 * 4  # tiny: layers x (K, V) x KV heads x c x head size x fp32
    assert hit["prefix_tokens"] == 32 and hit["load_bytes"] == 2 * chunk_bytes  # a hit loads its 2 chunks
    assert {r["copy"] for r in rows if r["bench"] == "bandwidth"} == {"raw_h2d", "raw_d2h", "tier_load"}
