"""LLMEngine end to end on the CPU: exact greedy output vs transformers, memory sharing, retention,
preemption under pressure, randomised add/step/abort with invariants, bad input."""

import dataclasses
import json
import random
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from chunkserve.kernels.block_union import BlockUnion
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams
from chunkserve.replicas.engine.sequence import Tenancy
from chunkserve.replicas.engine.stats import EngineStats
from tests import engine_ops
from tests.hf_checkpoints import make_hf_checkpoint

# stops at EOS like transformers does (no ignore_eos: that would let the engine pick EOS where
# transformers' min_new_tokens would suppress it)
GREEDY = SamplingParams(max_tokens=24, temperature=0)


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """8 prompts: five share a 330-token prefix (two of them also a longer one), three share
    nothing; no length is a multiple of 64."""
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    shared = tok(330)
    deeper = shared + tok(75)
    return [
        shared + tok(37),
        shared + tok(101),
        shared + tok(3),
        deeper + tok(21),
        deeper + tok(50),
        tok(45),
        tok(290),
        tok(7),
    ]


def hf_greedy(path: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, pad_token_id=0
            )
        outs.append(g[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_greedy_matches_transformers(arch, tmp_path):
    path = str(make_hf_checkpoint(arch, tmp_path / arch, seed=1))
    vocab = json.loads((tmp_path / arch / "config.json").read_text())["vocab_size"]
    prompts = mixed_prompts(vocab)
    expected = hf_greedy(path, prompts, GREEDY.max_tokens)
    assert sum(len(e) == GREEDY.max_tokens for e in expected) >= 6  # the seed gives long generations
    # a 128-token budget forces chunked prefill of every long prompt, mixed with decodes
    engine = LLMEngine.from_model(path, dtype="float32", device="cpu", max_num_batched_tokens=128, kv_cache_tokens=8192)
    got = engine.generate(prompts, GREEDY)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}): engine {g} != transformers {e}"
    stats = engine.stats()
    assert stats["cached_prompt_tokens"] > 0 and stats["max_decode_batch"] > 1
    # with sharing off the tokens are the same
    plain = LLMEngine.from_model(path, dtype="float32", device="cpu", enable_prefix_sharing=False, kv_cache_tokens=8192)
    assert plain.generate(prompts, GREEDY) == expected


@pytest.fixture(scope="module")
def tiny():
    return LLMEngine.from_model("tiny", kv_cache_tokens=40_000, max_num_batched_tokens=2048)


def run_until(engine, cond, limit=10_000):
    for _ in range(limit):
        if cond():
            return
        engine.step()
        engine.check()
    raise AssertionError("condition never reached")


def test_shared_prefix_memory_and_retention():
    """Knowl 4: 32 requests, one 1024-token prefix, distinct 64-token suffixes, c = 64."""
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(1024)]
    prompts = [prefix + [rng.randrange(256) for _ in range(64)] for _ in range(32)]
    # long enough that without sharing the first requests still run when the last one decodes
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    used, reserved = {}, {}
    for sharing in (True, False):
        engine = LLMEngine.from_model("tiny", kv_cache_tokens=40_000, enable_prefix_sharing=sharing)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        # decoding: every sequence has fed back at least one generated token
        running = engine.scheduler.running
        run_until(engine, lambda: len(running) == 32 and all(len(s.output_ids) >= 2 for s in running))
        used[sharing] = engine.stats()["kv_chunks_used"]
        # every sequence: 18 chunks (17 of prompt, its decode tail) and at most one reserved
        # ahead for decoding (Scheduler._reserve_ahead)
        tables = [s.chunk_table for s in engine.scheduler.running]
        assert all(len(t) in (18, 19) for t in tables)
        reserved[sharing] = sum(len(t) - 18 for t in tables)
        if sharing:
            # the 16 prefix chunks are shared; its own suffix chunk and decode tail per sequence
            assert all(t[:16] == tables[0][:16] for t in tables)
            assert len({c for t in tables for c in t[16:]}) == 32 * 2 + reserved[True]
            assert used[True] == 16 + 32 * 2 + reserved[True]
            run_until(engine, lambda: not engine.has_unfinished())
            assert engine.stats()["kv_chunks_used"] == 0 and engine.stats()["kv_chunks_cached"] > 16
            # retention: a later request with the same prefix runs no prefill over it
            before = engine.stats()["computed_prompt_tokens"]
            engine.add_request("late", prefix + [7] * 50, params)
            outs = []
            run_until(engine, lambda: outs.extend(engine.step()) or not engine.has_unfinished())
            assert outs[-1].cached_tokens == 1024
            assert engine.stats()["computed_prompt_tokens"] - before == 50
    assert used[False] == 32 * 18 + reserved[False]
    assert used[True] <= 0.25 * used[False]


