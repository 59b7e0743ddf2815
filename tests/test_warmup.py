"""replicas.warmup: synthetic batches through the normal path, then counters zeroed; the engine
then serves as a fresh one would."""

import pytest

from replicas.engine import LLMEngine, SamplingParams
from replicas.warmup import warmup

OPTS = dict(chunk_size=16, kv_cache_tokens=2048, max_num_batched_tokens=128, max_num_seqs=24)
PROMPTS = [list(range(30, 80)) + [200 + i] * (i + 2) for i in range(5)]
PARAMS = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 4 + [
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.8, seed=11, ignore_eos=True)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_warmed_engine_is_idle_counts_nothing_and_generates_as_a_fresh_one(async_scheduling):
    engine = LLMEngine.from_model("tiny", async_scheduling=async_scheduling, **OPTS)
    got = warmup(engine)
    assert got["warmup_requests"] == 24 + 8 and got["warmup_tokens"] == 32 * 5 and got["warmup_s"] > 0
    s = engine.stats()
    assert not engine.has_unfinished() and s["running"] == s["waiting"] == s["kv_chunks_used"] == 0
    assert s["kv_chunks_cached"] > 0  # its prompts' chunks stay in the prefix cache, evictable
    counted = ("prompt_tokens", "cached_prompt_tokens", "computed_prompt_tokens", "generated_tokens",
               "finished_requests", "steps", "decode_steps", "max_decode_batch", "last_decode_batch", "max_kv_chunks_used",
               "preemptions")
    assert {k: s[k] for k in counted} == dict.fromkeys(counted, 0)
    assert engine.attention.plan_builds == 0
    engine.check()
    fresh = LLMEngine.from_model("tiny", async_scheduling=async_scheduling, **OPTS)
    assert engine.generate(PROMPTS, PARAMS) == fresh.generate(PROMPTS, PARAMS)
    assert engine.stats()["generated_tokens"] == fresh.stats()["generated_tokens"] == 50


def test_warmup_fits_a_small_pool_and_a_short_context():
    # 20 chunks of 16 tokens, contexts of 60: fewer rows, a shorter prefix, preemptions allowed
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=320, max_model_len=60,
                                  max_num_batched_tokens=64, max_num_seqs=32)
    got = warmup(engine)
    assert got["warmup_requests"] == 5 + 5 and not engine.has_unfinished()
    assert engine.stats()["kv_chunks_used"] == 0


@pytest.mark.parametrize("max_model_len", [2, 12])
def test_warmup_fits_contexts_shorter_than_a_chunk(max_model_len):
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=2048, max_model_len=max_model_len,
                                  max_num_seqs=8)
    got = warmup(engine)
    assert got["warmup_requests"] == 16 and not engine.has_unfinished()


def test_warmup_refuses_a_busy_engine():
    engine = LLMEngine.from_model("tiny", **OPTS)
    engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        warmup(engine)


def test_warmup_runs_a_sparse_piece_when_sparse_prefill_is_on():
    engine = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, kv_cache_tokens=2048, max_num_batched_tokens=128,
                                  max_num_seqs=8, sparse_prefill=dict(min_context=256, block=32, window=1))
    pieces = []
    sparse_prefill = engine.attention.sparse_prefill
    engine.attention.sparse_prefill = lambda layer, q, out, spans, budget=None: (
        pieces.append(len(spans)), sparse_prefill(layer, q, out, spans, budget))
    got = warmup(engine)
    assert got["warmup_requests"] == 8 + 8 + 1 and len(pieces) >= engine.model_config.num_layers
    assert engine.stats()["sparse_pages_dense"] == 0  # counters zeroed
    # too long for the model's context: skipped
    short = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, kv_cache_tokens=2048, max_model_len=300,
                                 max_num_seqs=8, sparse_prefill=dict(min_context=256, block=32, window=1))
    assert warmup(short)["warmup_requests"] == 16
