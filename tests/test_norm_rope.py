"""chunkserve/kernels/norm_rope.py against its plain-torch references, the model's ops in replicas.model.layers.

Without CUDA the kernels run under the Triton interpreter (conftest.py); with CUDA on the GPU."""

from __future__ import annotations

import pytest
import torch

from chunkserve.kernels.norm_rope import rmsnorm, rope, rope_store, silu_mul, store_kv
from chunkserve.replicas.engine.kv_pool import KVPool, KVShape
from chunkserve.replicas.model.layers import (
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    apply_rotary_qk,
    rms_norm,
    silu_and_mul,
    silu_mul_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter (Triton 3.9) converts fp32 to bf16 by truncating, not rounding to nearest: there
# each bf16 rounding may land one place lower (on the GPU the conversion rounds as torch's does)
TRUNCATES = DEVICE == "cpu"


def ulps(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest difference in units of the last place of `want`'s dtype."""
    eps = torch.finfo(want.dtype).eps
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return int(((got.float() - want.float()).abs() / (scale * eps)).max().ceil().item()) if want.numel() else 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(0, 64), (1, 256), (7, 96), (33, 512)])
@pytest.mark.parametrize("with_residual,inplace", [(False, False), (True, False), (True, True)])
def test_rmsnorm_matches_torch(dtype, rows, n, with_residual, inplace):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, res = (torch.randn(rows, n, generator=gen).mul(3).to(DEVICE, dtype) for _ in range(2))
    w = (1 + torch.randn(n, generator=gen) / 4).to(DEVICE, dtype)
    # rows of a wider tensor: the kernel takes strided rows
    x = torch.cat([x, torch.zeros_like(x)], 1)[:, :n]
    res0 = res.clone()
    got = rmsnorm(x, w, 1e-5, res if with_residual else None, inplace)
    assert torch.equal(res, res0) or inplace  # (the residual is written over only in place)
    want = rms_norm(x, w, 1e-5, res0.clone() if with_residual else None, inplace)
    if with_residual:
        (got, got_h), (want, want_h) = got, want
        assert not rows or (got_h.data_ptr() == res.data_ptr()) == inplace  # in place: h is the residual
        # the add rounds as torch's
        assert ulps(got_h, want_h) <= 1 if dtype == torch.bfloat16 and TRUNCATES else torch.equal(got_h, want_h)
    assert got.dtype == want.dtype and got.shape == (rows, n)
    # the sum of squares is reduced in another order: at most a last-place difference
    assert ulps(got, want) <= (4 if dtype == torch.float32 else 3 if dtype == torch.bfloat16 and TRUNCATES else 1)
    if DEVICE == "cuda":  # the model's layer runs the kernel (on the CPU it runs rms_norm itself)
        layer = RMSNorm(n, 1e-5).to(DEVICE)
        layer.weight.data = w
        out = layer(x, res0.clone() if with_residual else None, inplace)
        outs, kernel = (out, (got, got_h)) if with_residual else ((out,), (got,))
        assert len(outs) == len(kernel) and all(torch.equal(o, e) for o, e in zip(outs, kernel))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "rows,hq,hkv,d", [(0, 4, 2, 64), (1, 4, 2, 64), (5, 8, 2, 128), (9, 6, 3, 32), (3, 4, 1, 64), (2, 20, 8, 128)]
)
def test_rope_matches_torch_bit_for_bit(dtype, rows, hq, hkv, d):
    gen = torch.Generator().manual_seed(rows + d)
    # q and k as views into one fused qkv output, as the model makes them
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).mul(4).to(DEVICE, dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(rows, hq, d), k.view(rows, hkv, d)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(d, 500000.0).to(DEVICE)(positions, dtype)
    got, want = rope(q, k, cos, sin), (apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))
    for g, w, x in zip(got, want, (q, k)):
        assert g.is_contiguous()
        if dtype == torch.bfloat16 and TRUNCATES and rows:  # three truncations, a sum that may cancel
            assert (g.float() - w.float()).abs().max() <= 4 * torch.finfo(dtype).eps * x.float().abs().max()
        else:
            assert torch.equal(g, w)
    if DEVICE == "cuda":  # the model's q/k rotation runs the kernel
        assert all(torch.equal(a, b) for a, b in zip(apply_rotary_qk(q, k, cos, sin), got))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(0, 64), (1, 96), (7, 1024), (3, 1500)])