def test_a_cached_prompt_runs_only_its_last_token_and_counts_it():
    # a prompt one token past a chunk boundary, run again: its chunks come from the cache, so
    # its last token runs alone (as a decode row) and is the one prompt token computed
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=4096)
    prompt = [5 + i % 90 for i in range(3 * 16 + 1)]
    params = SamplingParams(max_tokens=4, temperature=0)
    first = engine.generate([prompt], params)
    before = engine.stats()["computed_prompt_tokens"]
    assert engine.generate([prompt], params) == first
    assert engine.stats()["computed_prompt_tokens"] - before == 1
    assert engine.stats()["cached_prompt_tokens"] == 48


def test_aborted_requests_are_counted_with_their_prompts_once_admitted():
    # an abort retires a request as a finish does: finished_requests counts it, and its prompt
    # (and cached) tokens once it was admitted; one aborted while it waited reached no model
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=4096, max_num_seqs=1)
    prompt = [5 + i % 90 for i in range(40)]
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # its 2 chunks cached
    before = engine.stats()
    engine.add_request("running", prompt, params)
    engine.add_request("waiting", prompt, params)  # max_num_seqs 1: it waits behind the first
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
    assert engine.abort("running") and engine.abort("waiting") and not engine.abort("waiting")
    s = engine.stats()
    assert s["finished_requests"] - before["finished_requests"] == 2
    assert s["prompt_tokens"] - before["prompt_tokens"] == 40
    assert s["cached_prompt_tokens"] - before["cached_prompt_tokens"] == 32
    assert not engine.has_unfinished() and s["kv_chunks_used"] == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_under_pressure_keeps_outputs_exact(async_scheduling):
    rng = random.Random(3)
    common = [rng.randrange(256) for _ in range(40)]
    prompts = [
        (common if i % 2 else []) + [rng.randrange(256) for _ in range(rng.randrange(20, 90))] for i in range(14)
    ]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    roomy = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=16_384)
    expected = roomy.generate(prompts, params)
    need = sum(-(-(len(p) + 30) // 16) for p in prompts)
    tight = LLMEngine.from_model(
        "tiny", chunk_size=16, kv_cache_tokens=512, max_model_len=512, async_scheduling=async_scheduling
    )
    assert need >= 3 * tight.pool.num_chunks
    for i, p in enumerate(prompts):
        tight.add_request(str(i), p, params)
    got = {str(i): [] for i in range(len(prompts))}
    while tight.has_unfinished():
        for out in tight.step():
            got[out.request_id] += out.new_token_ids
        tight.check()
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert tight.stats()["preemptions"] > 0
    tight.tree.evict_all()
    assert tight.pool.num_free == tight.pool.num_chunks


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def small_pool(request):
    return LLMEngine.from_model(
        "tiny",
        chunk_size=16,
        kv_cache_tokens=320,
        max_model_len=160,
        max_num_batched_tokens=64,
        max_num_seqs=6,
        async_scheduling=request.param,
    )


ops = engine_ops.ops(max_length=100, bases=4, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_add_step_abort_keeps_invariants(small_pool, ops):
    engine = small_pool
    bases = [[5] * 48, [9] * 40 + [1] * 20, list(range(60)), [3]]  # prompts share prefixes
    engine_ops.drive(engine, ops, lambda base, length: (bases[base] * 3)[:length])
    engine.tree.evict_all()
    engine.check()
    assert engine.pool.num_free == engine.pool.num_chunks


def test_async_scheduling_defaults_to_the_device(tiny):
    # None (the default): on for CUDA, off on the CPU, where the host runs the step itself
    assert EngineConfig(model="tiny").async_scheduling is None
    assert tiny.device.type == "cpu" and tiny.config.async_scheduling is False
    assert LLMEngine.from_model("tiny", kv_cache_tokens=1024, async_scheduling=True).config.async_scheduling is True


def test_async_scheduling_gives_the_same_outputs_as_sync():
    # shared prefixes; EOS, stop tokens, lengths (max_tokens and max_model_len), seeded sampling;
    # an abort while the request's token is on the device; a short pool (preemptions)
    prompts = mixed_prompts(256, seed=5)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    sync = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=16_384, async_scheduling=False)
    stops = [out[k] for out, k in zip(sync.generate(prompts[:3], free), (0, 5, 23))]
    params = [
        greedy,
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=(stops[1],), ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(stops[0], stops[2])),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=8, stop_token_ids=(stops[1],)),
        SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),  # ends at max_model_len
        free,
    ]

    def run(engine: LLMEngine) -> tuple[dict, dict, dict]:  # tokens, finish reasons, counters
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        engine.add_request("gone", prompts[0], free)
        got, ends, gone = {str(i): [] for i in range(len(prompts))}, {}, []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == "gone":
                    assert len(gone) < 2  # nothing after the abort
                    gone.append(out)
                    if len(gone) == 2:  # with async scheduling its next token is on the device now
                        assert engine.abort("gone")
                if out.request_id in got:
                    got[out.request_id] += out.new_token_ids
                    assert out.output_tokens == len(got[out.request_id])
                    if out.finished:
                        ends[out.request_id] = out.finish_reason
            engine.check()
        assert len(gone) == 2
        engine.tree.evict_all()
        assert engine.pool.num_free == engine.pool.num_chunks
        return (
            got,
            ends,
            {
                k: engine.stats()[k]
                for k in (
                    "generated_tokens",
                    "finished_requests",
                    "prompt_tokens",
                    "cached_prompt_tokens",
                    "computed_prompt_tokens",
                )
            },
        )

    kw = dict(chunk_size=16, max_model_len=470)
    want = run(LLMEngine.from_model("tiny", kv_cache_tokens=16_384, async_scheduling=False, **kw))
    assert set(want[1].values()) == {"stop", "length"} and want[1]["1"] == "stop" and want[1]["6"] == "length"
    assert len(want[0]["6"]) < 200 and len(want[0]["4"]) == 1
    assert run(LLMEngine.from_model("tiny", kv_cache_tokens=16_384, async_scheduling=True, **kw)) == want
    # a short pool: preemptions, which finishes seen a step later can shift (so the counts of
    # cached and computed prompt tokens with them); the tokens stay the same
    tight = LLMEngine.from_model("tiny", kv_cache_tokens=640, async_scheduling=True, **kw)
    assert run(tight)[:2] == want[:2] and tight.stats()["preemptions"] > 0


