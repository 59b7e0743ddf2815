"""The engine on CUDA (run with `pytest -m gpu` on a GPU machine): the Triton decode path
against the reference path."""

import random
from collections import defaultdict

import pytest
import torch

from chunkserve.kernels import paged_prefill
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def shared_prompts(n=8, prefix_len=300, seed=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(5, 90))] for _ in range(n)]


def record_logits(engine):
    """Per request id, the logits of every token it sampled (the engine's own forward, untouched)."""
    seen, rows = defaultdict(list), []
    forward, compute = engine.runner.forward, engine.model.compute_logits

    def forward_and_name_rows(batch, prev):
        rows[:] = [s.request_id for s, n in batch.items if s.num_computed + n == s.num_tokens]
        return forward(batch, prev)

    def compute_and_keep(hidden):
        logits = compute(hidden)
        for rid, row in zip(rows, logits, strict=True):
            seen[rid].append(row)
        return logits

    engine.runner.forward, engine.model.compute_logits = forward_and_name_rows, compute_and_keep
    return seen


def copy_weights(engine, source):
    with torch.no_grad():
        for p, w in zip(engine.model.parameters(), source.model.parameters(), strict=True):
            p.copy_(w)


def tiny_run(prompts, params, weights=None, **options):
    """A tiny CUDA engine of `options` (weights copied from the engine `weights`, if given): the
    engine, its outputs for prompts and the logits of every token it sampled."""
    engine = LLMEngine.from_model("tiny", device="cuda", kv_cache_tokens=8192, **options)
    if weights is not None:
        copy_weights(engine, weights)
    logits = record_logits(engine)
    return engine, engine.generate(prompts, params), logits


def logit_errors(exact_out, exact, runs, steps):
    """Per run, |logits - exact logits| (max over the vocabulary) of every token, compared for each
    request for as long as the exact run and all `runs` ((outputs, logits) pairs) agree on tokens."""
    errors = [[] for _ in runs]
    for i, rid in enumerate(sorted(exact, key=lambda r: int(r.rsplit("-", 1)[1]))):
        for k in range(steps):
            if any(out[i][:k] != exact_out[i][:k] for out, _ in runs):
                break
            for err, (_, logits) in zip(errors, runs):
                err.append((logits[rid][k] - exact[rid][k]).abs().max().item())
    return errors


def test_tiny_fp32_triton_decode_matches_reference_and_cpu():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prompts = shared_prompts()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    opts = dict(dtype="float32", kv_cache_tokens=8192, max_num_batched_tokens=256)
    cpu = LLMEngine.from_model("tiny", device="cpu", **opts).generate(prompts, params)
    ref = LLMEngine.from_model("tiny", device="cuda", attention_backend="reference", **opts)
    tri = LLMEngine.from_model("tiny", device="cuda", async_scheduling=False, decode_graphs=True, **opts)
    eager = LLMEngine.from_model("tiny", device="cuda", enforce_eager=True, async_scheduling=False, **opts)
    ahead = LLMEngine.from_model("tiny", device="cuda", decode_graphs=True, **opts)  # asynchronous: CUDA's default
    assert tri.attention.backend == "triton" and eager.runner.graphs is None
    assert ahead.config.async_scheduling and not tri.config.async_scheduling
    assert tri.generate(prompts, params) == ref.generate(prompts, params) == cpu == eager.generate(prompts, params)
    assert ahead.generate(prompts, params) == cpu and ahead.counters.graph_replays >= 16
    assert tri.stats()["cached_prompt_tokens"] > 0
    assert tri.counters.plan_builds < tri.stats()["steps"] // 2
    # every decode-only step ran from the graph of its padded batch size
    assert tri.counters.graph_replays == tri.stats()["decode_steps"] >= 16
    assert tri.counters.unfixed_plans == 0


