"""Two-phase partition (TPP) decode attention over the chunked prefix-tree KV cache, in Triton.

Cache layout (DESIGN §3), per layer: ``k_cache, v_cache: [num_chunks, Hkv, c, D]``; query head
``h`` reads KV head ``h // G``. ``build_plan`` turns the decode batch (rows in prefix-tree DFS
order) into flat device work lists once per tree shape; ``tpp_decode`` runs at most three
launches per layer (DESIGN §4, ChunkAttention):

- phase 1, chunk-first: one program per (shared segment piece x row tile, KV head). The rows of
  the tile times the G query heads of the KV head form one [M, D] query matrix (GQA folded into
  M) that streams the piece's chunks once with ``tl.dot`` (fp32 accumulation) and writes a
  partial state (o normalised, lse) in fp32 for each of its rows.
- phase 2, sequence-first: one program per (row, KV head, split). It attends its share of the
  row's private chunks (the tail chunk masked to the row's length) and, in the row's first split,
  merges the phase-1 partials of every segment covering the row (online softmax). An unsplit row
  writes its output directly; a split row writes one more partial per split.
- combine, only when some row is split: one program per (split row, KV head) merges its splits.

All softmax arithmetic is in base 2: scores are pre-multiplied by ``sm_scale * log2(e)`` and
``lse`` is ``log2(sum exp2(s))``. Same semantics as ``kernels.reference.tpp_decode_ref``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.reference import TreePlan, build_tree_plan

__all__ = ["TppPlan", "build_plan", "tpp_decode"]

_LOG2E = 1.4426950408889634
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# Split-K: a plan aims at `_WAVES` programs per multiprocessor in each phase, never cutting a
# piece shorter than these many tokens (a phase-1 piece writes rows * G * D fp32 partials per
# KV head and a phase-2 split G * D, so phase-1 pieces must be longer to amortise them).
_WAVES = 4
_P1_MIN_SPLIT_TOKENS = 512
_P2_MIN_SPLIT_TOKENS = 256
# Phase-1 query tile: rows * G up to this many query vectors per program.
_P1_MAX_M = 64

# Item fields (int32 rows of the plan's work lists), in kernel argument order.
_P1_FIELDS = 5  # row0, nrows, chunk0 (into p1_chunks), nchunks, slot0 (into the partials)
_P2_FIELDS = 6  # row, chunk0 (into p2_chunks), nchunks, end (tokens through its last chunk), slot, merge
_CB_FIELDS = 3  # row, slot0 (into the split partials), nsplits


@dataclass(frozen=True)
class TppPlan:
    """Device work lists for one decode batch; reused by every layer until the tree changes.

    ``seq_lens: [B]`` int32 may be bumped in place between steps (``plan.seq_lens += 1``) as
    long as every row's new tokens stay inside its last (private, reserved) chunk; anything else
    (a row joins or leaves, a tail chunk fills) needs a new plan. The partial buffers belong to
    the plan, so one plan serves one stream at a time.
    """

    tree: TreePlan
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    chunk_size: int
    seq_lens: Tensor  # [B] int32
    p1_items: Tensor  # [I1, 5] int32
    p1_chunks: Tensor  # [sum of segment lengths] int32 chunk ids, one run per segment
    p1_block_m: int  # phase-1 query tile (rows * G padded to a power of two >= 16)
    p2_items: Tensor  # [I2, 6] int32, at least one per row
    p2_chunks: Tensor  # [sum of private chunks] int32 chunk ids, one run per row
    row_ptr: Tensor  # [B + 1] int32: row r merges phase-1 partials row_parts[row_ptr[r]:row_ptr[r+1]]
    row_parts: Tensor  # [sum of segment rows over pieces] int32 slots of part_o / part_lse
    cb_items: Tensor  # [R, 3] int32, rows with more than one phase-2 split
    part_o: Tensor  # [P, Hq, D] fp32 phase-1 partial outputs (normalised)
    part_lse: Tensor  # [P, Hq] fp32 their log2-sum-exp2
    split_o: Tensor  # [S, Hq, D] fp32 phase-2 split partials
    split_lse: Tensor  # [S, Hq] fp32

    @property
    def batch_size(self) -> int:
        return len(self.tree.seq_lens)


def _pieces(total: int, piece: int) -> list[tuple[int, int]]:
    """[0, total) cut into ceil(total / piece) near-equal (start, length) pieces."""
    n = max(1, -(-total // max(1, piece)))
    bounds = [total * i // n for i in range(n + 1)]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a token parallelism so that small tests still split


def build_plan(
    chunk_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    chunk_size: int,
    device: torch.device | str,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    target_programs: int | None = None,
) -> TppPlan:
    """Plan TPP decode for a batch whose rows are in prefix-tree DFS order.

    chunk_tables[r], seq_lens[r]: as in ``kernels.reference.build_tree_plan`` (which finds the
    shared segments and raises ValueError on tables that do not form contiguous row ranges).
    The heads fix the phase-1 row tiles (rows * G query vectors per tile) and the split-K
    degree; ``target_programs`` (default: 4 per multiprocessor) is the parallelism each phase
    aims at: segments and long private parts are cut into pieces until it is reached.
    """
    device = torch.device(device)
    if num_q_heads <= 0 or num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a positive multiple of num_kv_heads={num_kv_heads}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    tree = build_tree_plan(chunk_tables, seq_lens, chunk_size)
    c, g, hkv = chunk_size, num_q_heads // num_kv_heads, num_kv_heads
    b = len(tree.seq_lens)
    target = target_programs or _WAVES * _num_sms(device)
    per_head = max(1, -(-target // hkv))  # programs per KV head to aim at

    # phase 1: segment -> row tiles x chunk pieces; one partial slot per (piece, row)
    max_rows = max((s.row_end - s.row_start for s in tree.segments), default=1)
    block_m = max(16, min(triton.next_power_of_2(max_rows * g), max(_P1_MAX_M, triton.next_power_of_2(g))))
    rows_per_tile = max(1, block_m // g)
    tiles = [_pieces(s.row_end - s.row_start, rows_per_tile) for s in tree.segments]
    work = sum(len(t) * len(s.chunk_ids) for s, t in zip(tree.segments, tiles))  # chunk-tiles
    piece1 = max(-(-_P1_MIN_SPLIT_TOKENS // c), -(-work // per_head))
    p1_items, p1_chunks, row_parts = [], [], [[] for _ in range(b)]
    slot = 0
    for seg, seg_tiles in zip(tree.segments, tiles):
        base = len(p1_chunks)
        p1_chunks.extend(seg.chunk_ids)
        for c0, nc in _pieces(len(seg.chunk_ids), piece1):
            for t0, nt in seg_tiles:
                r0 = seg.row_start + t0
                p1_items.append((r0, nt, base + c0, nc, slot))
                for r in range(nt):
                    row_parts[r0 + r].append(slot + r)
                slot += nt
    num_parts = slot

    # phase 2: each row's private chunks, cut into splits when long
    covered = [set() for _ in range(b)]
    for seg in tree.segments:
        span = range(seg.chunk_start, seg.chunk_start + len(seg.chunk_ids))
        for r in range(seg.row_start, seg.row_end):
            covered[r].update(span)
    work = sum(len(ids) for ids in tree.private_chunks)
    piece2 = max(-(-_P2_MIN_SPLIT_TOKENS // c), -(-work // per_head))
    p2_items, p2_chunks, cb_items = [], [], []
    splits = 0
    for r, ids in enumerate(tree.private_chunks):
        positions = [p for p in range(-(-tree.seq_lens[r] // c)) if p not in covered[r]]
        base = len(p2_chunks)
        p2_chunks.extend(ids)
        pieces = _pieces(len(ids), piece2)
        if len(pieces) > 1:
            cb_items.append((r, splits, len(pieces)))
        for k, (c0, nc) in enumerate(pieces):
            end = (positions[c0 + nc - 1] + 1) * c if nc else 0
            slot = splits + k if len(pieces) > 1 else -1
            p2_items.append((r, base + c0, nc, end, slot, int(k == 0)))
        if len(pieces) > 1:
            splits += len(pieces)

    def i32(rows, width=None):
        t = torch.tensor(rows, dtype=torch.int32)
        return (t.view(-1, width) if width else t).to(device)

    ptr = [0]
    for parts in row_parts:
        ptr.append(ptr[-1] + len(parts))
    f32 = dict(dtype=torch.float32, device=device)
    return TppPlan(
        tree=tree,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        chunk_size=c,
        seq_lens=i32(list(tree.seq_lens)),
        p1_items=i32(p1_items, _P1_FIELDS),
        p1_chunks=i32(p1_chunks),
        p1_block_m=block_m,
        p2_items=i32(p2_items, _P2_FIELDS),
        p2_chunks=i32(p2_chunks),
        row_ptr=i32(ptr),
        row_parts=i32([s for parts in row_parts for s in parts]),
        cb_items=i32(cb_items, _CB_FIELDS),
        part_o=torch.empty(num_parts, num_q_heads, head_dim, **f32),
        part_lse=torch.empty(num_parts, num_q_heads, **f32),
        split_o=torch.empty(splits, num_q_heads, head_dim, **f32),
        split_lse=torch.empty(splits, num_q_heads, **f32),
    )


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@triton.jit
def _attend(q, acc, m_i, l_i, K, V, chunks, n_tok, kv_off, stride_kc, qk_scale,
            C: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_T: tl.constexpr,
            DOT_PREC: tl.constexpr):
    """Online softmax of q: [M, D] over tokens [0, n_tok) of the chunk run at `chunks`.

    acc: [M, D] fp32 unnormalised output, m_i / l_i: [M] running max / sum (base 2). Token t
    lives in chunk chunks[t // C] at slot t % C; kv_off selects the KV head inside a chunk.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in range(0, n_tok, BLOCK_N):
        t = start + offs_n
        live = t < n_tok
        cid = tl.load(chunks + t // C, mask=live, other=0).to(tl.int64)
        tok = cid * stride_kc + kv_off + (t % C) * D  # [BLOCK_N] element offset of each token
        ptrs = tok[:, None] + offs_d[None, :]
        k = tl.load(K + ptrs, mask=live[:, None], other=0.0).to(DOT_T)  # [BLOCK_N, D]
        v = tl.load(V + ptrs, mask=live[:, None], other=0.0).to(DOT_T)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [M, BLOCK_N]
        s = tl.where(live[None, :], s, float("-inf"))
        # every block holds a live token and padded query rows are zero, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # p rounded to the cache dtype, as the tensor cores take it
        acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype.element_ty).to(DOT_T), v, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _phase1_kernel(Q, K, V, PartO, PartLse, Items, Chunks, qk_scale,
                   stride_qb, stride_qh, stride_kc, stride_kh,
                   G: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (phase-1 items, Hkv); query vector m of the tile = row m // G, head kv * G + m % G
    item = tl.program_id(0)
    kv = tl.program_id(1)
    row0 = tl.load(Items + item * 5 + 0)
    nrows = tl.load(Items + item * 5 + 1)
    chunk0 = tl.load(Items + item * 5 + 2)
    nchunks = tl.load(Items + item * 5 + 3)
    slot0 = tl.load(Items + item * 5 + 4)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    r = offs_m // G
    head = kv * G + offs_m % G
    live = r < nrows
    q_ptrs = Q + (row0 + r).to(tl.int64)[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=live[:, None], other=0.0).to(DOT_T)  # [BLOCK_M, D]

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, Chunks + chunk0, nchunks * C,
                            kv.to(tl.int64) * stride_kh, stride_kc, qk_scale, C, D, BLOCK_N, DOT_T, DOT_PREC)

    # part_o: [P, Hq, D], part_lse: [P, Hq], contiguous; a piece always holds >= 1 full chunk
    hq = G * tl.num_programs(1)
    slot = (slot0 + r).to(tl.int64) * hq + head
    tl.store(PartO + slot[:, None] * D + offs_d[None, :], acc / l_i[:, None], mask=live[:, None])
    tl.store(PartLse + slot, m_i + tl.log2(l_i), mask=live)


@triton.jit
def _phase2_kernel(Q, K, V, Out, PartO, PartLse, SplitO, SplitLse, Items, Chunks, SeqLens,
                   RowPtr, RowParts, qk_scale,
                   stride_qb, stride_qh, stride_kc, stride_kh, stride_ob, stride_oh,
                   G: tl.constexpr, C: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, DOT_PREC: tl.constexpr):
    # grid: (phase-2 items, Hkv); query vector m = head kv * G + m, live for m < G
    item = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.load(Items + item * 6 + 0)
    chunk0 = tl.load(Items + item * 6 + 1)
    nchunks = tl.load(Items + item * 6 + 2)
    end = tl.load(Items + item * 6 + 3)
    slot = tl.load(Items + item * 6 + 4)
    merge = tl.load(Items + item * 6 + 5)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    head = kv * G + offs_m
    live = offs_m < G
    row64 = row.to(tl.int64)
    q = tl.load(Q + row64 * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=live[:, None], other=0.0).to(DOT_T)  # [BLOCK_M, D]

    # only the row's last chunk can be partial: cut the tokens past seq_len off this piece
    n_tok = nchunks * C - tl.maximum(end - tl.load(SeqLens + row), 0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend(q, acc, m_i, l_i, K, V, Chunks + chunk0, n_tok,
                            kv.to(tl.int64) * stride_kh, stride_kc, qk_scale, C, D, BLOCK_N, DOT_T, DOT_PREC)

    hq = G * tl.num_programs(1)
    if merge != 0:
        # fold in the phase-1 partial (o, lse) of every segment piece covering this row
        for i in range(tl.load(RowPtr + row), tl.load(RowPtr + row + 1)):
            p = tl.load(RowParts + i).to(tl.int64) * hq + head  # [BLOCK_M]
            lse = tl.load(PartLse + p, mask=live, other=0.0)  # 0, not -inf: padded rows stay finite
            o = tl.load(PartO + p[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(lse - m_new)
            acc = acc * alpha[:, None] + o * beta[:, None]
            l_i = l_i * alpha + beta
            m_i = m_new

    # a row that attended nothing (seq_len 0) has l = 0: write o = 0, lse = -inf, no NaN
    nonempty = l_i > 0
    o = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    if slot < 0:
        tl.store(Out + row64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(Out.dtype.element_ty), mask=live[:, None])
    else:
        s = slot.to(tl.int64) * hq + head
        tl.store(SplitO + s[:, None] * D + offs_d[None, :], o, mask=live[:, None])
        tl.store(SplitLse + s, tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)),
                                        float("-inf")), mask=live)


@triton.jit
def _combine_kernel(Out, SplitO, SplitLse, Items, stride_ob, stride_oh,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_G: tl.constexpr):
    # grid: (split rows, Hkv): merge the row's phase-2 splits (o, lse) into its output
    item = tl.program_id(0)
    kv = tl.program_id(1)
    row = tl.load(Items + item * 3 + 0)
    slot0 = tl.load(Items + item * 3 + 1)
    nsplits = tl.load(Items + item * 3 + 2)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, D)
    head = kv * G + offs_g
    live = offs_g < G
    hq = G * tl.num_programs(1)
    # lse of a split may be -inf (nothing attended): the max is taken over all splits first
    m = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for k in range(nsplits):
        m = tl.maximum(m, tl.load(SplitLse + (slot0 + k).to(tl.int64) * hq + head, mask=live, other=0.0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    for k in range(nsplits):
        s = (slot0 + k).to(tl.int64) * hq + head
        w = tl.exp2(tl.load(SplitLse + s, mask=live, other=float("-inf")) - m_safe)
        acc += w[:, None] * tl.load(SplitO + s[:, None] * D + offs_d[None, :], mask=live[:, None], other=0.0)
        l_i += w
    o = tl.where((l_i > 0)[:, None], acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(Out + row.to(tl.int64) * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=live[:, None])


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def _launch_config(phase: int, head_dim: int, block_m: int, elem_bytes: int) -> dict:
    """BLOCK_N (keys per step), warps and pipeline stages of the phase-1 or phase-2 kernel.

    One setting serves both phases today: an H200 sweep (``python -m kernels.bench sweep``) found
    nothing more than 3 % better for either; the phase argument lets the sweep vary one phase.
    """
    if head_dim >= 256:
        cfg = dict(BLOCK_N=32, num_warps=8 if block_m > 16 else 4, num_stages=2)
    else:
        cfg = dict(BLOCK_N=64, num_warps=4, num_stages=3)
    # K and V tiles of every stage in shared memory: keep them under 128 KB (fp32 caches)
    per_stage = 2 * cfg["BLOCK_N"] * head_dim * elem_bytes
    cfg["num_stages"] = max(1, min(cfg["num_stages"], (128 << 10) // per_stage))
    return cfg


def tpp_decode(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TppPlan, sm_scale: float | None = None) -> Tensor:
    """Decode attention of one query token per row over the plan's tree. Returns [B, Hq, D] in q.dtype.

    q: [B, Hq, D] (last dim contiguous); k_cache, v_cache: [num_chunks, Hkv, c, D] with the same
    strides, each chunk's [c, D] block of one head contiguous; fp16, bf16 or fp32 (all three
    tensors the same dtype). plan: ``build_plan`` for the same rows, heads, head dim and c.
    """
    _check(q, k_cache, v_cache, plan)
    b, hq, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    g = hq // hkv
    out = torch.empty_like(q)
    if b == 0:
        return out
    scale = (1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)) * _LOG2E
    # fp32 caches: exact products, no TF32. The Triton interpreter (3.9) multiplies bf16 tensors
    # as raw bits, so there bf16 operands are multiplied as their exact fp32 upcasts.
    prec, dot_t = "tf32", _TL_DTYPE[q.dtype]
    if q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"):
        prec, dot_t = "ieee", tl.float32
    sk = k_cache.stride()

    n1 = plan.p1_items.shape[0]
    if n1:
        _phase1_kernel[(n1, hkv)](
            q, k_cache, v_cache, plan.part_o, plan.part_lse, plan.p1_items, plan.p1_chunks, scale,
            q.stride(0), q.stride(1), sk[0], sk[1],
            G=g, C=c, D=d, BLOCK_M=plan.p1_block_m, DOT_T=dot_t, DOT_PREC=prec, **_launch_config(1, d, plan.p1_block_m, q.element_size()))
    block_m2 = max(16, triton.next_power_of_2(g))
    _phase2_kernel[(plan.p2_items.shape[0], hkv)](
        q, k_cache, v_cache, out, plan.part_o, plan.part_lse, plan.split_o, plan.split_lse,
        plan.p2_items, plan.p2_chunks, plan.seq_lens, plan.row_ptr, plan.row_parts, scale,
        q.stride(0), q.stride(1), sk[0], sk[1], out.stride(0), out.stride(1),
        G=g, C=c, D=d, BLOCK_M=block_m2, DOT_T=dot_t, DOT_PREC=prec, **_launch_config(2, d, block_m2, q.element_size()))
    if plan.cb_items.shape[0]:
        _combine_kernel[(plan.cb_items.shape[0], hkv)](
            out, plan.split_o, plan.split_lse, plan.cb_items, out.stride(0), out.stride(1),
            G=g, D=d, BLOCK_G=triton.next_power_of_2(g), num_warps=4)
    return out


def _check(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: TppPlan) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_chunks, Hkv, c, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must have the same strides, got {k_cache.stride()} and {v_cache.stride()}")
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
        raise ValueError(f"q, caches and plan must be on one device, got {q.device}, {k_cache.device}, "
                         f"{v_cache.device}, {plan.seq_lens.device}")
    got = (b, hq, hkv, d, c)
    want = (plan.batch_size, plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.chunk_size)
    if got != want:
        raise ValueError(f"(B, Hq, Hkv, D, c) = {got} does not match the plan's {want}")
