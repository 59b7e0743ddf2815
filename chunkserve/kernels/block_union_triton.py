"""block_union's Triton kernels (chunkserve/kernels/block_union.py plans and launches them), apart
so that block_union's CPU path imports no Triton (as tpp.py's kernels are apart from tpp_plan.py's
work lists):

- `agg_kernel`: a list's block scores from the queries and the blocks' key bounds, softmax over
  the blocks, normalised and folded over the list's heads and query blocks (`block_agg`);
- `pages_kernel`: a budget's chosen blocks' chunks written into the planned page lists (`write_pages`);
- `block_keys_kernel`: one layer's block bounds from the pool's chunk bounds (`block_keys_gpu`);
- `chunk_bounds_kernel`: each filled chunk's key bounds (max and min of its keys), every layer
  in one launch (`bound_chunks`).
"""

import triton
import triton.language as tl

__all__ = ["agg_kernel", "block_keys_kernel", "chunk_bounds_kernel", "pages_kernel"]


@triton.jit
def agg_kernel(
    Q,
    Bounds,
    Scratch,
    Agg,
    AggBits,
    Limits,
    T,
    NB,
    SPAN_QB,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kh,
    qk_scale,
    spread,
    G: tl.constexpr,
    SUB: tl.constexpr,
    HP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FOLD_SUM: tl.constexpr,
):
    # one program per (HP query heads of one sub-group, query block), its M = HP * BLOCK_Q
    # rows head after head: two passes over the blocks it sees (each row's softmax max
    # and sum, then each head's mean of its rows' p into Scratch with each head's max), a
    # third folding the heads' p / max into their span's list's row of Agg by an atomic
    # max (on the float bits: all are >= 0) or an atomic add. A score is two dots of head
    # dim D: (q + spread |q|) / 2 · max + (q - spread |q|) / 2 · min.
    M: tl.constexpr = HP * BLOCK_Q
    head0, qblk = tl.program_id(0) * HP, tl.program_id(1)
    kv = head0 // G
    lst = (qblk // SPAN_QB) * (tl.num_programs(0) * HP // SUB) + head0 // SUB
    seen = tl.load(Limits + qblk).to(tl.int32)
    heads = head0 + tl.arange(0, HP)
    rows = qblk * BLOCK_Q + tl.arange(0, M) % BLOCK_Q
    live = rows < T
    offs_d = tl.arange(0, D)
    n_rows = tl.minimum(T - qblk * BLOCK_Q, BLOCK_Q).to(tl.float32)
    scratch = Scratch + (heads[:, None] * tl.num_programs(1) + qblk) * NB  # [HP, 1]
    row_head = head0 + tl.arange(0, M) // BLOCK_Q
    q = tl.load(
        Q + rows[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :],
        mask=live[:, None],
        other=0.0,
    )
    qf = q.to(tl.float32)
    half = tl.abs(qf) * spread
    q_hi, q_lo = ((qf + half) * 0.5).to(q.dtype), ((qf - half) * 0.5).to(q.dtype)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    for n0 in range(0, seen, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        at = Bounds + cols[:, None] * stride_kb + kv * stride_kh + offs_d[None, :]
        k_max = tl.load(at, mask=(cols < seen)[:, None], other=0.0)
        k_min = tl.load(at + D, mask=(cols < seen)[:, None], other=0.0)
        s = tl.dot(q_lo, tl.trans(k_min), acc=tl.dot(q_hi, tl.trans(k_max))) * qk_scale  # log2 domain
        s = tl.where((cols < seen)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    w = tl.where(live, 1.0 / (l_i * n_rows), 0.0)  # each live row's 1 / (sum * rows)
    best = tl.zeros([HP], tl.float32)
    for n0 in range(0, seen, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        at = Bounds + cols[:, None] * stride_kb + kv * stride_kh + offs_d[None, :]
        k_max = tl.load(at, mask=(cols < seen)[:, None], other=0.0)
        k_min = tl.load(at + D, mask=(cols < seen)[:, None], other=0.0)
        s = tl.dot(q_lo, tl.trans(k_min), acc=tl.dot(q_hi, tl.trans(k_max))) * qk_scale
        p = tl.sum(tl.reshape(tl.exp2(s - m_i[:, None]) * w[:, None], (HP, BLOCK_Q, BLOCK_N)), 1)
        p = tl.where((cols < seen)[None, :], p, 0.0)  # [HP, BLOCK_N]
        tl.store(scratch + cols[None, :], p, mask=(cols < seen)[None, :])
        best = tl.maximum(best, tl.max(p, 1))
    tl.debug_barrier()  # this program's stores, seen by all its threads
    for n0 in range(0, seen, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        p = tl.load(scratch + cols[None, :], mask=(cols < seen)[None, :], other=0.0) / best[:, None]
        if FOLD_SUM:
            tl.atomic_add(Agg + lst * NB + cols, tl.sum(p, 0), mask=cols < seen)
        else:
            bits = tl.max(p, 0).to(tl.int32, bitcast=True)
            tl.atomic_max(AggBits + lst * NB + cols, bits, mask=cols < seen)


@triton.jit
def pages_kernel(
    Ids,
    Dst,
    Counts,
    Blocks,
    Table,
    stride_b,
    E: tl.constexpr,
    GROUPS: tl.constexpr,
    HKV: tl.constexpr,
    BC: tl.constexpr,
    FREE_P: tl.constexpr,
):
    # one program per list: its chosen blocks' chunks as pages chunk * Hkv + its KV head
    row = tl.program_id(0)
    offs = tl.arange(0, FREE_P)
    ok = offs < tl.load(Counts + row)
    out = Ids + tl.load(Dst + row)
    blk = tl.load(Blocks + row * stride_b + offs, mask=ok, other=0)
    for j in range(BC):
        chunk = tl.load(Table + blk * BC + j, mask=ok, other=0)
        tl.store(out + offs * BC + j, (chunk * HKV + row % E // GROUPS).to(tl.int32), mask=ok)


@triton.jit
def block_keys_kernel(
    Bounds,
    Table,
    Out,
    K,
    NB,
    stride_mn,
    stride_mh,
    stride_ob,
    stride_oh,
    BC: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # one program per (BLOCK_N blocks, KV head): the max of its chunks' maxima ([:D]) and
    # the min of their minima ([D:])
    blocks = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kv = tl.program_id(1)
    offs_d = tl.arange(0, D)
    hi = tl.full([BLOCK_N, D], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_N, D], float("inf"), tl.float32)
    for j in range(BC):
        chunk = blocks * BC + j
        ok = chunk < K
        cid = tl.load(Table + chunk, mask=ok, other=0).to(tl.int64)
        base = Bounds + cid[:, None] * stride_mn + kv * stride_mh + offs_d[None, :]
        hi = tl.maximum(hi, tl.load(base, mask=ok[:, None], other=float("-inf")).to(tl.float32))
        lo = tl.minimum(lo, tl.load(base + D, mask=ok[:, None], other=float("inf")).to(tl.float32))
    dst = Out + blocks[:, None] * stride_ob + kv * stride_oh + offs_d[None, :]
    live = (blocks < NB)[:, None]
    tl.store(dst, hi.to(Out.dtype.element_ty), mask=live)
    tl.store(dst + D, lo.to(Out.dtype.element_ty), mask=live)


@triton.jit
def chunk_bounds_kernel(
    KPool,
    Chunks,
    Out,
    F,
    stride_kl,
    stride_kn,
    stride_kh,
    stride_ol,
    stride_on,
    stride_oh,
    C: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
):
    # one program per (layer, chunk, KV head): the max and the min of the chunk's C keys
    # (offsets in int64: a layer's stride times the layers passes 2**31 in a large pool)
    layer, i = (tl.program_id(0) // F).to(tl.int64), tl.program_id(0) % F
    kv = tl.program_id(1)
    cid = tl.load(Chunks + i).to(tl.int64)
    offs_d = tl.arange(0, D)
    base = KPool + layer * stride_kl + cid * stride_kn + kv * stride_kh
    hi = tl.full([D], float("-inf"), tl.float32)
    lo = tl.full([D], float("inf"), tl.float32)
    for r0 in range(0, C, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        k = tl.load(base + rows[:, None] * D + offs_d[None, :]).to(tl.float32)
        hi = tl.maximum(hi, tl.max(k, 0))
        lo = tl.minimum(lo, tl.min(k, 0))
    dst = Out + layer * stride_ol + cid * stride_on + kv * stride_oh + offs_d
    tl.store(dst, hi.to(Out.dtype.element_ty))
    tl.store(dst + D, lo.to(Out.dtype.element_ty))