def test_cuda_graphs_under_churn_replay_every_decode_step_and_keep_tokens():
    """Rows leaving every 3 steps: each decode plan lives 3 steps, and every decode-only step
    still replays a graph (captured when the engine was built); tokens stay those of eager runs."""
    prompts = shared_prompts(n=12, prefix_len=200, seed=3)
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0, ignore_eos=True) for i in range(12)]
    opts = dict(dtype="float32", kv_cache_tokens=8192, max_num_batched_tokens=4096)
    eager = LLMEngine.from_model("tiny", device="cuda", enforce_eager=True, **opts).generate(prompts, params)
    engine = LLMEngine.from_model("tiny", device="cuda", decode_graphs=True, **opts)
    assert engine.generate(prompts, params) == eager
    assert engine.counters.plan_builds >= 10 and engine.counters.unfixed_plans == 0
    assert engine.counters.graph_replays == engine.stats()["decode_steps"] > 30


def test_warmed_engine_compiles_nothing_for_few_rows_after_a_long_prefix():
    # live traffic at a low rate: one or a few rows at a time after one long shared prefix,
    # joining as others decode and leave. After chunkserve.replicas.engine.warmup, their decode plans launch no
    # kernel variant it did not (each would compile on a request's path)
    from chunkserve.kernels import launch
    from chunkserve.replicas.engine.warmup import warmup

    engine = LLMEngine.from_model(
        "tiny", device="cuda", dtype="bfloat16", kv_cache_tokens=65536, chunk_size=64, max_num_seqs=64
    )
    warmup(engine)
    before = launch.first_launches()[0]
    rng = random.Random(5)
    prefix = [rng.randrange(256) for _ in range(2048)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    added = 0
    for _ in range(400):
        if added < 24 and rng.random() < 0.3:  # about one arrival in three steps
            engine.add_request(str(added), prefix + [rng.randrange(256) for _ in range(64)], params)
            added += 1
        if engine.has_unfinished():
            engine.step()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["max_decode_batch"] > 4  # (rows overlapped)
    assert launch.first_launched(before) == []


def test_llama3_8b_bf16_triton_logits_within_bf16_error_every_step():
    """bf16 tolerance, measured: at every step the Triton path's logits are about as far from an
    fp32 run of the same weights as the bf16 reference path's are (a random-weight 8B model
    amplifies rounding, so a fixed absolute tolerance would say little)."""
    prompts = shared_prompts(n=16, prefix_len=1024)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(backend, dtype, weights=None):
        engine = LLMEngine.from_model(
            "llama3-8b",
            device="cuda",
            dtype=dtype,
            kv_cache_tokens=32768,
            attention_backend=backend,
            decode_graphs=True,
        )
        if weights is not None:
            copy_weights(engine, weights)
        logits = record_logits(engine)
        out = engine.generate(prompts, params)
        s = engine.stats()
        assert s["cached_prompt_tokens"] >= 14 * 960 and s["kv_chunks_used"] == 0
        return engine, out, logits

    ref_engine, ref_out, ref = run("reference", "bfloat16")
    _, exact_out, exact = run("reference", "float32", weights=ref_engine)
    del ref_engine
    torch.cuda.empty_cache()
    tri_engine, tri_out, tri = run("triton", "bfloat16")
    assert tri_engine.attention.backend == "triton" and all(len(o) == 16 for o in tri_out)
    # the prompts' prefill through FlashInfer's paged prefill, where flashinfer is installed
    assert (tri_engine.counters.prefill_plans > 0) == paged_prefill.available()
    assert tri_engine.counters.graph_replays >= 8  # the logits below came through CUDA graphs
    err_ref, err_tri = logit_errors(exact_out, exact, [(ref_out, ref), (tri_out, tri)], 16)
    assert len(err_tri) >= 64, f"only {len(err_tri)} comparable tokens"
    assert max(err_tri) <= 2 * max(err_ref) + 1e-2, f"triton off by {max(err_tri)}, bf16 reference by {max(err_ref)}"
    assert sum(err_tri) <= 2 * sum(err_ref), (
        f"mean errors: triton {sum(err_tri) / len(err_tri)}, reference {sum(err_ref) / len(err_ref)}"
    )
    print(
        f"compared {len(err_tri)} tokens: max |logit error| triton {max(err_tri):.3f}, bf16 reference {max(err_ref):.3f}"
    )


def test_unshared_gqa_batch_decodes_through_flashinfer_within_bf16_error():
    """Nothing shared + grouped-query heads, eager engine: the engine decodes through FlashInfer's
    paged decode (chunkserve/kernels/fi_decode.py), whose logits are as close to an fp32 run as the Triton
    path's. A graphed engine decodes such a batch through TPP (and its graphs)."""
    pytest.importorskip("flashinfer", reason="the fallback needs flashinfer (on the GPU box: source .gpu/activate)")
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(70, 200))] for _ in range(8)]  # no shared chunk
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    def run(dtype, backend="triton", fallback=True, weights=None, graphs=False):
        return tiny_run(
            prompts,
            params,
            weights,
            dtype=dtype,
            attention_backend=backend,
            flashinfer_fallback=fallback,
            enforce_eager=not graphs,
            decode_graphs=graphs,
        )

    fi_engine, fi_out, fi = run("bfloat16")
    tri_engine, tri_out, tri = run("bfloat16", fallback=False)
    _, exact_out, exact = run("float32", backend="reference", weights=fi_engine)
    assert fi_engine.counters.fallback_plans == fi_engine.counters.plan_builds > 0
    assert tri_engine.counters.fallback_plans == 0
    # TPP from CUDA graphs (padded batches: their matrix products may round otherwise)
    graphed, graphed_out, graphed_logits = run("bfloat16", fallback=True, graphs=True)
    assert graphed.counters.fallback_plans == 0 and graphed.counters.graph_replays > 0
    err_fi, err_tri, err_graphed = logit_errors(
        exact_out, exact, [(fi_out, fi), (tri_out, tri), (graphed_out, graphed_logits)], 24
    )
    assert len(err_fi) >= 64, f"only {len(err_fi)} comparable tokens"
    assert max(err_graphed) <= 2 * max(err_tri) + 1e-2, f"graphed off by {max(err_graphed)}, eager by {max(err_tri)}"
    assert max(err_fi) <= 2 * max(err_tri) + 1e-2, f"flashinfer off by {max(err_fi)}, triton by {max(err_tri)}"
    print(f"compared {len(err_fi)} tokens: max |logit error| flashinfer {max(err_fi):.4f}, triton {max(err_tri):.4f}")


