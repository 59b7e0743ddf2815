"""chunkserve/replicas/engine/piecewise.py: the forward as pieces between the attentions. On the CPU the pieces run
as plain calls over the same static buffers and buckets (the plumbing); on CUDA as graphs."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.engine.piecewise import BUCKETS, PiecewiseGraphs

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


def _live_traffic(engine: LLMEngine, seed: int = 0, prefix_len: int = 150, own_len: int = 90) -> dict[str, list[int]]:
    """Requests joining while others decode and prefill (chunked: pieces of up to the budget),
    some leaving early: steps of many token counts, decode-only and mixed. Every other prompt
    starts with one `prefix_len`-token prefix; each has 1 to `own_len` - 1 tokens of its own."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]

    def request(n: int) -> tuple[list[int], SamplingParams]:
        own = [rng.randrange(256) for _ in range(rng.randrange(1, own_len))]
        return (prefix if n % 2 else []) + own, SamplingParams(
            max_tokens=rng.randrange(2, 24), temperature=0, ignore_eos=True
        )

    return drive(engine, {0: 3, 2: 2, 5: 4, 9: 1, 14: 3, 20: 2}, request)


def drive(
    engine: LLMEngine, arrivals: dict[int, int], request: Callable[[int], tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    """Step the engine until every request finished, adding arrivals[k] requests before step k
    (request n "r{n}": request(n) gives its prompt and params); each request's tokens."""
    out: dict[str, list[int]] = {}
    step = n = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for _ in range(arrivals.get(step, 0)):
            engine.add_request(f"r{n}", *request(n))
            n += 1
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_pieces_give_the_tokens_of_the_plain_forward_under_live_traffic(device, async_scheduling):
    # a budget between two buckets (96, 112): full prefill pieces of 97-100 tokens pad to 112
    opts = dict(
        device=device,
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=100,
        async_scheduling=async_scheduling,
    )
    plain = LLMEngine.from_model("tiny", piecewise_graphs=False, **opts)
    pieces = LLMEngine.from_model("tiny", piecewise_graphs=True, **opts)
    assert plain.runner.pieces is None and pieces.runner.pieces is not None
    want, got = _live_traffic(plain), _live_traffic(pieces)
    assert got == want and len(got) == 15
    steps = pieces.stats()["steps"]
    runs = pieces.counters.piecewise_replays
    # a whole-step decode graph runs decode-only steps and, on CUDA, mixed steps whose prefill
    # tokens fit its rows (cuda_graph.py)
    full = pieces.counters.graph_replays + pieces.counters.mixed_graph_replays
    assert runs + full == steps  # every step from the pieces or a whole-step graph
    if full == 0:  # every decode-only step (15 rows at most) fits a bucket: all from the pieces
        assert pieces.counters.piecewise_decode_replays == pieces.stats()["decode_steps"] > 0
    pieces.check()


def test_buckets_cover_every_count_up_to_the_largest_once():
    engine = LLMEngine.from_model("tiny", piecewise_graphs=False)
    g = PiecewiseGraphs(engine.model, engine.pool, max_tokens=300, graphs=False)
    # up to the first bucket that holds a step of max_tokens
    assert g.sizes == tuple(n for n in BUCKETS if n <= 320) and g.sizes[-1] == 320
    assert [g.bucket(t) for t in (1, 8, 9, 16, 17, 129, 256, 257, 300)] == [8, 8, 16, 16, 32, 160, 256, 320, 320]
    assert g.bucket(321) is None  # past the largest: the step runs eagerly
    big = PiecewiseGraphs(engine.model, engine.pool, max_tokens=8192, graphs=False)
    assert big.sizes == BUCKETS and big.bucket(1032) == 1088 and big.bucket(8192) == 8192
    # past 1024 tokens a step is padded by at most a sixteenth
    assert all(big.bucket(t) - t <= t / 16 for t in range(1025, 8193))
    assert PiecewiseGraphs(engine.model, engine.pool, max_tokens=20000, graphs=False).sizes == BUCKETS
    assert all(len(runs) == len(g.model.layers) + 1 for runs in g.runs.values())


def test_padding_rows_write_only_the_scratch_chunk():
    # Steps of T tokens run a bucket's n >= T rows; rows past T keep the ids and positions of an
    # earlier step. Their K/V must land in the scratch chunk, not in the slots the earlier step
    # wrote (which sequences hold): after every step the two engines' pools agree, scratch aside.
    opts = dict(device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=64)
    plain = LLMEngine.from_model("tiny", piecewise_graphs=False, **opts)
    pieces = LLMEngine.from_model("tiny", piecewise_graphs=True, **opts)
    rng = random.Random(3)
    for engine in (plain, pieces):
        for i, n in enumerate((40, 3, 17, 9)):
            engine.add_request(
                f"r{i}",
                [rng.randrange(1, 256) for _ in range(n)],
                SamplingParams(max_tokens=6 + i, temperature=0, ignore_eos=True),
            )
        rng.seed(3)
    scratch = pieces.pool.scratch
    assert plain.pool.scratch == scratch == pieces.pool.num_chunks
    padded = 0
    while plain.has_unfinished():
        plain.step()
        pieces.step()
        torch.testing.assert_close(pieces.pool.kv[:, :, :scratch], plain.pool.kv[:, :, :scratch], rtol=1e-5, atol=1e-5)
        padded += bool(pieces.pool.kv[:, :, scratch].abs().sum())
    assert not pieces.has_unfinished() and pieces.counters.piecewise_replays > 5
    assert padded  # some step had padding rows, and they wrote the scratch chunk
    assert not plain.pool.kv[:, :, scratch].any()  # the eager forward never writes it


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_without_decode_graphs_every_step_runs_from_the_pieces():
    # decode_graphs=False: no whole-step graph is captured on a request; every step up to the
    # largest bucket replays the pieces, with the plain forward's tokens
    opts = dict(device="cuda", dtype="float32", kv_cache_tokens=16384, max_num_batched_tokens=96)
    plain = LLMEngine.from_model("tiny", piecewise_graphs=False, enforce_eager=True, **opts)
    pieces = LLMEngine.from_model("tiny", decode_graphs=False, **opts)
    assert pieces.runner.graphs is None and pieces.runner.pieces is not None
    assert _live_traffic(pieces) == _live_traffic(plain)
    assert pieces.counters.piecewise_replays == pieces.stats()["steps"]
    pieces.check()
