"""Plain-torch attention over the chunked KV cache: the CPU path and the tests' oracle.

Cache layout (DESIGN §6), per layer: ``k_cache, v_cache: [num_chunks, Hkv, c, D]``. A sequence's
KV lives in the chunks of its chunk table, in order; its first ``seq_len`` positions are valid.
Query head ``h`` reads KV head ``h // G`` (GQA, ``Hq = G * Hkv``). Everything is computed in
float32 and returned in ``q.dtype``.

Decode uses the two-phase partition algorithm of ChunkAttention (ACL 2024, DESIGN §7):
``build_tree_plan`` finds the chunks shared by contiguous row ranges of the batch (the prefix
tree in DFS order); phase 1 attends each shared segment once for all its rows, phase 2 attends
each row's private chunks and merges the partial softmax states. ``decode_attention_ref`` is the
dense oracle it is tested against; ``prefill_attention_ref`` is the causal prefill path.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "Segment",
    "TreePlan",
    "attn_reduce",
    "block_scores_ref",
    "build_tree_plan",
    "decode_attention_ref",
    "gather_kv",
    "normalise",
    "partial_attn",
    "prefill_attention_ref",
    "segment_partial",
    "sparse_prefill_ref",
    "tpp_decode_ref",
]


def _scale(sm_scale: float | None, head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [num_chunks, Hkv, c, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, hkv, c, d = k_cache.shape
    return hkv, c, d


def _gqa_groups(num_q_heads: int, num_kv_heads: int) -> int:
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    return num_q_heads // num_kv_heads


# ---------------------------------------------------------------------------------------------
# Partial attention and its merge (online softmax)
# ---------------------------------------------------------------------------------------------


def partial_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sm_scale: float | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Unnormalised attention of ``q`` over one block of keys: the paper's partial state.

    q: [..., M, D], k: [..., N, D], v: [..., N, D] (leading dims broadcast, e.g. the KV heads).
    mask: optional bool, broadcastable to [..., M, N], True = attend.
    Returns fp32 ``o: [..., M, D]`` (= E @ v, not divided by n), ``m: [..., M]`` (row max of the
    scaled scores W) and ``n: [..., M]`` (row sum of E = exp(W - m)); the softmax output is o / n.
    A row with nothing to attend (all masked, or N == 0) gives m = -inf, n = 0, o = 0, no NaN,
    so it is the identity of ``attn_reduce``.
    """
    scale = _scale(sm_scale, q.shape[-1])
    q, k, v = q.float(), k.float(), v.float()
    w = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., M, N]
    if mask is not None:
        w = w.masked_fill(~mask, float("-inf"))
    if w.shape[-1] == 0:  # amax over an empty dim is an error; the state is simply empty
        m = w.new_full(w.shape[:-1], float("-inf"))
    else:
        m = w.amax(dim=-1)
    # exp(-inf - -inf) is NaN: shift empty rows by 0 instead, so E = exp(-inf) = 0 there
    e = torch.exp(w - _finite_or_zero(m).unsqueeze(-1))
    n = e.sum(dim=-1)
    o = torch.matmul(e, v)
    return o, m, n