def test_silu_mul_matches_torch(dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    # an MLP's gate_up output: gates spread wide (exp's tails), rows of a wider tensor's views
    x = torch.randn(rows, 2 * n, generator=gen).mul(6).to(DEVICE, dtype)
    x = torch.cat([x, torch.zeros(rows, 8, dtype=dtype, device=DEVICE)], 1)[:, : 2 * n]
    got, want = silu_mul(x), silu_mul_ref(x)
    assert got.shape == want.shape == (rows, n) and got.dtype == want.dtype
    if DEVICE == "cuda":  # torch's bits (libdevice's expf as torch's silu calls it, IEEE division)
        assert torch.equal(got, want)
        assert torch.equal(silu_and_mul(x), got)  # the model's op runs the kernel
    else:  # the interpreter's exp is numpy's, torch's CPU silu vectorized (a last place or two), and
        # its bf16/fp16 conversions truncate (TRUNCATES): a last place more at each rounding
        assert ulps(got, want) <= (3 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hkv,c,d", [(0, 2, 4, 64), (1, 1, 4, 64), (6, 2, 4, 128), (11, 3, 2, 32), (20, 8, 8, 16)])
def test_store_kv_writes_the_slots_the_index_assignment_writes(dtype, rows, hkv, c, d):
    gen = torch.Generator().manual_seed(rows * 31 + hkv)
    num_layers, chunks = 2, 8
    # a pool's layout [L, 2, N, Hkv, c, D]: the caches are one layer's K and V views
    kv = torch.randn(num_layers, 2, chunks, hkv, c, d, generator=gen).to(DEVICE, dtype)
    want = kv.clone()
    # k, v as views into one fused qkv output (strided rows), the rows' slots distinct
    qkv = torch.randn(rows, 3 * hkv * d, generator=gen).mul(4).to(DEVICE, dtype)
    _, k, v = qkv.split([hkv * d, hkv * d, hkv * d], dim=-1)
    k, v = k.view(rows, hkv, d), v.view(rows, hkv, d)
    slots = torch.randperm(chunks * c, generator=gen)[:rows]
    chunk_idx, offset = (slots // c).to(DEVICE), (slots % c).to(DEVICE)
    store_kv(kv[1, 0], kv[1, 1], chunk_idx, offset, k, v)
    want[1, 0][chunk_idx, :, offset] = k
    want[1, 1][chunk_idx, :, offset] = v
    assert torch.equal(kv, want)  # copies: every bit, nothing else touched
    with pytest.raises(ValueError, match="one layout and dtype"):
        store_kv(kv[1, 0], kv[1, 1], chunk_idx, offset, k.float() if dtype != torch.float32 else k.half(), v)
    with pytest.raises(ValueError, match="contiguous"):
        store_kv(kv[1, 0].transpose(2, 3), kv[1, 1].transpose(2, 3), chunk_idx, offset, k, v)


@pytest.mark.gpu  # KVPool.write runs store_kv on CUDA only (the test above runs the kernel everywhere)
def test_the_pools_write_runs_store_kv_on_cuda(monkeypatch):
    import chunkserve.kernels.norm_rope as norm_rope

    calls = []
    monkeypatch.setattr(norm_rope, "store_kv", lambda *a: calls.append(1) or store_kv(*a))
    pool = KVPool(KVShape(num_layers=2, num_kv_heads=2, chunk_size=4, head_dim=64, dtype=torch.bfloat16), 6, "cuda")
    want = pool.kv.clone()
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(5, 2, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    chunk_idx, offset = torch.tensor([0, 0, 3, 5, 2], device="cuda"), torch.tensor([0, 3, 1, 2, 0], device="cuda")
    pool.write(1, chunk_idx, offset, k, v)
    want[1, 0][chunk_idx, :, offset], want[1, 1][chunk_idx, :, offset] = k, v
    assert calls == [1] and torch.equal(pool.kv, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hq,hkv,c,d", [(0, 4, 2, 4, 64), (1, 4, 1, 4, 64), (6, 8, 2, 4, 128), (9, 6, 3, 2, 32)])
@pytest.mark.parametrize("given_out", [False, True])
def test_rope_store_is_rope_then_store_kv(dtype, rows, hq, hkv, c, d, given_out):
    gen = torch.Generator().manual_seed(rows * 13 + hq + d)
    chunks = 8
    kv = torch.randn(2, 2, chunks, hkv, c, d, generator=gen).to(DEVICE, dtype)  # [L, 2, N, Hkv, c, D]
    want = kv.clone()
    # q, k, v as views into one fused qkv output, as the model makes them
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).mul(4).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(rows, hq, d), k.view(rows, hkv, d), v.view(rows, hkv, d)
    positions = torch.randint(0, 4096, (rows,), generator=gen).to(DEVICE)
    cos, sin = RotaryEmbedding(d, 500000.0).to(DEVICE)(positions, dtype)
    slots = torch.randperm(chunks * c, generator=gen)[:rows]
    chunk_idx, offset = (slots // c).to(DEVICE), (slots % c).to(DEVICE)
    out = torch.full((rows, hq, d), 7.0, dtype=dtype, device=DEVICE) if given_out else None
    got = rope_store(q, k, v, cos, sin, kv[1, 0], kv[1, 1], chunk_idx, offset, out)
    want_q, want_k = rope(q, k, cos, sin)  # (the kernel's own bits: rope's test holds them to torch's)
    store_kv(want[1, 0], want[1, 1], chunk_idx, offset, want_k, v)
    assert torch.equal(got, want_q) and got.is_contiguous() and (got is out or not given_out)
    assert torch.equal(kv, want)  # the rotated k and v in their slots, nothing else touched
    with pytest.raises(ValueError, match="one dtype"):
        rope_store(
            q, k, v, cos.float() if dtype != torch.float32 else cos.half(), sin, kv[1, 0], kv[1, 1], chunk_idx, offset
        )
    with pytest.raises(ValueError, match="q_out"):
        rope_store(q, k, v, cos, sin, kv[1, 0], kv[1, 1], chunk_idx, offset, torch.empty(rows, hq + 1, d, dtype=dtype))


def test_the_pools_write_rope_is_rotate_then_write():
    """KVPool.write_rope: on CUDA rope_store (one launch), elsewhere the model's rotation then
    write; either way the bits of rotating, then writing (the CPU here, CUDA in the GPU run)."""
    shape = KVShape(num_layers=2, num_kv_heads=2, chunk_size=4, head_dim=64, dtype=torch.bfloat16)
    pool, ref = KVPool(shape, 6, DEVICE), KVPool(shape, 6, DEVICE)
    gen = torch.Generator().manual_seed(9)
    qkv = torch.randn(5, 8 * 64, generator=gen).mul(3).to(DEVICE, torch.bfloat16)
    q, k, v = (t.view(5, -1, 64) for t in qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1))
    cos, sin = RotaryEmbedding(64, 500000.0).to(DEVICE)(
        torch.tensor([3, 9, 70, 71, 4000], device=DEVICE), torch.bfloat16
    )
    chunk_idx, offset = torch.tensor([0, 0, 3, 5, 2], device=DEVICE), torch.tensor([0, 3, 1, 2, 0], device=DEVICE)
    q_out = torch.zeros(5, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    got = pool.write_rope(1, chunk_idx, offset, q, k, v, cos, sin, q_out)
    want_q, want_k = apply_rotary_qk(q, k, cos, sin)
    ref.write(1, chunk_idx, offset, want_k, v)
    assert got is q_out and torch.equal(q_out, want_q) and torch.equal(pool.kv, ref.kv)
    assert torch.equal(pool.write_rope(0, chunk_idx, offset, q, k, v, cos, sin), want_q)  # no q_out: a new one


@pytest.mark.gpu  # KVPool.write_rope runs rope_store on CUDA only
def test_the_pools_write_rope_runs_rope_store_on_cuda(monkeypatch):
    import chunkserve.kernels.norm_rope as norm_rope

    calls = []
    monkeypatch.setattr(norm_rope, "rope_store", lambda *a: calls.append(1) or rope_store(*a))
    test_the_pools_write_rope_is_rotate_then_write()
    assert calls == [1, 1]
