"""Fused RMSNorm (with the residual add before it), rotary embedding, SiLU-and-multiply and the
K/V store, in Triton.

Eager torch runs RMSNorm as eight elementwise kernels and RoPE as five per tensor: about 830
launches per decode step of a 32-layer model (counted from the ops). These do each in one
launch, which shortens even a CUDA-graphed decode step (figures: chunkserve/kernels/tools/records/README.md,
'Figures behind the code'), rounding as torch does so that the results match the plain-torch
references, which are the model's own ops in `chunkserve.replicas.model.layers`:

- `rmsnorm(x, weight, eps, residual=None, inplace=False)` against `layers.rms_norm`: with a
  residual, h = x + residual rounded to x's dtype first (returned too, the next residual; with
  inplace written over the residual); then y = weight * (hf *
  rsqrt(mean(hf²) + eps)) rounded to the dtype before the scale (HF's order). The sum of squares
  is reduced in another order than torch's, so a result may differ from torch's in its last bit.
- `rope(q, k, cos, sin)` against `layers.apply_rotary`: x * cos + rotate_half(x) * sin with each
  product and the sum rounded to the dtype, as torch's three ops round: equal to torch's bits.
  q's heads and k's in one launch.
- `rope_store(q, k, v, cos, sin, k_cache, v_cache, chunk_idx, offset, q_out)`: `rope` and
  `store_kv` in one launch, q rotated into q_out (a static buffer of the piecewise graphs), the
  rotated k straight into its pool slot: a layer's K/V store, RoPE and the copy of q out of the
  fused qkv output in one kernel where they took three.
- `store_kv(k_cache, v_cache, chunk_idx, offset, k, v)` against the index assignment of
  `KVPool.write`: a step's new K and V into their pool slots in one launch where torch's index
  assignments take two a layer (figures: chunkserve/replicas/tools/records/README.md,
  h200-2026-12-07).
- `silu_mul(x)` against `layers.silu_and_mul`: silu(gate) * up of x = [gate | up], silu(g) =
  g / (1 + exp(-g)) in fp32 (CUDA's expf, a correctly rounded division) rounded to the dtype,
  then the product rounded, as torch's two ops: equal to torch's bits. One pass over x and one
  write where torch's two ops read x, write silu(gate), read it and up again and write y.

They run on CUDA and under TRITON_INTERPRET=1 (tests); `layers.py` keeps the torch ops on the CPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

__all__ = ["rmsnorm", "rope", "rope_store", "silu_mul", "store_kv"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rmsnorm_kernel(
    X, R, W, Y, H, stride_x, stride_r, stride_y, stride_h, n, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    # grid: (T,): row t of x [T, n] (and of residual), one block of n elements
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:  # h = x + residual, rounded to the dtype as torch's add rounds
        x = (x.to(tl.float32) + tl.load(R + t * stride_r + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(H + t * stride_h + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt_rn(tl.sum(xf * xf, 0) / n + eps)
    xn = (xf * inv).to(x.dtype)
    w = tl.load(W + offs, mask=mask, other=0.0)
    tl.store(Y + t * stride_y + offs, (w.to(tl.float32) * xn.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rmsnorm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, inplace: bool = False):
    """x, residual: [T, N] (rows with a contiguous last dim), weight: [N]. Returns y, or (y, h)
    with a residual (h = x + residual, the next layer's residual; inplace: written over residual,
    which is returned, as vLLM's fused_add_rms_norm does: a row is read before it is written)."""
    t, n = x.shape
    y = torch.empty(t, n, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    h = None if residual is None else residual if inplace else torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(n)
        r = residual if residual is not None else x
        _rmsnorm_kernel[(t,)](
            x,
            r,
            weight,
            y,
            h if h is not None else y,
            x.stride(0),
            r.stride(0),
            y.stride(0),
            h.stride(0) if h is not None else 0,
            n,
            float(eps),
            HAS_RES=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
        )
    return y if residual is None else (y, h)


@triton.jit
def _rope_kernel(
    Q,
    K,
    Cos,
    Sin,
    OQ,
    OK,
    V,
    VC,
    Chunk,
    Offset,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_ct,
    stride_oqt,
    stride_okt,
    stride_vt,
    stride_vh,
    stride_cn,
    stride_ch,
    stride_cs,
    HQ,
    HKV,
    NQ,
    HEAD: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    HB: tl.constexpr,
    STORE: tl.constexpr,
):
    # grid: (T, NQ + NK): HB head vectors of row t, q's heads in NQ blocks then k's; D = 2 * HALF;
    # out = x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype (torch's
    # mul, mul, add); the row's cos and sin loaded once for its heads. STORE: k's rotated heads go
    # into slot Offset[t] of chunk Chunk[t] of the cache OK ([N, Hkv, c, D] strides stride_c*),
    # and V's same heads into VC's (store_kv's copy), instead of a [T, Hkv, D] OK
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    heads = tl.arange(0, HB)
    offs = tl.arange(0, BLOCK)
    if j < NQ:
        h = j * HB + heads
        mask = (h[:, None] < HQ) & (offs[None, :] < HALF)
        x = Q + t * stride_qt + h[:, None] * stride_qh
        o = OQ + t * stride_oqt + h[:, None] * HEAD
    else:
        h = (j - NQ) * HB + heads
        mask = (h[:, None] < HKV) & (offs[None, :] < HALF)
        x = K + t * stride_kt + h[:, None] * stride_kh
        if STORE:
            slot = tl.load(Chunk + t).to(tl.int64) * stride_cn + tl.load(Offset + t).to(tl.int64) * stride_cs
            o = OK + slot + h[:, None] * stride_ch
            vs = V + t * stride_vt + h[:, None] * stride_vh + offs[None, :]
            vd = VC + slot + h[:, None] * stride_ch + offs[None, :]
            tl.store(vd, tl.load(vs, mask=mask), mask=mask)
            tl.store(vd + HALF, tl.load(vs + HALF, mask=mask), mask=mask)
        else:
            o = OK + t * stride_okt + h[:, None] * HEAD
    x1 = tl.load(x + offs[None, :], mask=mask, other=0.0)
    x2 = tl.load(x + HALF + offs[None, :], mask=mask, other=0.0)
    c = Cos + t * stride_ct
    s = Sin + t * stride_ct
    half = offs < HALF
    c1 = tl.load(c + offs, mask=half, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(c + HALF + offs, mask=half, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(s + offs, mask=half, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(s + HALF + offs, mask=half, other=0.0).to(tl.float32)[None, :]
    dt = x1.dtype
    a1 = (x1.to(tl.float32) * c1).to(dt)
    b1 = (-x2.to(tl.float32) * s1).to(dt)
    a2 = (x2.to(tl.float32) * c2).to(dt)
    b2 = (x1.to(tl.float32) * s2).to(dt)
    tl.store(o + offs[None, :], (a1.to(tl.float32) + b1.to(tl.float32)).to(dt), mask=mask)
    tl.store(o + HALF + offs[None, :], (a2.to(tl.float32) + b2.to(tl.float32)).to(dt), mask=mask)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] (last dim contiguous; views into a fused qkv output are
    fine); cos, sin: [T, D] in q's dtype, contiguous. Returns contiguous rotated copies, both
    from one launch."""
    (t, hq, d), hkv = q.shape, k.shape[1]
    oq = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    ok = torch.empty(t, hkv, d, dtype=k.dtype, device=k.device)
    _rope(q, k, cos, sin, oq, ok, None)
    return oq, ok


def rope_store(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    chunk_idx: Tensor,
    offset: Tensor,
    q_out: Tensor | None = None,
) -> Tensor:
    """`rope` and `store_kv` in one launch: q rotated into q_out (else a new [T, Hq, D], returned),
    k rotated and v as it is into their pool slots (as `store_kv(k_cache, v_cache, chunk_idx,
    offset, *rope(q, k, cos, sin)[1:], v)`): the rotated k never leaves the kernel. q, k, v
    [T, H, D] with contiguous head vectors (views into a fused qkv output are fine); q_out
    contiguous; caches as `store_kv`'s, all of one dtype."""
    t, hq, d = q.shape
    if k_cache.stride() != v_cache.stride() or not (
        q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype
    ):
        raise ValueError("rope_store: K and V caches of one layout, q, k, v, cos, sin and the caches of one dtype")
    if not k_cache.stride(-1) == q.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        raise ValueError("rope_store: head vectors contiguous in q, k, v and the caches")
    if q_out is None:
        q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    elif q_out.shape != q.shape or q_out.dtype != q.dtype or not q_out.is_contiguous():
        raise ValueError("rope_store: q_out a contiguous tensor of q's shape and dtype")
    _rope(q, k, cos, sin, q_out, k_cache, (v, v_cache, chunk_idx, offset))
    return q_out


def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, oq: Tensor, ok: Tensor, store) -> None:
    # store: None (ok [T, Hkv, D]), or (v, v_cache, chunk_idx, offset) with ok the K cache
    (t, hq, d), hkv = q.shape, k.shape[1]
    if not t:
        return
    block = triton.next_power_of_2(d // 2)
    # a program per row and block of heads (as many as k has, up to about 1024 elements a
    # half): one per head vector left a long prompt's RoPE several times its memory time
    hb = min(triton.next_power_of_2(hkv), max(1, 1024 // block))
    nq = triton.cdiv(hq, hb)
    v, vc, chunk, off = store if store is not None else (k, ok, cos, cos)  # (unused without STORE)
    cs = (ok.stride(0), ok.stride(1), ok.stride(2)) if store is not None else (0, 0, 0)
    # no FMA contraction: a fused multiply-add would round once where torch rounds twice
    _rope_kernel[(t, nq + triton.cdiv(hkv, hb))](
        q,
        k,
        cos,
        sin,
        oq,
        ok,
        v,
        vc,
        chunk,
        off,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        oq.stride(0),
        ok.stride(0),
        v.stride(0),
        v.stride(1),
        *cs,
        hq,
        hkv,
        nq,
        HEAD=d,
        HALF=d // 2,
        BLOCK=block,
        HB=hb,
        STORE=store is not None,
        num_warps=max(1, min(4, hb * block // 256)),
        enable_fp_fusion=False,
    )


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KC,
    VC,
    Chunk,
    Offset,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cn,
    stride_ch,
    stride_cs,
    HKV,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T,): token t's K and V, every head, into slot Offset[t] of chunk Chunk[t]:
    # KC[n, h, s, :] = K[t, h, :] (the caches [N, Hkv, c, D], K and V's views of one pool)
    t = tl.program_id(0).to(tl.int64)
    n = tl.load(Chunk + t).to(tl.int64)
    s = tl.load(Offset + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    dst = n * stride_cn + s * stride_cs + h * stride_ch + d
    tl.store(KC + dst, tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask), mask=mask)
    tl.store(VC + dst, tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask), mask=mask)


def store_kv(k_cache: Tensor, v_cache: Tensor, chunk_idx: Tensor, offset: Tensor, k: Tensor, v: Tensor) -> None:
    """The new tokens' K/V into their slots, both in one launch: k, v [T, Hkv, D] (last dim
    contiguous), token t into chunk chunk_idx[t] at slot offset[t] of k_cache, v_cache
    [N, Hkv, c, D] (the same strides and dtype as k and v). Where two tokens name one slot (the
    graphs' padding rows, in the scratch chunk) which one lands there is unspecified."""
    t, hkv, d = k.shape
    if k_cache.stride() != v_cache.stride() or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError("store_kv: K and V caches of one layout and dtype, the dtype of k and v")
    if not k_cache.stride(-1) == k.stride(-1) == v.stride(-1) == 1:
        raise ValueError("store_kv: head vectors contiguous in k, v and the caches")
    if t:
        block_h, block_d = triton.next_power_of_2(hkv), triton.next_power_of_2(d)
        _store_kv_kernel[(t,)](
            k,
            v,
            k_cache,
            v_cache,
            chunk_idx,
            offset,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            hkv,
            D=d,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            num_warps=max(1, min(8, block_h * block_d // 256)),
        )


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    # grid: (T, cdiv(n, BLOCK)): a block of row t's y[t] = silu(x[t, :n]) * x[t, n:]
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(X + t * stride_x + offs, mask=mask, other=0.0)
    u = tl.load(X + t * stride_x + n + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    if LIBDEVICE:  # CUDA's expf, as torch's silu calls it (tl.exp is an approximation there)
        e = libdevice.exp(-gf)
    else:  # the interpreter (no libdevice): numpy's exp
        e = tl.exp(-gf)
    s = tl.math.div_rn(gf, 1.0 + e).to(g.dtype)  # torch's silu, rounded to the dtype
    tl.store(Y + t * stride_y + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_mul(x: Tensor) -> Tensor:
    """x: [T, 2I] = [gate | up] (rows with a contiguous last dim) -> silu(gate) * up: [T, I]."""
    t, two_n = x.shape
    n = two_n // 2
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(t, triton.cdiv(n, block))](
            x,
            y,
            x.stride(0),
            y.stride(0),
            n,
            BLOCK=block,
            LIBDEVICE=not _INTERPRETED,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return y
