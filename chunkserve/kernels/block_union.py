"""Block-union sparse KV selection for the prefill of long contexts (DESIGN §8; CompactAttention,
with FlashPrefill's max-based threshold and Quest's key bounds).

A prefill piece (T new tokens after context_len cached ones) whose context is long reads only
the context blocks its queries are likely to attend:

- Blocks: the context's chunks before the one holding the piece's first token, `block // c`
  chunks a block. A block's keys are summed up by their bounds, per dimension the max and the
  min of its keys ([max | min], 2D wide): the bounds of its chunks' bounds, which the pool keeps
  for every full chunk, per layer (chunkserve.replicas.engine.attention), so a shared prefix's are computed once,
  when its chunks fill. A query's score of a block is q · center + spread · |q| · radius of the
  box [min, max] its keys lie in (`bound_queries`, [(q + spread |q|) / 2 | (q - spread |q|) /
  2] against [max | min]). At spread 1 it is the bound q⁺ · max + q⁻ · min, the most q · k can
  be over the block's keys: one key that matches (a fact planted in the text) lifts its block's
  score, where a mean key dilutes it by the block's other keys. The default, 0.5, kept more of
  dense attention's mass than the bound or the center (chunkserve/kernels/tools/records/README.md).
- Scores [Hq, QB, NB] (`chunkserve.kernels.reference.block_scores_ref` of those queries and the blocks'
  bounds): for each query head and query block (`block` rows of the piece), the mean over its
  rows (every `stride`-th) of each row's softmax over the blocks of its scores * sm_scale;
  normalised by their best and folded over the list's heads and query blocks (`normalised`,
  `block_scores`; the Triton `block_agg` does all of it in one launch, `block_scores_gpu`): by
  their max for alpha's threshold, by their sum for a budget's ranking (`BlockUnion.fold`).
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
  (chunkserve.kernels.paged_prefill.FlashInferPrefill.run_sparse): nothing is gathered or copied. Every
  page but the last is full and the own chunks close each list, so FlashInfer's causal mask
  (bottom-right aligned over the compacted list) is the true one; see
  `chunkserve.kernels.reference.sparse_prefill_ref` for the semantics.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from chunkserve.kernels.reference import block_scores_ref

__all__ = [
    "BlockUnion",
    "agg_heads",
    "block_agg",
    "block_keys",
    "block_keys_gpu",
    "block_scores",
    "block_scores_gpu",
    "bound_chunks",
    "bound_queries",
    "budget_blocks",
    "budget_exclude",
    "budget_free",
    "budget_list_len",
    "budget_lists",
    "budget_pages",
    "budget_piece",
    "chunk_key_bounds",
    "chunk_key_bounds_ref",
    "chunk_mask",
    "context_blocks",
    "normalised",
    "piece_spans",
    "query_limits",
    "select_blocks",
    "span_blocks",
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
    window: int = 4  # blocks just before the span always kept
    subgroup: int = 4  # query heads of one KV head that share a page list (capped by the group)
    # None: alpha's threshold; else keep the sink, the window and this share of the context's
    # blocks, the best of the rest by score: one FlashInfer plan per step instead of one per layer
    budget: float | None = None
    # how much of a block's spread its score counts: q · center + spread · |q| · radius of the
    # box [min, max] its keys lie in; 1 scores the bound (the most q · k can be over the block),
    # 0 the box's center (at a budget of 0.1, 0.5 kept more of dense attention's mass than either:
    # chunkserve/kernels/tools/records/README.md)
    spread: float = 0.5
    # query blocks that share page lists: a piece's rows are cut into spans of this many blocks
    # from its first, each choosing among every block before it, its piece's earlier ones too,
    # so a row reads its own piece's chunks as it reads the context (CompactAttention's causal
    # block selection at span granularity); None: one span, the piece, whose own chunks every
    # list reads whole; "auto" (a budget's): per piece, the most blocks (a power of two) whose
    # rows are at most a quarter of the context it chooses (budget x context_len / 4), so a
    # span's own chunks stay a small part of what it reads (at a budget of 0.1 and blocks of 64:
    # one block up to 5K tokens, 1024 rows at 64K, where many short lists cost more than the
    # own chunks they save)
    span: int | Literal["auto"] | None = None
    # score every stride-th query row of a block (from its first): its softmax over the blocks is
    # much like its neighbours', and the scores' cost falls by as much (at a budget of 0.1 a
    # stride of 4 kept within 0.001 of every row's context mass: records README)
    stride: int = 1
    # the prompt's last this many tokens (its question, where a task puts it) attend densely:
    # their queries are the ones an answer reads from, and a selection scored over a whole piece's
    # queries dilutes theirs (chunkserve.replicas.engine.attention splits the prompt's last piece)
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
        if self.span == "auto":
            if self.budget is None:
                raise ValueError("sparse span 'auto' sizes spans by the budget: set a budget")
        elif self.span is not None and (not isinstance(self.span, int) or self.span < 1):
            raise ValueError(f"sparse span must be >= 1 query block, None (the piece) or 'auto', got {self.span!r}")
        if self.stride < 1 or self.stride & (self.stride - 1) or self.block // self.stride < 16:
            raise ValueError(
                f"sparse stride must be a power of two leaving >= 16 rows of a block of {self.block}, got {self.stride}"
            )
        if self.subgroup < 1:
            raise ValueError(f"sparse subgroup must be >= 1, got {self.subgroup}")
        if self.budget is not None and not (0 < self.budget <= 1 and self.window >= 1):
            raise ValueError(
                f"sparse budget must be in (0, 1] with a window >= 1 (the context's last, "
                f"partial block), got budget {self.budget}, window {self.window}"
            )

    @classmethod
    def from_spec(cls, spec: str, min_context: int) -> BlockUnion:
        """A tool's spec, 'budget=0.1,block=64,window=1,span=auto,stride=4' ('none' for None),
        -> BlockUnion(min_context=min_context, ...), validated as any other."""
        kinds = {"alpha": float, "budget": float, "spread": float}
        names = {f.name for f in dataclasses.fields(cls)} - {"min_context"}
        kw: dict[str, object] = {}
        for item in spec.split(","):
            key, _, val = item.partition("=")
            if key not in names:
                raise ValueError(f"unknown sparse field {key!r} in {spec!r} (fields: {', '.join(sorted(names))})")
            try:
                kw[key] = None if val == "none" else val if val == "auto" else kinds.get(key, int)(val)
            except ValueError:
                raise ValueError(f"sparse {key} takes a number, got {val!r} in {spec!r}") from None
        return cls(min_context=min_context, **kw)  # type: ignore[arg-type]

    def span_rows(self, context_len: int) -> int | None:
        """Query rows a span of a piece after context_len cached tokens holds (None: the piece's)."""
        if self.span is None or isinstance(self.span, int):
            return None if self.span is None else self.span * self.block
        rows, budget = self.block, self.budget or 0.0
        while 8 * rows <= budget * context_len:  # 2 rows <= budget x context_len / 4
            rows *= 2
        return rows

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


def piece_spans(context_len: int, n: int, span: int | None) -> list[tuple[int, int]]:
    """A sparse piece of n rows after context_len cached tokens -> its spans, (context_len,
    rows) each: runs of `span` rows from its first (the last may be shorter); the piece itself
    when span is None. A span chooses among the blocks before it as a piece would."""
    if span is None:
        return [(context_len, n)]
    return [(context_len + j, min(span, n - j)) for j in range(0, n, span)]


def context_blocks(context_len: int, chunk_size: int, block: int) -> int:
    """Blocks a piece (or span) after context_len tokens chooses among: those of the full chunks
    before the one holding its first token (the last block possibly short)."""
    return -(-(context_len // chunk_size) // (block // chunk_size))


def query_limits(context_len: int, n: int, chunk_size: int, cfg: BlockUnion) -> list[int]:
    """Per query block of a piece (`block` rows from its first): the blocks its span chooses
    among (`block_scores_ref`'s limits)."""
    out: list[int] = []
    for ctx, rows in piece_spans(context_len, n, cfg.span_rows(context_len)):
        out += [context_blocks(ctx, chunk_size, cfg.block)] * -(-rows // cfg.block)
    return out


def span_blocks(cfg: BlockUnion, query_blocks: int, context_len: int) -> int:
    """Query blocks per span of a piece of query_blocks after context_len cached tokens (all of
    them when its spans are the piece)."""
    rows = cfg.span_rows(context_len)
    return query_blocks if rows is None else min(query_blocks, rows // cfg.block)


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


def block_scores(
    q: Tensor,
    bounds: Tensor,
    cfg: BlockUnion,
    sub: int,
    sm_scale: float | None = None,
    limits: list[int] | None = None,
    context_len: int | None = None,
) -> Tensor:
    """The selection's scores in plain torch (`block_agg` on the GPU): q [T, Hq, D] a piece's
    queries after context_len cached tokens (needed by "auto" spans), bounds [NB, Hkv, 2D] the
    blocks before its last span, limits the blocks each query block sees (`query_limits`; None:
    all) -> [S * Hq / sub, NB] float32, span after span."""
    if context_len is None and cfg.span == "auto":
        raise ValueError("'auto' spans are sized by the piece's context: pass context_len")
    s = block_scores_ref(bound_queries(q[:: cfg.stride], cfg.spread), bounds, cfg.block // cfg.stride, sm_scale, limits)
    return normalised(s, sub, cfg.fold, span_blocks(cfg, s.shape[1], context_len or 0))


def block_scores_gpu(
    q: Tensor, bounds: Tensor, cfg: BlockUnion, sub: int, sm_scale: float, limits: Tensor, context_len: int
) -> Tensor:
    """`block_scores` by the Triton `block_agg`: limits [ceil(T / block)] int on q's device."""
    span_qb = span_blocks(cfg, limits.numel(), context_len)
    s = cfg.stride
    return block_agg(q[::s], bounds, cfg.block // s, sub, sm_scale, cfg.spread, cfg.fold, limits, span_qb)


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
    _triton().block_keys_kernel[(triton.cdiv(nb, block_n), hkv)](
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
        _triton().chunk_bounds_kernel[(num_layers * f, hkv)](
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


def bound_chunks(k_pool: Tensor, chunks: Tensor, out: Tensor, triton: bool) -> None:
    """out[:, chunks] = the chunks' key bounds, k_pool [L, N, Hkv, c, D] and out [L, N, Hkv, 2D]
    (the pool's, or one layer's slices of them): chunk_key_bounds' one launch, or the reference."""
    if triton:
        chunk_key_bounds(k_pool, chunks, out)
    else:
        out[:, chunks] = chunk_key_bounds_ref(k_pool[:, chunks])


def chunk_key_bounds_ref(k_chunks: Tensor) -> Tensor:
    """k_chunks [..., Hkv, c, D] (chunks' keys) -> [..., Hkv, 2D]: [max | min] over the slots."""
    return torch.cat([k_chunks.amax(-2), k_chunks.amin(-2)], dim=-1)


def normalised(scores: Tensor, sub: int, fold: str = "max", span_qb: int | None = None) -> Tensor:
    """scores: [Hq, QB, NB] -> [S * E, NB], E = Hq / sub page lists per span of span_qb query
    blocks (S = ceil(QB / span_qb); one span of all QB by default): each block's score over its
    (head, query block)'s best, folded over the list's sub heads and its span's query blocks by
    their max or their sum (`BlockUnion.fold`). Row s * E + e: span s's entry e, which serves
    query heads [e * sub, (e + 1) * sub), of KV head e // (E / Hkv)."""
    if fold not in ("max", "sum"):
        raise ValueError(f"fold must be 'max' or 'sum', got {fold!r}")
    hq, qb, nb = scores.shape
    span_qb = qb if span_qb is None else span_qb
    spans, e = -(-qb // span_qb), hq // sub
    per = torch.nn.functional.pad(scores / scores.amax(-1, keepdim=True), (0, 0, 0, spans * span_qb - qb))
    per = per.view(e, sub, spans, span_qb, nb).transpose(1, 2).reshape(e, spans, sub * span_qb, nb)
    folded = per.amax(2) if fold == "max" else per.sum(2)  # (a short last span's padding adds 0)
    return folded.transpose(0, 1).reshape(spans * e, nb)


def _row_limits(agg: Tensor, limits: list[int] | None) -> Tensor:
    """[R, 1] the blocks each row of agg chooses among (all NB without limits)."""
    lim = [agg.shape[1]] * agg.shape[0] if limits is None else limits
    if len(lim) != agg.shape[0] or max(lim) > agg.shape[1]:
        raise ValueError(f"{len(lim)} row limits up to {max(lim)} do not fit scores {tuple(agg.shape)}")
    return torch.tensor(lim, device=agg.device)[:, None]


def select_blocks(agg: Tensor, cfg: BlockUnion, limits: list[int] | None = None) -> Tensor:
    """agg: [R, NB] normalised scores, limits: [R] the blocks each row (a span's list) chooses
    among (None: all NB) -> keep: [R, NB] bool: the threshold's blocks (alpha: the union over
    the list's heads and query blocks; or the budget's when it is set), the sink's and the
    window's, all below the row's limit."""
    lim = _row_limits(agg, limits)
    cols = torch.arange(agg.shape[1], device=agg.device)
    if cfg.budget is not None:
        blocks = budget_blocks(agg, cfg, limits)
        counts = torch.tensor([budget_free(cfg, n) for n in lim[:, 0].tolist()], device=agg.device)
        keep = torch.zeros_like(agg, dtype=torch.bool)
        keep.scatter_(1, blocks, torch.arange(blocks.shape[1], device=agg.device) < counts[:, None])
    else:
        keep = agg >= cfg.alpha
    keep |= (cols < cfg.sink) | (cols >= lim - cfg.window)
    return keep & (cols < lim)


def budget_free(cfg: BlockUnion, nb: int) -> int:
    """Blocks a budget list chooses by score among the nb - sink - window in between: the
    budget's share of all nb, besides the sink and window (counted in, they would take the
    whole budget below (sink + window) / budget blocks and leave no block chosen by score)."""
    return max(0, min(nb - cfg.sink - cfg.window, math.ceil(cfg.budget * nb)))


def budget_exclude(cfg: BlockUnion, limits: Tensor, nb: int) -> Tensor:
    """limits: [R, 1] the blocks each row chooses among -> [R, nb] bool: the blocks a budget
    does not rank (sink, window, past the limit); a step builds it once for all its layers."""
    cols = torch.arange(nb, device=limits.device)
    return (cols < cfg.sink) | (cols >= limits - cfg.window)


def budget_blocks(
    agg: Tensor, cfg: BlockUnion, limits: list[int] | None = None, exclude: Tensor | None = None
) -> Tensor:
    """agg: [R, NB] normalised scores, limits: [R] the blocks each row chooses among (None: all
    NB), exclude: their `budget_exclude` if at hand (a step builds it once) -> [R, F] the
    budget's best blocks of each row (neither sink nor window), best first; F = `budget_free`
    of the largest limit, and row r's own count is budget_free of its limit (its later entries
    mean nothing). A list's context pages may come in any order (all are full and precede its
    span's own): attention sums over them."""
    if exclude is None:
        exclude = budget_exclude(cfg, _row_limits(agg, limits), agg.shape[1])
    free = budget_free(cfg, agg.shape[1] if limits is None else max(limits))
    return agg.masked_fill(exclude, float("-inf")).topk(free, dim=1).indices


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


def budget_piece(
    table: list[int], context_len: int, n: int, chunk_size: int, cfg: BlockUnion, num_kv_heads: int, entries: int
) -> tuple[list[int], list[tuple[int, list[int], int]], list[int], list[int], list[int]]:
    """A budget piece's page lists as a step plans them, span after span (`piece_spans`), each
    span's E = entries lists (`budget_lists`) -> (the pages; FlashInfer's pieces, one per span:
    (rows, pages per list, the last page's tokens); per list r = s * E + e: the offset of its
    chosen pages in the pages, how many blocks it chooses, the blocks it chooses among)."""
    c = chunk_size
    pages: list[int] = []
    planned, dst, counts, limits = [], [], [], []
    for ctx, rows in piece_spans(context_len, n, cfg.span_rows(context_len)):
        total = ctx + rows
        lists, per, chosen = budget_lists(table, ctx, total, c, cfg, num_kv_heads, entries)
        nb = context_blocks(ctx, c, cfg.block)
        dst += [len(pages) + i * per + chosen.start for i in range(entries)]
        counts += [budget_free(cfg, nb)] * entries
        limits += [nb] * entries
        pages += lists
        planned.append((rows, [per] * entries, total - (-(-total // c) - 1) * c))
    return pages, planned, dst, counts, limits


def budget_list_len(cfg: BlockUnion, context_len: int, total: int, chunk_size: int) -> int:
    """Pages in each of a budget piece's lists: the sink's, the chosen and the window's blocks'
    chunks, and the piece's own."""
    bc = cfg.block // chunk_size
    k0, used = context_len // chunk_size, -(-total // chunk_size)
    nb = -(-k0 // bc)
    return (cfg.sink + budget_free(cfg, nb)) * bc + used - (nb - cfg.window) * bc


def budget_pages(
    blocks: Tensor, table: Tensor, block_chunks: int, num_kv_heads: int, entries: int | None = None
) -> Tensor:
    """blocks: [R, free] chosen blocks of R = S * E lists (span after span, E = entries, all R
    by default) -> their chunks' pages [R, free * block_chunks] int32 (chunk * Hkv + the
    entry's KV head), block after block (`write_pages` on the GPU)."""
    r = blocks.shape[0]
    e = r if entries is None else entries
    chunks = (blocks[:, :, None] * block_chunks + torch.arange(block_chunks, device=blocks.device)).flatten(1)
    kv = torch.arange(r, device=blocks.device) % e // (e // num_kv_heads)
    return (table[chunks] * num_kv_heads + kv[:, None]).to(torch.int32)


def write_pages(
    ids: Tensor,
    dst: Tensor,
    counts: Tensor,
    blocks: Tensor,
    table: Tensor,
    block_chunks: int,
    num_kv_heads: int,
    entries: int,
) -> None:
    """Triton `budget_pages` written into planned page ids, one launch: row r of blocks [R, F]
    (list e = r % entries of its span) writes its first counts[r] blocks' pages at ids[dst[r]:].
    ids: [P] int32; dst: [R] int64; counts: [R] int32, each <= F."""
    r, free = blocks.shape
    if ids.dtype != torch.int32 or ids.dim() != 1 or dst.shape != (r,) or counts.shape != (r,) or r % entries:
        raise ValueError(
            f"pages {tuple(ids.shape)} {ids.dtype}, {tuple(dst.shape)} offsets and {tuple(counts.shape)} counts "
            f"do not fit {r} lists of {entries} per span"
        )
    if free and r:
        import triton

        _triton().pages_kernel[(r,)](
            ids,
            dst,
            counts,
            blocks,
            table,
            blocks.stride(0),
            E=entries,
            GROUPS=entries // num_kv_heads,
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


AGG_ROWS = 128  # query rows a block_agg program scores at once (its heads' query blocks)


def agg_heads(sub: int, block: int) -> int:
    """Query heads a block_agg program scores together: the most (a power of two dividing the
    sub-group, so they share a KV head and a list) whose query blocks fit AGG_ROWS rows. They
    read each block's bounds once for all of them: at blocks of 64, half the loads."""
    hp = 1
    while sub % (2 * hp) == 0 and 2 * hp * block <= AGG_ROWS:
        hp *= 2
    return hp


def block_agg(
    q: Tensor,
    bounds: Tensor,
    block: int,
    sub: int,
    sm_scale: float | None = None,
    spread: float = 1.0,
    fold: str = "max",
    limits: Tensor | None = None,
    span_qb: int | None = None,
) -> Tensor:
    """Triton ``normalised(chunkserve.kernels.reference.block_scores_ref(bound_queries(q, spread), bounds,
    block, sm_scale, limits), sub, fold, span_qb)`` in one launch: q [T, Hq, D] (last dim
    contiguous), bounds [NB, Hkv, 2D] (each block's [max | min]), limits [ceil(T / block)] int
    on q's device (the blocks each query block sees; None: all NB) -> [S * Hq / sub, NB]
    float32, S spans of span_qb query blocks (one by default). Each program forms its head's two
    query halves itself (no [T, Hq, 2D] copy) and scores them against the max and min halves.
    Scores in q's precision (a 16-bit q's dot products round the bounds to its type),
    accumulated in float32; a sum's order over the list's programs is the GPU's."""
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
    span_qb = qb if span_qb is None else span_qb
    if limits is None:
        limits = torch.full((qb,), nb, dtype=torch.int32, device=q.device)
    if limits.shape != (qb,):
        raise ValueError(f"limits {tuple(limits.shape)}: one per query block of {qb}")
    scratch = torch.empty(hq, qb, nb, dtype=torch.float32, device=q.device)  # each program: its block means
    agg = torch.zeros(triton.cdiv(qb, span_qb) * (hq // sub), nb, dtype=torch.float32, device=q.device)
    scale = (1.0 / math.sqrt(d) if sm_scale is None else sm_scale) * 1.4426950408889634  # log2(e)
    block_n = 64 if nb >= 64 else max(16, triton.next_power_of_2(nb))
    hp = agg_heads(sub, block)
    _triton().agg_kernel[(hq // hp, qb)](
        q,
        bounds,
        scratch,
        agg,
        agg.view(torch.int32),
        limits,
        t,
        nb,
        span_qb,
        q.stride(0),
        q.stride(1),
        bounds.stride(0),
        bounds.stride(1),
        scale,
        spread,
        G=hq // hkv,
        SUB=sub,
        HP=hp,
        D=d,
        BLOCK_Q=block,
        BLOCK_N=block_n,
        FOLD_SUM=fold == "sum",
        num_warps=8 if hp * block * d >= 128 * 128 else 4,
    )
    return agg


def _triton():
    """The Triton kernels' module, imported on first use: the CPU reference path must not need triton."""
    from chunkserve.kernels import block_union_triton

    return block_union_triton
