"""Top-p (nucleus) cut of each row without sorting it: the lowest logit that stays, found by a
16-way search over the logits' float order (Triton), beside its sort-based reference.

The rule (chunkserve.replicas.engine.sampler): a token stays unless the tokens more likely than it already hold
top_p of the probability, the mass summed in float64 from float32 probabilities. With M(t) the
mass of the tokens whose logit exceeds t, the kept tokens are those x with M(x) < top_p, so the
cut is the smallest row value v with M(v) < top_p: tokens of one value stay or go together and
the most likely always stays. M falls only at row values, so the smallest *float* t with
M(t) < top_p is that value. The search narrows (lo, hi] around it, M(lo) >= top_p > M(hi), by
evaluating M at 16 points of it per pass over the rows: 8 passes cover the 2**32 float keys.

A row is cut into chunks (about V/32), one program each per launch. A filter launch first keeps
only the tokens that can matter (probability over a bound, see nucleus_floor: with peaked rows
a few hundred of a 128256 vocabulary), packed to the front of the chunk's region of a buffer;
each pass then sums its chunk's masses over those, and from the second pass on packs the ones
still inside (lo, hi] forward again, carrying the mass of those now above hi (every threshold
counts it). The next pass's programs add the chunks' masses up in one fixed order (so all of a
row's agree, and the cut is deterministic) and narrow. A sort of the rows (torch.sort,
segmented radix) costs more, and so does one program per row looping over it 8 times
(latency-bound; figures: chunkserve/kernels/tools/records/README.md, 'Figures behind the code').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

__all__ = ["nucleus_floor", "nucleus_floor_ref"]

_WAYS = 16  # thresholds a pass evaluates (the last is the current hi)
_PASSES = 8  # 16**8 = 2**32 keys
# Tokens a program takes per step, chunks per row at most, and programs per launch to aim at
# over all rows (fewer chunks a row where there are many rows: a pass over the few tokens left
# is latency-bound, program by program): the fastest of those swept, peaked rows to flat (figures:
# chunkserve/kernels/tools/records/README.md, 'Figures behind the code').
_BLOCK = 128
_CHUNKS = 32
_PROGRAMS = 2048


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
        # (lo, hi] holds the cut: M(hi) = 0 at the largest logit (Hi0 [rows, NCHUNKS]: each
        # chunk's largest key, from the filter), and lo = -inf, where M is all
        # the mass (if even that is under top_p, every token stays: the search ends at -inf or
        # just above it)
        lo = _key(tl.full([], float("-inf"), tl.float32)).to(tl.int64)
        hi = tl.max(tl.load(Hi0 + row * NCHUNKS + tl.arange(0, NCHUNKS)), 0).to(tl.int64)
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
def _filter_kernel(
    Keys,
    Ps,
    Count,
    Hi0,
    Logits,
    Probs,
    Plo,
    n,
    stride_l,
    stride_p,
    NCHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (rows, NCHUNKS). The tokens of this program's CHUNK of the row that can matter (p >
    # the row's plo, see nucleus_floor), in row order, to the front of its region of Keys (their
    # float order keys, int32) and Ps (their probabilities); how many to Count [rows, NCHUNKS],
    # and the chunk's largest key to Hi0 [rows, NCHUNKS].
    row = tl.program_id(0)
    c = tl.program_id(1)
    plo = tl.load(Plo + row)
    out = (row * NCHUNKS + c).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    w = 0
    top = tl.full([BLOCK], -(2**31), tl.int32)
    for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, n), BLOCK):
        live = start + offs < n
        x = tl.load(Logits + row.to(tl.int64) * stride_l + start + offs, mask=live, other=float("-inf"))
        p = tl.load(Probs + row.to(tl.int64) * stride_p + start + offs, mask=live, other=0.0)
        k = _key(x)
        top = tl.maximum(top, k)
        keep = live & (p > plo)
        at = out + w + tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(Keys + at, k, mask=keep)
        tl.store(Ps + at, p, mask=keep)
        w += tl.sum(keep.to(tl.int32), 0)
    tl.store(Count + row * NCHUNKS + c, w)
    tl.store(Hi0 + row * NCHUNKS + c, tl.max(top, 0))


@triton.jit
def _pass_kernel(
    Partials,
    LoHi,
    Keys,
    Ps,
    Count,
    Carry,
    TopP,
    Hi0,
    rows,
    K: tl.constexpr,
    NCHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # grid: (rows, NCHUNKS). Pass K: the mass above each of WAYS thresholds in (lo, hi], over
    # this program's tokens, to Partials [PASSES, rows, NCHUNKS, WAYS] float64. Its tokens are
    # those of its region of Keys / Ps still in (lo, hi] (Count of them); from pass 1 on it moves
    # the ones still inside to the region's front, and adds the mass of those now above hi, which
    # every threshold counts, to its Carry [rows, NCHUNKS] (those at or under lo count for none).
    row = tl.program_id(0)
    c = tl.program_id(1)
    lo, hi = _state(LoHi, Partials, TopP, Hi0, row, rows, K, NCHUNKS, WAYS)
    if c == 0:  # LoHi [PASSES, rows, 2] int64, read by the next pass
        tl.store(LoHi + 2 * (K * rows + row), lo)
        tl.store(LoHi + 2 * (K * rows + row) + 1, hi)
    ways = tl.arange(0, WAYS)
    t = (lo + ((hi - lo) * (ways + 1)) // WAYS).to(tl.int32)  # [WAYS], the last is hi (keys are int32)
    lo, hi = lo.to(tl.int32), hi.to(tl.int32)
    rc = row * NCHUNKS + c
    region = rc.to(tl.int64) * CHUNK
    count = tl.load(Count + rc)
    offs = tl.arange(0, BLOCK)
    # [WAYS, BLOCK]: a thread's ways side by side, summed across the block once at the end (a
    # reduction per block, cross-thread float64 shuffles, made the pass compute-bound; ways
    # across threads, [BLOCK, WAYS], were slower over whole rows: records)
    acc = tl.zeros([WAYS, BLOCK], dtype=tl.float64)
    above = tl.zeros([BLOCK], dtype=tl.float64)
    w = 0
    for start in range(0, count, BLOCK):
        live = start + offs < count
        k = tl.load(Keys + region + start + offs, mask=live, other=0)
        p32 = tl.load(Ps + region + start + offs, mask=live, other=0.0)
        p = p32.to(tl.float64)
        inside = live & (k > lo) & (k <= hi)
        acc += tl.where(inside[None, :] & (k[None, :] > t[:, None]), p[None, :], 0.0)
        above += tl.where(live & (k > hi), p, 0.0)
        if K > 0:  # (in pass 0 every token is inside)
            # stores land at or before the block's loads (w <= start): the barrier keeps every
            # thread's loads before any store
            at = region + w + tl.cumsum(inside.to(tl.int32), 0) - 1
            tl.debug_barrier()
            tl.store(Keys + at, k, mask=inside)
            tl.store(Ps + at, p32, mask=inside)
            w += tl.sum(inside.to(tl.int32), 0)
    carry = tl.load(Carry + rc) + tl.sum(above, 0)
    tl.store(Partials + ((K * rows + row) * NCHUNKS + c) * WAYS + ways, carry + tl.sum(acc, 1))
    if K > 0:
        tl.store(Carry + rc, carry)
        tl.store(Count + rc, w)


@triton.jit
def _floor_kernel(Floor, LoHi, Partials, TopP, Hi0, rows, K: tl.constexpr, NCHUNKS: tl.constexpr, WAYS: tl.constexpr):
    # grid: (rows,): the state after the last pass; its hi is the cut, back to float32
    row = tl.program_id(0)
    _, hi = _state(LoHi, Partials, TopP, Hi0, row, rows, K, NCHUNKS, WAYS)
    k = hi.to(tl.int32)
    tl.store(Floor + row, tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True))


def nucleus_floor(logits: Tensor, probs: Tensor, top_p: Tensor) -> Tensor:
    """``nucleus_floor_ref`` without the sort, on CUDA (or the interpreter): [P, 1] float32 cuts
    that keep the same tokens (the cut itself is the lowest kept value, or, where every token
    stays, possibly any value below them). A pass is a launch over (row, CHUNK of the row).
    probs must not fall where the logits rise (exp(logits - lse), a softmax): the tokens left out
    are then the row's lowest. A row's probs may hold less than all of its mass (the sampler's
    top-k candidates)."""
    if logits.shape != probs.shape or logits.dim() != 2 or top_p.shape != (logits.shape[0], 1):
        raise ValueError(
            f"logits and probs must be [P, V] and top_p [P, 1], got {tuple(logits.shape)}, "
            f"{tuple(probs.shape)}, {tuple(top_p.shape)}"
        )
    logits, probs = logits.float().contiguous(), probs.float().contiguous()
    rows, n = logits.shape
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out[:, None]
    per_row = min(_CHUNKS, triton.next_power_of_2(triton.cdiv(_PROGRAMS, rows)))
    chunk = max(_BLOCK, triton.next_power_of_2(triton.cdiv(n, per_row)))
    nchunks = triton.next_power_of_2(triton.cdiv(n, chunk))
    dev = logits.device
    top_p = top_p.double().contiguous()
    # Only tokens of probability over plo can matter: the cut's token has p > (mass - top_p) / n
    # (the mass at or under it is over mass - top_p, over n tokens at most), half of that leaves
    # room for rounding, and those at or under plo (the row's lowest values, probabilities rising
    # with the logits) hold under (mass - top_p) / 2: the mass above them still reaches top_p,
    # so leaving them out moves no threshold of the search across top_p. With peaked rows most
    # of the vocabulary drops out here (records: 'Figures behind the code').
    # (The row's mass summed in float32, its error far under the 1e-4 taken off.)
    mass = probs.sum(-1).double()
    plo = ((mass * (1 - 1e-4) - top_p[:, 0]).clamp(min=0.0) * (0.5 / n)).float()
    keys = torch.empty(rows * nchunks * chunk, dtype=torch.int32, device=dev)
    ps = torch.empty(rows * nchunks * chunk, dtype=torch.float32, device=dev)
    count = torch.empty(rows, nchunks, dtype=torch.int32, device=dev)
    carry = torch.zeros(rows, nchunks, dtype=torch.float64, device=dev)
    hi0 = torch.empty(rows, nchunks, dtype=torch.int32, device=dev)
    _filter_kernel[(rows, nchunks)](
        keys,
        ps,
        count,
        hi0,
        logits,
        probs,
        plo,
        n,
        logits.stride(0),
        probs.stride(0),
        NCHUNKS=nchunks,
        CHUNK=chunk,
        BLOCK=_BLOCK,
    )
    partials = torch.empty(_PASSES, rows, nchunks, _WAYS, dtype=torch.float64, device=dev)
    lohi = torch.empty(_PASSES, rows, 2, dtype=torch.int64, device=dev)
    for k in range(_PASSES):
        _pass_kernel[(rows, nchunks)](
            partials,
            lohi,
            keys,
            ps,
            count,
            carry,
            top_p,
            hi0,
            rows,
            K=k,
            NCHUNKS=nchunks,
            CHUNK=chunk,
            WAYS=_WAYS,
            BLOCK=_BLOCK,
        )
    _floor_kernel[(rows,)](out, lohi, partials, top_p, hi0, rows, K=_PASSES, NCHUNKS=nchunks, WAYS=_WAYS)
    return out[:, None]
