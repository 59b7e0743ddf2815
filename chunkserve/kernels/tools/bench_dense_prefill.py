"""``python -m chunkserve.kernels.tools.bench dense``: one layer's dense attention for the last
prefill piece of a long prompt, by the layout the K/V sit in, one JSON object per line (issue
#46: a 64K prompt's TTFT was 1.25x vLLM's on an H100, its prefill attention running at about
400 TFLOP/s where vLLM's whole TTFT implies about 550; chunkserve/replicas/tools/records,
h100-2026-12-06d).

    python -m chunkserve.kernels.tools.bench dense [--contexts 24576 57344] [--piece 8192]
                                   [--heads 32/8] [--chunk-sizes 64 128 256] [--reps 10]

Per case (cached context tokens, piece tokens, heads; bf16, head dim 128, causal bottom-right),
µs per layer, each the median over `reps` of 4 back-to-back calls (as a forward's layers run):
- ``paged_c{c}``: FlashInfer's paged prefill over the pool as the engine keeps it
  ([chunks, Hkv, c, D], "HND", page size c; the prompt's chunks scattered in the pool), through
  ``chunkserve.kernels.paged_prefill.FlashInferPrefill``, for each chunk size;
- ``paged_c64_in_order``: the same over chunks that follow each other in the pool;
- ``paged_nhd_c64``: FlashInfer's paged prefill over a pool in the "NHD" layout
  ([chunks, c, Hkv, D]);
- ``ragged``: FlashInfer's ragged prefill over the prompt's K/V contiguous ([tokens, Hkv, D]);
- ``gather``: copying the prompt's K and V out of the engine's pool into that contiguous form
  (what a ragged path would add to each layer);
- ``sdpa_flash``: torch's scaled_dot_product_attention on its flash backend (FlashAttention-2)
  with a lower-right causal mask (``causal_lower_right``, which that backend runs without
  materialising it) over the contiguous K/V (the KV heads repeated, not timed), or the error it
  gave.
Each time's attention rate, ``tflops_*`` (4 · Hq · D · the causal pairs), and each output's largest
difference from ``paged_c64``'s (``diff_*``: the layouts must agree). Needs CUDA and flashinfer.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from typing import Any

import torch

from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.paged_prefill import FlashInferPrefill
from chunkserve.kernels.tools.bench_prefill import _per_call

_CALLS = 4  # back-to-back calls a timing (the K/V of a long context is far past the L2)


def _host(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def causal_flops(context: int, piece: int, hq: int, d: int) -> float:
    """FLOPs of one layer's causal attention for `piece` queries after `context` keys: each query
    row i sees context + i + 1 keys, 2 · d for its score and 2 · d for its share of the output."""
    pairs = piece * context + piece * (piece + 1) // 2
    return 4.0 * hq * d * pairs


def _pool(k: torch.Tensor, table: list[int], c: int, num_chunks: int, nhd: bool) -> torch.Tensor:
    """A pool of num_chunks chunks holding the contiguous [T, Hkv, D] keys k at `table`'s chunks
    in order: [N, Hkv, c, D] ("HND") or [N, c, Hkv, D] ("NHD")."""
    t, hkv, d = k.shape
    padded = torch.zeros(len(table) * c, hkv, d, dtype=k.dtype, device=k.device)
    padded[:t] = k
    chunks = padded.view(len(table), c, hkv, d)
    pool = torch.zeros(num_chunks, c, hkv, d, dtype=k.dtype, device=k.device)
    pool[torch.tensor(table, device=k.device)] = chunks
    return pool if nhd else pool.permute(0, 2, 1, 3).contiguous()


def run_case(context: int, piece: int, hq: int, hkv: int, chunk_sizes: list[int], reps: int) -> dict:
    import flashinfer

    d, dtype, dev = 128, torch.bfloat16, torch.device("cuda")
    total, scale = context + piece, d**-0.5
    gen = torch.Generator(device=dev).manual_seed(context + piece)
    q = torch.randn(piece, hq, d, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(total, hkv, d, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(total, hkv, d, device=dev, dtype=dtype, generator=gen)
    flops = causal_flops(context, piece, hq, d)
    row: dict[str, Any] = dict(context=context, piece=piece, hq=hq, hkv=hkv, head_dim=d, dtype="bf16")
    outs: dict[str, torch.Tensor] = {}

    def timed(name: str, fn: Callable[[], torch.Tensor]) -> None:
        outs[name] = fn().reshape(piece, hq, d)
        us = _per_call(fn, _CALLS, reps)
        row[f"{name}_us"] = round(us, 1)
        row[f"tflops_{name}"] = round(flops / us / 1e6, 1)

    def scattered(n: int) -> list[int]:
        table = list(range(n + 8))
        random.Random(n).shuffle(table)
        return table[:n]

    for c in chunk_sizes:  # the engine's path, as its pool holds a prompt
        used = -(-total // c)
        table = scattered(used)
        kp, vp = _pool(k, table, c, used + 8, False), _pool(v, table, c, used + 8, False)
        fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=dev, sm_scale=scale)
        fi.plan([(table, context, piece)])
        timed(f"paged_c{c}", functools.partial(fi.run, q, kp, vp))
        if c == 64:
            ordered = list(range(used))
            ko, vo = _pool(k, ordered, c, used, False), _pool(v, ordered, c, used, False)
            fo = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=dev, sm_scale=scale)
            fo.plan([(ordered, context, piece)])
            timed("paged_c64_in_order", lambda: fo.run(q, ko, vo))
            # the gather a ragged path would add: the prompt's chunks out of the engine's pool
            tab = torch.tensor(table, device=dev)
            kc = torch.empty(used, c, hkv, d, dtype=dtype, device=dev)
            vc = torch.empty_like(kc)

            def gather(kp=kp, vp=vp, tab=tab, kc=kc, vc=vc) -> torch.Tensor:
                kc.copy_(kp.index_select(0, tab).transpose(1, 2))
                vc.copy_(vp.index_select(0, tab).transpose(1, 2))
                return kc

            gather()
            row["gather_us"] = round(_per_call(gather, _CALLS, reps), 1)
            row["diff_gather"] = round(float((kc.view(-1, hkv, d)[:total] - k).abs().max()), 4)

    # NHD pool, page size 64
    used = -(-total // 64)
    table = scattered(used)
    kn, vn = _pool(k, table, 64, used + 8, True), _pool(v, table, 64, used + 8, True)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    nhd = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    nhd.plan(
        _host([0, piece]),
        _host([0, used]),
        _host(table).to(dev),
        _host([total - (used - 1) * 64]),
        hq,
        hkv,
        d,
        64,
        causal=True,
        sm_scale=scale,
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    timed("paged_nhd_c64", lambda: nhd.run(q, (kn, vn)))

    ws2 = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws2, "NHD")
    ragged.plan(
        _host([0, piece]),
        _host([0, total]),
        hq,
        hkv,
        d,
        causal=True,
        sm_scale=scale,
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    timed("ragged", lambda: ragged.run(q, k, v))

    try:  # torch's FlashAttention-2, lower-right causal (the piece's rows after the context)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        g = hq // hkv
        qs = q.transpose(0, 1)[None]  # [1, Hq, n, D]
        ks = k.repeat_interleave(g, dim=1).transpose(0, 1)[None]  # [1, Hq, T, D]
        vs = v.repeat_interleave(g, dim=1).transpose(0, 1)[None]
        mask = causal_lower_right(piece, total)

        def sdpa() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
            return o[0].transpose(0, 1)

        timed("sdpa_flash", sdpa)
    except Exception as e:  # noqa: BLE001 - an unsupported backend or mask is a finding, printed
        row["sdpa_flash"] = f"{type(e).__name__}: {str(e)[:200]}"

    want = outs["paged_c64"].float()
    for name, o in outs.items():
        if name != "paged_c64":
            row[f"diff_{name}"] = round(float((o.float() - want).abs().max()), 4)
    return row


def main(args) -> None:
    print(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__)), flush=True)
    for heads in args.heads:
        hq, hkv = (int(x) for x in heads.split("/"))
        for context in args.contexts:
            print(json.dumps(run_case(context, args.piece, hq, hkv, args.chunk_sizes, args.reps)), flush=True)


def add_parser(sub) -> None:
    p = sub.add_parser("dense", help="a long prompt's last prefill piece: dense attention by K/V layout")
    p.add_argument("--contexts", type=int, nargs="*", default=[24576, 57344], help="cached tokens before the piece")
    p.add_argument("--piece", type=int, default=8192)
    p.add_argument("--heads", nargs="*", default=["32/8"], help="query/KV heads")
    p.add_argument("--chunk-sizes", type=int, nargs="*", default=[64, 128, 256])
    p.add_argument("--reps", type=int, default=10)
