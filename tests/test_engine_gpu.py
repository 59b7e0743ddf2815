"""The engine on CUDA (run with `pytest -m gpu` on a GPU machine)."""

import random

import pytest
import torch

from replicas.engine import LLMEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def shared_prompts(n=8, prefix_len=300, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


def test_tiny_fp32_on_cuda_matches_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts = shared_prompts()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    cpu = LLMEngine.from_model("tiny", device="cpu", dtype="float32", kv_cache_tokens=8192)
    gpu = LLMEngine.from_model("tiny", device="cuda", dtype="float32", kv_cache_tokens=8192,
                               max_num_batched_tokens=256)
    assert gpu.generate(prompts, params) == cpu.generate(prompts, params)
    assert gpu.stats()["cached_prompt_tokens"] > 0


def test_llama3_8b_preset_generates_bf16():
    engine = LLMEngine.from_model("llama3-8b", device="cuda", dtype="bfloat16", kv_cache_tokens=65536)
    prompts = shared_prompts(n=16, prefix_len=1024)
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert all(len(o) == 16 for o in outs)
    s = engine.stats()
    assert s["cached_prompt_tokens"] >= 14 * 960 and s["kv_chunks_used"] == 0
