"""Decode plans live as long as the batch's chunk tables: rebuilt when rows join/leave or a
table grows (the scheduler reserves a chunk ahead for every decode row at once), only bumped
otherwise, tail fills included; the Triton backend gives the reference backend's tokens."""

import torch

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams

SHARED = list(range(100, 132))  # two full chunks of 16


def prompts():
    # all 37 tokens long: 2 shared chunks + 5 private tokens; decode positions start at 37
    return [SHARED + [i] * 5 for i in range(4)]


def test_decode_plan_is_rebuilt_only_when_the_tree_changes():
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=2048, attention_backend="reference")
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    # the shared chunks cached first: four prompts computing them together would make three wait
    # a step for the first's (Scheduler prefix waits) and run a step behind it
    engine.generate([SHARED + [99]], SamplingParams(max_tokens=1))
    steps, builds = engine.stats()["steps"], engine.counters.plan_builds
    engine.generate(prompts(), params)
    assert engine.counters.prefix_waits == 0
    # step 1 prefills all four; 29 decode steps feed positions 37..65 together. Position 48
    # needs a fourth chunk: every row gets it and a fifth (reserved), so plans are built at 37
    # and 48, and bumped in the 27 other steps (the tail filling at 64 included)
    assert engine.stats()["steps"] - steps == 30
    assert engine.counters.plan_builds - builds == 2


def test_staggered_rows_rebuild_about_once_per_chunk_of_tokens():
    # 8 rows at 8 different lengths: some row's tail fills every other step. Growth is
    # synchronised, so the plan is rebuilt only when some row runs out of reserved room
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=4096, attention_backend="reference")
    ps = [SHARED + [i] * (3 + 2 * i) for i in range(8)]
    engine.generate(ps, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    steps = engine.stats()["steps"]
    fills = sum(len(range(len(p) // 16 + 1, (len(p) + 63) // 16 + 1)) for p in ps)  # tail fills while decoding
    assert fills >= 24
    assert engine.counters.plan_builds <= 2 + steps // 12, (engine.counters.plan_builds, steps)


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
    assert tri.counters.plan_builds < tri.stats()["steps"] // 2


def test_torch_backend_is_the_cpu_default_and_matches_reference_backend():
    # staggered rows (tails filling at different steps, plans bumped between rebuilds), one
    # row sharing nothing, a deeper branch: the batched torch decode gives the reference's tokens
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    options = dict(chunk_size=16, kv_cache_tokens=4096, device="cpu", dtype="float32")
    ref = LLMEngine.from_model("tiny", attention_backend="reference", **options)
    auto = LLMEngine.from_model("tiny", **options)
    assert auto.attention.backend == "torch"
    ps = [SHARED + [i] * (3 + 2 * i) for i in range(6)] + [[7] * 11, SHARED + [3] * 20]
    assert auto.generate(ps, params) == ref.generate(ps, params)
    assert auto.counters.plan_builds == ref.counters.plan_builds < auto.stats()["steps"] // 2
