"""Decode plans live as long as the tree's shape: rebuilt when rows join/leave or a tail chunk
fills, only bumped otherwise; the Triton backend gives the reference backend's tokens."""

import torch

from replicas.engine import LLMEngine, SamplingParams

SHARED = list(range(100, 132))  # two full chunks of 16


def prompts():
    # all 37 tokens long: 2 shared chunks + 5 private tokens; decode positions start at 37
    return [SHARED + [i] * 5 for i in range(4)]


def test_decode_plan_is_rebuilt_only_when_the_tree_changes():
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=2048, attention_backend="reference")
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.generate(prompts(), params)
    # step 1 prefills all four; 29 decode steps feed positions 37..65 together; the rows' tails
    # fill at 48 and 64, so plans are built at 37, 48 and 64 and bumped in the 26 other steps
    assert engine.stats()["steps"] == 30
    assert engine.attention.plan_builds == 3


def test_triton_backend_matches_reference_backend():
    # on the CPU the kernels run under the Triton interpreter (tests/conftest.py)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    options = dict(chunk_size=16, kv_cache_tokens=2048, device=device, dtype="float32")
    ref = LLMEngine.from_model("tiny", attention_backend="reference", **options)
    tri = LLMEngine.from_model("tiny", attention_backend="triton", **options)
    ps = prompts() + [[7] * 11, SHARED + [3] * 20]  # plus a row sharing nothing, a deeper branch
    assert tri.generate(ps, params) == ref.generate(ps, params)
    assert tri.attention.backend == "triton"
    assert tri.attention.plan_builds < tri.stats()["steps"] // 2
