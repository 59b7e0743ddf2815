"""Engine throughput on a shared-prefix batch: `python -m chunkserve.replicas.tools.bench [options]` prints one JSON
line per attention backend and run (prefill seconds, decode tokens/s from the second decode step
on, KV chunks in use, decode plans built).

    python -m chunkserve.replicas.tools.bench --model llama3-8b --batch 64 --prefix 2048 --suffix 64 --max-tokens 64
    python -m chunkserve.replicas.tools.bench ... --stagger --repeat 2   # rows' tails at staggered offsets; the
                                                        # second run finds every kernel compiled
    python -m chunkserve.replicas.tools.bench ... --batch 8,64,256       # a run per batch size on one engine
                                                        # (sized for the largest), in this order
    python -m chunkserve.replicas.tools.bench ... --tp 2                 # tensor-parallel over 2 GPUs (ranks as
                                                        # processes, chunkserve/replicas/parallel.py)
    python -m chunkserve.replicas.tools.bench ... --warmup               # replicas.warmup first, as a GPU replica
                                                        # does: run 0 on a fresh machine then
                                                        # shows what users' first requests see
    python -m chunkserve.replicas.tools.bench ... --no-flashinfer-prefill  # prefill spans through the plain-torch
                                                          # reference, one by one
    python -m chunkserve.replicas.tools.bench --batch 1 --prefix 0 --suffix 32768 --max-tokens 2 --sparse budget=0.1
                                                        # one long prompt prefilled with block-
                                                        # union sparse attention (BlockUnion's
                                                        # fields: budget=0.1,block=64,span=auto,...)
    python -m chunkserve.replicas.tools.bench ... --no-async-scheduling  # each step prepared after the one before
                                                        # ran (EngineConfig.async_scheduling; on
                                                        # by default on CUDA)
    python -m chunkserve.replicas.tools.bench ... --no-decode-graphs     # no whole-step graphs per padded batch
                                                        # size (EngineConfig.decode_graphs, on
                                                        # by default on CUDA): piecewise only

--stagger gives row i a suffix of suffix + (7 i mod chunk size) tokens, so the rows' tail chunks
fill at different steps (as in a live batch) rather than all at once.

Under live traffic (--request-rate: requests arrive as a Poisson stream, the engine stepping
as a replica does, adding each request at the first step boundary after it arrives):

    python -m chunkserve.replicas.tools.bench --model llama3-8b --backend triton --prefix 2048 --suffix 64 \
        --max-tokens 128 --request-rate 8,24,64 --requests 256 --warmup

prints per rate the request throughput, TTFT and TPOT (mean, p50, p99; TTFT from the arrival),
normalized latency (E2EL / output tokens), decode-only steps and how many ran from a CUDA graph,
host ms a step, and decode plans built. --groups G gives G distinct shared prefixes (SGLang's
gsp), the requests of the groups interleaved. The arrival times are chunkserve.cluster.loadtest's for the
same rate and seed (a gamma process of shape 1), so the whole stack can be driven with the same
schedule: `python -m chunkserve.cluster.loadtest --workload gsp --gsp-num-groups G --gsp-prompts-per-group
N/G --gsp-system-prompt-len 2048 --gsp-question-len 64 --gsp-output-len 128 --request-rate R`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from chunkserve.kernels.block_union import BlockUnion
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams
from chunkserve.replicas.engine.warmup import warmup


def _config(args: argparse.Namespace, backend: str, rank: int = 0) -> EngineConfig:
    device = args.device
    if args.tp > 1 and device in ("auto", "cuda"):  # a GPU per rank, when there are GPUs
        device = f"cuda:{rank}" if torch.cuda.is_available() else "cpu"
    return EngineConfig(
        model=args.model,
        device=device,
        dtype=args.dtype,
        chunk_size=args.chunk_size,
        kv_cache_tokens=args.kv_cache_tokens,
        attention_backend=backend,
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        tp_size=args.tp,
        tp_rank=rank,
        async_scheduling=args.async_scheduling,
        flashinfer_prefill=args.flashinfer_prefill,
        sparse_prefill=args.sparse,  # a BlockUnion after main's parse
        enable_prefix_sharing=args.prefix_sharing,
        piecewise_graphs=args.piecewise_graphs,
        decode_graphs=args.decode_graphs,
        graph_mixed_steps=args.graph_mixed_steps,
    )


# --guided: every row's output (or the first --guided-rows rows') kept inside one of these
# (chunkserve.replicas.engine.guided); the JSON rows' free string runs as long as the model keeps off the quote
GUIDES = {
    "json": Guide("json", json.dumps({"type": "object", "properties": {"text": {"type": "string"}}})),
    "json_object": Guide("json_object"),
    "regex": Guide("regex", r"([a-z]{1,8} ){1,64}"),
    "choice": Guide("choice", ("red", "green", "blue")),
}


def run(args: argparse.Namespace, backend: str, engine=None, warm: bool = True) -> dict:
    """One run of args.batch rows on a fresh engine (or on `engine`, idle: a previous run's, or rank
    0's TPEngine under --tp); with args.warmup and `warm`, chunkserve.replicas.engine.warmup first."""
    if engine is None:
        engine = LLMEngine(_config(args, backend))
    engine.reset_counters()  # a previous run's figures are not this run's
    warmed = warmup(engine) if args.warmup and warm else {}  # (counters zeroed after it)
    rng = random.Random(0)
    prefix = [rng.randrange(256) for _ in range(args.prefix)]
    guided_rows = args.batch if args.guided_rows is None else args.guided_rows
    for i in range(args.batch):
        suffix = args.suffix + (7 * i % args.chunk_size if args.stagger else 0)
        engine.add_request(
            str(i),
            prefix + [rng.randrange(256) for _ in range(suffix)],
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                ignore_eos=True,
                seed=i if args.seeded else None,
                guided=GUIDES[args.guided] if args.guided and i < guided_rows else None,
            ),
        )
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    while any(len(s.output_ids) == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything (decodes of early finishers ride along)
    sync()
    prefill_s = time.perf_counter() - t0
    kv_used = engine.stats()["kv_chunks_used"]
    engine.step()  # the first decode step, untimed: it JIT-compiles the decode kernels on a cold cache
    sync()
    c = engine.counters  # (reset_counters zeroes it in place: the same object throughout)
    t1, wait0 = time.perf_counter(), c.wait_s
    decode_tokens = decode_steps = 0
    while engine.has_unfinished():
        decode_tokens += len(engine.step())
        decode_steps += 1
    sync()
    t2 = time.perf_counter()
    s = engine.stats()
    graphs = engine.runner.graphs
    return {
        "bench": "engine",
        "model": args.model,
        "backend": engine.attention.backend,
        "device": str(engine.device),
        "tp": args.tp,
        "async_scheduling": engine.config.async_scheduling,
        "dtype": args.dtype,
        "batch": args.batch,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "stagger": args.stagger,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seeded": args.seeded,
        "guided": args.guided,
        "guided_rows": guided_rows if args.guided else 0,
        "prefill_s": round(prefill_s, 3),
        "decode_tok_per_s": round(decode_tokens / max(t2 - t1, 1e-9), 1),
        "decode_step_ms": round(1e3 * (t2 - t1) / max(1, decode_steps), 2),
        # of which the host's own time (the step less its wait for the sampled tokens): with
        # async_scheduling it runs while the device runs the step before; without, the device
        # waits for part of it
        "host_ms_per_step": round(1e3 * (t2 - t1 - (c.wait_s - wait0)) / max(1, decode_steps), 2),
        "kv_pool_chunks": engine.pool.num_chunks,
        "kv_chunks_used_after_prefill": kv_used,
        "cached_prompt_tokens": s["cached_prompt_tokens"],
        "preemptions": s["preemptions"],
        "plan_builds": c.plan_builds,
        "prefill_plans": c.prefill_plans,
        "steps": s["steps"],
        # steps with prefill tokens that ran from a whole-step graph (their tokens as decode rows)
        "mixed_graph_replays": c.mixed_graph_replays,
        "graph_sizes": len(graphs.sizes) if graphs else 0,
        "graph_replays": c.graph_replays,
        "unfixed_plans": c.unfixed_plans,
        "graph_capture_s": round(graphs.capture_s, 3) if graphs else 0,
        "piecewise_steps": c.piecewise_replays,
        "sparse": None if args.sparse is None else dataclasses.asdict(args.sparse),
        **{k: v for k, v in s.items() if k.startswith("sparse_")},
        **warmed,
    }


def poisson_offsets(n: int, rate: float, seed: int = 0) -> list[float]:
    """n arrival times (s) of a Poisson stream: chunkserve.cluster.loadtest.workloads.poisson_offsets's
    (burstiness 1), written again here: replicas sits below cluster and never imports it."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(1.0, 1.0 / rate)
    return out


def _ms(name: str, xs: list[float]) -> dict:
    ms = np.asarray(xs, dtype=float) * 1e3 if xs else np.zeros(1)
    return {
        f"mean_{name}_ms": round(float(ms.mean()), 2),
        f"median_{name}_ms": round(float(np.median(ms)), 2),
        f"p99_{name}_ms": round(float(np.percentile(ms, 99)), 2),
    }


def _first_launches() -> tuple[int, float]:
    """chunkserve.kernels.launch.first_launches, or nothing launched where Triton is not installed."""
    launch = _launch_module()
    return (0, 0.0) if launch is None else launch.first_launches()


def _first_launched(since: int) -> list[str]:
    """chunkserve.kernels.launch.first_launched, or none where Triton is not installed."""
    launch = _launch_module()
    return [] if launch is None else launch.first_launched(since)


def _launch_module():
    try:
        from chunkserve.kernels import launch
    except ImportError:  # (no Triton: nothing is launched through it)
        return None
    return launch


def run_poisson(args: argparse.Namespace, engine, rate: float, run_index: int) -> dict:
    """Requests arriving as a Poisson stream at `rate` a second, the engine stepped as a replica
    steps it: each request added at the first step boundary after its arrival."""
    engine.reset_counters()
    rng = random.Random(1000 + run_index)  # fresh prompts each run: none finds the last run's cached
    groups = max(1, args.groups)
    prefixes = [[rng.randrange(256) for _ in range(args.prefix)] for _ in range(groups)]
    order = [i % groups for i in range(args.requests)]
    random.Random(run_index).shuffle(order)
    prompts = [prefixes[g] + [rng.randrange(256) for _ in range(args.suffix)] for g in order]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, ignore_eos=True
    )
    offsets = poisson_offsets(args.requests, rate, args.seed)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    count: dict[str, int] = {}
    steps_s, batch_sizes = [], []
    kinds: dict[bool, list[float]] = {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]}  # decode-only?: steps, s, host s
    sync()
    t0 = time.perf_counter()
    c = engine.counters  # (zeroed in place above: the same object throughout)
    wait0 = c.wait_s
    keys0, first_s0 = _first_launches()
    nxt = 0
    while nxt < args.requests or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < args.requests and offsets[nxt] <= now:
            rid = str(nxt)
            engine.add_request(rid, prompts[nxt], params)
            arrival[rid] = t0 + offsets[nxt]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, offsets[nxt] - (time.perf_counter() - t0)))
            continue
        d0, w0 = engine.stats()["decode_steps"], c.wait_s  # (read before the step's clock starts)
        s0 = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        steps_s.append(t - s0)
        after = engine.stats()
        batch_sizes.append(after["last_decode_batch"])
        kind = kinds[after["decode_steps"] > d0]
        kind[0] += 1
        kind[1] += t - s0
        kind[2] += t - s0 - (c.wait_s - w0)
        for out in outs:
            first.setdefault(out.request_id, t)
            last[out.request_id] = t
            count[out.request_id] = out.output_tokens
    sync()
    wall = time.perf_counter() - t0
    done = list(arrival)
    ttft = [first[r] - arrival[r] for r in done]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in done if count[r] > 1]
    norm = [(last[r] - arrival[r]) / count[r] for r in done]
    s = engine.stats()
    graphs, pieces = engine.runner.graphs, engine.runner.pieces
    replays = c.graph_replays
    return {
        "bench": "engine_poisson",
        "model": args.model,
        "backend": engine.attention.backend,
        "device": str(engine.device),
        "async_scheduling": engine.config.async_scheduling,
        "request_rate": rate,
        "requests": args.requests,
        "groups": groups,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "max_tokens": args.max_tokens,
        "duration": round(wall, 3),
        "request_throughput": round(len(done) / wall, 3),
        "output_throughput": round(sum(count.values()) / wall, 1),
        "total_output_tokens": sum(count.values()),
        **_ms("ttft", ttft),
        **_ms("tpot", tpot),
        **_ms("norm_latency", norm),
        "steps": s["steps"],
        "decode_steps": s["decode_steps"],
        "graph_replays": replays,
        # decode-only steps that ran from a whole-step CUDA graph (a replay is one decode-only step)
        "graph_fraction": round(replays / max(1, s["decode_steps"]), 3),
        # decode-only steps that ran from CUDA graphs, whole-step or pieces (on the CPU the pieces are calls)
        "decode_graph_fraction": round((replays + c.piecewise_decode_replays) / max(1, s["decode_steps"]), 3),
        # steps with prefill tokens that ran from a whole-step graph (their tokens as decode rows)
        "mixed_graph_replays": c.mixed_graph_replays,
        "graph_sizes": len(graphs.sizes) if graphs else 0,
        "plan_builds": c.plan_builds,
        # decode plans built plain where fixed ones are (none fitted): their steps ran from the pieces
        "unfixed_plans": c.unfixed_plans,
        "graph_capture_s": round(graphs.capture_s, 3) if graphs else 0,
        # kernels launched for the first time in this run (each may have compiled, on a request's path)
        "kernel_first_launches": _first_launches()[0] - keys0,
        "kernel_first_launch_s": round(_first_launches()[1] - first_s0, 3),
        "kernel_first_launched": _first_launched(keys0),  # their kernels' names
        # steps that ran from the pieces between attentions (chunkserve/replicas/engine/piecewise.py), of all steps
        "piecewise_steps": c.piecewise_replays,
        "piecewise_capture_s": round(pieces.capture_s, 2) if pieces else 0,
        "step_ms": round(1e3 * sum(steps_s) / max(1, len(steps_s)), 2),
        "p99_step_ms": _ms("step", steps_s)["p99_step_ms"],
        "max_step_ms": round(1e3 * max(steps_s, default=0), 2),
        "host_ms_per_step": round(1e3 * (sum(steps_s) - (c.wait_s - wait0)) / max(1, len(steps_s)), 2),
        # the same per kind of step launched: decode-only, or holding prefill tokens (mixed). With
        # async_scheduling a step's time ends on the step before's tokens: its wait is that one's
        **{
            f"{name}_{key}": round(1e3 * kinds[k][i] / max(1, kinds[k][0]), 2)
            for k, name in ((True, "decode_only"), (False, "mixed"))
            for i, key in ((1, "step_ms"), (2, "host_ms"))
        },
        "mixed_steps": kinds[False][0],
        "mean_decode_batch": round(sum(batch_sizes) / max(1, len(batch_sizes)), 1),
        "max_decode_batch": s["max_decode_batch"],
        "cached_prompt_tokens": s["cached_prompt_tokens"],
        "prompt_tokens": s["prompt_tokens"],
        "computed_prompt_tokens": s["computed_prompt_tokens"],  # prompt positions run (a prefix twice: twice)
        # admissions put off a step for a prompt chunk another request was computing
        "prefix_waits": c.prefix_waits,
        "preemptions": s["preemptions"],
        "prefix_sharing": engine.config.enable_prefix_sharing,
        "max_kv_chunks_used": s["max_kv_chunks_used"],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkserve.replicas.tools.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--backend",
        action="append",
        choices=["reference", "torch", "triton"],
        help="attention backend(s) to run (default: auto)",
    )
    ap.add_argument("--batch", default="32", help="rows a run (comma-separated: a run per size, one engine)")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--suffix", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--kv-cache-tokens", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--stagger", action="store_true", help="rows' suffixes of staggered lengths (see above)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument(
        "--seeded",
        action="store_true",
        help="each request sampled with its own seed (else the engine keys it by arrival)",
    )
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the host prepares each step while the device runs the one before (default: on CUDA)",
    )
    ap.add_argument(
        "--flashinfer-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill through FlashInfer's paged prefill where it is installed (else the reference, span by span)",
    )
    ap.add_argument(
        "--sparse",
        default=None,
        metavar="SPEC",
        help="block-union sparse prefill of long contexts, its fields as 'budget=0.1,block=64,window=1,"
        "span=auto,stride=4,dense_tail=64' (chunkserve.kernels.block_union.BlockUnion; 'alpha=0.1' for the threshold)",
    )
    ap.add_argument(
        "--sparse-min-context", type=int, default=BlockUnion.min_context, help="shorter contexts prefill dense"
    )
    ap.add_argument(
        "--guided",
        choices=sorted(GUIDES),
        default=None,
        help="every row's output kept inside this guide (structured outputs; see GUIDES)",
    )
    ap.add_argument("--guided-rows", type=int, default=None, help="with --guided: only the first N rows guided")
    ap.add_argument(
        "--warmup",
        action="store_true",
        help="chunkserve.replicas.engine.warmup before each run (as a GPU replica starts)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per backend, each on a fresh engine")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (a process and a GPU each)")
    ap.add_argument(
        "--piecewise-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the forward between attentions as CUDA graphs (EngineConfig.piecewise_graphs; default: on CUDA)",
    )
    ap.add_argument(
        "--decode-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whole-step CUDA graphs per padded batch size (EngineConfig.decode_graphs; default: on CUDA)",
    )
    ap.add_argument(
        "--graph-mixed-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="steps with prefill tokens from the decode graphs where they fit (EngineConfig.graph_mixed_steps)",
    )
    ap.add_argument(
        "--prefix-sharing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share prompts' common chunks in the prefix tree (EngineConfig.enable_prefix_sharing)",
    )
    ap.add_argument("--request-rate", help="Poisson arrivals at these rates (comma-separated), see above")
    ap.add_argument("--requests", type=int, default=256, help="with --request-rate: requests per rate")
    ap.add_argument("--groups", type=int, default=1, help="with --request-rate: distinct shared prefixes")
    ap.add_argument("--seed", type=int, default=0, help="with --request-rate: the arrival times' seed")
    args = ap.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        ap.error(f"--batch takes row counts, comma-separated, not {args.batch!r}")
    if min(batches) < 1:
        ap.error("--batch takes row counts >= 1")
    args.batch = max(batches)  # the engine's max_num_seqs
    if args.sparse is not None:
        try:
            args.sparse = BlockUnion.from_spec(args.sparse, args.sparse_min_context)
            args.sparse.check_chunk_size(args.chunk_size)
        except ValueError as e:
            ap.error(f"--sparse: {e}")
    if args.request_rate is not None:
        rates = [float(r) for r in args.request_rate.split(",")]
        if not rates or min(rates) <= 0 or args.requests < 1 or args.tp != 1:
            ap.error("--request-rate takes rates > 0, --requests >= 1, one GPU (no --tp)")
        args.batch = max(args.batch, args.requests)  # max_num_seqs: the engine admits all it can hold
        for backend in args.backend or ["auto"]:
            engine = LLMEngine(_config(args, backend))
            warmed = warmup(engine) if args.warmup else {}
            for k, rate in enumerate(rates):
                print(json.dumps({**run_poisson(args, engine, rate, k), **warmed}), flush=True)
            del engine
            _release()
        return
    if args.tp > 1:
        from chunkserve.replicas.engine.distributed import free_port

        mp.start_processes(_rank, args=(args, free_port(), batches), nprocs=args.tp, start_method="spawn")
        return
    for backend in args.backend or ["auto"]:
        for k in range(args.repeat):
            engine = LLMEngine(_config(args, backend))
            for i, b in enumerate(batches):
                print(json.dumps(dict(run(_rows(args, b), backend, engine, warm=i == 0), run=k)), flush=True)
            del engine
            _release()


def _rows(args: argparse.Namespace, batch: int) -> argparse.Namespace:
    """args for a run of `batch` rows (the engine's config keeps the largest)."""
    return argparse.Namespace(**{**vars(args), "batch": batch})


def _release() -> None:
    """Free the last run's engine: the next one sizes its KV pool from the free memory."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rank(rank: int, args: argparse.Namespace, port: int, batches: list[int]) -> None:
    """--tp: rank 0 makes each run through a TPEngine; the other ranks step with it until it closes."""
    from chunkserve.replicas.engine.distributed import init_group
    from chunkserve.replicas.parallel import TPEngine, TPWorker

    backends = args.backend or ["auto"]
    device = _config(args, backends[0], rank).device
    if (
        device == "cpu"
    ):  # the cores shared out: ranks spinning on more threads than cores stall each other's collectives
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tp))
    init_group(rank, args.tp, "127.0.0.1", port, device)
    for backend in backends:
        for k in range(args.repeat):
            config = _config(args, backend, rank)
            if rank:
                TPWorker(config).serve()
            else:
                engine = TPEngine(LLMEngine(config))
                for i, b in enumerate(batches):
                    print(json.dumps(dict(run(_rows(args, b), backend, engine, warm=i == 0), run=k)), flush=True)
                engine.close()
                del engine
            _release()


if __name__ == "__main__":
    main()
