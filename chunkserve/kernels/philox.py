"""Counter-based random numbers for sampling: one uniform per (row, vocabulary entry) from each
row's own 64-bit key and counter, all rows in one launch (Philox4x32-10, Salmon et al. 2011).

A row's numbers depend only on its (key, counter) and the column, never on the rest of the batch,
so a seeded request draws the same tokens wherever it sits in a batch, and no per-row generator
(a few launches per row per step) is needed. A row of n numbers takes m = ceil(n / 4) Philox
calls, at counters (i, counter low word, counter high word, 0) for i < m under the key (its low
word first): word w of call i gives column w * m + i. Each word's top 23 bits b become
(b + 1/2) / 2**23, in (0, 1) and exact in float32 (never 0 or 1, so a draw's -log(u) is finite
and positive).

``uniform`` runs the Triton kernel on CUDA and the NumPy reference elsewhere (tests also run the
kernel in the interpreter). The reference is NumPy, not torch, for its unsigned 64-bit products;
it was written from the published algorithm and is checked against its known-answer vectors.
(All four words of a call are used, a quarter of the calls: chunkserve/cluster/loadtest/records/
README.md, 'Figures behind the code', has the reference's times either way.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["uniform", "uniform_ref", "philox4x32_ref"]

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
_MANTISSA = 23  # bits of each word kept: (b + 1/2) / 2**23 is exact in float32 and below 1
_BLOCK = 1024


def philox4x32_ref(ctr: Sequence[np.ndarray], key: Sequence[np.ndarray], rounds: int = 10) -> np.ndarray:
    """Philox4x32: counter words ctr[0..3] and key words key[0..1] (uint32 values, arrays that
    broadcast) -> [4, ...] uint32 (Random123's order: the first round under the key as given, the
    key bumped before each later round). Words are carried in uint64 arrays, updated in place."""
    mask, s32 = np.uint64(0xFFFFFFFF), np.uint64(32)
    shape = np.broadcast_shapes(*(np.shape(w) for w in ctr))
    c0, c1, c2, c3 = (np.broadcast_to(np.asarray(w, dtype=np.uint64), shape).copy() for w in ctr)
    k0, k1 = (np.asarray(w, dtype=np.uint64) for w in key)
    p0, p1 = np.empty(shape, np.uint64), np.empty(shape, np.uint64)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + np.uint64(_W0)) & mask, (k1 + np.uint64(_W1)) & mask
        np.multiply(c0, np.uint64(_M0), out=p0)  # exact: both factors under 2**32
        np.multiply(c2, np.uint64(_M1), out=p1)
        # (c0, c1, c2, c3) <- (hi(p1) ^ c1 ^ k0, lo(p1), hi(p0) ^ c3 ^ k1, lo(p0))
        np.right_shift(p1, s32, out=c0)
        c0 ^= c1
        c0 ^= k0
        np.bitwise_and(p1, mask, out=c1)
        np.right_shift(p0, s32, out=c2)
        c2 ^= c3
        c2 ^= k1
        np.bitwise_and(p0, mask, out=c3)
    return np.stack([c0, c1, c2, c3]).astype(np.uint32)


def _words(values: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[S] int64 (any bits) -> their low and high uint32 words."""
    v = values.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    return v.astype(np.uint32), (v >> np.uint64(32)).astype(np.uint32)


def uniform_ref(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    """[S, n] float32 on the CPU: row i's numbers for columns 0 .. n - 1 (see the module doc).
    keys, counters: [S] int64, read as 64 unsigned bits."""
    k_lo, k_hi = _words(keys)
    c_lo, c_hi = _words(counters)
    calls = np.arange(-(-n // 4), dtype=np.uint32)[None, :]  # [1, m]
    words = philox4x32_ref([calls, c_lo[:, None], c_hi[:, None], np.uint32(0)], [k_lo[:, None], k_hi[:, None]])
    bits = np.concatenate(list(words), axis=-1)[:, :n] >> np.uint32(
        32 - _MANTISSA
    )  # [S, n]: word w, call i -> w * m + i
    return torch.from_numpy((bits.astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-_MANTISSA))


@triton.jit
def _uniform_kernel(Out, Keys, Counters, n, m, stride_o, BLOCK: tl.constexpr, MANTISSA: tl.constexpr):
    # grid: (rows, cdiv(m, BLOCK)); Out [S, n] float32; m = cdiv(n, 4) Philox calls per row
    row = tl.program_id(0)
    call = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    counter = tl.load(Counters + row).to(tl.uint64, bitcast=True)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    # tl.philox: Random123's rounds, the key's low word first (key = the row's 64 bits)
    w0, w1, w2, w3 = tl.philox(
        tl.load(Keys + row),
        call.to(tl.uint32),
        zero + (counter & 0xFFFFFFFF).to(tl.uint32),
        zero + (counter >> 32).to(tl.uint32),
        zero,
    )
    out = Out + row.to(tl.int64) * stride_o
    scale = 1.0 / (1 << MANTISSA)
    tl.store(out + call, ((w0 >> (32 - MANTISSA)).to(tl.float32) + 0.5) * scale, mask=call < m)
    tl.store(out + m + call, ((w1 >> (32 - MANTISSA)).to(tl.float32) + 0.5) * scale, mask=(call < m) & (m + call < n))
    tl.store(
        out + 2 * m + call, ((w2 >> (32 - MANTISSA)).to(tl.float32) + 0.5) * scale, mask=(call < m) & (2 * m + call < n)
    )
    tl.store(
        out + 3 * m + call, ((w3 >> (32 - MANTISSA)).to(tl.float32) + 0.5) * scale, mask=(call < m) & (3 * m + call < n)
    )


def uniform(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    """[S, n] float32 on keys' device: row i's numbers for columns 0 .. n - 1 (module doc).
    keys, counters: [S] int64 (read as 64 unsigned bits) on one device."""
    if keys.shape != counters.shape or keys.dim() != 1 or keys.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(
            f"keys and counters must both be [S] int64, got {keys.dtype}{tuple(keys.shape)} "
            f"and {counters.dtype}{tuple(counters.shape)}"
        )
    if not 0 < n < 2**31:
        raise ValueError(f"n must be in [1, 2**31), got {n}")
    if not keys.is_cuda:
        return uniform_ref(keys, counters, n)
    return _uniform_triton(keys, counters, n)


def _uniform_triton(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    out = torch.empty(keys.shape[0], n, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        m = triton.cdiv(n, 4)
        _uniform_kernel[(keys.shape[0], triton.cdiv(m, _BLOCK))](
            out, keys, counters.to(keys.device), n, m, out.stride(0), BLOCK=_BLOCK, MANTISSA=_MANTISSA
        )
    return out
