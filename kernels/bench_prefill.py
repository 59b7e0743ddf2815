"""``python -m kernels.bench prefill``: one layer's attention for a prefill piece after a long
cached context, dense against block-union sparse (DESIGN §5), one JSON object per line.

    python -m kernels.bench prefill [--contexts 8192 32768] [--piece 2048] [--heads 32/8 32/32]
                                    [--densities 0.1 0.25 0.5 1.0] [--chunk-size 64]

Per case (context tokens, piece tokens, heads; bf16, head dim 128, the piece's K/V in the pool):
- ``dense_us``: FlashInfer's paged prefill over the whole chunk table
  (kernels.paged_prefill.FlashInferPrefill.run; its plan, made once per step, not timed);
- ``select_us``: block-union's selection for the piece (block keys from the pool's chunk means,
  the Triton scores, the threshold and unions, the chunk masks);
- ``sparse_us`` per density d: FlashInferPrefill.run_sparse over page lists keeping that share
  of the context's blocks (drawn at random per list, plus sink and window), planned layer by
  layer as the engine does (the read-back of the lists' lengths and the plan are timed).
  A layer of the engine costs select_us + sparse_us at the density its selection gives.
Timed eagerly (host work included: the sparse path waits for the device each layer), median of
the repeats. Needs CUDA and flashinfer.
"""

from __future__ import annotations

import json
import random
import time

import torch

from kernels import block_union
from kernels.block_union import BlockUnion
from kernels.paged_prefill import FlashInferPrefill, SparsePiece


def _time(fn, reps: int) -> float:
    """Median µs of fn(), each call timed from the host after a synchronize (eager: its host work
    counts)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6)
    return sorted(times)[len(times) // 2]


def run_case(context: int, piece: int, hq: int, hkv: int, c: int, densities: list[float], reps: int,
             cfg: BlockUnion) -> dict:
    d, dtype, dev = 128, torch.bfloat16, torch.device("cuda")
    total = context + piece
    used = -(-total // c)
    num_chunks = used + 8
    k = torch.randn(num_chunks, hkv, c, d, device=dev, dtype=dtype)
    v = torch.randn(num_chunks, hkv, c, d, device=dev, dtype=dtype)
    table = list(range(num_chunks))
    random.Random(context).shuffle(table)
    table = table[:used]
    q = torch.randn(piece, hq, d, device=dev, dtype=dtype)
    fi = FlashInferPrefill(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, chunk_size=c, dtype=dtype, device=dev,
                           sm_scale=d ** -0.5)
    fi.plan([(table, context, piece)])
    dense_us = _time(lambda: fi.run(q, k, v), reps)

    means = k.float().mean(2)  # [N, Hkv, D]: the pool's chunk means
    tab = torch.tensor(table, device=dev)
    bc, k0 = cfg.block // c, context // c
    sub = block_union.subgroup_size(hq, hkv, cfg.subgroup)

    def select():
        keys = block_union.block_keys(means, tab[:k0], bc)
        scores = block_union.block_scores(q, keys, cfg.block, d ** -0.5)
        keep = block_union.select_blocks(scores, hkv, sub, cfg)
        return block_union.chunk_mask(keep, bc, k0, used)

    select_us = _time(select, reps)
    e, nb = hq // sub, -(-k0 // bc)
    rng = torch.Generator(device="cpu").manual_seed(context)
    row = dict(context=context, piece=piece, hq=hq, hkv=hkv, head_dim=d, dtype="bf16", chunk_size=c,
               block=cfg.block, entries=e, dense_us=round(dense_us, 1), select_us=round(select_us, 1))
    for dens in densities:
        keep = torch.rand(e, nb, generator=rng) < dens
        keep[:, :cfg.sink] = True
        keep[:, max(0, nb - cfg.window):] = True
        mask = block_union.chunk_mask(keep.to(dev), bc, k0, used)
        pieces = [SparsePiece(q, mask, tab, total)]
        sparse_us = _time(lambda: fi.run_sparse(pieces, k, v), reps)
        kept = mask[:, :k0].float().mean().item()
        row[f"sparse_us@{dens}"] = round(sparse_us, 1)
        row[f"kept@{dens}"] = round(kept, 3)
        row[f"speedup@{dens}"] = round(dense_us / (select_us + sparse_us), 2)
    return row


def main(args) -> None:
    cfg = BlockUnion()
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, block=cfg.block,
                          sink=cfg.sink, window=cfg.window, subgroup=cfg.subgroup)), flush=True)
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for context in args.contexts:
            print(json.dumps(run_case(context, args.piece, hq, hkv, args.chunk_size, args.densities, args.reps,
                                      cfg)), flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="a prefill piece after a long context: dense vs block-union sparse")
    p.add_argument("--contexts", type=int, nargs="*", default=[8192, 16384, 32768, 65536])
    p.add_argument("--piece", type=int, default=2048)
    p.add_argument("--heads", nargs="*", default=["32/8", "32/32"], help="query/KV heads")
    p.add_argument("--densities", type=float, nargs="*", default=[0.1, 0.25, 0.5, 1.0])
    p.add_argument("--chunk-size", type=int, default=64, choices=[16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=10)