def test_prefill_through_flashinfer_within_bf16_error():
    """Chunked prefill (pieces of 96 tokens: spans with a context, several a step, partial chunks)
    of prompts sharing a prefix, bf16: FlashInfer's paged prefill (mixed steps from the piecewise
    graphs), and the prefill tokens as decode rows of the TPP plan (mixed steps from the decode
    graphs), give logits as close to an fp32 run as the reference prefill does, at every step."""
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    prompts = shared_prompts(n=8, prefix_len=300, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)

    def run(dtype, fused=True, backend="triton", weights=None, rows=False):
        return tiny_run(
            prompts,
            params,
            weights,
            dtype=dtype,
            attention_backend=backend,
            max_num_batched_tokens=96,
            flashinfer_prefill=fused,
            graph_mixed_steps=rows,
        )

    fi_engine, fi_out, fi = run("bfloat16")
    ref_engine, ref_out, ref = run("bfloat16", fused=False)
    rows_engine, rows_out, rows = run("bfloat16", rows=True, weights=fi_engine)
    _, exact_out, exact = run("float32", backend="reference", weights=fi_engine)
    assert fi_engine.counters.prefill_plans >= 8 and ref_engine.counters.prefill_plans == 0
    assert fi_engine.stats()["cached_prompt_tokens"] > 0
    assert rows_engine.counters.mixed_graph_replays >= 8
    runs = [(fi_out, fi), (ref_out, ref), (rows_out, rows)]
    err_fi, err_ref, err_rows = logit_errors(exact_out, exact, runs, 12)
    assert len(err_fi) >= 48, f"only {len(err_fi)} comparable tokens"
    for name, err in (("flashinfer", err_fi), ("TPP rows", err_rows)):
        assert max(err) <= 2 * max(err_ref) + 1e-2, f"{name} prefill off by {max(err)}, reference by {max(err_ref)}"
    print(
        f"compared {len(err_fi)} tokens: max |logit error| flashinfer prefill {max(err_fi):.4f}, "
        f"TPP rows {max(err_rows):.4f}, reference {max(err_ref):.4f}"
    )