def _finite_or_zero(m: Tensor) -> Tensor:
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def attn_reduce(
    o1: Tensor, m1: Tensor, n1: Tensor, o2: Tensor, m2: Tensor, n2: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Merge two partial states over disjoint key sets into the state over their union.

    o: [..., M, D], m: [..., M], n: [..., M] (fp32). NaN-free when either side is empty
    (m = -inf, n = 0, o = 0), including both.
    """
    m = torch.maximum(m1, m2)
    m_safe = _finite_or_zero(m)  # both empty: rescale by exp(-inf - 0) = 0, not NaN
    a1 = torch.exp(m1 - m_safe)
    a2 = torch.exp(m2 - m_safe)
    o = o1 * a1.unsqueeze(-1) + o2 * a2.unsqueeze(-1)
    n = n1 * a1 + n2 * a2
    return o, m, n


def normalise(o: Tensor, n: Tensor) -> Tensor:
    """o / n of a partial state; rows that attended nothing (n = 0) come out as 0, not 0/0."""
    return torch.where((n > 0).unsqueeze(-1), o / n.clamp_min(1e-38).unsqueeze(-1), 0.0)


# ---------------------------------------------------------------------------------------------
# Gathering a sequence's KV
# ---------------------------------------------------------------------------------------------


def gather_kv(cache: Tensor, chunk_ids: Sequence[int], length: int) -> Tensor:
    """Positions [0, length) of one sequence, contiguous: [Hkv, length, D], in cache.dtype.

    cache: [num_chunks, Hkv, c, D]; chunk_ids: the sequence's chunk table (may be longer than
    needed, e.g. a reserved next chunk; only the first ceil(length / c) are read).
    """
    _, hkv, c, d = cache.shape
    need = -(-length // c)
    if length < 0 or len(chunk_ids) < need:
        raise ValueError(f"{len(chunk_ids)} chunks of {c} cannot hold {length} tokens")
    idx = torch.as_tensor(list(chunk_ids[:need]), dtype=torch.long, device=cache.device)
    kv = cache.index_select(0, idx)  # [need, Hkv, c, D]
    return kv.transpose(0, 1).reshape(hkv, need * c, d)[:, :length]


# ---------------------------------------------------------------------------------------------
# The tree plan: shared segments and private chunks of a DFS-ordered decode batch
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """Consecutive full chunks read by every row of [row_start, row_end) (row_end - row_start >= 2).

    chunk_ids: the chunks in sequence order; chunk_start: the position of the first of them in
    the rows' chunk tables (so the segment covers positions chunk_start .. + len(chunk_ids) - 1).
    """

    row_start: int
    row_end: int
    chunk_ids: tuple[int, ...]
    chunk_start: int


@dataclass(frozen=True)
class TreePlan:
    """What each decode row reads, split into shared segments and private chunks.

    seq_lens: valid tokens per row. segments: in DFS pre-order (by row_start, then position); a
    deeper segment's row range nests inside its ancestor's. private_chunks[r]: row r's chunk ids
    not covered by any segment, in sequence order; private_lens[r]: valid tokens in each (only the
    last nonempty one can be partial; built with `reserved`, empty ones may follow it: chunks the
    row grows into); private_positions[r]: their positions in the row's chunk table. Every (row,
    position < ceil(seq_len / c)) is covered exactly once.
    """

    seq_lens: tuple[int, ...]
    segments: tuple[Segment, ...]
    private_chunks: tuple[tuple[int, ...], ...]
    private_lens: tuple[tuple[int, ...], ...]
    private_positions: tuple[tuple[int, ...], ...]

    def row_segments(self) -> tuple[tuple[int, ...], ...]:
        """Per row, indices into ``segments`` of the segments covering it."""
        rows: list[list[int]] = [[] for _ in self.seq_lens]
        for s, seg in enumerate(self.segments):
            for r in range(seg.row_start, seg.row_end):
                rows[r].append(s)
        return tuple(tuple(r) for r in rows)


def build_tree_plan(
    chunk_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], chunk_size: int, *, reserved: bool = False
) -> TreePlan:
    """Plan two-phase partition decode for a batch whose rows are in prefix-tree DFS order.

    chunk_tables[r]: row r's chunk ids in order. Entries past ceil(seq_lens[r] / c) (reserved
    chunks the row will grow into) are ignored, or with `reserved` appended to the row's private
    chunks with 0 valid tokens: a plan that stays valid while rows grow inside their tables (the
    lengths bumped, see ``TreePlan``). Raises ValueError if a table is too short for its length,
    or if the rows holding some chunk id at some position are not contiguous (the batch is not in
    DFS order, so that chunk cannot be read once for one row range).

    At position p, a maximal contiguous run of >= 2 rows holding the same chunk id, full for each
    of them ((p + 1) * c <= seq_len), shares it; a row for which the chunk is partial only reads a
    prefix of it, so it reads it privately (the run is cut there). Runs at consecutive positions
    with exactly the same row range become one segment. Everything else is private to its row.
    """
    c = int(chunk_size)
    if c <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if len(chunk_tables) != len(seq_lens):
        raise ValueError(f"{len(chunk_tables)} chunk tables for {len(seq_lens)} seq_lens")
    lens = tuple(int(n) for n in seq_lens)
    need = []  # chunks each row reads
    for r, (table, n) in enumerate(zip(chunk_tables, lens)):
        if n < 0:
            raise ValueError(f"row {r}: negative seq_len {n}")
        need.append(-(-n // c))
        if len(table) < need[-1]:
            raise ValueError(f"row {r}: {len(table)} chunks of {c} cannot hold {n} tokens")
    # Vectorised over the [rows, positions] grid (rebuilt whenever the batch's tree changes, so
    # it must stay cheap at hundreds of rows): ids[r, p] the chunk row r reads at position p.
    b, width = len(lens), max(need, default=0)
    used = np.zeros((b, width), dtype=bool)
    used[:] = np.arange(width) < np.array(need, dtype=np.int64)[:, None]
    ids = np.zeros((b, width), dtype=np.int64)
    ids[used] = np.fromiter(
        itertools.chain.from_iterable(t[:n] for t, n in zip(chunk_tables, need)), dtype=np.int64, count=int(sum(need))
    )
    _check_contiguous(ids, used)
    # link[r, p]: rows r and r + 1 hold the same chunk at p, full for both. Maximal chains of
    # links are the runs of >= 2 rows that share a chunk.
    full = (np.arange(1, width + 1) * c)[None, :] <= np.array(lens, dtype=np.int64)[:, None]
    link = full[:-1] & full[1:] & (ids[:-1] == ids[1:])  # [B - 1, P]
    shared = np.zeros((b, width), dtype=bool)
    shared[:-1] |= link
    shared[1:] |= link
    edge = np.diff(np.pad(link, ((1, 1), (0, 0))).astype(np.int8), axis=0)  # +1: a chain starts, -1: ends
    p_start, r_start = np.nonzero(edge.T == 1)  # by position, then row: chains pair up in order
    _, r_end = np.nonzero(edge.T == -1)

    # runs with the same row range at consecutive positions become one segment
    runs: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # (i, j) -> [(p, id)]
    for p, i, j, cid in zip(p_start.tolist(), r_start.tolist(), (r_end + 1).tolist(), ids[r_start, p_start].tolist()):
        runs[(i, j)].append((p, cid))
    segments = []
    for (i, j), cols in runs.items():
        start = 0
        for k in range(1, len(cols) + 1):
            if k == len(cols) or cols[k][0] != cols[k - 1][0] + 1:
                segments.append(Segment(i, j, tuple(cid for _, cid in cols[start:k]), cols[start][0]))
                start = k
    segments.sort(key=lambda s: (s.row_start, s.chunk_start))

    private = used & ~shared
    rows, pos = np.nonzero(private)  # row-major: each row's positions in order
    cuts = np.concatenate([[0], np.cumsum(private.sum(axis=1))]).tolist()
    bounds = list(zip(cuts, cuts[1:]))

    def per_row(values: list[int]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(values[i:j]) for i, j in bounds)

    tokens = np.minimum(c, np.array(lens, dtype=np.int64)[rows] - pos * c)
    chunks, counts, places = per_row(ids[rows, pos].tolist()), per_row(tokens.tolist()), per_row(pos.tolist())
    if reserved:  # each row's entries past its length: private, empty for now
        chunks = tuple(ids_r + tuple(t[n:]) for ids_r, t, n in zip(chunks, chunk_tables, need))
        counts = tuple(k + (0,) * (len(t) - n) for k, t, n in zip(counts, chunk_tables, need))
        places = tuple(p + tuple(range(n, len(t))) for p, t, n in zip(places, chunk_tables, need))
    return TreePlan(lens, tuple(segments), chunks, counts, places)


def _check_contiguous(ids: np.ndarray, used: np.ndarray) -> None:
    """Raise unless, at every position, the rows holding each chunk id are contiguous."""
    p, r = np.nonzero(used.T)  # by position, then row
    cid = ids[r, p]
    order = np.lexsort((r, cid, p))  # by position, chunk id, row
    p, r, cid = p[order], r[order], cid[order]
    same = (p[1:] == p[:-1]) & (cid[1:] == cid[:-1])
    gaps = np.flatnonzero(same & (r[1:] != r[:-1] + 1))
    if gaps.size == 0:
        return
    # report the first position's chunk that is first held by the lowest row
    at = p[gaps[0]]
    bad = {int(cid[g]) for g in gaps if p[g] == at}
    held = [(int(r[k]), int(cid[k])) for k in np.flatnonzero(p == at) if int(cid[k]) in bad]
    first = min(held)[1]
    rows = [x for x, y in held if y == first]
    raise ValueError(
        f"chunk {first} at position {int(at)} is held by non-contiguous rows "
        f"(rows {min(rows)}..{max(rows)}, {len(rows)} of them): batch not in DFS order"
    )


# ---------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------


def segment_partial(
    qf: Tensor, k_cache: Tensor, v_cache: Tensor, seg: Segment, sm_scale: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Phase 1 of one shared segment: each KV head's G query heads of rows [i, j) stacked into
    one [(j - i) * G, D] matrix (rows major) attend the segment's K/V once (the GPU kernel's
    tensor-core tile), vectorised over KV heads. qf: [B, Hkv, G, D] float32. Returns the rows'
    partial states o: [j - i, Hkv, G, D], m, n: [j - i, Hkv, G]."""
    _, hkv, g, d = qf.shape
    i, j = seg.row_start, seg.row_end
    length = len(seg.chunk_ids) * k_cache.shape[2]  # segments hold full chunks only
    k = gather_kv(k_cache, seg.chunk_ids, length)  # [Hkv, L, D]
    v = gather_kv(v_cache, seg.chunk_ids, length)
    o, m, n = partial_attn(qf[i:j].transpose(0, 1).reshape(hkv, (j - i) * g, d), k, v, sm_scale)
    return (
        o.view(hkv, j - i, g, d).transpose(0, 1),
        m.view(hkv, j - i, g).transpose(0, 1),
        n.view(hkv, j - i, g).transpose(0, 1),
    )


