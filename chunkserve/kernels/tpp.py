"""Two-phase partition (TPP) decode attention over the chunked prefix-tree KV cache, in Triton.

Cache layout (DESIGN §6), per layer: ``k_cache, v_cache: [num_chunks, Hkv, c, D]``; query head
``h`` reads KV head ``h // G``. ``build_plan`` (kernels/tpp_plan.py) turns the decode batch (rows in prefix-tree DFS
order) into flat device work lists once per tree shape; ``tpp_decode`` (an engine's
``TppDecoder``: the same, its launches kept per plan and run past Triton's dispatcher) runs two or
three launches per layer (DESIGN §7, ChunkAttention):

- attend: the work of both phases cut into pieces of about equal size, one program per (piece,
  KV head), enough of them to fill the GPU a few times over. A piece is either
    phase 1, chunk-first: a run of a shared segment's chunks for a tile of its rows; or
    phase 2, sequence-first: a run of one row's private chunks (the tail chunk masked to the
      row's length).
  Either way the piece's rows times the G query heads of the KV head form one [M, D] query
  matrix (GQA folded into M) that streams the chunks once with ``tl.dot`` (fp32 accumulation);
  on sm90+ phase 1 streams its K/V blocks by TMA (tensor descriptors over the cache's rows).
  One kernel serves both phases; by default each phase is its own launch with its own M (rows *
  G for phase 1, G for phase 2: a phase-2 piece in phase 1's tile wastes its exps and MMAs). On
  sm90+ the phase-2 launch starts while phase 1 runs (programmatic dependent launch) and waits
  for it only before it folds phase-1 partials, so the phases stream side by side. Where many
  rows' private parts are short and whole, a phase-2 program streams several rows one after
  another in one loop instead (``_attend_rows_kernel``, see ``_ROWS``). A piece
  writes a partial state (o normalised, lse) in fp32 for each of its rows, except a row's whole
  private part when that is all the row reads: that writes the output directly.
- merge, only when some row has partials left: one program (one warp) per (row, query head)
  folds the row's partials, which sit contiguously, with one vector load (online softmax over
  blocks of them).

All softmax arithmetic is in base 2: scores are pre-multiplied by ``sm_scale * log2(e)`` and
``lse`` is ``log2(sum exp2(s))``. Same semantics as ``chunkserve.kernels.reference.tpp_decode_ref``.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from chunkserve.kernels import tpp_plan
from chunkserve.kernels.launch import aligned, launch
from chunkserve.kernels.tpp_plan import FixedPlans, TppPlan, build_fixed_plan, build_plan

__all__ = ["FixedPlans", "TppDecoder", "TppPlan", "build_fixed_plan", "build_plan", "tpp_decode"]

_LOG2E = 1.4426950408889634
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# The launcher's knobs (the planner's are in chunkserve/kernels/tpp_plan.py, read from there at call time;
# the measurements behind them in chunkserve/kernels/tools/records/README.md, "TPP tuning"). Tests set them.
# Phase 2's launch starts while phase 1's runs, by programmatic dependent launch (sm90+, not
# in the interpreter), see tpp_decode.
_PDL = True
# Whole K/V blocks loaded through TMA descriptors (sm90+), see _attend and _use_tma.
_TMA = True
# MHA (G = 1): a phase-2 piece that folds its row's phase-1 partials (at most
# tpp_plan._FOLD_MAX) loads them, if it has this many at least, in one
# [FOLD_P, D] block: one L2 round trip where a loop over them takes one each (0: always the
# loop). Rows with 2 keep the loop (one load gathers vector 0's state across the tile first).
_FOLD_VEC_MIN = 3
# GQA (G > 1): the same, all the tile's vectors' partials in one [M, FOLD_P, D] load (each vector
# keeps its own state, so nothing is gathered first), for rows with this many partials at least
# (0: always the loop). Either fold is compiled in only where the plan has rows that take it
# (TppPlan.most_folds): compiled in but not taken, it slows the step.
_FOLD_VEC_MIN_GQA = 3
# The fold loop of a phase-2 piece (rows with 2 partials, or GQA rows with fewer than
# _FOLD_VEC_MIN_GQA) issues two partials' loads together per step: one L2 round trip for two.
_FOLD_PAIRS = True
_ROWS_CONFIG = dict(num_warps=4, num_stages=3)  # _attend_rows_kernel's (tpp_plan._ROWS)
_ROWS_BLOCK_BYTES = 16 << 10  # a chunk's [c, D] block of one head at most this (fp32 or D = 256: the plain kernel)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _step(q, k, v, live, acc, m_i, l_i, qk_scale, MASK: tl.constexpr, DOT_T: tl.constexpr, DOT_PREC: tl.constexpr):
    """One block of the online softmax: q: [M, D] against k, v: [BLOCK_N, D] (tokens with
    live False are masked out where MASK; their v rows must be zeros)."""
    s = tl.dot(q, tl.trans(k.to(DOT_T)), input_precision=DOT_PREC) * qk_scale  # [M, BLOCK_N]
    if MASK:
        s = tl.where(live[None, :], s, float("-inf"))
    # every block holds a live token and padded query rows are zero, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # p rounded to the cache dtype, as the tensor cores take it
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_T), v.to(DOT_T), input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend(
    q,
    K,
    V,
    Kd,
    Vd,
    chunks,
    cid0,
    n_tok,
    kv,
    stride_kc,
    stride_kh,
    qk_scale,
    BLOCK_M: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
    TAIL: tl.constexpr,
):
    """Online softmax of q: [M, D] over tokens [0, n_tok) of the chunk run at `chunks`.

    Returns acc: [M, D] fp32 unnormalised output and m_i / l_i: [M] max / sum (base 2). Token t
    lives in chunk chunks[t // C] at slot t % C (cid0 = chunks[0]) of KV head kv.

    TMA (BLOCK_N <= C): the blocks come through the tensor descriptors Kd, Vd over the caches'
    [chunks * Hkv * C, D] row view, one [BLOCK_N, D] box each (asynchronous copies, no
    addresses in registers). TAIL: the last block may be partial (a row's tail chunk): tokens
    past n_tok are masked out. Without TMA a pointer loop takes every block (always masked).
    """
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    if TMA:
        row_kc = stride_kc // D  # rows of the view per chunk (Hkv * C)
        row_kv = kv * (stride_kh // D)
        cid = cid0
        t0 = n_tok // BLOCK_N * BLOCK_N if TAIL else n_tok  # whole blocks
        for start in range(0, t0, BLOCK_N):
            # the next block's chunk id a block ahead (see the pointer loop)
            cid_next = tl.load(chunks + (start + BLOCK_N) // C, mask=start + BLOCK_N < n_tok, other=0)
            row = cid * row_kc + row_kv + start % C
            acc, m_i, l_i = _step(
                q, Kd.load([row, 0]), Vd.load([row, 0]), offs_n, acc, m_i, l_i, qk_scale, False, DOT_T, DOT_PREC
            )  # whole block: no mask (offs_n unused)
            cid = cid_next
        if TAIL:
            if t0 < n_tok:  # a partial last block: slots past n_tok may hold any bits, NaN too (0 * NaN is NaN)
                live = t0 + offs_n < n_tok
                row = cid * row_kc + row_kv + t0 % C
                v = tl.where(live[:, None], Vd.load([row, 0]), 0.0)
                acc, m_i, l_i = _step(q, Kd.load([row, 0]), v, live, acc, m_i, l_i, qk_scale, True, DOT_T, DOT_PREC)
    else:
        offs_d = tl.arange(0, D)
        kv_off = kv.to(tl.int64) * stride_kh
        # each block's chunk ids are loaded one block ahead: K/V addresses that hang on a load
        # in the same iteration made Triton's pipeliner spend a stage on it and single-buffer
        # K and V
        if BLOCK_N <= C:
            # every block inside one chunk: one chunk id per block (the first came with the
            # item), the block one contiguous [BLOCK_N, D] run of the cache at the same offsets
            # from the run's start every block (faster than a chunk id per token, and fewer
            # registers than offsets built in the loop: records, "TPP tuning")
            offs_blk = offs_n[:, None] * D + offs_d[None, :]
            cid = cid0
            for start in range(0, n_tok, BLOCK_N):
                live = start + offs_n < n_tok
                cid_next = tl.load(chunks + (start + BLOCK_N) // C, mask=start + BLOCK_N < n_tok, other=0)
                run = cid.to(tl.int64) * stride_kc + kv_off + (start % C) * D
                k = tl.load((K + run) + offs_blk, mask=live[:, None], other=0.0)  # [BLOCK_N, D]
                v = tl.load((V + run) + offs_blk, mask=live[:, None], other=0.0)
                acc, m_i, l_i = _step(q, k, v, live, acc, m_i, l_i, qk_scale, True, DOT_T, DOT_PREC)
                cid = cid_next
        else:  # a block spans chunks: a chunk id per token
            cid = tl.load(chunks + offs_n // C, mask=offs_n < n_tok, other=0)
            for start in range(0, n_tok, BLOCK_N):
                t = start + offs_n
                live = t < n_tok
                cid_next = tl.load(chunks + (t + BLOCK_N) // C, mask=t + BLOCK_N < n_tok, other=0)
                tok = cid.to(tl.int64) * stride_kc + kv_off + (t % C) * D  # [BLOCK_N] element offset of each token
                ptrs = tok[:, None] + offs_d[None, :]
                k = tl.load(K + ptrs, mask=live[:, None], other=0.0)  # [BLOCK_N, D]
                v = tl.load(V + ptrs, mask=live[:, None], other=0.0)
                acc, m_i, l_i = _step(q, k, v, live, acc, m_i, l_i, qk_scale, True, DOT_T, DOT_PREC)
                cid = cid_next
    return acc, m_i, l_i


@triton.jit
def _fold_each(
    acc, m_i, l_i, PartO, PartLse, fold0, nfold, head, hq, live, offs_d, D: tl.constexpr, PAIRS: tl.constexpr
):
    """Fold the partials at slots fold0 .. fold0 + nfold - 1 (o normalised, lse) into the tile's
    state acc: [M, D], m_i / l_i: [M], one slot (one L2 round trip) at a time, or (PAIRS) two
    slots' loads issued together per step (see _FOLD_PAIRS)."""
    if PAIRS:
        for j in range(0, nfold, 2):
            part = (fold0 + j).to(tl.int64) * hq + head  # [M]
            second = live & (head * 0 + j + 1 < nfold)  # [M] (a tensor compare: the interpreter needs it)
            lse0 = tl.load(PartLse + part, mask=live, other=0.0)  # 0, not -inf: padded rows stay finite
            lse1 = tl.load(PartLse + part + hq, mask=second, other=float("-inf"))
            o0 = tl.load(PartO + part[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
            o1 = tl.load(PartO + (part + hq)[:, None] * D + offs_d[None, :], mask=second[:, None], other=0.0)
            m_new = tl.maximum(m_i, tl.maximum(lse0, lse1))
            alpha = tl.exp2(m_i - m_new)
            b0 = tl.exp2(lse0 - m_new)
            b1 = tl.exp2(lse1 - m_new)
            acc = acc * alpha[:, None] + o0 * b0[:, None] + o1 * b1[:, None]
            l_i = l_i * alpha + b0 + b1
            m_i = m_new
    else:
        for j in range(nfold):
            part = (fold0 + j).to(tl.int64) * hq + head  # [M]
            lse = tl.load(PartLse + part, mask=live, other=0.0)  # 0, not -inf: padded rows stay finite
            o_j = tl.load(PartO + part[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + o_j * beta[:, None]
            l_i = l_i * alpha + beta
            m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fold_rows(
    acc, m_i, l_i, PartO, PartLse, fold0, nfold, head, hq, live, offs_d, D: tl.constexpr, FOLD_P: tl.constexpr
):
    """_fold_each with every live vector's nfold <= FOLD_P partials in one [M, FOLD_P, D] load
    (GQA phase 2: the G heads of a row; padded vectors load nothing)."""
    offs_f = tl.arange(0, FOLD_P)
    fl = live[:, None] & (offs_f[None, :] < nfold)  # [M, FOLD_P]
    part = (fold0 + offs_f[None, :]).to(tl.int64) * hq + head[:, None]
    lse = tl.load(PartLse + part, mask=fl, other=float("-inf"))
    o_f = tl.load(PartO + part[:, :, None] * D + offs_d[None, None, :], mask=fl[:, :, None], other=0.0)
    m_new = tl.maximum(m_i, tl.max(lse, 1))
    # -inf only on a padded vector of a piece that read nothing: keep it NaN-free
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    w = tl.exp2(lse - m_safe[:, None])  # [M, FOLD_P]
    acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o_f, 1)
    l_i = l_i * alpha + tl.sum(w, 1)
    return acc, m_new, l_i


@triton.jit
def _fold_vector(
    acc,
    m_i,
    l_i,
    PartO,
    PartLse,
    fold0,
    nfold,
    head,
    hq,
    offs_m,
    offs_d,
    BLOCK_M: tl.constexpr,
    D: tl.constexpr,
    FOLD_P: tl.constexpr,
):
    """_fold_each for a tile of one query vector (MHA phase 2: vector 0 of head `head`; the
    others are padding, never stored): its nfold <= FOLD_P partials in one [FOLD_P, D] load."""
    offs_f = tl.arange(0, FOLD_P)
    fl = offs_f < nfold
    part = (fold0 + offs_f).to(tl.int64) * hq + head  # [FOLD_P]
    lse = tl.load(PartLse + part, mask=fl, other=float("-inf"))
    o_f = tl.load(PartO + part[:, None] * D + offs_d[None, :], mask=fl[:, None], other=0.0)  # [FOLD_P, D]
    first = offs_m == 0
    m0 = tl.max(tl.where(first, m_i, float("-inf")), 0)
    l0 = tl.sum(tl.where(first, l_i, 0.0), 0)
    acc0 = tl.sum(tl.where(first[:, None], acc, 0.0), 0)  # [D]
    m_new = tl.maximum(m0, tl.max(lse, 0))  # finite: a phase-1 partial read whole chunks
    alpha = tl.exp2(m0 - m_new)
    w = tl.exp2(lse - m_new)  # [FOLD_P]
    acc0 = acc0 * alpha + tl.sum(w[:, None] * o_f, 0)
    # every vector of the tile takes vector 0's state
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32) + acc0[None, :]
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32) + (l0 * alpha + tl.sum(w, 0))
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["first"])  # (its values vary by plan: see chunkserve.kernels.launch)
def _attend_kernel(
    Q,
    K,
    V,
    Kd,
    Vd,
    Out,
    PartO,
    PartLse,
    first,
    Count,
    Items,
    Chunks,
    SeqLens,
    SlotList,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kc,
    stride_kh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
    LAUNCH_NEXT: tl.constexpr,
    EARLY: tl.constexpr,
    TMA: tl.constexpr,
    TAIL: tl.constexpr,
    FOLD_P: tl.constexpr,
    FOLD_VEC_MIN: tl.constexpr,
    FOLD_PAIRS: tl.constexpr,
):
    # grid: (pieces, Hkv): piece `first + program_id(0)` for KV head kv; a fixed plan's launch
    # (Count not None) (Hkv, capacity), heads inner: its first capacity - Count programs return
    # at once, before any piece starts (chunkserve.kernels.tpp_plan.FixedPlans). Both phases share one code path:
    # query vector m is row row0 + m // G, head kv * G + m % G, live for rows < nrows (a phase-2
    # piece is one row: its G heads). One piece per program, no loop around the streaming loop:
    # nesting it in one slowed the streaming (records: 'Figures behind the code').
    if LAUNCH_NEXT:  # the next launch may start once every program here is past this (tpp_decode)
        gdc_launch_dependents()
    if Count is not None:
        n = tl.load(Count)
        piece = tl.program_id(1) - (tl.num_programs(1) - n)
        kv = tl.program_id(0)
        hq = G * tl.num_programs(0)
        if piece < 0:
            if EARLY:  # no program here waits below, but the merge must follow phase 1
                if n == 0:
                    gdc_wait()
            return
    else:
        piece = tl.program_id(0)
        kv = tl.program_id(1)
        hq = G * tl.num_programs(1)
    it = Items + (first + piece) * 10
    row0 = tl.load(it + 1)
    nrows = tl.load(it + 2)
    chunk0 = tl.load(it + 3)
    nchunks = tl.load(it + 4)
    end = tl.load(it + 5)
    slot = tl.load(it + 6)
    fold0 = tl.load(it + 7)
    nfold = tl.load(it + 8)
    cid0 = tl.load(it + 9)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    r = offs_m // G
    head = kv * G + offs_m % G
    live = r < nrows
    rows = (row0 + r).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0
    ).to(DOT_T)  # [BLOCK_M, D]
    # only a row's last chunk can be partial (phase 2; phase 1 has end 0): cut the tokens past
    # seq_len off this piece
    # (none at all for a piece of reserved chunks past it: a plan built with `reserved`)
    n_tok = tl.maximum(nchunks * C - tl.maximum(end - tl.load(SeqLens + row0), 0), 0)
    acc, m_i, l_i = _attend(
        q,
        K,
        V,
        Kd,
        Vd,
        Chunks + chunk0,
        cid0,
        n_tok,
        kv,
        stride_kc,
        stride_kh,
        qk_scale,
        BLOCK_M,
        C,
        D,
        BLOCK_N,
        DOT_T,
        DOT_PREC,
        TMA,
        TAIL,
    )
    if EARLY:  # started before the launch before completed: past this point it has
        gdc_wait()
    # a finishing phase-2 piece folds in its row's phase-1 partials (nfold = 0 otherwise)
    if FOLD_P > 1:
        if nfold >= FOLD_VEC_MIN:
            if G == 1:
                acc, m_i, l_i = _fold_vector(
                    acc, m_i, l_i, PartO, PartLse, fold0, nfold, kv, hq, offs_m, offs_d, BLOCK_M, D, FOLD_P
                )
            else:
                acc, m_i, l_i = _fold_rows(
                    acc, m_i, l_i, PartO, PartLse, fold0, nfold, head, hq, live, offs_d, D, FOLD_P
                )
        else:
            acc, m_i, l_i = _fold_each(
                acc, m_i, l_i, PartO, PartLse, fold0, nfold, head, hq, live, offs_d, D, FOLD_PAIRS
            )
    else:
        acc, m_i, l_i = _fold_each(acc, m_i, l_i, PartO, PartLse, fold0, nfold, head, hq, live, offs_d, D, FOLD_PAIRS)
    # a piece that attended nothing (a shortened row) has l = 0: o = 0, lse = -inf, no NaN
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = tl.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
    if slot < 0:  # the row's only piece: its output
        tl.store(
            Out + rows[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
            o.to(Out.dtype.element_ty),
            mask=live[:, None],
        )
    else:  # part_o: [P, Hq, D], part_lse: [P, Hq], contiguous
        part = tl.load(SlotList + slot + r, mask=live, other=0).to(tl.int64) * hq + head
        tl.store(PartO + part[:, None] * D + offs_d[None, :], o, mask=live[:, None])
        tl.store(PartLse + part, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=live)


@triton.jit(do_not_specialize=["first", "n_items"])
def _attend_rows_kernel(
    Q,
    K,
    V,
    Out,
    PartO,
    PartLse,
    first,
    n_items,
    Items,
    Chunks,
    SeqLens,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kc,
    stride_kh,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    C: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_T: tl.constexpr,
    DOT_PREC: tl.constexpr,
    EARLY: tl.constexpr,
):
    # Phase 2, grid (ceil(items / ROWS), Hkv): items first + p * ROWS .. + ROWS - 1, each a row's
    # whole private part ending the row (slot -1), their chunk runs back to back in Chunks. One
    # flat loop streams the runs one after another, a chunk per step; query vector m is row slot
    # m // G, head kv * G + m % G, and a chunk's scores are masked to the row slot that owns it
    # (every vector keeps its own online-softmax state; one that owns no block yet has m = -inf).
    kv = tl.program_id(1)
    hq = G * tl.num_programs(1)
    offs_t = tl.arange(0, ROWS)
    base = tl.program_id(0) * ROWS
    it_ok = base + offs_t < n_items
    its = Items + (first + base + offs_t) * 10
    rows = tl.load(its + 1, mask=it_ok, other=0)
    nch = tl.load(its + 4, mask=it_ok, other=0)  # [ROWS] chunks of each row slot (0 past the items)
    ends = tl.cumsum(nch, 0)  # the flat block index where each row slot's run ends
    starts = ends - nch
    endtok = tl.load(its + 5, mask=it_ok, other=0)
    lens = tl.load(SeqLens + rows, mask=it_ok, other=0)
    ntok = tl.maximum(nch * C - tl.maximum(endtok - lens, 0), 0)  # [ROWS] tokens to attend
    fold0s = tl.load(its + 7, mask=it_ok, other=0)
    nfolds = tl.load(its + 8, mask=it_ok, other=0)
    chunk0 = tl.load(Items + (first + base) * 10 + 3)
    total = tl.sum(nch, 0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, C)
    t_m = offs_m // G
    live = t_m < tl.minimum(ROWS, n_items - base)
    sel = t_m[:, None] == offs_t[None, :]  # [BLOCK_M, ROWS]: vector m's row slot
    row_m = tl.sum(tl.where(sel, rows[None, :], 0), 1).to(tl.int64)
    fold0 = tl.sum(tl.where(sel, fold0s[None, :], 0), 1)
    nfold = tl.sum(tl.where(sel, nfolds[None, :], 0), 1)
    head = kv * G + offs_m % G
    q = tl.load(
        Q + row_m[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0
    ).to(DOT_T)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_off = kv.to(tl.int64) * stride_kh
    offs_blk = offs_n[:, None] * D + offs_d[None, :]
    cid = tl.load(Chunks + chunk0)
    for i in range(0, total):
        # the next chunk id a block ahead (see _attend's pointer loop)
        cid_next = tl.load(Chunks + chunk0 + i + 1, mask=i + 1 < total, other=0)
        rb = tl.sum((ends <= i).to(tl.int32), 0)  # the row slot this chunk belongs to
        start_rb = tl.sum(tl.where(offs_t == rb, starts, 0), 0)
        ntok_rb = tl.sum(tl.where(offs_t == rb, ntok, 0), 0)
        tok_live = (i - start_rb) * C + offs_n < ntok_rb
        run = cid.to(tl.int64) * stride_kc + kv_off
        k = tl.load(K + run + offs_blk, mask=tok_live[:, None], other=0.0)  # [C, D]
        v = tl.load(V + run + offs_blk, mask=tok_live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT_T)), input_precision=DOT_PREC) * qk_scale
        s = tl.where((t_m == rb)[:, None] & tok_live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # vectors that own nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_T), v.to(DOT_T), input_precision=DOT_PREC)
        m_i = m_new
        cid = cid_next
    if EARLY:  # started before phase 1 completed: past this point it has
        gdc_wait()
    for j in range(0, tl.max(tl.where(live, nfold, 0), 0)):  # each row's phase-1 partials
        fl = live & (j < nfold)
        part = (fold0 + j).to(tl.int64) * hq + head
        lse = tl.load(PartLse + part, mask=fl, other=float("-inf"))
        o_j = tl.load(PartO + part[:, None] * D + offs_d[None, :], mask=fl[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + o_j * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new
    o = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(
        Out + row_m[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
        o.to(Out.dtype.element_ty),
        mask=live[:, None],
    )


@triton.jit
def _merge_kernel(Out, PartO, PartLse, Count, Items, stride_ob, stride_oh, D: tl.constexpr, BLOCK_P: tl.constexpr):
    # grid: (merge rows, Hq): fold the row's partials (o, lse) at slots slot0 .. slot0 + n - 1;
    # a fixed plan's (Count not None) (Hq, rows), its programs past Count rows last, returning.
    # (One head per program: blocks of heads, as [BLOCK_P, heads, D] loads, were slower; records.)
    if Count is not None:
        item = tl.program_id(1)
        head = tl.program_id(0)
        hq = tl.num_programs(0)
        if item >= tl.load(Count):
            return
    else:
        item = tl.program_id(0)
        head = tl.program_id(1)
        hq = tl.num_programs(1)
    row = tl.load(Items + item * 3 + 0)
    slot0 = tl.load(Items + item * 3 + 1)
    n = tl.load(Items + item * 3 + 2)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    m_i = tl.max(tl.full([BLOCK_P], float("-inf"), dtype=tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_P], dtype=tl.float32), 0)
    acc = tl.zeros([D], dtype=tl.float32)
    for p0 in range(0, n, BLOCK_P):
        live = p0 + offs_p < n
        s = (slot0 + p0 + offs_p).to(tl.int64) * hq + head  # [BLOCK_P]
        lse = tl.load(PartLse + s, mask=live, other=float("-inf"))  # -inf: a piece that read nothing
        o = tl.load(PartO + s[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)  # [BLOCK_P, D]
        m_new = tl.maximum(m_i, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe)  # [BLOCK_P]
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    o = tl.where(l_i > 0, acc / tl.where(l_i > 0, l_i, 1.0), 0.0)
    tl.store(Out + row.to(tl.int64) * stride_ob + head * stride_oh + offs_d, o.to(Out.dtype.element_ty))


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _use_tma(q: Tensor, k_cache: Tensor, c: int, block_n: int) -> bool:
    """Whether whole K/V blocks can come through TMA descriptors over the caches' [chunks * Hkv
    * c, D] row view: sm90+ (or the interpreter, for tests), the caches contiguous (the view
    exists) and a block inside one chunk (one box of rows)."""
    # (box coordinates are int32 rows)
    if not _TMA or block_n > c or not k_cache.is_contiguous() or k_cache.numel() // k_cache.shape[-1] >= 2**31:
        return False
    if q.is_cuda:
        return _sm90_plus(q.device.index) and k_cache.data_ptr() % 16 == 0
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _sm90_plus(device_index: int) -> bool:
    """Programmatic dependent launch and TMA need sm90+ (asked once per device: tpp_decode runs per layer)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


class TppDecoder:
    """``tpp_decode`` for one engine, its host work per layer cut down to the launches.

    A plan serves every layer of every step it lives for, with the same arguments but the layer's
    caches: so its launches (kernel, grid, constexprs, options, arguments) are worked out once,
    at its first call, and kept on the plan; the caches' TMA descriptors are made once per cache
    (kept here, so they go with the engine); each launch runs from its compiled kernel
    (``chunkserve.kernels.launch``), not through Triton's dispatcher.
    """

    def __init__(self) -> None:
        self._descriptors: dict[tuple, TensorDescriptor] = {}

    def __call__(
        self,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        plan: TppPlan,
        sm_scale: float | None = None,
        out: Tensor | None = None,
    ) -> Tensor:
        """See ``tpp_decode``."""
        out = torch.empty_like(q) if out is None else out
        # what _check and the launches depend on (the launch knobs too: tests set them): a call
        # like one seen before needs neither again
        sig = (
            q.shape,
            q.stride(),
            q.dtype,
            q.get_device(),
            k_cache.shape,
            k_cache.stride(),
            k_cache.dtype,
            k_cache.get_device(),
            v_cache.stride(),
            v_cache.dtype,
            v_cache.get_device(),
            out.shape,
            out.stride(),
            out.dtype,
            out.get_device(),
            sm_scale,
            _PDL,
            _TMA,
            tpp_plan._FOLD_MAX,
            _FOLD_VEC_MIN,
            _FOLD_VEC_MIN_GQA,
            _FOLD_PAIRS,
            _ROWS_BLOCK_BYTES,
        )
        launches = plan.launch_cache.get(sig)
        if launches is None:
            _check(q, k_cache, v_cache, plan, out)
            launches = plan.launch_cache[sig] = _plan_launches(q, k_cache, out, plan, sm_scale)
        if not launches:
            return out
        spec = aligned(q, k_cache, v_cache, out)
        for fn, grid, (kind, block_n), tail, options, key in launches:
            if kind == 0 and block_n:  # _attend_kernel, K/V blocks by TMA
                args = (
                    q,
                    k_cache,
                    v_cache,
                    self._descriptor(k_cache, block_n),
                    self._descriptor(v_cache, block_n),
                    out,
                    *tail,
                )
            elif kind == 0:
                args = (q, k_cache, v_cache, None, None, out, *tail)
            elif kind == 1:  # _attend_rows_kernel
                args = (q, k_cache, v_cache, out, *tail)
            else:  # _merge_kernel
                args = (out, *tail)
            launch(fn, grid, args, options, (key, spec))
        return out

    def _descriptor(self, cache: Tensor, block_n: int) -> TensorDescriptor:
        # (a cache's view made by the pool per call: keyed by where it lies, not by the object)
        key = (cache.data_ptr(), cache.shape, cache.stride(), cache.dtype, block_n)
        found = self._descriptors.get(key)
        if found is None:
            d = cache.shape[-1]
            found = self._descriptors[key] = TensorDescriptor.from_tensor(cache.view(-1, d), [block_n, d])
        return found


def tpp_decode(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TppPlan, sm_scale: float | None = None, out: Tensor | None = None
) -> Tensor:
    """Decode attention of one query token per row over the plan's tree. Returns [B, Hq, D] in q.dtype.

    q: [B, Hq, D] (last dim contiguous); k_cache, v_cache: [num_chunks, Hkv, c, D] with the same
    strides, each chunk's [c, D] block of one head contiguous; fp16, bf16 or fp32 (all three
    tensors the same dtype). plan: ``build_plan`` for the same rows, heads, head dim and c.
    out: [B, Hq, D] of q's dtype (last dim contiguous) to write, else a new tensor. An engine
    calls a ``TppDecoder`` of its own instead (the same, with its host work cached).
    """
    return TppDecoder()(q, k_cache, v_cache, plan, sm_scale, out)


def _plan_launches(q: Tensor, k_cache: Tensor, out: Tensor, plan: TppPlan, sm_scale: float | None) -> tuple:
    """The plan's launches for calls like this one: (kernel, grid, (kind, TMA block or 0), the
    arguments after the tensors a call brings, options, key) each; see TppDecoder."""
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    if b == 0:
        return ()
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * _LOG2E
    # fp32 caches: exact products, no TF32. The Triton interpreter (3.9) multiplies bf16 tensors
    # as raw bits, so there bf16 operands are multiplied as their exact fp32 upcasts.
    prec, dot_t = "tf32", _TL_DTYPE[q.dtype]
    if q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"):
        prec, dot_t = "ieee", tl.float32
    sk = k_cache.stride()
    strides = (q.stride(0), q.stride(1), sk[0], sk[1], out.stride(0), out.stride(1))
    # Programmatic dependent launch (sm90+): phase 2's launch may start once every phase-1
    # program has, so the two phases stream side by side. A phase-2 program waits for phase 1
    # to complete (gdc_wait) after its own streaming, before it folds phase-1 partials; all of
    # them wait, so phase 2 completes after phase 1 and the merge (and whatever follows),
    # launched plainly, after both. (The merge launched early too was slower; records.)
    pdl = _PDL and q.is_cuda and _sm90_plus(q.device.index)
    n = len(plan.launches)
    vec_min = _FOLD_VEC_MIN if g == 1 else _FOLD_VEC_MIN_GQA
    if plan.most_folds < vec_min:  # no row takes the vector fold: compile the loop alone
        vec_min = 0
    launches = []
    for i, (first, programs, block_m, live, phase) in enumerate(plan.launches):
        early = dict(launch_pdl=True) if pdl and i > 0 else {}
        if phase == 2 and plan.rows_per_program > 1 and c * d * q.element_size() <= _ROWS_BLOCK_BYTES:  # see _ROWS
            rows = plan.rows_per_program
            tail = (
                plan.part_o,
                plan.part_lse,
                first,
                programs,
                plan.items,
                plan.chunks,
                plan.seq_lens,
                scale,
                *strides,
                g,
                c,
                d,
                rows,
                max(16, triton.next_power_of_2(rows * g)),
                dot_t,
                prec,
                pdl and i > 0,
            )
            options = {**_ROWS_CONFIG, **early}
            launches.append(
                (
                    _attend_rows_kernel,
                    (triton.cdiv(programs, rows), hkv, 1),
                    (1, 0),
                    tail,
                    options,
                    (q.dtype, tail[8:], tuple(options.items())),
                )
            )
            continue
        lean = plan.lean_phase1 if phase == 1 else plan.lean_phase2 if phase == 2 else False
        cfg = tpp_plan._launch_config(d, block_m, q.element_size(), live, lean)
        # K/V blocks by TMA (sm90+), see _attend: phase 1 streams faster by it. Not phase 2: MHA's
        # one-buffer phase-2 tile is slower by it (each copy's wait exposed), GQA's on par (figures:
        # chunkserve/kernels/tools/records/README.md, 'Figures behind the code').
        tma = phase != 2 and _use_tma(q, k_cache, c, cfg["BLOCK_N"])
        block_n = cfg.pop("BLOCK_N")
        tail = (
            plan.part_o,
            plan.part_lse,
            first,
            None if plan.counts is None else plan.count(phase - 1),
            plan.items,
            plan.chunks,
            plan.seq_lens,
            plan.slot_list,
            scale,
            *strides,
            g,
            c,
            d,
            block_m,
            block_n,
            dot_t,
            prec,
            pdl and i + 1 < n,
            pdl and i > 0,
            tma,
            phase != 1,  # TAIL: phase-1 pieces read whole chunks
            triton.next_power_of_2(tpp_plan._FOLD_MAX) if vec_min and phase == 2 else 1,  # FOLD_P, see _FOLD_VEC_MIN
            vec_min,
            _FOLD_PAIRS and phase == 2 and plan.most_folds > 1,
        )
        options = {**cfg, **early}
        launches.append(
            (
                _attend_kernel,
                (programs, hkv, 1) if plan.counts is None else (hkv, programs, 1),
                (0, block_n if tma else 0),
                tail,
                options,
                (q.dtype, tail[9:], tuple(options.items()), plan.counts is None),
            )
        )
    if plan.merge_items.shape[0]:
        count = None if plan.counts is None else plan.count(2)
        tail = (plan.part_o, plan.part_lse, count, plan.merge_items, out.stride(0), out.stride(1), d, plan.block_p)
        options = dict(num_warps=1)  # one warp: no cross-warp reduction (faster; records)
        launches.append(
            (
                _merge_kernel,
                (plan.merge_items.shape[0], hq, 1) if count is None else (hq, plan.merge_items.shape[0], 1),
                (2, 0),
                tail,
                options,
                (q.dtype, tail[4:], tuple(options.items()), count is None),
            )
        )
    return tuple(launches)


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TppPlan, out: Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_chunks, Hkv, c, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must have the same strides, got {k_cache.stride()} and {v_cache.stride()}"
        )
    b, hq, d = q.shape
    _, hkv, c, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q head dim {d} != cache head dim {dk}")
    if k_cache.stride(3) != 1 or k_cache.stride(2) != d:
        raise ValueError(f"each cache chunk's [c, D] block per head must be contiguous, got strides {k_cache.stride()}")
    if q.stride(2) != 1:
        raise ValueError(f"q's last dim must be contiguous, got strides {q.stride()}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache, v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if not (q.device == k_cache.device == v_cache.device == plan.seq_lens.device):
        raise ValueError(
            f"q, caches and plan must be on one device, got {q.device}, {k_cache.device}, "
            f"{v_cache.device}, {plan.seq_lens.device}"
        )
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1 or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with its last dim contiguous, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}"
        )
    got = (b, hq, hkv, d, c)
    want = (plan.batch_size, plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.chunk_size)
    if plan.max_rows is not None and plan.batch_size <= b <= plan.max_rows:  # a fixed plan's padded rows
        got = (plan.batch_size, *got[1:])
    if got != want:
        raise ValueError(f"(B, Hq, Hkv, D, c) = {got} does not match the plan's {want}")
