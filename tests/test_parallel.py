"""Tensor parallelism across engine ranks (chunkserve/replicas/parallel.py): two (or four) gloo ranks,
each a forked process with its own engine on its shard, ranks 1.. serving rank 0's steps as the
replica's Ray worker actors do. (The Serve path, with Ray actors, is in tests/test_serve_cluster.py.)"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import sys
import traceback

import pytest
import torch
import torch.distributed as dist

from chunkserve.replicas.engine.distributed import free_port, init_group
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.engine.warmup import warmup
from chunkserve.replicas.parallel import TPEngine, TPWorker, _apply, _send_ops
from chunkserve.replicas.wire import AbortRequest

CONFIG = EngineConfig(
    model="tiny", device="cpu", dtype="float32", kv_cache_tokens=4096, chunk_size=16, max_num_batched_tokens=64
)  # prompts prefill in several pieces
CONFIG2 = dataclasses.replace(CONFIG, tp_size=2)
SHARED = list(range(40, 40 + 70))  # 70 shared tokens: 4 whole chunks and a partial one
PROMPTS = [SHARED + [300 + i] * (i + 1) for i in range(6)] + [[7, 8, 9]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# (with logprobs and prompt logprobs: every rank computes them, rank 0's are returned)
SAMPLED = SamplingParams(
    max_tokens=12, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True, logprobs=2, prompt_logprobs=1
)
# penalties: every rank keeps the row's token counts from the tokens rank 0 broadcast
PENALIZED = dataclasses.replace(
    GREEDY, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={5: 1.5}
)
# guided: rank 0 keeps the row's grammar state (its tokens are broadcast), and async scheduling
# collects each step inside the next one's launch, on every rank, while it lives
GUIDED = SamplingParams(max_tokens=40, temperature=0.9, seed=2, guided=Guide("regex", r"[a-z]{3}-\d{2}"))
JOIN_S = 120


def _config(scenario: str, tp_size: int = 1, rank: int = 0, device: str = "cpu") -> EngineConfig:
    sizes = KV_TOKENS.get(scenario, (CONFIG.kv_cache_tokens,) * 2)
    return dataclasses.replace(
        CONFIG,
        tp_size=tp_size,
        tp_rank=rank,
        device=device,
        kv_cache_tokens=sizes[min(rank, 1)] if tp_size > 1 else min(sizes),  # (ranks past 1: rank 1's)
        max_model_len=MAX_MODEL_LEN.get(scenario, (None, None))[min(rank, 1) if tp_size > 1 else 0],
        async_scheduling=scenario.endswith("_async"),
        sparse_prefill=SPARSE.get(scenario),
        host_cache_tokens=HOST_TOKENS.get(scenario, 0),
    )


def _on_gpu(rank: int, device: str) -> str:
    """A CUDA rank sees its own GPU only, as a replica's Ray worker does (set before CUDA starts):
    -> the device it joins the group on (cuda:0, as the replica's ranks do)."""
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        return "cuda:0"
    return device


def _worker(rank: int, size: int, port: int, scenario: str, device: str = "cpu") -> None:
    """Rank 1 .. size-1: step with rank 0 until it closes the group."""
    group_device = _on_gpu(rank, device)
    torch.set_num_threads(1)
    if scenario == "samples_apart":  # rank 1 samples other tokens than rank 0 from its logits
        import chunkserve.replicas.engine.runner

        sample_ids = chunkserve.replicas.engine.runner.sample_ids
        chunkserve.replicas.engine.runner.sample_ids = lambda logits, *args: (
            (sample_ids(logits, *args) + 1) % logits.shape[-1]
        )
    init_group(rank, size, "127.0.0.1", port, group_device, timeout_s=JOIN_S)
    try:
        TPWorker(_config(scenario, size, rank, device)).serve()
    finally:
        _leave(device)


def _leave(device: str) -> None:
    """End a rank's group. A spawned (CUDA) rank then exits at once, as a forked one does: its
    interpreter's shutdown measured stuck past JOIN_S on the H200s, its work done."""
    if device == "cpu":
        dist.destroy_process_group()
    else:
        os._exit(0 if sys.exc_info()[0] is None else 1)


def _rank0(size: int, port: int, scenario: str, out_path: str, device: str = "cpu") -> None:
    group_device = _on_gpu(0, device)
    torch.set_num_threads(1)
    result: dict = {}
    try:
        init_group(0, size, "127.0.0.1", port, group_device, timeout_s=JOIN_S)
        engine = TPEngine(LLMEngine(_config(scenario, size, 0, device)))
        result = SCENARIOS[scenario](engine)
        engine.close()
    except BaseException:  # noqa: BLE001 - the parent reports it
        result = {"error": traceback.format_exc()}
    finally:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            _leave(device)


# Scenarios: run on rank 0's TPEngine, and on a one-rank LLMEngine for what they should give.
def _generate(engine) -> dict:
    params = [GREEDY] * (len(PROMPTS) - 3) + [PENALIZED, GUIDED, SAMPLED]
    return {"tokens": engine.generate(PROMPTS, params), "stats": engine.stats()}


def _bad_input_and_abort(engine) -> dict:
    """A bad request raises on rank 0 and reaches no rank; an abort mid-decode reaches all."""
    errors = []
    for bad in ([], [10**6], "text"):
        try:
            engine.add_request("bad", bad, GREEDY)
        except ValueError as e:
            errors.append(str(e))
    engine.add_request("gone", SHARED + [1, 2], GREEDY)
    engine.add_request("kept", SHARED + [3, 4], GREEDY)
    for _ in range(4):  # prefill pieces, then the first decodes
        engine.step()
    engine.abort("gone")
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return {"errors": errors, "kept_tail": tokens, "stats": engine.stats()}


def _preemption(engine) -> dict:
    """A pool of 10 chunks that the rows outgrow: the newest are preempted and recomputed."""
    out = engine.generate(PROMPTS, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(PROMPTS))
    return {"tokens": out, "stats": engine.stats()}


def _warmed(engine) -> dict:
    """chunkserve.replicas.engine.warmup through the engine (rank 0's TPEngine: every rank runs it), then _generate."""
    got = warmup(engine)
    return {"warmup_requests": got["warmup_requests"], **_generate(engine)}


def _sparse(engine) -> dict:
    """Long prompts whose later pieces run block-union sparse: each rank selects for its own heads."""
    prompts = [SHARED * 3 + [300 + i] * (20 + 9 * i) for i in range(3)]
    return {"tokens": engine.generate(prompts, GREEDY), "stats": engine.stats()}


def _host_tier(engine) -> dict:
    """Six 5-chunk prefixes, asked twice, through a 12-chunk pool: the first asks' chunks spill
    to the host tier, the second asks load them back, on each rank its own heads' K/V."""
    prefixes = [[(31 * p + 7 * i) % 250 for i in range(80)] for p in range(6)]
    prompts = [prefix + [300 + r] * (r + 1) for r in range(2) for prefix in prefixes]
    tokens = engine.generate(prompts, GREEDY)
    stats = {k: v for k, v in engine.stats().items() if k != "host_copy_ms"}  # (a time: each run's own)
    return {"tokens": tokens, "stats": stats}


SCENARIOS = {
    "generate": _generate,
    "host_tier": _host_tier,
    "bad_input_and_abort": _bad_input_and_abort,
    "preemption": _preemption,
    "warmed": _warmed,
}
# the scenarios' pool sizes (rank 0, rank 1) where not CONFIG's: ranks that could hold different
# pools (free GPU memory) agree on the smaller one, which one rank alone then has
KV_TOKENS = {"preemption": (4096, 160), "host_tier": (192, 192)}
HOST_TOKENS = {"host_tier": 2048}  # the scenarios' host tiers (EngineConfig.host_cache_tokens)
# (rank 0, rank 1): a rank 1 that ends the longest prompts' rows at 80 tokens, rank 0 at 12 new ones
MAX_MODEL_LEN = {"diverge": (None, 80)}
SCENARIOS["diverge"] = _generate
SCENARIOS["samples_apart"] = _generate
SCENARIOS["generate_async"] = _generate  # (_config: a scenario named *_async schedules asynchronously)
SCENARIOS["bad_input_and_abort_async"] = _bad_input_and_abort
SCENARIOS["sparse"] = SCENARIOS["sparse_per_head"] = _sparse
# sparse pieces from 96 cached tokens on (3 blocks of 32), a budget of half the blocks; per_head:
# a page list per query head (subgroup 1), as four ranks of one query head each select
SPARSE = {"sparse": dict(min_context=96, block=32, sink=1, window=1, budget=0.5)}
SPARSE["sparse_per_head"] = dict(SPARSE["sparse"], subgroup=1)


def _run_tp(scenario: str, tmp_path, fails: bool = False, device: str = "cpu", size: int = 2) -> dict:
    port, out = free_port(), str(tmp_path / f"{scenario}.pkl")
    # forked as in tests/test_model.py (a spawned rank re-imports torch: slow); CUDA ranks spawned
    # (CUDA does not survive a fork), each on a GPU of its own
    ctx = mp.get_context("fork" if device == "cpu" else "spawn")
    ranks = [ctx.Process(target=_rank0, args=(size, port, scenario, out, device))]
    ranks += [ctx.Process(target=_worker, args=(r, size, port, scenario, device)) for r in range(1, size)]
    for p in ranks:
        p.start()
    try:
        for p in ranks:
            p.join(timeout=JOIN_S)
    finally:
        for p in ranks:
            if p.is_alive():  # the other rank failed and this one waits in a collective
                p.kill()
    codes = [p.exitcode for p in ranks]
    try:
        with open(out, "rb") as f:
            result = pickle.load(f)
    except FileNotFoundError:
        pytest.fail(f"rank 0 left no result (exit codes {codes})")
    if fails:
        assert "error" in result and codes[1] != 0, (result, codes)
        return result
    assert "error" not in result, result["error"]
    assert codes == [0] * size
    return result


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_engine_generates_what_tp1_does(tmp_path):
    """Greedy rows and a seeded sampled row over a shared prefix: the same tokens, steps and cache
    use as one rank, the ranks' outputs compared at every step (TPEngine.step)."""
    want = _generate(LLMEngine(CONFIG))
    assert want["stats"]["cached_prompt_tokens"] >= 5 * 64  # the shared prefix is served from the tree
    assert _run_tp("generate", tmp_path) == want


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_engine_with_async_scheduling_generates_what_tp1_does(tmp_path):
    """Both ranks prepare each step while the one before runs (async_scheduling): the same
    tokens as one rank stepping synchronously; bad input and an abort mid-decode as one rank."""
    want = _generate(LLMEngine(CONFIG))
    got = _run_tp("generate_async", tmp_path)
    assert got["tokens"] == want["tokens"] and got["stats"]["generated_tokens"] == want["stats"]["generated_tokens"]
    want = _bad_input_and_abort(LLMEngine(CONFIG))
    got = _run_tp("bad_input_and_abort_async", tmp_path)
    assert (got["errors"], got["stats"]["running"], got["stats"]["kv_chunks_used"]) == (want["errors"], 0, 0)


@pytest.mark.gpu2
@pytest.mark.parametrize("scenario", ["generate", "generate_async"])
def test_tp2_on_two_gpus_generates_what_one_gpu_does(scenario, tmp_path):
    """Two CUDA ranks over NCCL (a GPU each, as a replica's ranks run), fp32: the tokens one GPU
    gives, greedy, penalized, guided and sampled rows alike, synchronous and asynchronous."""
    if torch.cuda.device_count() < 2:
        pytest.fail(f"needs two CUDA devices, found {torch.cuda.device_count()}")
    want = _generate(LLMEngine(dataclasses.replace(_config(scenario), device="cuda:0")))
    got = _run_tp(scenario, tmp_path, device="cuda")
    assert got["tokens"] == want["tokens"]
    assert got["stats"]["generated_tokens"] == want["stats"]["generated_tokens"]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp4_replicates_kv_heads_and_generates_what_tp1_does(tmp_path):
    """Four ranks over tiny's two KV heads: each rank holds one query head and the KV head it
    reads, replicated on two ranks (layers.kv_heads_of_rank); the same tokens as one rank, greedy,
    penalized, guided and sampled rows alike."""
    want = _generate(LLMEngine(CONFIG))
    got = _run_tp("generate", tmp_path, size=4)
    assert got["tokens"] == want["tokens"] and got["stats"]["generated_tokens"] == want["stats"]["generated_tokens"]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp4_sparse_prefill_selects_for_each_ranks_replicated_head(tmp_path):
    """Block-union prefill on four ranks of one query head each, over the KV head it holds: a
    list per query head (subgroup 1) as on one rank; the same tokens, rank 0 counting one of the
    one rank's four lists."""
    want = _sparse(LLMEngine(_config("sparse_per_head")))
    assert 0 < want["stats"]["sparse_pages_read"] < want["stats"]["sparse_pages_dense"]
    got = _run_tp("sparse_per_head", tmp_path, size=4)
    assert got["tokens"] == want["tokens"]
    assert 4 * got["stats"]["sparse_pages_read"] == want["stats"]["sparse_pages_read"]


@pytest.mark.gpu4
@pytest.mark.parametrize("scenario", ["generate", "generate_async"])
def test_tp4_on_four_gpus_generates_what_one_gpu_does(scenario, tmp_path):
    """Four CUDA ranks over NCCL, tiny's two KV heads replicated on two ranks each, fp32: the
    tokens one GPU gives."""
    if torch.cuda.device_count() < 4:
        pytest.fail(f"needs four CUDA devices, found {torch.cuda.device_count()}")
    want = _generate(LLMEngine(dataclasses.replace(_config(scenario), device="cuda:0")))
    got = _run_tp(scenario, tmp_path, device="cuda", size=4)
    assert got["tokens"] == want["tokens"]
    assert got["stats"]["generated_tokens"] == want["stats"]["generated_tokens"]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_sparse_prefill_generates_what_tp1_does(tmp_path):
    """Block-union prefill with each rank selecting for its own heads (lists per KV head, as on
    one rank): the same tokens and pages as one rank."""
    want = _sparse(LLMEngine(_config("sparse")))
    assert 0 < want["stats"]["sparse_pages_read"] < want["stats"]["sparse_pages_dense"]
    got = _run_tp("sparse", tmp_path)
    assert got["tokens"] == want["tokens"]
    # each rank counts its own lists: rank 0 holds half of the KV heads
    assert 2 * got["stats"]["sparse_pages_read"] == want["stats"]["sparse_pages_read"]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_warmup_runs_on_every_rank_and_leaves_them_together(tmp_path):
    """The warmup's requests go to every rank, its chunks stay cached on each alike: the ranks'
    later steps match (checked at every step) and give what one warmed rank gives."""
    want = _warmed(LLMEngine(CONFIG))
    assert want["warmup_requests"] > 8 and want["stats"]["kv_chunks_cached"] > 0
    assert _run_tp("warmed", tmp_path) == want


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_ranks_take_rank0s_sampled_tokens(tmp_path):
    """Ranks whose logits differ (in the last bit, on GPUs) could sample different tokens: here
    rank 1's sampler is off by one on every row. Rank 0's tokens, broadcast, are what every rank
    appends, so the ranks stay together (without the broadcast the outputs' check raises)."""
    assert _run_tp("samples_apart", tmp_path) == _generate(LLMEngine(CONFIG))


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_bad_input_raises_on_rank0_and_abort_reaches_every_rank(tmp_path):
    want = _bad_input_and_abort(LLMEngine(CONFIG))
    assert len(want["errors"]) == 3 and want["stats"]["running"] == want["stats"]["kv_chunks_used"] == 0
    # had the bad adds or the abort reached one rank only, the ranks' next steps would differ:
    # TPEngine.step raises on that, and the scenario returns an error
    assert _run_tp("bad_input_and_abort", tmp_path) == want


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_preempts_and_recomputes_as_one_rank_does(tmp_path):
    """Each rank decides preemptions from its own pool: rank 0 could hold 256 chunks and rank 1
    10, both take 10 (agree_min), and the same operations make the same preemptions on both."""
    want = _preemption(LLMEngine(_config("preemption")))
    assert want["stats"]["preemptions"] >= 2
    assert _run_tp("preemption", tmp_path) == want


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_ranks_that_part_ways_raise_on_both(tmp_path):
    """Rank 1 ends a row (max_model_len) a step before rank 0 does: the batches still match in
    shape, so the collectives cannot tell; the outputs' hashes do, and both ranks raise."""
    got = _run_tp("diverge", tmp_path, fails=True)
    assert "tensor-parallel ranks [1] diverged from rank 0 in step" in got["error"]


def test_tp_size_without_a_group_is_refused():
    with pytest.raises(ValueError, match="torch.distributed group"):
        LLMEngine(CONFIG2)
    with pytest.raises(ValueError, match="tp_rank"):
        LLMEngine(dataclasses.replace(CONFIG2, tp_rank=2))
    with pytest.raises(ValueError, match="rank 0"):
        TPWorker(CONFIG)


def test_the_ranks_ops_are_wire_messages_not_tagged_tuples():
    """Rank 0 sends, and a rank applies, only chunkserve/replicas/wire.py's ops: a string-tagged
    tuple (the ops' old form) is refused before it reaches the group or an engine."""
    with pytest.raises(TypeError, match="the ranks' ops: tuple .*AbortRequest, AddRequest"):
        _send_ops([AbortRequest("a"), ("abort", "b")])  # (checked before any collective: no group here)
    with pytest.raises(TypeError, match="not an op"):
        _apply(None, [("abort", "b")])  # type: ignore[arg-type, list-item]


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_tp2_spills_and_loads_each_ranks_heads_as_one_rank_does(tmp_path):
    """The host tier's spills and loads are the tree's decisions, which every rank makes alike
    from the same operations; each rank copies its own heads' K/V. Rank 1 loading other K/V than
    it spilled would change the all-reduced hidden states, so the tokens, of both ranks, from
    those of one rank without the tier."""
    want = _host_tier(LLMEngine(_config("host_tier")))
    plain = _host_tier(LLMEngine(dataclasses.replace(_config("host_tier"), host_cache_tokens=0)))
    assert want["stats"]["host_loads"] >= 6 and want["stats"]["cached_prompt_tokens_host"] > 0
    assert want["tokens"] == plain["tokens"] and plain["stats"]["cached_prompt_tokens"] == 0
    got = _run_tp("host_tier", tmp_path)
    # the same chunks copied, each rank its own (one of two) KV heads of each: half the bytes
    assert got["stats"].pop("host_copy_bytes") * 2 == want["stats"].pop("host_copy_bytes")
    assert got == want
