"""Sampling cost per step: `python -m chunkserve.replicas.tools.bench_sampler [--rows 64 256] [--vocab 128256]` prints
one JSON line per (rows, logits, sampling params): milliseconds per `sample` call (batched), per
call of the one-row reference over every row (with --reference), and the largest set of tokens a
row's filters keep.

Logits are random normal times a scale: 8 gives peaked rows (a nucleus of a few tokens), 1 flat
ones (tens of thousands). Real next-token distributions are mostly peaked. CUDA if available.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from chunkserve.replicas.engine import sampler
from chunkserve.replicas.engine.sequence import SamplingParams

CASES = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top-k 50, top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9, top_k=50),
    "top-k 50": SamplingParams(temperature=0.8, top_k=50),
}


def _ms(fn, device: torch.device, reps: int) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps * 1e3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.replicas.tools.bench_sampler", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--scales", type=float, nargs="*", default=[8.0, 1.0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--reference", action="store_true", help="also time the one-row reference, row by row")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in args.rows:
        for scale in args.scales:
            logits = torch.randn(rows, args.vocab, device=device, generator=gen) * scale
            for name, p in CASES.items():
                # every row keyed, as the engine keys every sampling request
                params, keys, counters = [p] * rows, list(range(rows)), [0] * rows
                row = dict(
                    bench="sampler",
                    device=str(device),
                    rows=rows,
                    vocab=args.vocab,
                    logits_scale=scale,
                    case=name,
                    batched_ms=round(_ms(lambda: sampler.sample(logits, params, keys, counters), device, args.reps), 3),
                    kept_max=int((sampler._probs(params, logits) > 0).sum(-1).max()),
                )
                if args.reference:
                    row["row_by_row_ms"] = round(
                        _ms(
                            lambda: [sampler.sample_row_ref(x, p, i, 0) for i, x in enumerate(logits)],
                            device,
                            max(1, args.reps // 5),
                        ),
                        3,
                    )
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
