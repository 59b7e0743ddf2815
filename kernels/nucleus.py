"""Top-p (nucleus) cut of each row without sorting it: the lowest logit that stays, found by a
16-way search over the logits' float order (Triton), beside its sort-based reference.

The rule (replicas.sampler): a token stays unless the tokens more likely than it already hold
top_p of the probability, the mass summed in float64 from float32 probabilities. With M(t) the
mass of the tokens whose logit exceeds t, the kept tokens are those x with M(x) < top_p, so the
cut is the smallest row value v with M(v) < top_p: tokens of one value stay or go together and
the most likely always stays. M falls only at row values, so the smallest *float* t with
M(t) < top_p is that value. The search narrows (lo, hi] around it, M(lo) >= top_p > M(hi), by
evaluating M at 16 points of it per pass over the rows: 8 passes cover the 2**32 float keys.
A pass is one launch over (row, chunk of the row), each program summing its chunk's masses; the
next pass's programs add those up in one fixed order (so all of a row's agree) and narrow. A
sort of the rows (torch.sort, segmented radix) costs more: H200, 256 rows of 128256, top-p 0.9:
5.2 ms a step. (One program per row, looping over it 8 times, took 5.9 ms: latency-bound.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["nucleus_floor", "nucleus_floor_ref"]

_WAYS = 16  # thresholds a pass evaluates (the last is the current hi)
_PASSES = 8  # 16**8 = 2**32 keys
_BLOCK = 256
_CHUNKS = 32  # programs per row and pass, about (each sums a chunk of the row)


def nucleus_floor_ref(logits: Tensor, probs: Tensor, top_p: Tensor) -> Tensor:
    """[P, 1] float32: each row's lowest kept logit, by sorting the row. logits [P, V] float32
    (-inf: filtered out), probs [P, V] their float32 probabilities, top_p [P, 1] float64."""
    order = torch.sort(logits, dim=-1, descending=True)
    p = probs.gather(1, order.indices).double()
    before = p.cumsum(-1) - p  # the mass sorted before each token (for a run of ties: above its value)
    keep = (before < top_p) & (order.values > float("-inf"))
    n = keep.sum(-1, keepdim=True).clamp(min=1)
    return order.values.gather(1, n - 1)


@triton.jit
def _key(x):
    """Float32 -> int32 in the same order (-0.0 as +0.0): non-negative floats keep their bits,
    negative ones have all but the sign flipped."""
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(x == 0.0, 0, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _state(LoHi, Partials, TopP, Hi0, row, rows, K: tl.constexpr, NCHUNKS: tl.constexpr, WAYS: tl.constexpr):
    """(lo, hi) int64 keys of the row before pass K: pass K - 1's (lo, hi) narrowed by its masses
    (summed over the row's chunks in one fixed order, so every program of the row agrees)."""
    ways = tl.arange(0, WAYS)
    if K == 0:
        # (lo, hi] holds the cut: M(hi) = 0 at the largest logit, and lo = -inf, where M is all
        # the mass (if even that is under top_p, every token stays: the search ends at -inf or
        # just above it)
        lo = _key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        hi = _key(tl.load(Hi0 + row)).to(tl.int64)
    else:
        at = (K - 1) * rows + row
        lo = tl.load(LoHi + 2 * at)
        hi = tl.load(LoHi + 2 * at + 1)
        t = lo + ((hi - lo) * (ways + 1)) // WAYS  # the thresholds pass K - 1 summed at
        chunks = tl.arange(0, NCHUNKS)
        part = tl.load(Partials + (at * NCHUNKS + chunks)[:, None] * WAYS + ways[None, :])  # [NCHUNKS, WAYS]
        mass = tl.sum(part, 0)
        j = tl.min(tl.where(mass < tl.load(TopP + row), ways, WAYS), 0)  # the first past the cut (hi is)
        new_hi = tl.sum(tl.where(ways == j, t, 0), 0)
        lo = tl.where(j == 0, lo, tl.sum(tl.where(ways == j - 1, t, 0), 0))
        hi = new_hi
    return lo, hi


@triton.jit
def _pass_kernel(Partials, LoHi, Logits, Probs, TopP, Hi0, n, rows, stride_l, stride_p,
                 K: tl.constexpr, NCHUNKS: tl.constexpr, CHUNK: tl.constexpr, WAYS: tl.constexpr,
                 BLOCK: tl.constexpr):
    # grid: (rows, NCHUNKS). Pass K: the mass above each of WAYS thresholds in (lo, hi], summed
    # over this program's CHUNK of the row, to Partials [PASSES, rows, NCHUNKS, WAYS] float64
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo, hi = _state(LoHi, Partials, TopP, Hi0, row, rows, K, NCHUNKS, WAYS)
    if c == 0:  # LoHi [PASSES, rows, 2] int64, read by the next pass
        tl.store(LoHi + 2 * (K * rows + row), lo)
        tl.store(LoHi + 2 * (K * rows + row) + 1, hi)
    ways = tl.arange(0, WAYS)
    t = (lo + ((hi - lo) * (ways + 1)) // WAYS).to(tl.int32)  # [WAYS], the last is hi (keys are int32)
    offs = tl.arange(0, BLOCK)
    # summed across the block once at the end: a reduction per block (cross-thread float64
    # shuffles) made the pass compute-bound
    acc = tl.zeros([BLOCK, WAYS], dtype=tl.float64)
    for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n), BLOCK):
        live = start + offs < n
        x = tl.load(Logits + row.to(tl.int64) * stride_l + start + offs, mask=live, other=float("-inf"))
        p = tl.load(Probs + row.to(tl.int64) * stride_p + start + offs, mask=live, other=0.0).to(tl.float64)
        acc += tl.where(_key(x)[:, None] > t[None, :], p[:, None], 0.0)  # [BLOCK, WAYS]
    tl.store(Partials + ((K * rows + row) * NCHUNKS + c) * WAYS + ways, tl.sum(acc, 0))


