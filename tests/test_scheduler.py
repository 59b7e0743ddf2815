"""chunkserve/replicas/engine/scheduler.py on its own: FCFS admission under the token budget, chunked prefill,
max_num_seqs, DFS order of the decode rows, preemption of the newest. A small driver plays the
engine: after each step the new K/V count as computed and every row that reached its last token
samples one more."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from chunkserve.replicas.engine.config import EngineConfig
from chunkserve.replicas.engine.kv_pool import KVPool, KVShape
from chunkserve.replicas.engine.prefix_tree import PrefixTree
from chunkserve.replicas.engine.scheduler import Scheduler, _sort_dfs
from chunkserve.replicas.engine.sequence import Batch, SamplingParams, Sequence, Status, Tenancy

C = 4  # tokens a chunk


def _scheduler(
    num_chunks: int = 64,
    *,
    budget: int = 64,
    max_num_seqs: int = 16,
    sharing: bool = True,
    max_model_len: int | None = None,
) -> Scheduler:
    pool = KVPool(
        KVShape(num_layers=1, num_kv_heads=1, chunk_size=C, head_dim=2, dtype=torch.float32), num_chunks, "cpu"
    )
    config = EngineConfig(
        "tiny",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_sharing=sharing,
        max_model_len=max_model_len,
    )
    return Scheduler(PrefixTree(pool), config)


_arrivals = itertools.count()


def _seq(name: str, prompt: list[int], max_tokens: int = 1000, tenancy: Tenancy | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Sequence(name, list(prompt), params, next(_arrivals), tenancy=tenancy or Tenancy())


def _step(s: Scheduler) -> Batch:
    """One engine step: schedule, 'run' it, sample a token for each row that reached its end."""
    batch = s.schedule()
    s.advance(batch)
    for seq, _ in batch.items:
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(100 + len(seq.output_ids))
    return batch


def _pieces(batch: Batch) -> list[tuple[str, int]]:
    return [(seq.request_id, n) for seq, n in batch.prefills]


def test_admission_is_fcfs_a_short_request_does_not_overtake_a_long_one():
    s = _scheduler(budget=8)
    a, b, c = _seq("a", range(1, 7)), _seq("b", range(11, 16)), _seq("c", [21])
    for seq in (a, b, c):
        s.add(seq)
    # a whole (6), b a first piece of what the budget leaves (2): c, though it would fit in one
    # token, does not overtake b
    first = _step(s)
    assert _pieces(first) == [("a", 6), ("b", 2)] and first.num_tokens == 8
    assert list(s.waiting) == [c] and c.status is Status.WAITING
    # a decodes, b's prefill continues (3 left), c is admitted with what remains (its one
    # prompt token runs as a decode row would: one token, then it samples)
    second = _step(s)
    assert [q.request_id for q in second.decodes] == ["a", "c"]
    assert _pieces(second) == [("b", 3)]
    assert not s.waiting and all(q.status is Status.RUNNING for q in (a, b, c))


def test_a_long_prompt_is_prefilled_in_pieces_beside_the_decodes():
    s = _scheduler(budget=10)
    short, long = _seq("short", [1, 2, 3]), _seq("long", range(1, 40))
    s.add(short)
    _step(s)
    s.add(long)
    pieces = []
    while long.num_computed < len(long.prompt_ids):
        batch = _step(s)
        assert [q.request_id for q in batch.decodes] == ["short"]  # the running decode every step
        assert batch.num_tokens <= 10
        pieces += [n for seq, n in batch.prefills if seq is long]
    assert pieces == [9, 9, 9, 9, 3]  # the budget less the decode's token, the rest last


def test_max_num_seqs_caps_the_running_batch():
    s = _scheduler(max_num_seqs=3)
    seqs = [_seq(f"r{i}", [i + 1, i + 2]) for i in range(5)]
    for seq in seqs:
        s.add(seq)
    for _ in range(3):
        _step(s)
        assert len(s.running) == 3 and [q.request_id for q in s.running] == ["r0", "r1", "r2"]
    s.finish(seqs[1], "stop")
    _step(s)
    assert [q.request_id for q in s.running] == ["r0", "r2", "r3"]  # the next in arrival order


def test_decode_rows_holding_a_node_are_contiguous():
    # two system prompts of two chunks each, their requests arriving interleaved: the decode
    # rows come grouped by prefix (DFS), arrival order inside each group
    s = _scheduler()
    p, q = list(range(1, 9)), list(range(50, 58))
    seqs = [
        _seq(f"{name}{i}", prefix + [200 + 10 * i + k for k in range(3)])
        for i in range(3)
        for name, prefix in (("p", p), ("q", q))
    ]
    for seq in seqs:
        s.add(seq)
    for _ in range(3):
        batch = _step(s)
    order = [seq.request_id for seq in batch.decodes]
    assert len(order) == 6
    assert order in (["p0", "p1", "p2", "q0", "q1", "q2"], ["q0", "q1", "q2", "p0", "p1", "p2"])
    shared = {seq.request_id: seq.nodes[:2] for seq in batch.decodes}
    assert shared["p0"] == shared["p2"] and shared["q0"] == shared["q1"]  # the prefix read once


@pytest.mark.parametrize("sharing", [True, False])
def test_out_of_chunks_the_newest_is_preempted_and_requeued_by_arrival(sharing):
    # 8 chunks, two running rows of one chunk of prompt each, a third request held back by
    # max_num_seqs: the rows grow until a chunk is needed and none is left. The newer row is
    # preempted (released: it recomputes; its full chunks stay in the tree when sharing), goes
    # back to the queue ahead of the later arrival, and nothing is admitted in that step.
    s = _scheduler(num_chunks=8, max_num_seqs=2, sharing=sharing)
    old, new, later = _seq("old", [1, 2, 3, 4]), _seq("new", [5, 6, 7, 8]), _seq("later", [9])
    for seq in (old, new, later):
        s.add(seq)
    for _ in range(40):
        batch = _step(s)
        if s.counters.preemptions:
            break
    assert s.counters.preemptions == 1
    assert [q.request_id for q in batch.decodes] == ["old"] and not batch.prefills  # no admission
    assert old.status is Status.RUNNING and new.status is Status.WAITING
    assert not new.nodes and not new.private and new.num_computed == 0
    assert list(s.waiting) == [new, later]
    assert (s.tree.num_cached > 0) is sharing
    s.tree.check(s.running, s.last_decode_paths)  # every chunk owned once, refcounts as held


def test_decode_rows_get_a_chunk_ahead_when_one_of_them_needs_a_chunk():
    # three rows at staggered lengths: at a step where some row crosses into a new chunk, every
    # decode row with less than a chunk of room past its next token gets one more, so the rows'
    # tables (and the decode plan) change about once per chunk of tokens, not at every step
    # where some row's tail fills
    s = _scheduler()
    # prompts of 5, 6, 7 tokens, no chunk in common (none waits for another's)
    rows = [_seq(f"r{i}", list(range(20 + 10 * i, 25 + 11 * i))) for i in range(3)]
    for seq in rows:
        s.add(seq)
    _step(s)  # the prompts, each in one piece
    changed = 0
    for _ in range(4 * C):
        before = [q.num_chunks for q in rows]
        batch = _step(s)
        assert len(batch.decodes) == 3 and not batch.prefills
        changed += before != [q.num_chunks for q in rows]
    # the three tails cross chunk boundaries at 3 different steps of every 4: without reserving
    # ahead the tables would change at 3 steps in 4 (12 of 16)
    assert changed <= 6, changed
    s.tree.check(s.running, s.last_decode_paths)


def test_a_row_at_its_length_limit_runs_nothing_more():
    # max_tokens reached, or the prompt and outputs at max_model_len: the row's last token is the
    # one it ends on (still on the device, under asynchronous scheduling), so it is not scheduled
    # again; the same rule as the engine's "length"
    s = _scheduler(max_model_len=9)
    limited, short = _seq("limited", list(range(6))), _seq("short", [40, 41], max_tokens=2)
    for seq in (limited, short):
        s.add(seq)
    for _ in range(8):
        _step(s)
    assert len(limited.output_ids) == 3  # 6 + 3 = max_model_len
    assert len(short.output_ids) == 2
    assert _step(s).items == [] and limited.status is short.status is Status.RUNNING  # (the engine ends them)


def test_decode_rows_sort_by_shared_path_then_arrival():
    # random forests of shared runs (refs > 1) with private tails (ref 1): _sort_dfs orders the
    # rows as the plain key (the path of the row's shared run, then arrival) does

    class Node:  # a tree node as _sort_dfs reads it: its id, how many live sequences hold it
        def __init__(self, ref):
            self.id, self.ref = next(ids), ref

    class Row:  # what _sort_dfs reads of a Sequence: nodes (id, ref), arrival, path_ids()
        def __init__(self, nodes, arrival):
            self.nodes, self.arrival = nodes, arrival

        def path_ids(self):
            return tuple(n.id for n in self.nodes)

    rng = random.Random(0)
    ids = iter(range(10**6))
    for trial in range(30):
        roots = [[Node(9)] for _ in range(rng.randint(1, 3))]
        branches = [
            r + [Node(5) for _ in range(rng.randint(0, 3))] for r in roots for _ in range(rng.randint(1, 3))
        ] + [[]]
        rows = [
            Row(rng.choice(branches) + [Node(1) for _ in range(rng.randint(0, 2))], a)
            for a in rng.sample(range(100), 40)
        ]

        def plain(row):
            k = sum(n.ref > 1 for n in row.nodes)
            return row.path_ids()[:k], row.arrival

        want = sorted(rows, key=plain)
        _sort_dfs(rows)
        assert rows == want, trial
        # with a sequence to follow them (a mixed step's first prefill): still a DFS order, and
        # the rows holding any node of its path are the last ones
        last = Row(rng.choice(branches) + [Node(1)], 100)
        rng.shuffle(rows)
        _sort_dfs(rows, last)
        for node in {id(n): n for r in rows for n in r.nodes if n.ref > 1}.values():
            held = [i for i, r in enumerate(rows) if node in r.nodes]
            assert held == list(range(held[0], held[0] + len(held))), trial
            if node in last.nodes:
                assert held[-1] == len(rows) - 1, trial


@pytest.mark.parametrize("tenants", [False, True])
@pytest.mark.parametrize("sharing", [True, False])
def test_random_traffic_keeps_the_tree_and_pool_whole(sharing, tenants):
    # arrivals, finishes and aborts at random under a small pool (preemptions included): the
    # tree's invariants hold after every step, and every chunk comes back at the end
    rng = random.Random(3)
    s = _scheduler(num_chunks=12, budget=16, max_num_seqs=6, sharing=sharing)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    live = []
    for _ in range(300):
        if rng.random() < 0.3:
            own = [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            # with tenants: three, each its own salt or none, two priorities (fair admission)
            t = rng.randrange(3)
            tenancy = Tenancy(f"t{t}", [None, "a", "b"][t], rng.randrange(2)) if tenants else None
            seq = _seq(f"q{len(live)}", rng.choice(prefixes) + own, rng.randint(1, 16), tenancy)
            s.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            seq = live[rng.randrange(len(live))]
            if seq.status is not Status.FINISHED:
                s.finish(seq, "abort")
        _step(s)
        for seq in list(s.running):
            if len(seq.output_ids) >= seq.params.max_tokens:
                s.finish(seq, "length")
        s.tree.check(s.running, s.last_decode_paths)
        s.check()  # the chunks registered as being computed are
        # the per-class queues hold exactly the waiting sequences, each in arrival order
        assert sorted(q.request_id for queue in s._queues.values() for q in queue) == sorted(
            q.request_id for q in s.waiting
        )
        for queue in s._queues.values():
            assert queue and [q.arrival for q in queue] == sorted(q.arrival for q in queue)
    # no more arrivals: every request finishes (none waits forever for a chunk being computed)
    for _ in range(2000):
        if all(seq.status is Status.FINISHED for seq in live):
            break
        _step(s)
        for seq in list(s.running):
            if len(seq.output_ids) >= seq.params.max_tokens:
                s.finish(seq, "length")
        s.tree.check(s.running, s.last_decode_paths)
        s.check()
    assert all(seq.status is Status.FINISHED for seq in live)
    assert not s._inflight
    s.tree.check([], [])
    assert s.counters.preemptions > 0  # (the pool was short)
    assert (s.counters.prefix_waits > 0) is sharing  # some waited for a prefix being computed
    s.tree.evict_all()
    assert s.tree.pool.num_free == 12


def test_a_tenants_flood_does_not_make_another_wait_behind_it():
    # tenant a fills the batch and queues 8 more; b's one request, arriving after all of them, is
    # admitted at the first free place: a has 3 running there, b none
    s = _scheduler(max_num_seqs=4)
    a = [_seq(f"a{i}", [i + 1] * 3, tenancy=Tenancy("a")) for i in range(12)]
    for seq in a:
        s.add(seq)
    _step(s)
    assert s.running == a[:4]
    b = _seq("b", [50, 51], tenancy=Tenancy("b"))
    s.add(b)
    _step(s)
    assert b.status is Status.WAITING  # (no room: nobody is preempted for it)
    s.finish(a[0], "stop")
    _step(s)
    assert b.status is Status.RUNNING and a[4].status is Status.WAITING
    s.finish(a[1], "stop")
    _step(s)
    assert a[4].status is Status.RUNNING  # then a's next, in a's arrival order
    assert [q.request_id for q in s.waiting] == [f"a{i}" for i in range(5, 12)]


def test_a_lower_priority_value_is_admitted_first_and_preempted_last():
    s = _scheduler(max_num_seqs=2)
    low = [_seq(f"low{i}", [i + 1] * 2, tenancy=Tenancy("x", priority=1)) for i in range(3)]
    high = _seq("high", [9, 9], tenancy=Tenancy("y", priority=0))
    for seq in low + [high]:
        s.add(seq)
    _step(s)
    assert {q.request_id for q in s.running} == {"high", "low0"}
    assert s._victim() is low[0]  # the highest value's newest, though `high` came later


def test_out_of_chunks_the_tenant_running_most_loses_its_newest():
    # two tenants, a running 3 and b running 1 (b's the newest): a preemption takes a's newest
    s = _scheduler(num_chunks=64)
    seqs = [_seq(f"a{i}", [i + 1] * 3, tenancy=Tenancy("a")) for i in range(3)]
    seqs.append(_seq("b0", [7] * 3, tenancy=Tenancy("b")))
    for seq in seqs:
        s.add(seq)
    _step(s)
    assert s._victim() is seqs[2]


def _run(s: Scheduler, seqs: list[Sequence], limit: int = 200) -> list[Batch]:
    """Step until every sequence has its max_tokens (then finished), checking the scheduler."""
    batches = []
    for _ in range(limit):
        if all(q.status is Status.FINISHED for q in seqs):
            return batches
        batches.append(_step(s))
        for q in list(s.running):
            if len(q.output_ids) >= q.params.max_tokens:
                s.finish(q, "length")
        s.tree.check(s.running, s.last_decode_paths)
        s.check()
    raise AssertionError("some sequence never finished")


def test_requests_of_a_prefix_being_computed_wait_for_it_and_match_it():
    # a and its prefix's two other requests arrive together: a computes the 4 prefix chunks, b
    # and c wait a step (passed over: `other`, behind them, is admitted) and then match them
    s = _scheduler(budget=24)
    prefix = list(range(1, 17))
    a, b = _seq("a", prefix + [40, 41], 3), _seq("b", prefix + [42], 3)
    other, c = _seq("other", [90, 91, 92], 3), _seq("c", prefix + [43, 44, 45], 3)
    for seq in (a, b, other, c):
        s.add(seq)
    first = _step(s)
    assert _pieces(first) == [("a", 18), ("other", 3)]
    assert list(s.waiting) == [b, c] and s.counters.prefix_waits == 2
    second = _step(s)
    assert {seq.request_id: n for seq, n in second.prefills} == {"c": 3}  # (b's one token: a decode row)
    assert b in second.decodes and b.num_cached_prompt == c.num_cached_prompt == 16 and a.num_cached_prompt == 0
    assert b.nodes[:4] == c.nodes[:4] == a.nodes[:4]  # one copy, computed once
    _run(s, [a, b, other, c])


def test_a_prefix_computed_over_several_steps_is_waited_for_to_its_end():
    # a's 18 tokens take 3 steps (7, 7, 4): b is considered only when a leaves some budget, at
    # its last piece, which computes b's next chunk: b waits that step, then matches the 4
    # prefix chunks and computes its own token only
    s = _scheduler(budget=7)
    prefix = list(range(1, 17))
    a, b = _seq("a", prefix + [40, 41], 2), _seq("b", prefix + [42], 2)
    s.add(a)
    s.add(b)
    batches = _run(s, [a, b])
    assert [_pieces(x) for x in batches[:3]] == [[("a", 7)], [("a", 7)], [("a", 4)]]
    assert s.counters.prefix_waits == 1 and b.num_cached_prompt == 16
    assert b in batches[3].decodes and not any(seq is b for x in batches for seq, _ in x.prefills)


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_a_request_waiting_for_a_prefix_is_admitted_when_its_computer_goes(how):
    # a short pool (7 chunks, `old` holding 3 and one kept in hand for it): a gets a first piece
    # of 3 chunks of its 5, and b waits for a's 4th. Then a goes: aborted, or preempted (old's
    # next token needs a chunk: the newest running sequence, a, is). The chunks a was to compute
    # are no longer registered (check), b is not passed over for them and completes, matching
    # what a left in the tree (and, preempted, a is admitted again first, older, and b waits
    # for the rest of its prefix once more).
    prefix = list(range(1, 17))
    s = _scheduler(num_chunks=7, budget=64)
    old = _seq("old", list(range(60, 71)), 4)
    a, b = _seq("a", prefix + [40, 41], 4), _seq("b", prefix + [42], 4)
    s.add(old)
    _step(s)
    s.add(a)
    s.add(b)
    first = _step(s)
    assert _pieces(first) == [("a", 12)] and b.status is Status.WAITING and s.counters.prefix_waits == 1
    assert {k for q, k in s._inflight.values() if q is a} == {3}
    if how == "abort":
        s.finish(a, "abort")
    else:
        _step(s)
        assert s.counters.preemptions == 1 and a.status is Status.WAITING
    s.check()
    assert not s._inflight
    _run(s, [old, b] if how == "abort" else [old, a, b])
    # (aborted: what old's growth left of a's 3 chunks)
    assert 0 < b.num_cached_prompt <= 12 if how == "abort" else b.num_cached_prompt == 16


def test_the_queues_next_prefixes_are_evicted_after_those_nobody_waits_for():
    # LRU alone evicts the oldest cached prefix first, though a request at the head of the queue
    # will match it; the scheduler keeps the head's prefixes as if used each step
    s = _scheduler(num_chunks=12, max_num_seqs=1)
    a, b = _seq("a", range(1, 10)), _seq("b", range(21, 30))  # two full chunks and a token each
    for seq in (a, b):
        s.add(seq)
        _step(s)
        s.finish(seq, "stop")
    r, w = _seq("r", range(41, 50)), _seq("w", [*range(1, 9), 99])  # w: a's prefix, older than b's
    s.add(r)
    s.add(w)
    _step(s)
    assert (r.status, w.status) == (Status.RUNNING, Status.WAITING)  # (one row at most)
    ours, others = s.tree.match(w.token_ids, 8), s.tree.match(b.token_ids, 8)
    assert len(ours) == len(others) == 2
    for _ in range(2):
        assert s.tree._evict_one(spill=False)
    assert all(n.parent is not None for n in ours) and all(n.parent is None for n in others)
    s.check()
    s.finish(r, "stop")
    _step(s)  # w admitted: its prefix matched, only its own token computed
    assert w.status is Status.RUNNING and w.num_cached_prompt == 8 and not s._wait_paths
    s.check()


def test_a_pool_no_step_can_run_short_leaves_the_queue_untouched():
    s = _scheduler(num_chunks=64, budget=8, max_num_seqs=1)  # a step takes at most 2 + 2 + 2 chunks
    r, w = _seq("r", range(41, 50)), _seq("w", range(1, 10))
    s.add(r)
    s.add(w)
    _step(s)
    assert w.status is Status.WAITING and s.tree.pool.num_free > 6 and not s._wait_paths


def test_different_cache_salts_never_wait_for_each_other():
    # one prompt under three salts: none waits for another's (they share no node); a second
    # request of salt x waits for x's first, then matches its chunks only
    s = _scheduler(budget=64)
    prompt = list(range(1, 19))
    x, y, none = (_seq(n, prompt, 2, Tenancy(cache_salt=salt)) for n, salt in (("x", "x"), ("y", "y"), ("none", None)))
    x2 = _seq("x2", prompt, 2, Tenancy(cache_salt="x"))
    for seq in (x, y, none, x2):
        s.add(seq)
    first = _step(s)
    assert [q.request_id for q, _ in first.prefills] == ["x", "y", "none"] and list(s.waiting) == [x2]
    assert s.counters.prefix_waits == 1
    _step(s)
    assert x2.num_cached_prompt == 16 and x2.nodes[:4] == x.nodes[:4]
    assert not set(y.nodes) & set(x.nodes) and not set(none.nodes) & set(x.nodes)
    _run(s, [x, y, none, x2])
