"""chunkserve/replicas/engine/cuda_graph.py: whole decode steps from one graph per padded batch size, over fixed TPP
plans. On the CPU (the triton backend under the interpreter) the graphs run as plain calls over
the same buffers and plan objects (the plumbing); on CUDA as graphs."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from chunkserve.replicas.engine.cuda_graph import batch_sizes
from chunkserve.replicas.engine.llm_engine import LLMEngine
from chunkserve.replicas.engine.sequence import SamplingParams
from tests.test_piecewise import DEVICES, _live_traffic, drive


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graphs_give_the_plain_forwards_tokens_under_live_traffic(device, async_scheduling):
    # rows join, leave and fill their tails: a new decode plan every few steps, each a fixed plan
    # whose step replays its size's graph (captured before the first request); padding rows
    # write only the scratch chunk
    opts = dict(
        device=device,
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        attention_backend="triton",
        async_scheduling=async_scheduling,
    )
    # (prompts shorter than the piecewise tests': the interpreter runs these kernels on the CPU)
    traffic = functools.partial(_live_traffic, prefix_len=80, own_len=48)
    plain = LLMEngine.from_model("tiny", decode_graphs=False, **opts)
    graphed = LLMEngine.from_model("tiny", decode_graphs=True, **opts)
    graphs = graphed.runner.graphs
    assert plain.runner.graphs is None and graphs is not None and graphs.sizes == (8, 16)
    assert traffic(graphed) == traffic(plain)
    s = graphed.stats()
    assert graphed.counters.plan_builds >= 10 and graphed.counters.unfixed_plans == 0
    assert graphed.counters.graph_replays == s["decode_steps"] > 10  # every decode-only step from its graph
    # (float32 rounding apart: padded matrix products and other piece cuts sum in another order)
    scratch = graphed.pool.scratch
    torch.testing.assert_close(graphed.pool.kv[:, :, :scratch], plain.pool.kv[:, :, :scratch], rtol=1e-3, atol=1e-4)
    graphed.check()


def test_batch_sizes_cover_max_num_seqs():
    assert batch_sizes(16) == (8, 16) and batch_sizes(5) == (8,)
    assert batch_sizes(100) == (8, 16, 32, 48, 64, 80, 96, 112) and batch_sizes(256)[-3:] == (192, 224, 256)


def test_decode_graphs_need_the_triton_backend():
    engine = LLMEngine.from_model("tiny", device="cpu", decode_graphs=True)  # torch backend: no fixed plans
    assert engine.attention.backend == "torch" and engine.runner.graphs is None


def _tenants(engine: LLMEngine, seed: int = 0) -> dict[str, list[int]]:
    """Two tenants' prompts (a 100-token prefix each, and 1-23 own tokens) joining while the
    other tenant's rows decode: mixed steps whose decode rows hold either prefix. (Each prefill
    token of a mixed step is a decode row of the interpreter's kernels on the CPU, at its causal
    length: the prompts are short to keep the test to a minute or two there.)"""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(256) for _ in range(100)] for _ in range(2)]

    def request(n: int) -> tuple[list[int], SamplingParams]:
        own = [rng.randrange(256) for _ in range(rng.randrange(1, 24))]
        return prefixes[n % 2] + own, SamplingParams(max_tokens=rng.randrange(4, 20), temperature=0, ignore_eos=True)

    return drive(engine, {0: 2, 1: 1, 3: 2, 6: 1, 8: 2, 11: 1, 15: 2}, request)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_steps_replay_the_decode_graphs_with_the_plain_forwards_tokens(device):
    # a step's prefill tokens as decode rows of its fixed plan (each of its causal length),
    # after the decode rows holding their prefix (the scheduler orders them last), for either
    # tenant: the step replays its size's graph and gives the plain forward's tokens
    opts = dict(
        device=device,
        dtype="float32",
        kv_cache_tokens=16384,
        max_num_batched_tokens=32,  # (graphs of 8, 16 and 32 rows: a mixed step's 32 tokens fit one)
        max_num_seqs=32,
        attention_backend="triton",
    )
    plain = LLMEngine.from_model("tiny", decode_graphs=False, **opts)
    graphed = LLMEngine.from_model("tiny", decode_graphs=True, **opts)
    assert graphed.runner.graphs is not None and graphed.attention.plan_rows
    want, got = _tenants(plain), _tenants(graphed)
    assert got == want and len(got) == 11
    c, s = graphed.counters, graphed.stats()
    mixed = s["steps"] - s["decode_steps"]
    # most mixed steps: the others hold both tenants' pieces (only one prefix can come last)
    assert c.mixed_graph_replays > mixed // 2 > 4
    assert c.graph_replays == s["decode_steps"]
    graphed.check()
    off = LLMEngine.from_model("tiny", decode_graphs=True, graph_mixed_steps=False, **opts)
    assert off.runner.graphs is not None and not off.attention.plan_rows
    assert _tenants(off) == want and off.counters.mixed_graph_replays == 0
