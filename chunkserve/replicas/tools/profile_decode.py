"""Where a decode step's time goes: `python -m chunkserve.replicas.tools.profile_decode [options]`
prints one JSON line per batch size: the step's wall time (unprofiled), the device's busy time
a step (the union of its kernels' intervals under torch.profiler), the idle rest, the kernel time
by kind (GEMMs, attention, norm/RoPE, sampling, copies, other) and the top kernels; beside them
the floor a step cannot beat, the model's weights read once at the bandwidth a large
device-to-device copy reaches in the same run.

    python -m chunkserve.replicas.tools.profile_decode --model llama3-8b --batch 1,8,16,32,64 \\
        --prefix 2048 --suffix 64 --kv-cache-tokens 262144

    python -m chunkserve.replicas.tools.profile_decode ... --prefix 0 --suffix 1024 --arrival 1024
                                                # nothing shared; every step also prefills a new
                                                # 1024-token prompt (a mixed step)

    python -m chunkserve.replicas.tools.profile_decode --prompt 32768 --batch 1
                                                # one fresh prompt's prefill to its first token
                                                # (its steps together), not a decode step

Rows share a `--prefix`-token prompt and have `--suffix` own tokens, as the load test's gsp; the
engine is the replica's (CUDA graphs, async scheduling: EngineConfig's defaults on the device).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import torch
from torch.profiler import ProfilerActivity, profile

from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, SamplingParams

KINDS = (  # first match wins; names as the CUDA kernels are called (FlashInfer's sm90 kernels are
    # cutlass templates: attention before gemm)
    ("attention", re.compile(r"tpp|attn|attend|attention|merge|flash|prefill|paged|decode", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul|sm90_", re.I)),
    ("kv_write", re.compile(r"index_put|scatter|store_kv", re.I)),  # the step's K/V into the pool
    ("norm_rope", re.compile(r"norm|rope|rotary", re.I)),
    ("sampler", re.compile(r"sampl|nucleus|philox|argmax|topk|top_k|softmax|multinomial", re.I)),
    ("copy", re.compile(r"memcpy|memset|copy", re.I)),
)


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if pat.search(name)), "other")


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 31) -> float:
    """Bytes a second (read + write) of a device-to-device copy of nbytes: the step's memory floor."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    n = 10
    for _ in range(n):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * nbytes * n / (time.perf_counter() - t0)


