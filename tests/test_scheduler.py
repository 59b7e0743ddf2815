"""replicas/scheduler.py on its own: FCFS admission under the token budget, chunked prefill,
max_num_seqs, DFS order of the decode rows, preemption of the newest. A small driver plays the
engine: after each step the new K/V count as computed and every row that reached its last token
samples one more."""

from __future__ import annotations

import itertools

import pytest
import torch

from replicas.kv_pool import KVPool
from replicas.prefix_tree import PrefixTree
from replicas.scheduler import Batch, Scheduler
from replicas.sequence import SamplingParams, Sequence, Status

C = 4  # tokens a chunk


def _scheduler(num_chunks: int = 64, *, budget: int = 64, max_num_seqs: int = 16, sharing: bool = True) -> Scheduler:
    pool = KVPool(
        num_layers=1, num_chunks=num_chunks, num_kv_heads=1, chunk_size=C, head_dim=2, dtype=torch.float32, device="cpu"
    )
    return Scheduler(
        PrefixTree(pool), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_prefix_sharing=sharing
    )


_arrivals = itertools.count()


def _seq(name: str, prompt: list[int], max_tokens: int = 1000) -> Sequence:
    return Sequence(name, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), next(_arrivals))


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
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    assert [q.request_id for q in batch.decodes] == ["old"] and not batch.prefills  # no admission
    assert old.status is Status.RUNNING and new.status is Status.WAITING
    assert not new.nodes and not new.private and new.num_computed == 0
    assert list(s.waiting) == [new, later]
    assert (s.tree.num_cached > 0) is sharing
    s.tree.check(s.running, s.last_decode_paths)  # every chunk owned once, refcounts as held