def test_async_steps_return_the_step_before_and_drop_a_token_past_a_stop():
    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=4096, async_scheduling=True)
    prompt = list(range(10, 40))
    free = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert engine.stats()["steps"] == 6  # the prompt, then 5 decodes: none past the known last one
    engine.add_request(
        "a", prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=(free[2],))
    )
    assert engine.step() == []  # the prompt's step is on the device
    seq = engine.scheduler.running[0]
    assert seq.output_ids == [-1]  # a placeholder for its token
    got = []
    for _ in range(3):
        got += engine.step()
    # the stop token arrived while the step after it ran: that step's token is dropped
    assert [o.new_token_ids[0] for o in got] == free[:3] and got[-1].finished and got[-1].finish_reason == "stop"
    assert seq.output_ids == free[:3] and not engine.has_unfinished()
    assert engine.stats()["generated_tokens"] == 6 + 3
    assert engine.step() == [] and engine.stats()["kv_chunks_used"] == 0


def test_bad_input_raises_and_engine_keeps_serving(tiny, tmp_path):
    good = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    alone = tiny.generate([good], params)[0]
    tiny.add_request("ok", good, params)
    cases = {
        "empty": ([], None, "empty"),
        "vocab": ([1, 2, 10**6], None, "token ids must be"),
        "negative": ([1, -1], None, "token ids must be"),
        "long": ([1] * tiny.max_model_len, None, "max_model_len"),
        "dup": (good, None, "already in use"),
    }
    for rid, (prompt, p, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            tiny.add_request("ok" if rid == "dup" else rid, prompt, p)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    for seed in (2**64, -(2**63) - 1, 1.5):  # outside SEED_RANGE
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=1.0, seed=seed)
    out = []
    while tiny.has_unfinished():
        out += [t for o in tiny.step() for t in o.new_token_ids]
        tiny.check()
    assert out == alone
    with pytest.raises(ValueError, match="no-such-model"):
        LLMEngine.from_model(str(tmp_path / "no-such-model"))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLMEngine.from_model(str(bad))
    with pytest.raises(ValueError, match="unknown engine option"):
        LLMEngine.from_model("tiny", chunk_sise=64)
    for bad_chunk in (0, 48):  # the chunk size named, before the sparse block is checked against it
        with pytest.raises(ValueError, match="chunk_size must be"):
            EngineConfig(model="tiny", chunk_size=bad_chunk, sparse_prefill=dict(block=128))