def union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_batch(engine: LLMEngine, args: argparse.Namespace, batch: int, run: int) -> dict:
    rng = random.Random(run)
    prefix = [rng.randrange(256, 30000) for _ in range(args.prefix)]
    budget = args.warm_steps + 2 * args.steps + 8
    for i in range(batch):
        engine.add_request(
            f"{run}.{i}",
            prefix + [rng.randrange(256, 30000) for _ in range(args.suffix)],
            SamplingParams(max_tokens=budget, ignore_eos=True),
        )
    sync = torch.cuda.synchronize
    arrivals = 0

    def step() -> None:  # one engine step; with --arrival, a fresh prompt of that many tokens joins it
        nonlocal arrivals
        if args.arrival:
            engine.add_request(
                f"{run}.a{arrivals}",
                [rng.randrange(256, 30000) for _ in range(args.arrival)],
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
            arrivals += 1
        engine.step()

    while any(len(s.output_ids) == 0 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warm_steps):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    wall_ms = 1e3 * (time.perf_counter() - t0) / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        sync()
    for i in range(batch):
        engine.abort(f"{run}.{i}")
    while engine.has_unfinished():
        engine.step()
    split = kernel_split(prof, args.steps, args.top)
    return {
        "batch": batch,
        "wall_ms_per_step": round(wall_ms, 3),
        "device_busy_ms_per_step": split["device_busy_ms"],
        "device_idle_ms_per_step": round(max(0.0, wall_ms - split["device_busy_ms"]), 3),
        "kernels_per_step": split["kernels"],
        "kind_ms_per_step": split["kind_ms"],
        "top": [  # (per step, as the records before --prompt name them)
            {"name": t["name"], "kind": t["kind"], "ms_per_step": t["ms"], "calls_per_step": t["calls"]}
            for t in split["top"]
        ],
    }


def profile_prompt(engine: LLMEngine, args: argparse.Namespace) -> dict:
    """One fresh --prompt-token prompt from arrival to its first token, alone: wall time (the
    second of two, unprofiled), then a third under the profiler, by kind as a step's."""
    rng = random.Random(args.prompt)
    steps = [0, 0, 0]  # each run's engine steps

    def run(i: int) -> None:
        engine.add_request(
            f"p{i}", [rng.randrange(256, 30000) for _ in range(args.prompt)], SamplingParams(max_tokens=1)
        )
        while engine.has_unfinished():
            engine.step()
            steps[i] += 1
        torch.cuda.synchronize()

    run(0)
    t0 = time.perf_counter()
    run(1)
    wall_ms = 1e3 * (time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(2)
    return {"prompt": args.prompt, "wall_ms": round(wall_ms, 1), "steps": steps[1], **kernel_split(prof, 1, args.top)}


def kernel_split(prof, per: int, top_n: int) -> dict:
    """The profiled kernels' device time: busy (their intervals' union), by kind and the top
    names, each divided by per (steps)."""
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = union_us([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3 / per
    by_kind: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_kind[kind(e.name)] = by_kind.get(kind(e.name), 0.0) + us
        by_name.setdefault(e.name, []).append(us)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top_n]
    return {
        "device_busy_ms": round(busy_ms, 3),
        "kernels": round(len(kernels) / per, 1),
        "kind_ms": {k: round(v / 1e3 / per, 3) for k, v in sorted(by_kind.items())},
        "top": [
            {"name": n[:120], "kind": kind(n), "ms": round(sum(v) / 1e3 / per, 3), "calls": len(v) / per}
            for n, v in top
        ],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", default="1,8,16,32,64", help="comma-separated batch sizes, one engine")
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--kv-cache-tokens", type=int, default=262144)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed, then as many profiled")
    p.add_argument("--warm-steps", type=int, default=8)
    p.add_argument(
        "--arrival",
        type=int,
        default=0,
        help="a fresh prompt of this many tokens (nothing shared, one output token) joins every step: "
        "mixed steps, as under Poisson arrivals of `random` traffic",
    )
    p.add_argument(
        "--prompt",
        type=int,
        default=0,
        help="profile one fresh prompt of this many tokens to its first token (a prefill), not decode steps",
    )
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode needs a CUDA device")
    batches = [int(b) for b in args.batch.split(",")]
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cuda",
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            kv_cache_tokens=args.kv_cache_tokens,
            max_num_seqs=max(batches),
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
    )
    # every weight a step reads whole (the embedding table only its rows: left out)
    weight_bytes = sum(
        t.numel() * t.element_size() for n, t in engine.runner.model.named_parameters() if "embed" not in n
    )
    bw = copy_bandwidth(engine.device)
    floor = {
        "weight_bytes": weight_bytes,
        "copy_bytes_per_s": round(bw),
        "weights_floor_ms": round(1e3 * weight_bytes / bw, 3),
    }
    print(
        json.dumps({"tool": "profile_decode", "model": args.model, "device": torch.cuda.get_device_name(), **floor}),
        flush=True,
    )
    if args.prompt:
        print(json.dumps({"tool": "profile_decode", "model": args.model, **profile_prompt(engine, args)}), flush=True)
        return
    for run, b in enumerate(batches):
        print(
            json.dumps(
                {
                    "tool": "profile_decode",
                    "model": args.model,
                    "prefix": args.prefix,
                    "suffix": args.suffix,
                    "arrival": args.arrival,
                    **profile_batch(engine, args, b, run),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