def tpp_decode_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: TreePlan,
    sm_scale: float | None = None,
) -> Tensor:
    """Two-phase partition decode attention (ChunkAttention), one query token per row.

    q: [B, Hq, D]; k_cache, v_cache: [num_chunks, Hkv, c, D]; plan from ``build_tree_plan`` for
    the same B rows. Returns [B, Hq, D] in q.dtype.
    Phase 1 (chunk-first): per shared segment, each KV head's G query heads of rows [i, j) are
    stacked into one [(j - i) * G, D] matrix and attend the segment's K/V once (the GPU kernel's
    tensor-core tile); vectorised over KV heads. Phase 2 (sequence-first): per row, attend its
    private chunks, then merge the phase-1 partials of every segment covering it.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    hkv, c, d = _check_cache(k_cache, v_cache)
    b, hq, dq = q.shape
    if dq != d:
        raise ValueError(f"q head dim {dq} != cache head dim {d}")
    if b != len(plan.seq_lens):
        raise ValueError(f"q has {b} rows, plan has {len(plan.seq_lens)}")
    g = _gqa_groups(hq, hkv)
    scale = _scale(sm_scale, d)
    qf = q.float().view(b, hkv, g, d)  # query head h = kv * G + g

    # phase 1: one partial state per segment, per row of it
    partials = [segment_partial(qf, k_cache, v_cache, seg, scale) for seg in plan.segments]

    # phase 2: per row, private chunks (state [Hkv, G, ...]) ...
    o = qf.new_zeros(b, hkv, g, d)
    m = qf.new_full((b, hkv, g), float("-inf"))
    n = qf.new_zeros(b, hkv, g)
    for r, (ids, lens) in enumerate(zip(plan.private_chunks, plan.private_lens)):
        while lens and lens[-1] == 0:  # reserved chunks past the row's length
            ids, lens = ids[:-1], lens[:-1]
        if not ids:
            continue
        if any(x != c for x in lens[:-1]) or not 0 < lens[-1] <= c:
            raise ValueError(f"row {r}: only the last private chunk may be partial, got {lens}")
        length = (len(ids) - 1) * c + lens[-1]
        k = gather_kv(k_cache, ids, length)
        v = gather_kv(v_cache, ids, length)
        o[r], m[r], n[r] = partial_attn(qf[r], k, v, scale)

    # ... merged with the partials of the segments covering it; done per segment for all of its
    # rows at once, which is the same per-row merge vectorised (merge order only changes rounding)
    for seg, (po, pm, pn) in zip(plan.segments, partials):
        i, j = seg.row_start, seg.row_end
        o[i:j], m[i:j], n[i:j] = attn_reduce(o[i:j], m[i:j], n[i:j], po, pm, pn)

    return normalise(o, n).view(b, hq, d).to(q.dtype)


def decode_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    chunk_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    sm_scale: float | None = None,
) -> Tensor:
    """Dense decode oracle: each row's query attends its positions [0, seq_len) by plain softmax.

    q: [B, Hq, D]; k_cache, v_cache: [num_chunks, Hkv, c, D]; chunk_tables[r], seq_lens[r] as in
    ``build_tree_plan``. Returns [B, Hq, D] in q.dtype. No plan, no partial states: the KV heads
    are repeated to Hq so that it shares no GQA bookkeeping with the code it checks.
    """
    hkv, _, d = _check_cache(k_cache, v_cache)
    b, hq, _ = q.shape
    if len(chunk_tables) != b or len(seq_lens) != b:
        raise ValueError(f"q has {b} rows, got {len(chunk_tables)} tables / {len(seq_lens)} lens")
    g = _gqa_groups(hq, hkv)
    scale = _scale(sm_scale, d)
    out = q.new_zeros(b, hq, d, dtype=torch.float32)
    for r in range(b):
        if seq_lens[r] == 0:
            continue
        k = gather_kv(k_cache, chunk_tables[r], seq_lens[r]).float().repeat_interleave(g, 0)
        v = gather_kv(v_cache, chunk_tables[r], seq_lens[r]).float().repeat_interleave(g, 0)
        w = torch.einsum("hd,hld->hl", q[r].float(), k) * scale  # [Hq, L]
        out[r] = torch.einsum("hl,hld->hd", torch.softmax(w, dim=-1), v)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------

# fp32 score elements per query tile ([Hq, tile, keys]); bounds memory for long prompts
_PREFILL_TILE_ELEMS = 1 << 24


def prefill_attention_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    chunk_ids: Sequence[int],
    context_len: int,
    sm_scale: float | None = None,
) -> Tensor:
    """Causal attention of one sequence's T new tokens over its cached prefix and themselves.

    q: [T, Hq, D] for positions context_len .. context_len + T - 1, whose K/V are already in the
    cache; k_cache, v_cache: [num_chunks, Hkv, c, D]; chunk_ids: the sequence's chunk table.
    Query t sees keys [0, context_len + t] (bottom-right aligned causal mask). Returns [T, Hq, D]
    in q.dtype. KV is gathered once; queries go in tiles so the fp32 scores stay bounded, each
    tile a batched matmul over KV heads with the G query heads folded into M.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    hkv, _, d = _check_cache(k_cache, v_cache)
    t_new, hq, _ = q.shape
    g = _gqa_groups(hq, hkv)
    scale = _scale(sm_scale, d)
    total = context_len + t_new
    k = gather_kv(k_cache, chunk_ids, total).float()  # [Hkv, total, D]
    v = gather_kv(v_cache, chunk_ids, total).float()
    qf = q.float().permute(1, 0, 2).reshape(hkv, g, t_new, d)  # head h = kv * G + g
    out = q.new_empty(hkv, g, t_new, d, dtype=torch.float32)

    tile = max(1, _PREFILL_TILE_ELEMS // max(1, hq * total))
    for t0 in range(0, t_new, tile):
        t1 = min(t_new, t0 + tile)
        keys = context_len + t1  # the tile's last query sees no further
        qt = qf[:, :, t0:t1].reshape(hkv, g * (t1 - t0), d)
        w = torch.matmul(qt, k[:, :keys].transpose(1, 2)) * scale  # [Hkv, G*t, keys]
        w = w.view(hkv, g, t1 - t0, keys)
        qpos = torch.arange(context_len + t0, context_len + t1, device=q.device)
        allowed = torch.arange(keys, device=q.device) <= qpos[:, None]  # [t, keys]
        w = w.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(w, dim=-1).view(hkv, g * (t1 - t0), keys)
        out[:, :, t0:t1] = torch.matmul(p, v[:, :keys]).view(hkv, g, t1 - t0, d)
    return out.reshape(hq, t_new, d).permute(1, 0, 2).to(q.dtype)


def block_scores_ref(
    q: Tensor, keys: Tensor, block: int, sm_scale: float | None = None, limits: Sequence[int] | None = None
) -> Tensor:
    """Block-union's selection scores (chunkserve.kernels.block_union, DESIGN §8).

    q: [T, Hq, D], a prefill piece's queries; keys: [NB, Hkv, D], one key per context block
    (the selection passes the bounded queries and the blocks' [max | min] bounds: D = 2 x head dim).
    For query head h and query block b (rows [b * block, (b + 1) * block) of the piece, the last
    one possibly short): the mean over its rows of each row's softmax over the blocks it sees,
    the first limits[b] (all NB without limits), of q · key * sm_scale. Returns
    [Hq, ceil(T / block), NB] float32 (each row sums to 1; 0 past its limit).
    """
    t, hq, d = q.shape
    nb, hkv, _ = keys.shape
    g = _gqa_groups(hq, hkv)
    s = torch.einsum("thd,bhd->htb", q.float(), keys.float().repeat_interleave(g, dim=1)) * _scale(sm_scale, d)
    if limits is not None:
        seen = torch.as_tensor(limits, device=q.device).repeat_interleave(block)[:t]  # [T]
        s = s.masked_fill(torch.arange(nb, device=q.device) >= seen[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)  # [Hq, T, NB]
    qb = -(-t // block)
    p = torch.nn.functional.pad(p, (0, 0, 0, qb * block - t))  # zero rows: they add nothing
    rows = torch.full((qb,), float(block), device=q.device)
    rows[-1] = t - (qb - 1) * block
    return p.view(hq, qb, block, nb).sum(2) / rows[:, None]


def sparse_prefill_ref(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    chunk_ids: Sequence[int],
    context_len: int,
    chunk_mask: Tensor,
    sm_scale: float | None = None,
) -> Tensor:
    """Causal prefill attention where each group of query heads sees only its marked chunks.

    q: [T, Hq, D] at positions context_len .. context_len + T - 1; chunk_mask: [E, used] bool,
    used = the chunks holding context_len + T tokens; entry e = kv * S + s (S = E / Hkv groups of
    sub = Hq / E query heads per KV head) covers query heads [e * sub, (e + 1) * sub), which read
    KV head e // S. A query sees the keys of its entry's marked chunks at positions up to its
    own. With every chunk marked this is ``prefill_attention_ref``. Returns [T, Hq, D].
    """
    hkv, c, d = _check_cache(k_cache, v_cache)
    t_new, hq, _ = q.shape
    e, used = chunk_mask.shape
    total = context_len + t_new
    if used != -(-total // c) or e % hkv or hq % e:
        raise ValueError(
            f"chunk_mask {tuple(chunk_mask.shape)} does not fit {total} tokens in chunks of {c}, Hq={hq}, Hkv={hkv}"
        )
    sub, groups = hq // e, e // hkv
    scale = _scale(sm_scale, d)
    k = gather_kv(k_cache, chunk_ids, total).float().repeat_interleave(groups, dim=0)  # [E, total, D]
    v = gather_kv(v_cache, chunk_ids, total).float().repeat_interleave(groups, dim=0)
    seen = chunk_mask.to(q.device).repeat_interleave(c, dim=1)[:, :total]  # [E, total]
    qf = q.float().reshape(t_new, e, sub, d).permute(1, 2, 0, 3)  # [E, sub, T, D]
    out = q.new_empty(e, sub, t_new, d, dtype=torch.float32)
    tile = max(1, _PREFILL_TILE_ELEMS // max(1, hq * total))
    for t0 in range(0, t_new, tile):
        t1 = min(t_new, t0 + tile)
        w = torch.matmul(qf[:, :, t0:t1], k.transpose(1, 2)[:, None]) * scale  # [E, sub, t, total]
        qpos = torch.arange(context_len + t0, context_len + t1, device=q.device)
        allowed = (torch.arange(total, device=q.device) <= qpos[:, None])[None, None] & seen[:, None, None]
        p = torch.softmax(w.masked_fill(~allowed, float("-inf")), dim=-1)
        out[:, :, t0:t1] = torch.matmul(p, v[:, None])
    return out.permute(2, 0, 1, 3).reshape(t_new, hq, d).to(q.dtype)
