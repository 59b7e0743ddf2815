"""replicas/cuda_graph.py: whole decode steps from one graph per padded batch size, over fixed TPP
plans. On the CPU (the triton backend under the interpreter) the graphs run as plain calls over
the same buffers and plan objects (the plumbing); on CUDA as graphs."""

from __future__ import annotations

import pytest
import torch

from replicas.cuda_graph import batch_sizes
from replicas.engine import LLMEngine
from tests.test_piecewise import DEVICES, _live_traffic


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
        max_num_batched_tokens=100,
        max_num_seqs=16,
        attention_backend="triton",
        async_scheduling=async_scheduling,
    )
    plain = LLMEngine.from_model("tiny", **opts)
    graphed = LLMEngine.from_model("tiny", decode_graphs=True, **opts)
    graphs = graphed.runner.graphs
    assert plain.runner.graphs is None and graphs is not None and graphs.sizes == (8, 16)
    assert _live_traffic(graphed) == _live_traffic(plain)
    s = graphed.stats()
    assert graphed.attention.plan_builds >= 10 and graphed.attention.unfixed_plans == 0
    assert graphs.replays == s["decode_steps"] > 10  # every decode-only step from its graph
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