def test_sampling_seeded_stop_and_abort(tiny):
    prompt = list(range(40, 90))
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=123, ignore_eos=True)
    a, b = tiny.generate([prompt, prompt], [sampled, sampled])
    assert a == b  # same seed, same tokens, even in one batch
    greedy = tiny.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert (
        tiny.generate([prompt], SamplingParams(max_tokens=12, temperature=1.0, top_k=1, ignore_eos=True))[0] == greedy
    )
    stop = greedy[4]
    stopped = tiny.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), ignore_eos=True)
    )[0]
    assert stopped == greedy[: greedy.index(stop) + 1]
    tiny.add_request("gone", prompt, SamplingParams(max_tokens=100, temperature=0))
    tiny.step()
    assert tiny.stats()["kv_chunks_used"] > 0
    assert tiny.abort("gone") and not tiny.abort("gone")
    tiny.check()
    assert tiny.stats()["kv_chunks_used"] == 0 and tiny.stats()["running"] == 0


def test_cli_prints_text():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkserve.replicas.engine.llm_engine",
            "--model",
            "tiny",
            "--prompt",
            "Hello there",
            "--max-tokens",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "Hello there" in r.stdout and "8 generated" in r.stdout


def test_cache_digest_names_cached_prefixes_as_the_router_hashes_them():
    from chunkserve.router.hashing import chunk_hashes

    engine = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=1024)
    rng = random.Random(5)
    a = [rng.randrange(256) for _ in range(100)]
    b = a[:48] + [rng.randrange(256) for _ in range(40)]  # shares three chunks with a
    engine.generate([a, b], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    digest = engine.cache_digest("tiny", route_chunks=32)
    want_a, want_b = chunk_hashes(a, 16, 32, "tiny"), chunk_hashes(b, 16, 32, "tiny")
    assert set(want_a) | set(want_b) == set(digest)  # 6 + 2 distinct full chunks of the prompts
    assert len(digest) == len(set(want_a) | set(want_b))
    assert set(engine.cache_digest("tiny", route_chunks=2)) == set(want_a[:2])
    assert digest[:3] != engine.cache_digest("other-model", 32)[:3]  # seeded by the served model
    head = engine.cache_digest("tiny", 32, limit=4)
    assert set(want_a[:3]) <= set(head)  # a truncated digest keeps ancestors first
    engine.tree.evict_all()
    assert engine.cache_digest("tiny", 32) == []


def test_cpu_engine_runs_eagerly():
    # CUDA graphs are for CUDA decode steps (tests/test_engine_gpu.py); on the CPU every step is eager
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=4096)
    assert engine.runner.graphs is None
    assert len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]) == 3


