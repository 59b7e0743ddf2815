"""chunkserve.replicas.engine.warmup: synthetic batches through the normal path, then counters zeroed; the engine
then serves as a fresh one would."""

import pytest

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.engine.warmup import warmup

OPTS = dict(chunk_size=16, kv_cache_tokens=2048, max_num_batched_tokens=128, max_num_seqs=24)
PROMPTS = [list(range(30, 80)) + [200 + i] * (i + 2) for i in range(5)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 4 + [
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True)
]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_warmed_engine_is_idle_counts_nothing_and_generates_as_a_fresh_one(async_scheduling):
    engine = LLMEngine.from_model("tiny", async_scheduling=async_scheduling, **OPTS)
    got = warmup(engine)
    # 24 rows after a short prefix, 8 alone, 1 + 2 + 4 + 8 + 16 after each long prefix (24 rows at most)
    assert got["warmup_requests"] == 24 + 8 + 2 * 31 and got["warmup_tokens"] == 94 * 5 and got["warmup_s"] > 0
    s = engine.stats()
    assert not engine.has_unfinished() and s["running"] == s["waiting"] == s["kv_chunks_used"] == 0
    assert s["kv_chunks_cached"] > 0  # its prompts' chunks stay in the prefix cache, evictable
    counted = (
        "prompt_tokens",
        "cached_prompt_tokens",
        "computed_prompt_tokens",
        "generated_tokens",
        "finished_requests",
        "steps",
        "decode_steps",
        "max_decode_batch",
        "last_decode_batch",
        "max_kv_chunks_used",
        "preemptions",
    )
    assert {k: s[k] for k in counted} == dict.fromkeys(counted, 0)
    assert engine.counters.plan_builds == 0
    engine.check()
    fresh = LLMEngine.from_model("tiny", async_scheduling=async_scheduling, **OPTS)
    assert engine.generate(PROMPTS, PARAMS) == fresh.generate(PROMPTS, PARAMS)
    assert engine.stats()["generated_tokens"] == fresh.stats()["generated_tokens"] == 50


def test_warmup_fits_a_small_pool_and_a_short_context():
    # 20 chunks of 16 tokens, contexts of 60: fewer rows, a shorter prefix, preemptions allowed
    engine = LLMEngine.from_model(
        "tiny", chunk_size=16, kv_cache_tokens=320, max_model_len=60, max_num_batched_tokens=64, max_num_seqs=32
    )
    got = warmup(engine)
    assert got["warmup_requests"] == 5 + 5 and not engine.has_unfinished()
    assert engine.stats()["kv_chunks_used"] == 0


@pytest.mark.parametrize("max_model_len", [2, 12])
def test_warmup_fits_contexts_shorter_than_a_chunk(max_model_len):
    engine = LLMEngine.from_model(
        "tiny", chunk_size=16, kv_cache_tokens=2048, max_model_len=max_model_len, max_num_seqs=8
    )
    got = warmup(engine)
    assert got["warmup_requests"] == 16 and not engine.has_unfinished()


def test_warmup_refuses_a_busy_engine():
    engine = LLMEngine.from_model("tiny", **OPTS)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warmup(engine)


def test_warmup_runs_a_sparse_piece_when_sparse_prefill_is_on():
    engine = LLMEngine.from_model(
        "tiny",
        device="cpu",
        chunk_size=16,
        kv_cache_tokens=2048,
        max_num_batched_tokens=128,
        max_num_seqs=8,
        sparse_prefill=dict(min_context=256, block=32, window=1),
    )
    pieces = []
    sparse_prefill = engine.attention.sparse_prefill
    engine.attention.sparse_prefill = lambda layer, q, out, spans, budget=None: (
        pieces.append(len(spans)),
        sparse_prefill(layer, q, out, spans, budget),
    )
    got = warmup(engine)
    assert got["warmup_requests"] == 8 + 8 + 2 * 15 + 1 and len(pieces) >= engine.model_config.num_layers
    assert engine.stats()["sparse_pages_dense"] == 0  # counters zeroed
    # too long for the model's context: skipped
    short = LLMEngine.from_model(
        "tiny",
        device="cpu",
        chunk_size=16,
        kv_cache_tokens=2048,
        max_model_len=300,
        max_num_seqs=8,
        sparse_prefill=dict(min_context=256, block=32, window=1),
    )
    assert warmup(short)["warmup_requests"] == 16 + 2 * 15  # (the second long prefix cut to the context)


def test_warmup_decodes_few_rows_after_long_prefixes():
    # batches of 1 .. max_num_seqs rows after a prefix of 8 and of 32 chunks, each row's own part
    # 1 .. 3 chunks long: the decode plans of live traffic at low rates
    engine = LLMEngine.from_model("tiny", **OPTS)
    batches = []
    generate = engine.generate

    def recording(prompts, params=None):
        # (rows, their common prefix's length: None for one row, each row's length)
        common = (
            None
            if len(prompts) < 2
            else next((i for i, t in enumerate(zip(*prompts)) if len(set(t)) > 1), min(map(len, prompts)))
        )
        batches.append((len(prompts), common, [len(p) for p in prompts]))
        return generate(prompts, params)

    engine.generate = recording
    warmup(engine)
    assert [b for b, _, _ in batches] == [24, 8] + [1, 2, 4, 8, 16] * 2  # 32 rows > max_num_seqs 24
    few = batches[2:]
    for i, (b, common, lens) in enumerate(few):
        prefix = (8 if i < 5 else 32) * 16
        assert common in (None, prefix) and all(prefix + 1 <= n <= prefix + 3 * 16 for n in lens), (b, common, lens)
    assert len({n for _, _, lens in few for n in lens}) > 10  # own parts of many lengths
    # a context too short for a prefix longer than the first batch's two chunks: none
    short = LLMEngine.from_model("tiny", **{**OPTS, "max_model_len": 80})
    batches.clear()
    short.generate, generate = recording, short.generate
    warmup(short)
    assert [b for b, _, _ in batches] == [24, 8]
