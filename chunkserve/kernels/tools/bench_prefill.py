"""``python -m chunkserve.kernels.tools.bench prefill``: one layer's attention for a prefill piece after a long
cached context, dense against block-union sparse (DESIGN §8), one JSON object per line.

    python -m chunkserve.kernels.tools.bench prefill [--contexts 8192 32768] [--piece 2048] [--heads 32/8 32/32]
                                    [--densities 0.1 0.25 0.5 1.0] [--chunk-size 64]
                                    [--block 128] [--window 4] [--span 1|0|auto] [--stride 4]

Per case (context tokens, piece tokens, heads; bf16, head dim 128, the piece's K/V in the pool),
µs per layer, each timed over 8 back-to-back calls as a forward's layers run (host work
overlapping the device's; median of the repeats):
- ``dense_us``: FlashInfer's paged prefill over the whole chunk table
  (chunkserve.kernels.paged_prefill.FlashInferPrefill.run; its plan, once per step, not timed);
- per budget d (``pages@d``: the pages the lists read over the dense piece's, sink, window and
  own chunks included): ``budget_us@d``: BlockUnion(budget=d, block, window, span) as the
  engine runs a layer: with spans, the piece's own chunks' key bounds; the block bounds from the
  pool's chunk key bounds and the normalised scores (Triton), the best blocks, their page ids
  written into the lists planned once per step (not timed), FlashInfer over them;
  ``speedup@d`` = dense / budget; ``select_us@d``: its selection alone (bounds, scores, the
  best blocks, their page ids);
  ``alpha_us@d`` (without spans): alpha's threshold as the engine runs a layer (selection, the
  lists' lengths read back, a FlashInfer plan, the run) over lists of that share drawn at
  random (random keys score flat: the threshold would keep everything).
Needs CUDA and flashinfer.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import torch

from chunkserve.kernels import block_union
from chunkserve.kernels.block_union import BlockUnion
from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.paged_prefill import FlashInferPrefill, SparsePiece


def _per_call(fn, calls: int, reps: int) -> float:
    """Median µs per call of `calls` back-to-back calls of fn (as a forward's layers run them:
    host work overlaps the device's, waits included), synchronized only around them."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return sorted(times)[len(times) // 2]


def run_case(
    context: int,
    piece: int,
    hq: int,
    hkv: int,
    c: int,
    densities: list[float],
    reps: int,
    layers: int = 8,
    knobs: dict | None = None,
) -> dict:
    """knobs: BlockUnion fields besides the budget (block, window, span)."""
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
    fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=dev, sm_scale=d**-0.5)
    fi.plan([(table, context, piece)])
    row: dict[str, Any] = dict(context=context, piece=piece, hq=hq, hkv=hkv, head_dim=d, dtype="bf16", chunk_size=c)
    row["dense_us"] = round(_per_call(lambda: fi.run(q, k, v), layers, reps), 1)

    bounds = block_union.chunk_key_bounds_ref(k)  # [N, Hkv, 2D]: the pool's chunk key bounds
    tab = torch.tensor(table, device=dev)
    k0 = context // c
    rng = torch.Generator(device="cpu").manual_seed(context)
    for dens in densities:
        # a budget: planned once (not timed, as the dense plan), each layer selects and rewrites
        cfg = BlockUnion(budget=dens, **(knobs or {}))
        bc, sub = cfg.block // c, block_union.subgroup_size(hq, hkv, cfg.subgroup)
        e, nb = hq // sub, -(-k0 // bc)
        pages, planned, dst, counts, limits = block_union.budget_piece(table, context, piece, c, cfg, hkv, e)
        ids = torch.tensor(pages, dtype=torch.int32, device=dev)
        fi.plan_sparse(ids, planned)
        dst_d, counts_d = torch.tensor(dst, device=dev), torch.tensor(counts, dtype=torch.int32, device=dev)
        exclude = block_union.budget_exclude(cfg, torch.tensor(limits, device=dev)[:, None], max(limits))
        q_limits = torch.tensor(block_union.query_limits(context, piece, c, cfg), dtype=torch.int32, device=dev)
        parts = block_union.piece_spans(context, piece, cfg.span_rows(context))
        k_last = parts[-1][0] // c
        own = tab[k0:k_last]
        out = torch.empty_like(q)

        def agg(cfg=cfg, limits=q_limits):
            if own.numel():  # the piece's own chunks its later spans choose among (as the engine, per layer)
                block_union.chunk_key_bounds(k[None], own, bounds[None])
            keys = block_union.block_keys_gpu(bounds, tab[:k_last], bc, q.dtype)
            return block_union.block_scores_gpu(q, keys, cfg, sub, d**-0.5, limits, context)

        def select():
            chosen = block_union.budget_blocks(agg(), cfg, None, exclude)
            block_union.write_pages(ids, dst_d, counts_d, chosen, tab, bc, hkv, e)

        def budget_layer():
            select()
            return fi.run_planned_sparse([q], k, v, [out])

        dense_pages = sum(-(-(ctx + n) // c) for ctx, n in parts)
        row[f"pages@{dens}"] = round(len(pages) / (e * dense_pages), 3)
        row[f"budget_us@{dens}"] = round(_per_call(budget_layer, layers, reps), 1)
        row[f"select_us@{dens}"] = round(_per_call(select, layers, reps), 1)
        if cfg.span is None:
            # alpha's threshold: selection as the engine runs it, lists of that share at random
            # (random keys score flat), planned layer by layer (one piece: without spans)
            alpha = BlockUnion(**(knobs or {}))
            keep = torch.rand(e, nb, generator=rng) < dens
            keep[:, : cfg.sink] = True
            keep[:, nb - cfg.window :] = True
            mask = block_union.chunk_mask(keep.to(dev), bc, k0, used)

            def alpha_layer(alpha=alpha, mask=mask):
                block_union.chunk_mask(block_union.select_blocks(agg(alpha), alpha), bc, k0, used)
                return fi.run_sparse([SparsePiece(q, mask, tab, total)], k, v, [out])

            row[f"alpha_us@{dens}"] = round(_per_call(alpha_layer, layers, reps), 1)
        row[f"speedup@{dens}"] = round(row["dense_us"] / row[f"budget_us@{dens}"], 2)
    return row


def main(args) -> None:
    knobs = {key: getattr(args, key) for key in ("block", "window", "span", "stride") if getattr(args, key) is not None}
    if "span" in knobs:
        knobs["span"] = None if knobs["span"] == "0" else "auto" if knobs["span"] == "auto" else int(knobs["span"])
    cfg = BlockUnion(budget=min(args.densities, default=1.0), **knobs)  # (the header: the knobs as set)
    print(
        json.dumps(
            dict(
                device=torch.cuda.get_device_name(),
                torch=torch.__version__,
                block=cfg.block,
                sink=cfg.sink,
                window=cfg.window,
                subgroup=cfg.subgroup,
                span=cfg.span,
                stride=cfg.stride,
                spread=cfg.spread,
            )
        ),
        flush=True,
    )
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for context in args.contexts:
            print(
                json.dumps(
                    run_case(context, args.piece, hq, hkv, args.chunk_size, args.densities, args.reps, knobs=knobs)
                ),
                flush=True,
            )


def add_parser(sub) -> None:
    p = sub.add_parser("prefill", help="a prefill piece after a long context: dense vs block-union sparse")
    p.add_argument("--contexts", type=int, nargs="*", default=[8192, 16384, 32768, 65536])
    p.add_argument("--piece", type=int, default=2048)
    p.add_argument("--heads", nargs="*", default=["32/8", "32/32"], help="query/KV heads")
    p.add_argument("--densities", type=float, nargs="*", default=[0.1, 0.25, 0.5, 1.0])
    p.add_argument("--chunk-size", type=int, default=64, choices=[16, 32, 64, 128])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--block", type=int, help="BlockUnion's block (default: its default)")
    p.add_argument("--window", type=int, help="BlockUnion's window")
    p.add_argument("--stride", type=int, help="BlockUnion's stride (score every stride-th query row)")
    p.add_argument("--span", help="BlockUnion's span (query blocks a list serves; 0: the piece; auto)")