@triton.jit
def _floor_kernel(Floor, LoHi, Partials, TopP, Hi0, rows, K: tl.constexpr, NCHUNKS: tl.constexpr,
                  WAYS: tl.constexpr):
    # grid: (rows,): the state after the last pass; its hi is the cut, back to float32
    row = tl.program_id(0)
    _, hi = _state(LoHi, Partials, TopP, Hi0, row, rows, K, NCHUNKS, WAYS)
    k = hi.to(tl.int32)
    tl.store(Floor + row, tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True))


def nucleus_floor(logits: Tensor, probs: Tensor, top_p: Tensor) -> Tensor:
    """``nucleus_floor_ref`` without the sort, on CUDA (or the interpreter): [P, 1] float32 cuts
    that keep the same tokens (the cut itself is the lowest kept value, or, where every token
    stays, possibly any value below them). A pass is a launch over (row, CHUNK of the row)."""
    if logits.shape != probs.shape or logits.dim() != 2 or top_p.shape != (logits.shape[0], 1):
        raise ValueError(f"logits and probs must be [P, V] and top_p [P, 1], got {tuple(logits.shape)}, "
                         f"{tuple(probs.shape)}, {tuple(top_p.shape)}")
    logits, probs = logits.float().contiguous(), probs.float().contiguous()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out[:, None]
    chunk = max(_BLOCK, triton.next_power_of_2(triton.cdiv(n, _CHUNKS)))
    nchunks = triton.next_power_of_2(triton.cdiv(n, chunk))
    partials = torch.zeros(_PASSES, rows, nchunks, _WAYS, dtype=torch.float64, device=logits.device)
    lohi = torch.empty(_PASSES, rows, 2, dtype=torch.int64, device=logits.device)
    top_p, hi0 = top_p.double().contiguous(), logits.amax(-1).contiguous()
    for k in range(_PASSES):
        _pass_kernel[(rows, nchunks)](partials, lohi, logits, probs, top_p, hi0, n, rows, logits.stride(0),
                                      probs.stride(0), K=k, NCHUNKS=nchunks, CHUNK=chunk, WAYS=_WAYS, BLOCK=_BLOCK)
    _floor_kernel[(rows,)](out, lohi, partials, top_p, hi0, rows, K=_PASSES, NCHUNKS=nchunks, WAYS=_WAYS)
    return out[:, None]
