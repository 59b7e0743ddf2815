"""Counter-based random numbers for sampling: one uniform per (row, vocabulary entry) from each
row's own 64-bit key and counter, all rows in one launch (Philox4x32-10, Salmon et al. 2011).

A row's numbers depend only on its (key, counter) and the column, never on the rest of the batch,
so a seeded request draws the same tokens wherever it sits in a batch, and no per-row generator
(a few launches per row per step) is needed. Word 0 of Philox4x32-10 at counter (column, counter
low word, counter high word, 0) under key (key low word, key high word) gives column j's number:
its top 23 bits b as (b + 1/2) / 2**23, in (0, 1) and exact in float32 (never 0 or 1, so a draw's
-log(u) is finite and positive).

``uniform`` runs the Triton kernel on CUDA and the NumPy reference elsewhere (tests also run the
kernel in the interpreter). The reference is NumPy, not torch, for its unsigned 64-bit products;
it was written from the published algorithm and is checked against its known-answer vectors.
"""

from __future__ import annotations

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


def philox4x32_ref(ctr: np.ndarray, key: np.ndarray, rounds: int = 10) -> np.ndarray:
    """Philox4x32: ctr [4, ...] and key [2, ...] uint32 -> [4, ...] uint32 (Random123's order:
    the first round under the key as given, the key bumped before each later round)."""
    c = [np.asarray(w, dtype=np.uint32) for w in ctr]
    k0, k1 = (np.asarray(w, dtype=np.uint32) for w in key)
    for r in range(rounds):
        if r:
            k0 = (k0.astype(np.uint64) + _W0).astype(np.uint32)  # mod 2**32
            k1 = (k1.astype(np.uint64) + _W1).astype(np.uint32)
        p0 = np.uint64(_M0) * c[0].astype(np.uint64)  # exact in 64 bits
        p1 = np.uint64(_M1) * c[2].astype(np.uint64)
        hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), p0.astype(np.uint32)
        hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), p1.astype(np.uint32)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c)


def _words(values: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """[S] int64 (any bits) -> their low and high uint32 words."""
    v = values.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    return v.astype(np.uint32), (v >> np.uint64(32)).astype(np.uint32)


def uniform_ref(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    """[S, n] float32 on the CPU: row i's numbers for columns 0 .. n - 1 (see the module doc).
    keys, counters: [S] int64, read as 64 unsigned bits."""
    k_lo, k_hi = _words(keys)
    c_lo, c_hi = _words(counters)
    col = np.arange(n, dtype=np.uint32)[None, :]
    shape = (len(k_lo), n)
    ctr = [np.broadcast_to(col, shape), np.broadcast_to(c_lo[:, None], shape),
           np.broadcast_to(c_hi[:, None], shape), np.zeros(shape, np.uint32)]
    word = philox4x32_ref(ctr, [np.broadcast_to(k_lo[:, None], shape), np.broadcast_to(k_hi[:, None], shape)])[0]
    bits = (word >> np.uint32(32 - _MANTISSA)).astype(np.float32)
    return torch.from_numpy((bits + np.float32(0.5)) * np.float32(2.0 ** -_MANTISSA))


@triton.jit
def _uniform_kernel(Out, Keys, Counters, n, stride_o, BLOCK: tl.constexpr, MANTISSA: tl.constexpr):
    # grid: (rows, cdiv(n, BLOCK)); Out [S, n] float32
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    counter = tl.load(Counters + row).to(tl.uint64, bitcast=True)
    c1 = (counter & 0xFFFFFFFF).to(tl.uint32)
    c2 = (counter >> 32).to(tl.uint32)
    zero = tl.zeros([BLOCK], dtype=tl.uint32)
    # tl.philox: Random123's rounds, the key's low word first (key = the row's 64 bits)
    word, _, _, _ = tl.philox(tl.load(Keys + row), col.to(tl.uint32), zero + c1, zero + c2, zero)
    u = ((word >> (32 - MANTISSA)).to(tl.float32) + 0.5) * (1.0 / (1 << MANTISSA))
    tl.store(Out + row.to(tl.int64) * stride_o + col, u, mask=col < n)


def uniform(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    """[S, n] float32 on keys' device: row i's numbers for columns 0 .. n - 1 (module doc).
    keys, counters: [S] int64 (read as 64 unsigned bits) on one device."""
    if keys.shape != counters.shape or keys.dim() != 1 or keys.dtype != torch.int64 or counters.dtype != torch.int64:
        raise ValueError(f"keys and counters must both be [S] int64, got {keys.dtype}{tuple(keys.shape)} "
                         f"and {counters.dtype}{tuple(counters.shape)}")
    if not 0 < n < 2**31:
        raise ValueError(f"n must be in [1, 2**31), got {n}")
    if not keys.is_cuda:
        return uniform_ref(keys, counters, n)
    return _uniform_triton(keys, counters, n)


def _uniform_triton(keys: Tensor, counters: Tensor, n: int) -> Tensor:
    out = torch.empty(keys.shape[0], n, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _uniform_kernel[(keys.shape[0], triton.cdiv(n, _BLOCK))](
            out, keys, counters.to(keys.device), n, out.stride(0), BLOCK=_BLOCK, MANTISSA=_MANTISSA)
    return out