def test_bench_cli_prints_a_run_per_repeat():
    """`python -m chunkserve.replicas.tools.bench` on the CPU: one JSON line per run, the shared prefix cached for
    every row but the first, the decode timed step by step (host share within the step)."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkserve.replicas.tools.bench",
            "--batch",
            "4",
            "--prefix",
            "64",
            "--suffix",
            "5",
            "--max-tokens",
            "6",
            "--repeat",
            "2",
            "--max-num-batched-tokens",
            "69",
        ],  # row 1 prefills alone
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    runs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [run["run"] for run in runs] == [0, 1]
    for run in runs:
        assert run["device"] == "cpu" and run["preemptions"] == 0 and run["kv_pool_chunks"] >= 4 * 2
        assert run["cached_prompt_tokens"] == 3 * 64  # rows 2-4 find row 1's prefix chunk in the tree
        assert run["steps"] >= 6 and run["decode_tok_per_s"] > 0
        assert 0 < run["host_ms_per_step"] <= run["decode_step_ms"]


def test_bench_cli_runs_each_batch_size_on_one_engine():
    """--batch 2,4: a run per size in order on one engine, each counting only its own steps."""
    argv = [
        sys.executable,
        "-m",
        "chunkserve.replicas.tools.bench",
        "--batch",
        "2,4",
        "--prefix",
        "64",
        "--suffix",
        "5",
    ]
    r = subprocess.run([*argv, "--max-tokens", "6"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    runs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [run["batch"] for run in runs] == [2, 4]
    # the first run's second row waits a step for the first's prefix chunk (being computed) and
    # matches it; the second run's all find that chunk still in the tree
    assert [run["cached_prompt_tokens"] for run in runs] == [64, 4 * 64]
    for run in runs:
        assert 6 <= run["steps"] <= 8 and run["preemptions"] == 0
    bad = subprocess.run([*argv[:4], "2,x"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--batch takes row counts" in bad.stderr


def test_bench_cli_prefills_sparse_as_its_spec_says_and_refuses_a_bad_one():
    """--sparse SPEC: BlockUnion's fields; the run's pieces after min_context read fewer pages
    than dense would, and the record names every field of the selection it ran."""
    argv = [
        sys.executable,
        "-m",
        "chunkserve.replicas.tools.bench",
        "--batch",
        "1",
        "--prefix",
        "0",
        "--suffix",
        "1024",
    ]
    argv += "--max-tokens 2 --chunk-size 16 --max-num-batched-tokens 256 --sparse-min-context 256".split()
    spec = "budget=0.25,block=16,window=1,span=auto,stride=1,dense_tail=16"
    r = subprocess.run([*argv, "--sparse", spec], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (run,) = [json.loads(line) for line in r.stdout.splitlines()]
    want = BlockUnion(min_context=256, budget=0.25, block=16, window=1, span="auto", dense_tail=16)
    assert run["sparse"] == dataclasses.asdict(want)
    assert 0 < run["sparse_pages_read"] < run["sparse_pages_dense"]
    bad = {"block=32,bogus=1": "unknown sparse field 'bogus'", "span=auto": "set a budget", "block=8": "two >= 16"}
    for spec, says in bad.items():
        r = subprocess.run([*argv, "--sparse", spec], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "error: --sparse: " in r.stderr and says in r.stderr, r.stderr


def test_bench_cli_warms_up_first_and_counts_only_the_run():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "chunkserve.replicas.tools.bench",
            "--batch",
            "4",
            "--prefix",
            "64",
            "--suffix",
            "5",
            "--max-tokens",
            "6",
            "--warmup",
            "--max-num-batched-tokens",
            "69",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (run,) = [json.loads(line) for line in r.stdout.splitlines()]
    # max_num_seqs rows, then as many alone, then 1, 2 and 4 rows after each of two long prefixes
    assert run["warmup_requests"] == 4 + 4 + 2 * (1 + 2 + 4) and run["warmup_s"] > 0
    # the run's own figures: the warmup's requests are neither cached hits nor counted steps
    assert run["cached_prompt_tokens"] == 3 * 64 and run["preemptions"] == 0
    assert 6 <= run["steps"] <= 12


def test_reset_counters_zeroes_every_parts_counts():
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=4096, piecewise_graphs=True)
    c, runner = engine.counters, engine.runner
    # one object, which every part counts into
    parts = (engine.scheduler, engine.attention, runner, runner.pieces)
    assert all(part.counters is c for part in parts)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
    assert engine.stats()["steps"] > 0 and c.plan_builds > 0 and c.piecewise_replays > 0
    fields = dataclasses.fields(EngineStats)
    for i, f in enumerate(fields):  # every count set, those no CPU step reaches too
        setattr(c, f.name, type(f.default)(i + 1))
    engine.reset_counters()
    assert engine.counters is c and all(getattr(c, f.name) == 0 for f in fields)
    s = engine.stats()
    assert s["steps"] == s["generated_tokens"] == s["finished_requests"] == s["preemptions"] == 0


def test_cache_salts_share_nothing_and_give_the_same_tokens(tiny):
    # one prompt under three salts, then again under each: a salt's second request is served from
    # its own tree, never from another salt's (the same tokens, nothing cached across salts), and
    # the tokens are what the unsalted request gets
    prompt = list(range(1, 200))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    salts = [None, "tenant:a", "tenant:b"]

    def run(rid: str, salt: str | None) -> tuple[list[int], int]:
        tiny.add_request(rid, prompt, params, Tenancy(cache_salt=salt))
        tokens, cached = [], None
        while tiny.has_unfinished():
            for out in tiny.step():
                tokens += out.new_token_ids
                cached = out.cached_tokens if cached is None else cached
            tiny.check()
        return tokens, cached

    tiny.tree.evict_all()
    firsts = [run(f"first-{i}", salt) for i, salt in enumerate(salts)]
    assert [cached for _, cached in firsts] == [0, 0, 0]  # each salt's first: nothing of the others'
    seconds = [run(f"second-{i}", salt) for i, salt in enumerate(salts)]
    full = len(prompt) // tiny.config.chunk_size * tiny.config.chunk_size
    assert [cached for _, cached in seconds] == [full] * 3  # each from its own tree
    assert all(tokens == firsts[0][0] for tokens, _ in firsts + seconds)
    assert set(tiny.tree.roots) == set(salts)
    digest = tiny.cache_digest("tiny", 32)
    assert len(digest) == 3 * (full // tiny.config.chunk_size) and len(set(digest)) == len(digest)
    tiny.tree.evict_all()
    assert set(tiny.tree.roots) == {None}  # a salt's root goes with its last chunk
    tiny.check()


@pytest.mark.parametrize(
    ("async_scheduling", "budget"), [(False, 2048), (True, 2048), (False, 128)], ids=["sync", "async", "pieces"]
)
def test_requests_of_one_prefix_added_together_compute_it_once(async_scheduling, budget):
    # four requests of one 256-token prefix (4 chunks) and one of none, added in one step: the
    # first computes the prefix, the others wait a step for it (Scheduler._inflight) and match
    # it: cached, computed once, and every token what an engine without sharing (each prompt
    # computed whole) gives. In pieces of 128 the others are first considered at the first's
    # last piece, when its prefix is in the tree already: none waits.
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(256)]
    prompts = [prefix + [rng.randrange(256) for _ in range(n)] for n in (10, 3, 40, 64)]
    prompts.append([rng.randrange(256) for _ in range(100)])
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    plain = LLMEngine.from_model("tiny", kv_cache_tokens=8192, enable_prefix_sharing=False)
    expected = plain.generate(prompts, params)
    engine = LLMEngine.from_model(
        "tiny", kv_cache_tokens=8192, max_num_batched_tokens=budget, async_scheduling=async_scheduling
    )
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            cached.setdefault(out.request_id, out.cached_tokens)
        engine.check()
    assert [got[str(i)] for i in range(len(prompts))] == expected
    assert cached == {"0": 0, "1": 256, "2": 256, "3": 256, "4": 0}
    assert engine.stats()["computed_prompt_tokens"] == sum(map(len, prompts)) - 3 * 256
    assert engine.counters.prefix_waits == (3 if budget == 2048 else 0)