def test_sparse_prefill_through_flashinfer_within_bf16_error(monkeypatch):
    """Block-union prefill with every block kept (alpha 0; min_context 128, so the pieces after
    the shared prefix run sparse): FlashInfer over the (chunk, KV head) page lists, bf16, gives
    logits as close to an fp32 run as the dense FlashInfer prefill does, at every step. With
    alpha 1 the pieces read fewer pages and the engine still generates."""
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    prompts = shared_prompts(n=8, prefix_len=300, seed=3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    sparse = dict(min_context=128, block=32, window=1)

    def run(dtype, backend="triton", weights=None, **options):
        return tiny_run(
            prompts,
            params,
            weights,
            dtype=dtype,
            attention_backend=backend,
            chunk_size=16,
            max_num_batched_tokens=96,
            **options,
        )

    sp_engine, sp_out, sp = run("bfloat16", sparse_prefill=dict(sparse, alpha=0.0))
    de_engine, de_out, de = run("bfloat16", weights=sp_engine)
    _, exact_out, exact = run("float32", backend="reference", weights=sp_engine)
    stats = sp_engine.stats()
    assert stats["sparse_pages_dense"] > 0 and stats["sparse_pages_read"] == stats["sparse_pages_dense"]
    err_sp, err_de = logit_errors(exact_out, exact, [(sp_out, sp), (de_out, de)], 12)
    assert len(err_sp) >= 48, f"only {len(err_sp)} comparable tokens"
    assert max(err_sp) <= 2 * max(err_de) + 1e-2, f"sparse off by {max(err_sp)}, dense by {max(err_de)}"
    bu_engine, bu_out, bu = run("bfloat16", weights=sp_engine, sparse_prefill=dict(sparse, budget=1.0))
    assert bu_engine.attention._prefill._sparse_rows  # planned once a step, through FlashInfer
    (err_bu,) = logit_errors(exact_out, exact, [(bu_out, bu)], 12)
    assert max(err_bu) <= 2 * max(err_de) + 1e-2, f"a whole budget off by {max(err_bu)}, dense by {max(err_de)}"
    # in spans: each span's lists planned once a step, every block before it kept
    runs_planned = []
    plan_sparse = paged_prefill.FlashInferPrefill.plan_sparse

    def counted(self, ids, pieces):
        runs_planned.append(len(pieces))
        return plan_sparse(self, ids, pieces)

    monkeypatch.setattr(paged_prefill.FlashInferPrefill, "plan_sparse", counted)
    _, sb_out, sb = run("bfloat16", weights=sp_engine, sparse_prefill=dict(sparse, budget=1.0, span=1))
    assert max(runs_planned) > 1, f"a step's spans planned as {runs_planned}"
    (err_sb,) = logit_errors(exact_out, exact, [(sb_out, sb)], 12)
    assert max(err_sb) <= 2 * max(err_de) + 1e-2, f"spans off by {max(err_sb)}, dense by {max(err_de)}"
    print(
        f"compared {len(err_sp)} tokens: max |logit error| sparse (all kept) {max(err_sp):.4f}, "
        f"a whole budget {max(err_bu):.4f}, dense {max(err_de):.4f}"
    )
    for cut_options in (dict(alpha=1.0), dict(budget=0.3), dict(budget=0.3, span=1), dict(budget=0.3, span="auto")):
        cut, cut_out, _ = run("bfloat16", weights=sp_engine, sparse_prefill=dict(sparse, **cut_options))
        stats = cut.stats()
        assert 0 < stats["sparse_pages_read"] < stats["sparse_pages_dense"]
        assert all(len(o) == 12 for o in cut_out)
        print(f"{cut_options}: read {stats['sparse_pages_read']} of {stats['sparse_pages_dense']} pages")
