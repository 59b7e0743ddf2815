"""Block-union sparse KV selection for the prefill of long contexts (DESIGN §5; CompactAttention,
with FlashPrefill's max-based threshold and Quest's key bounds).

A prefill piece (T new tokens after context_len cached ones) whose context is long reads only
the context blocks its queries are likely to attend:

- Blocks: the context's chunks before the one holding the piece's first token, `block // c`
  chunks a block. A block's keys are summed up by their bounds, per dimension the max and the
  min of its keys ([max | min], 2D wide): the bounds of its chunks' bounds, which the pool keeps
  for every full chunk, per layer (replicas.attention), so a shared prefix's are computed once,
  when its chunks fill. A query's score of a block is q · center + spread · |q| · radius of the
  box [min, max] its keys lie in (`bound_queries`, [(q + spread |q|) / 2 | (q - spread |q|) /
  2] against [max | min]). At spread 1 it is the bound q⁺ · max + q⁻ · min, the most q · k can
  be over the block's keys: one key that matches (a fact planted in the text) lifts its block's
  score, where a mean key dilutes it by the block's other keys. The default, 0.5, kept more of
  dense attention's mass than the bound or the center (kernels/tools/records/README.md).
- Scores [Hq, QB, NB] (`kernels.reference.block_scores_ref` of those queries and the blocks'
  bounds): for each query head and query block (`block` rows of the piece), the mean over its
  rows of each row's softmax over the blocks of its scores * sm_scale; normalised by their best
  and folded over the list's heads and query blocks (`normalised`, `block_scores`; the Triton
  `block_agg` does all of it in one launch): by their max for alpha's threshold, by their sum
  for a budget's ranking (`BlockUnion.fold`).
- Selection (`select_blocks`): a (head, query block) keeps the blocks scoring at least alpha ×
  its best; union over the piece's query blocks and over each sub-group of `subgroup` query
  heads of one KV head; plus the first `sink` and the last `window` blocks. Or, with a
  `budget` (`budget_blocks`), each list keeps the sink, the window and a fixed share of the
  context's blocks, the best of the rest by the summed normalised score. The threshold's lists
  differ in length layer by layer, and FlashInfer's plan takes the lengths on the host: a wait
  for the device and a plan's host time per layer. A budget's lengths are known when the step
  is planned: one plan a step, each layer only rewrites the page ids in place, and nothing
  waits.
- Page lists (`chunk_mask`): per (KV head, sub-group), the kept blocks' chunks in order, then
  the piece's own chunks (from the one holding its first token; always kept). As pages
  `chunk * Hkv + kv_head` of the pool's view `[num_chunks * Hkv, 1, c, D]` these are what
  FlashInfer's paged prefill runs over with one KV head per list
  (kernels.paged_prefill.FlashInferPrefill.run_sparse): nothing is gathered or copied. Every
  page but the last is full and the own chunks close each list, so FlashInfer's causal mask
  (bottom-right aligned over the compacted list) is the true one; see
  `kernels.reference.sparse_prefill_ref` for the semantics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.reference import block_scores_ref

__all__ = [
    "BlockUnion",
    "block_agg",
    "block_keys",
    "block_keys_gpu",
    "block_scores",
    "bound_queries",
    "budget_blocks",
    "budget_free",
    "budget_list_len",
    "budget_lists",
    "budget_pages",
    "chunk_key_bounds",
    "chunk_key_bounds_ref",
    "chunk_mask",
    "normalised",
    "select_blocks",
    "subgroup_size",
    "write_pages",
]


@dataclass(frozen=True)
class BlockUnion:
    """The selection's knobs (EngineConfig.sparse_prefill)."""

    min_context: int = 8192  # a piece whose context (tokens cached before it) is shorter runs dense
    block: int = 128  # tokens per KV block and per query block: a power of two, a multiple of the chunk size
    alpha: float = 0.1  # keep the blocks scoring >= alpha x the best one (per query head and query block)
    sink: int = 1  # first blocks always kept
    window: int = 4  # blocks just before the piece always kept
    subgroup: int = 4  # query heads of one KV head that share a page list (capped by the group)
    # None: alpha's threshold; else keep the sink, the window and this share of the context's
    # blocks, the best of the rest by score: one FlashInfer plan per step instead of one per layer
    budget: float | None = None
    # how much of a block's spread its score counts: q · center + spread · |q| · radius of the
    # box [min, max] its keys lie in; 1 scores the bound (the most q · k can be over the block),
    # 0 the box's center (at a budget of 0.1, 0.5 kept more of dense attention's mass than either:
    # kernels/tools/records/README.md)
    spread: float = 0.5
    # the prompt's last this many tokens (its question, where a task puts it) attend densely:
    # their queries are the ones an answer reads from, and a selection scored over a whole piece's
    # queries dilutes theirs (replicas.attention splits the prompt's last piece)
    dense_tail: int = 128

    def __post_init__(self):
        if self.block < 16 or self.block & (self.block - 1):
            raise ValueError(f"sparse block must be a power of two >= 16, got {self.block}")
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"sparse alpha must be in [0, 1], got {self.alpha}")
        if not 0 <= self.spread <= 1:
            raise ValueError(f"sparse spread must be in [0, 1], got {self.spread}")
        for name in ("min_context", "sink", "window", "dense_tail"):
            if getattr(self, name) < 0:
                raise ValueError(f"sparse {name} must be >= 0, got {getattr(self, name)}")
        if self.subgroup < 1:
            raise ValueError(f"sparse subgroup must be >= 1, got {self.subgroup}")
        if self.budget is not None and not (0 < self.budget <= 1 and self.window >= 1):
            raise ValueError(
                f"sparse budget must be in (0, 1] with a window >= 1 (the context's last, "
                f"partial block), got budget {self.budget}, window {self.window}"
            )

    @property
    def fold(self) -> str:
        """How a list folds its (head, query block)s' normalised scores: alpha's threshold needs
        their max (a block some head's query block weighs >= alpha x its best); a budget ranks
        blocks by their sum (the blocks most of the list's rows weigh)."""
        return "max" if self.budget is None else "sum"

    def check_chunk_size(self, chunk_size: int) -> None:
        if self.block % chunk_size:
            raise ValueError(f"sparse block {self.block} must be a multiple of the chunk size {chunk_size}")

    def applies(self, context_len: int, chunk_size: int) -> bool:
        """Whether a piece after context_len cached tokens runs sparse: a long context with more
        blocks than the sink and window always keep."""
        blocks = -(-(context_len // chunk_size) // (self.block // chunk_size))
        return context_len >= self.min_context and blocks > self.sink + self.window

    def first_sparse_context(self, chunk_size: int) -> int:
        """The shortest context after which a piece runs sparse (applies from there on)."""
        return max(self.min_context, (self.sink + self.window) * self.block + chunk_size)


def subgroup_size(num_q_heads: int, num_kv_heads: int, subgroup: int) -> int:
    """Query heads per page list: the largest divisor of the GQA group up to `subgroup`."""
    g = num_q_heads // num_kv_heads
    return max(d for d in range(1, min(g, subgroup) + 1) if g % d == 0)


def block_keys(chunk_bounds: Tensor, table: Tensor, block_chunks: int) -> Tensor:
    """chunk_bounds: [..., num_chunks, Hkv, 2D] (the pool's, a layer's or every layer's: per
    chunk [max | min] of its keys); table: [k] the context's chunk ids (full chunks) ->
    [..., ceil(k / block_chunks), Hkv, 2D], each block's bounds (a short last block's over its
    chunks)."""
    k = table.numel()
    nb = -(-k // block_chunks)
    bounds = chunk_bounds.index_select(-3, table)  # [..., k, Hkv, 2D]
    if nb * block_chunks > k:  # the last chunk again: it changes no max or min
        last = bounds.narrow(-3, k - 1, 1)
        bounds = torch.cat([bounds, last.expand(*last.shape[:-3], nb * block_chunks - k, *last.shape[-2:])], dim=-3)
    lead, (hkv, d2) = bounds.shape[:-3], bounds.shape[-2:]
    per = bounds.reshape(*lead, nb, block_chunks, hkv, d2)
    d = d2 // 2
    return torch.cat([per[..., :d].amax(-3), per[..., d:].amin(-3)], dim=-1)


def bound_queries(q: Tensor, spread: float = 1.0) -> Tensor:
    """q [T, Hq, D] -> [T, Hq, 2D] = [(q + spread |q|) / 2 | (q - spread |q|) / 2], whose dot
    product with a block's [max | min] is q · center + spread · |q| · radius of the block's box:
    at spread 1, [q⁺ | q⁻] (q's positive and negative parts), the most q · k can be over the
    block's keys."""
    a = q.abs() * spread
    return torch.cat([(q + a) * 0.5, (q - a) * 0.5], dim=-1)


def block_scores(q: Tensor, bounds: Tensor, cfg: BlockUnion, sub: int, sm_scale: float | None = None) -> Tensor:
    """The selection's scores in plain torch (`block_agg` on the GPU): q [T, Hq, D] a piece's
    queries, bounds [NB, Hkv, 2D] its context blocks' [max | min] -> [Hq / sub, NB] float32."""
    s = block_scores_ref(bound_queries(q, cfg.spread), bounds, cfg.block, sm_scale)
    return normalised(s, sub, cfg.fold)


def block_keys_gpu(chunk_bounds: Tensor, table: Tensor, block_chunks: int, dtype: torch.dtype) -> Tensor:
    """Triton `block_keys` for one layer, in one launch: chunk_bounds [num_chunks, Hkv, 2D],
    table [k] -> [ceil(k / block_chunks), Hkv, 2D] in dtype (the queries', for the scores)."""
    import triton

    k = table.numel()
    _, hkv, d2 = chunk_bounds.shape
    nb = -(-k // block_chunks)
    out = torch.empty(nb, hkv, d2, dtype=dtype, device=chunk_bounds.device)
    d = d2 // 2
    if chunk_bounds.stride(2) != 1 or d & (d - 1) or d2 != 2 * d:
        raise ValueError(
            f"chunk bounds {tuple(chunk_bounds.shape)}: [max | min] of a power-of-two head dim, contiguous"
        )
    block_n = min(64, triton.next_power_of_2(nb))
    _kernels()[2][(triton.cdiv(nb, block_n), hkv)](
        chunk_bounds,
        table,
        out,
        k,
        nb,
        chunk_bounds.stride(0),
        chunk_bounds.stride(1),
        out.stride(0),
        out.stride(1),
        BC=block_chunks,
        D=d,
        BLOCK_N=block_n,
    )
    return out


def chunk_key_bounds(k_pool: Tensor, chunks: Tensor, out: Tensor) -> None:
    """Triton: out[:, chunks] = [max | min] of k_pool[:, chunks] over the chunk's slots, every
    layer in one launch and with no copy of the chunks. k_pool: [L, N, Hkv, c, D] (the pool's K,
    a view); out: [L, N, Hkv, 2D] (the pool's key bounds)."""
    num_layers, _, hkv, c, d = k_pool.shape
    if (
        k_pool.stride(4) != 1
        or out.stride(3) != 1
        or out.shape[3] != 2 * d
        or k_pool.stride(3) != d
        or c & (c - 1)
        or d & (d - 1)
    ):
        raise ValueError(
            f"K pool {tuple(k_pool.shape)} / bounds {tuple(out.shape)}: contiguous chunks of powers of two"
        )
    f = chunks.numel()
    if f:
        _kernels()[3][(num_layers * f, hkv)](
            k_pool,
            chunks,
            out,
            f,
            k_pool.stride(0),
            k_pool.stride(1),
            k_pool.stride(2),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            C=c,
            D=d,
            ROWS=min(c, max(1, 4096 // d)),
        )


def chunk_key_bounds_ref(k_chunks: Tensor) -> Tensor:
    """k_chunks [..., Hkv, c, D] (chunks' keys) -> [..., Hkv, 2D]: [max | min] over the slots."""
    return torch.cat([k_chunks.amax(-2), k_chunks.amin(-2)], dim=-1)


def normalised(scores: Tensor, sub: int, fold: str = "max") -> Tensor:
    """scores: [Hq, QB, NB] -> [E, NB], E = Hq / sub page lists: each block's score over its
    (head, query block)'s best, folded over the list's sub heads and query blocks by their max
    or their sum (`BlockUnion.fold`; entry e serves query heads [e * sub, (e + 1) * sub), of KV
    head e // (E / Hkv))."""
    if fold not in ("max", "sum"):
        raise ValueError(f"fold must be 'max' or 'sum', got {fold!r}")
    hq, qb, nb = scores.shape
    per = (scores / scores.amax(-1, keepdim=True)).view(hq // sub, sub * qb, nb)
    return per.amax(1) if fold == "max" else per.sum(1)


def select_blocks(agg: Tensor, cfg: BlockUnion) -> Tensor:
    """agg: [E, NB] normalised scores -> keep: [E, NB] bool: the threshold's blocks (alpha: the
    union over the list's heads and query blocks; or the budget's when it is set), the sink's
    and the window's."""
    nb = agg.shape[1]
    if cfg.budget is not None:
        blocks = budget_blocks(agg, cfg)
        keep = torch.zeros(blocks.shape[0], nb, dtype=torch.bool, device=agg.device)
        keep.scatter_(1, blocks, True)
    else:
        keep = agg >= cfg.alpha
    keep[:, : cfg.sink] = True
    keep[:, max(0, nb - cfg.window) :] = True
    return keep


def budget_free(cfg: BlockUnion, nb: int) -> int:
    """Blocks a budget list chooses by score among the nb - sink - window in between: the
    budget's share of all nb, besides the sink and window (counted in, they would take the
    whole budget below (sink + window) / budget blocks and leave no block chosen by score)."""
    return max(0, min(nb - cfg.sink - cfg.window, math.ceil(cfg.budget * nb)))


def budget_blocks(agg: Tensor, cfg: BlockUnion) -> Tensor:
    """agg: [E, NB] normalised scores -> [E, free] the budget's chosen blocks (neither sink nor
    window), in no particular order: a list's context pages may come in any order (all are
    full and precede the piece's own), attention sums over them."""
    nb = agg.shape[1]
    free = budget_free(cfg, nb)
    mid = agg[:, cfg.sink : nb - cfg.window]
    return mid.topk(free, dim=1, sorted=False).indices + cfg.sink


def budget_lists(
    table: list[int], context_len: int, total: int, chunk_size: int, cfg: BlockUnion, num_kv_heads: int, entries: int
) -> tuple[list[int], int, slice]:
    """A budget piece's page lists as laid out for a step (one plan, every layer): per entry
    (entry e reads KV head e // (entries / Hkv)) the sink's chunks, then `budget_free` blocks'
    chunks chosen per layer, then the window's and the piece's own chunks, as pages
    ``chunk * Hkv + kv_head``. -> (the pages, entry after entry, the chosen places 0; pages per
    entry; the chosen places' slice within an entry)."""
    c, bc = chunk_size, cfg.block // chunk_size
    k0, used = context_len // c, -(-total // c)
    nb = -(-k0 // bc)
    free = budget_free(cfg, nb)
    head = table[: cfg.sink * bc]
    tail = table[(nb - cfg.window) * bc : used]
    groups = entries // num_kv_heads
    pages = []
    for e in range(entries):
        kv = e // groups
        pages += [t * num_kv_heads + kv for t in head] + [0] * (free * bc) + [t * num_kv_heads + kv for t in tail]
    per = budget_list_len(cfg, context_len, total, chunk_size)
    assert per == len(head) + free * bc + len(tail)
    return pages, per, slice(len(head), len(head) + free * bc)


def budget_list_len(cfg: BlockUnion, context_len: int, total: int, chunk_size: int) -> int:
    """Pages in each of a budget piece's lists: the sink's, the chosen and the window's blocks'
    chunks, and the piece's own."""
    bc = cfg.block // chunk_size
    k0, used = context_len // chunk_size, -(-total // chunk_size)
    nb = -(-k0 // bc)
    return (cfg.sink + budget_free(cfg, nb)) * bc + used - (nb - cfg.window) * bc


def budget_pages(blocks: Tensor, table: Tensor, block_chunks: int, num_kv_heads: int) -> Tensor:
    """blocks: [E, free] chosen blocks -> their chunks' pages [E, free * block_chunks] int32
    (chunk * Hkv + the entry's KV head), block after block (`write_pages` on the GPU)."""
    e = blocks.shape[0]
    chunks = (blocks[:, :, None] * block_chunks + torch.arange(block_chunks, device=blocks.device)).flatten(1)
    kv = torch.arange(e, device=blocks.device) // (e // num_kv_heads)
    return (table[chunks] * num_kv_heads + kv[:, None]).to(torch.int32)


def write_pages(out: Tensor, blocks: Tensor, table: Tensor, block_chunks: int, num_kv_heads: int) -> None:
    """Triton `budget_pages` written into out ([E, free * block_chunks] int32, rows may be strided,
    a view of planned lists): one launch."""
    e, free = blocks.shape
    if out.shape != (e, free * block_chunks) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"pages out {tuple(out.shape)} {out.dtype} does not fit {e} lists of {free} blocks")
    if free:
        import triton

        _kernels()[1][(e,)](
            out,
            blocks,
            table,
            out.stride(0),
            blocks.stride(0),
            free,
            GROUPS=e // num_kv_heads,
            HKV=num_kv_heads,
            BC=block_chunks,
            FREE_P=triton.next_power_of_2(free),
        )


def chunk_mask(keep: Tensor, block_chunks: int, context_chunks: int, used: int) -> Tensor:
    """keep: [E, NB] over the blocks of the first context_chunks chunks -> [E, used] bool over
    the chunks in use: the kept blocks' chunks, and every chunk from context_chunks on."""
    e = keep.shape[0]
    mask = torch.ones(e, used, dtype=torch.bool, device=keep.device)
    mask[:, :context_chunks] = keep.repeat_interleave(block_chunks, dim=1)[:, :context_chunks]
    return mask


def block_agg(
    q: Tensor,
    bounds: Tensor,
    block: int,
    sub: int,
    sm_scale: float | None = None,
    spread: float = 1.0,
    fold: str = "max",
) -> Tensor:
    """Triton ``normalised(kernels.reference.block_scores_ref(bound_queries(q, spread), bounds,
    block, sm_scale), sub, fold)`` in one launch: q [T, Hq, D] (last dim contiguous), bounds
    [NB, Hkv, 2D] (each block's [max | min]) -> [Hq / sub, NB] float32. Each program forms its
    head's two query halves itself (no [T, Hq, 2D] copy) and scores them against the max and
    min halves. Scores in q's precision (a 16-bit q's dot products round the bounds to its
    type), accumulated in float32; a sum's order over the list's programs is the GPU's."""
    import triton

    t, hq, d = q.shape
    nb, hkv, d2 = bounds.shape
    if d2 != 2 * d or hq % hkv or (hq // hkv) % sub or q.stride(2) != 1:
        raise ValueError(
            f"q {tuple(q.shape)}, bounds {tuple(bounds.shape)} ([max | min]: twice q's head dim) and "
            f"sub-groups of {sub} do not fit (q's last dim contiguous)"
        )
    if d & (d - 1) or d < 16 or block & (block - 1) or block < 16:
        raise ValueError(f"head dim and block must be powers of two >= 16, got {d} and {block}")
    if fold not in ("max", "sum"):
        raise ValueError(f"fold must be 'max' or 'sum', got {fold!r}")
    bounds = bounds.to(q.dtype).contiguous()
    qb = triton.cdiv(t, block)
    scratch = torch.empty(hq, qb, nb, dtype=torch.float32, device=q.device)  # each program: its block means
    agg = torch.zeros(hq // sub, nb, dtype=torch.float32, device=q.device)
    scale = (1.0 / math.sqrt(d) if sm_scale is None else sm_scale) * 1.4426950408889634  # log2(e)
    block_n = 64 if nb >= 64 else max(16, triton.next_power_of_2(nb))
    _kernels()[0][(hq, qb)](
        q,
        bounds,
        scratch,
        agg,
        agg.view(torch.int32),
        t,
        nb,
        q.stride(0),
        q.stride(1),
        bounds.stride(0),
        bounds.stride(1),
        scale,
        spread,
        G=hq // hkv,
        SUB=sub,
        D=d,
        BLOCK_Q=block,
        BLOCK_N=block_n,
        FOLD_SUM=fold == "sum",
        num_warps=8 if block * d >= 128 * 128 else 4,
    )
    return agg


_KERNELS = None


def _kernels():
    """The Triton kernels, defined on first use: the CPU reference path must not need triton."""
    global _KERNELS
    if _KERNELS is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _agg_kernel(
            Q,
            Bounds,
            Scratch,
            Agg,
            AggBits,
            T,
            NB,
            stride_qt,
            stride_qh,
            stride_kb,
            stride_kh,
            qk_scale,
            spread,
            G: tl.constexpr,
            SUB: tl.constexpr,
            D: tl.constexpr,
            BLOCK_Q: tl.constexpr,
            BLOCK_N: tl.constexpr,
            FOLD_SUM: tl.constexpr,
        ):
            # one program per (query head, query block): two passes over the block bounds (each
            # row's softmax max and sum, then the mean of the rows' p into Scratch with the row's
            # max), a third folding p / max into its list's row of Agg by an atomic max (on the
            # float bits: all are >= 0) or an atomic add. A score is two dots of head dim D:
            # (q + spread |q|) / 2 · max + (q - spread |q|) / 2 · min.
            head, qblk = tl.program_id(0), tl.program_id(1)
            lst, kv = head // SUB, head // G
            rows = qblk * BLOCK_Q + tl.arange(0, BLOCK_Q)
            live = rows < T
            offs_d = tl.arange(0, D)
            n_rows = tl.minimum(T - qblk * BLOCK_Q, BLOCK_Q).to(tl.float32)
            scratch = Scratch + (head * tl.num_programs(1) + qblk) * NB
            q = tl.load(
                Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0
            )
            qf = q.to(tl.float32)
            half = tl.abs(qf) * spread
            q_hi, q_lo = ((qf + half) * 0.5).to(q.dtype), ((qf - half) * 0.5).to(q.dtype)
            m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q], tl.float32)
            for n0 in range(0, NB, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                at = Bounds + cols[:, None] * stride_kb + kv * stride_kh + offs_d[None, :]
                k_max = tl.load(at, mask=(cols < NB)[:, None], other=0.0)
                k_min = tl.load(at + D, mask=(cols < NB)[:, None], other=0.0)
                s = tl.dot(q_lo, tl.trans(k_min), acc=tl.dot(q_hi, tl.trans(k_max))) * qk_scale  # log2 domain
                s = tl.where((cols < NB)[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
                m_i = m_new
            w = tl.where(live, 1.0 / (l_i * n_rows), 0.0)  # each live row's 1 / (sum * rows)
            best = 0.0
            for n0 in range(0, NB, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                at = Bounds + cols[:, None] * stride_kb + kv * stride_kh + offs_d[None, :]
                k_max = tl.load(at, mask=(cols < NB)[:, None], other=0.0)
                k_min = tl.load(at + D, mask=(cols < NB)[:, None], other=0.0)
                s = tl.dot(q_lo, tl.trans(k_min), acc=tl.dot(q_hi, tl.trans(k_max))) * qk_scale
                p = tl.sum(tl.exp2(s - m_i[:, None]) * w[:, None], 0)
                p = tl.where(cols < NB, p, 0.0)
                tl.store(scratch + cols, p, mask=cols < NB)
                best = tl.maximum(best, tl.max(p, 0))
            tl.debug_barrier()  # this program's stores, seen by all its threads
            for n0 in range(0, NB, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                p = tl.load(scratch + cols, mask=cols < NB, other=0.0) / best
                if FOLD_SUM:
                    tl.atomic_add(Agg + lst * NB + cols, p, mask=cols < NB)
                else:
                    tl.atomic_max(AggBits + lst * NB + cols, p.to(tl.int32, bitcast=True), mask=cols < NB)

        @triton.jit
        def _pages_kernel(
            Out,
            Blocks,
            Table,
            stride_o,
            stride_b,
            FREE,
            GROUPS: tl.constexpr,
            HKV: tl.constexpr,
            BC: tl.constexpr,
            FREE_P: tl.constexpr,
        ):
            # one program per list: its chosen blocks' chunks as pages chunk * Hkv + its KV head
            lst = tl.program_id(0)
            offs = tl.arange(0, FREE_P)
            ok = offs < FREE
            blk = tl.load(Blocks + lst * stride_b + offs, mask=ok, other=0)
            for j in range(BC):
                chunk = tl.load(Table + blk * BC + j, mask=ok, other=0)
                tl.store(Out + lst * stride_o + offs * BC + j, (chunk * HKV + lst // GROUPS).to(tl.int32), mask=ok)

        @triton.jit
        def _block_keys_kernel(
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
        def _chunk_bounds_kernel(
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

        _KERNELS = (_agg_kernel, _pages_kernel, _block_keys_kernel, _chunk_bounds_kernel)
    return _KERNELS
