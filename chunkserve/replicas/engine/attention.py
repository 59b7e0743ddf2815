"""Attention over the chunk pool (DESIGN §7, §8).

Split as in mini-sglang: `Attention.plan(batch)` once per step builds what every layer needs
(slot indices, the decode tree plan, per-sequence prefill spans) and returns a `StepAttention`
whose `forward(layer, q, k, v)` the model calls once per layer: it writes the new K/V into the
pool and attends.

Decode runs the two-phase partition over the prefix tree: `chunkserve.kernels.tpp` (Triton) on CUDA,
`chunkserve.kernels.tpp_torch` (batched torch ops) on the CPU; `chunkserve.kernels.reference`, the plain-torch oracle
the others are checked against, on request (backend "reference"). On CUDA a batch with nothing
shared and grouped-query heads decodes through FlashInfer's tensor-core paged decode instead
when flashinfer is installed (`chunkserve.kernels.fi_decode`: faster there, as measured in the records; off with
`flashinfer_fallback`, which the engine turns off unless it runs eagerly: its CUDA graphs cover
TPP plans only).
The decode plan lives as long as the batch's chunk tables ("lazy context"): it covers each
row's whole table, the chunks reserved past its length included (the scheduler reserves them
ahead, for all rows together), so a step whose decode rows are the same sequences with the same
tables as the last step's only advances every row's length by one, tail fills included. A row
joining or leaving, or a table that grew or changed (a filled chunk deduplicated on insertion),
rebuilds it. FlashInfer's plans list only the chunks in use, so they are also rebuilt when a
row's tail fills.

With fixed plans and `plan_rows` (the engine's graph_mixed_steps) a step holding prefill
tokens is planned as decode rows where it fits (`_plan_rows`, DESIGN §9): the decode graphs
replay it, FlashInfer's prefill is not launched.

Prefill (DESIGN §8, the dense path): with the triton backend, a 16-bit pool and flashinfer
installed, every prefill span of a step goes through FlashInfer's paged prefill in one launch
per layer (``chunkserve.kernels.paged_prefill``, planned once per step); otherwise span by span through
the plain-torch reference.

Block-union sparse prefill (DESIGN §8, `chunkserve.kernels.block_union`; on with `sparse`): a piece whose
context is at least `sparse.min_context` tokens reads, per layer, only the context blocks its
queries score high on, through FlashInfer's paged prefill over per-(KV head, sub-group) page
lists (the reference, `chunkserve.kernels.reference.sparse_prefill_ref`, without FlashInfer). With a
budget the lists' lengths are known when the step is planned: FlashInfer plans them once, here,
and each layer writes its chosen page ids into them; alpha's lists are planned layer by layer.
The prompt's last piece keeps its last `dense_tail` tokens dense, a span of their own.
The pool then keeps each full chunk's key bounds per layer ([max | min] of its keys), updated
after each step's forward (`StepAttention.keep_key_bounds`) for the chunks the step filled;
each layer bounds its context blocks' keys from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chunkserve.kernels import (
    block_union,
    fi_decode,
    paged_prefill,
    reference,
    tpp_torch,
)  # flashinfer imported only when used
from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.tpp_plan import FixedPlans
from chunkserve.replicas.engine.kv_pool import KVPool
from chunkserve.replicas.engine.stats import EngineStats
from chunkserve.replicas.engine.transfer import to_device

if TYPE_CHECKING:
    from chunkserve.replicas.engine.config import EngineConfig
    from chunkserve.replicas.engine.sequence import Batch


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of this sequence in the flattened batch
    num_new: int  # query tokens this step
    context_len: int  # tokens already in the cache before this step
    chunk_ids: tuple[int, ...]
    table: torch.Tensor | None = None  # block-union pieces: the chunks in use, on the device (else None)
    limits: torch.Tensor | None = None  # block-union pieces: per query block the blocks its span sees (device)

    @property
    def sparse(self) -> bool:
        return self.table is not None


@dataclass(frozen=True)
class BudgetRows:
    """Where a budget piece's chosen pages go in its step's planned page ids: per row r = s * E + e
    (span s's list e), the offset of its chosen pages, how many blocks it chooses, and the
    blocks it chooses among; pages: its lists' pages in all (for the counters)."""

    dst: torch.Tensor  # [R] int64
    counts: torch.Tensor  # [R] int32
    exclude: torch.Tensor  # [R, NB] bool: what each row does not rank (block_union.budget_exclude)
    pages: int


@dataclass(frozen=True)
class SparseBudget:
    """A step's budget lists (Attention._plan_budget): the page ids FlashInfer planned, which
    each layer rewrites in place at its pieces' rows."""

    ids: torch.Tensor  # [sum of the lists' pages] int32
    pieces: tuple[BudgetRows, ...]


class Attention:
    """Per engine: the pool, the decode kernel, and the decode plan kept across steps."""

    def __init__(self, pool: KVPool, config: EngineConfig, num_q_heads: int, counters: EngineStats | None = None):
        """config: the engine's, resolved (EngineConfig.resolved): backend, device, FlashInfer's
        decode fallback and prefill, sparse prefill, graph_mixed_steps. num_q_heads: this rank's.
        counters: the engine's, where plans built and sparse pages read are counted (None: one
        of its own)."""
        backend, device, head_dim, sparse = (
            config.attention_backend,
            config.torch_device,
            pool.shape.head_dim,
            config.sparse_prefill,
        )
        assert backend in ("reference", "torch", "triton"), f"a resolved config names its backend, got {backend!r}"
        if backend == "triton":
            from chunkserve.kernels import tpp  # imports triton; the reference path must not need it

            self._tpp = tpp
            self._decoder = tpp.TppDecoder()
        self.backend = backend
        self.pool, self.device = pool, device
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.sm_scale = head_dim**-0.5
        num_kv_heads = pool.kv.shape[3]
        # what both FlashInfer wrappers and the fixed plans take: the pool's layout, this rank's heads
        self.heads = PagedHeads(num_q_heads, num_kv_heads, head_dim, pool.chunk_size)
        paged = dict(dtype=pool.kv.dtype, device=device, sm_scale=self.sm_scale)
        self._fi = None  # fi_decode.FlashInferDecode for unshared GQA batches, if usable
        if (
            backend == "triton"
            and config.flashinfer_fallback
            and num_q_heads != num_kv_heads
            and pool.kv.dtype in (torch.float16, torch.bfloat16)
            and fi_decode.available()
        ):
            self._fi = fi_decode.FlashInferDecode(self.heads, **paged)
        # paged_prefill.FlashInferPrefill for every step's prefill spans, if usable
        self._prefill = None
        if config.flashinfer_prefill and paged_prefill.usable(pool.kv.dtype, head_dim, device):
            self._prefill = paged_prefill.FlashInferPrefill(self.heads, **paged)
        self.sparse = sparse
        if sparse is not None:
            sparse.check_chunk_size(pool.chunk_size)
            if pool.key_bounds is None:
                raise ValueError("sparse prefill needs a pool that keeps its chunks' key bounds")
            self._sub = block_union.subgroup_size(num_q_heads, num_kv_heads, sparse.subgroup)
        self.counters = EngineStats() if counters is None else counters
        self._signature: tuple | None = None
        self._decode_plan = None
        self.fixed: FixedPlans | None = None  # the fixed plans' buffers decode plans are built into (fix_plans)
        # with fixed plans: mixed steps as decode rows where they fit (_plan_rows)
        self.plan_rows = config.graph_mixed_steps

    def fix_plans(self, sizes: tuple[int, ...]) -> None:
        """From now on build each decode plan of at most max(sizes) rows as a fixed plan of the
        least size holding it, where it fits (chunkserve.kernels.tpp_plan.FixedPlans): what the decode
        graphs (chunkserve/replicas/engine/cuda_graph.py) replay. The triton backend only."""
        if self.backend != "triton":
            raise ValueError(f"fixed decode plans need the triton backend, not {self.backend!r}")
        self.fixed = FixedPlans(self.device, sizes, self.heads, num_chunks=self.pool.kv.shape[2])
        self._signature = self._decode_plan = None

    def plan(self, batch: Batch) -> StepAttention:
        c = self.pool.chunk_size
        # the new tokens' positions and chunk ids as flat Python lists, one host-to-device copy:
        # this runs every step, and per-row tensors would cost a copy per row
        positions: list[int] = []
        chunk_idx: list[int] = []
        prefills = []
        for seq in batch.decodes:  # one token each (Sequence.chunk_at inlined: per row per step)
            n = seq.num_computed
            positions.append(n)
            k, nodes = n // c, seq.nodes
            chunk_idx.append(nodes[k].chunk_id if k < len(nodes) else seq.private[k - len(nodes)])
        filled: list[int] = []  # chunks this step fills (their key bounds are due: sparse prefill)
        bounds = self.pool.key_bounds is not None
        if bounds:
            filled = [chunk_idx[i] for i, n in enumerate(positions) if n % c == c - 1]
        tail_chunks = 0  # chunks the dense tails of sparse pieces read (each layer, each page list)
        for seq, n in batch.prefills:
            start = seq.num_computed
            table = tuple(seq.chunk_table)
            row = len(positions)
            tail = n  # the piece's tokens that attend densely, at its end: all, or the prompt's tail
            if self.sparse is not None and self.sparse.applies(start, c):
                # the prompt's last piece keeps its last dense_tail tokens dense, a span of their own
                tail = min(n, self.sparse.dense_tail) if start + n == seq.num_tokens else 0
                if tail < n:
                    m = n - tail
                    used = list(table[: -(-(start + m) // c)])
                    both = to_device(used + block_union.query_limits(start, m, c, self.sparse), self.device)
                    prefills.append(PrefillSpan(row, m, start, table, both[: len(used)], both[len(used) :]))
                tail_chunks += -(-(start + n) // c) if tail else 0
            if tail:
                prefills.append(PrefillSpan(row + n - tail, tail, start + n - tail, table))
            if bounds:
                filled += [seq.chunk_at(k) for k in range(start // c, (start + n) // c)]
            positions.extend(range(start, start + n))
            while n:  # the run of positions in each chunk
                k = start // c
                take = min(n, (k + 1) * c - start)
                chunk_idx += [seq.chunk_at(k)] * take
                start, n = start + take, n - take
        if tail_chunks:  # (counted as read by sparse pieces: their share of the work kept)
            pages = tail_chunks * self.pool.kv.shape[0] * (self.num_q_heads // self._sub)
            self.counters.sparse_pages_read += pages
            self.counters.sparse_pages_dense += pages
        new = to_device(positions + chunk_idx, self.device).view(2, -1)  # [2, T], not waited for
        filled_ids = to_device(filled, self.device) if filled else None
        rows = self._plan_rows(batch) if batch.prefills and self.plan_rows and not tail_chunks else None
        if rows is not None:  # every token a decode row: the decode graph of its size runs the step
            return StepAttention(
                self, new[0], new[1], new[0] % c, len(positions), rows, (), filled=filled_ids, mixed=True
            )
        dense = [s for s in prefills if not s.sparse]
        fused = self._prefill is not None and bool(dense)
        dense_rows = None  # the dense spans' rows, where sparse spans are among them
        if fused:
            self._prefill.plan([(s.chunk_ids, s.context_len, s.num_new) for s in dense])
            self.counters.prefill_plans += 1
            if len(dense) < len(prefills):
                dense_rows = to_device([r for s in dense for r in range(s.start, s.start + s.num_new)], self.device)
        sparse = [s for s in prefills if s.sparse]
        budget = None
        if sparse and self._prefill is not None and self.sparse.budget is not None:
            budget = self._plan_budget(sparse)
        return StepAttention(
            self,
            new[0],
            new[1],
            new[0] % c,
            len(batch.decodes),
            self._plan_decode(batch),
            tuple(prefills),
            fused,
            dense_rows,
            filled_ids,
            budget,
        )

    def _plan_budget(self, spans: list[PrefillSpan]) -> SparseBudget:
        """A budget's page lists for the step's sparse pieces, planned once for every layer: each
        piece's spans (block_union.piece_spans) in order, each span's E lists, FlashInfer's
        pieces; and where each list's chosen pages go, which its layers rewrite."""
        cfg, c, hkv = self.sparse, self.pool.chunk_size, self.pool.kv.shape[3]
        e = self.num_q_heads // self._sub
        pages: list[int] = []
        planned, rows = [], []
        for s in spans:
            lists, runs, dst, counts, limits = block_union.budget_piece(
                list(s.chunk_ids), s.context_len, s.num_new, c, cfg, hkv, e
            )
            rows.append(([len(pages) + o for o in dst], counts, limits, len(lists)))
            pages += lists
            planned += runs
        flat = to_device(pages + [x for r in rows for x in r[0] + r[1] + r[2]], self.device)
        ids = flat[: len(pages)].to(torch.int32)
        self._prefill.plan_sparse(ids, planned)
        pieces, o = [], len(pages)
        for dst, _, lims, n_pages in rows:
            r = len(dst)
            limits = flat[o + 2 * r : o + 3 * r, None]
            exclude = block_union.budget_exclude(cfg, limits, max(lims))
            pieces.append(BudgetRows(flat[o : o + r], flat[o + r : o + 2 * r].to(torch.int32), exclude, n_pages))
            o += 3 * r
        return SparseBudget(ids, tuple(pieces))

    def _plan_rows(self, batch: Batch):
        """A mixed step as one fixed decode plan (the decode graphs replay it), each prefill
        token a row of its causal length: row p of a piece starting at s reads the sequence's
        first s + p + 1 tokens, its own K/V (written before the attention) included. The tokens
        after the decode rows keep the tree's DFS order where the scheduler put the rows sharing
        the first piece's prefix last (Scheduler.prefill_rows_last); None where they do not, a
        piece is sparse, or the rows do not fit the fixed plans (then the step's prefill runs
        as a prefill)."""
        c = self.pool.chunk_size
        if batch.num_tokens > max(self.fixed.shapes) or (
            self.sparse is not None and any(self.sparse.applies(s.num_computed, c) for s, _ in batch.prefills)
        ):
            return None
        tables = [s.chunk_table for s in batch.decodes]
        lens = [s.num_computed + 1 for s in batch.decodes]
        for seq, n in batch.prefills:
            table = seq.chunk_table
            for length in range(seq.num_computed + 1, seq.num_computed + n + 1):
                tables.append(table[: -(-length // c)])
                lens.append(length)
        try:
            tree = reference.build_tree_plan(tables, lens, c, reserved=True)
        except ValueError:  # the rows holding some chunk are not contiguous (another piece's prefix)
            return None
        plan = self._tpp.build_fixed_plan(tables, lens, self.fixed, tree=tree)
        if plan is not None:  # (it took the fixed buffers: the next decode step plans anew)
            self._signature = self._decode_plan = None
        return plan

    def _plan_decode(self, batch: Batch):
        if not batch.decodes:
            self._signature = self._decode_plan = None
            return None
        # same rows, same chunk tables => each row advanced one token inside its table
        c = self.pool.chunk_size
        signature = self._signature_of(batch.decodes, isinstance(self._decode_plan, fi_decode.FiPlan))
        if signature == self._signature:
            self._decode_plan = self._bump(self._decode_plan)
            return self._decode_plan
        tables = [s.chunk_table for s in batch.decodes]
        lens = [s.num_computed + 1 for s in batch.decodes]  # + the token this step writes
        tree = reference.build_tree_plan(tables, lens, c, reserved=True)
        if self._fi is not None and not tree.segments:  # nothing shared: FlashInfer's paged decode
            plan = self._fi.plan(tables, lens)
            self.counters.fallback_plans += 1
        elif self.backend == "triton":
            plan = None if self.fixed is None else self._tpp.build_fixed_plan(tables, lens, self.fixed, tree=tree)
            self.counters.unfixed_plans += self.fixed is not None and plan is None
            if plan is None:
                plan = self._tpp.build_plan(
                    tables,
                    lens,
                    c,
                    self.device,
                    num_q_heads=self.num_q_heads,
                    num_kv_heads=self.pool.kv.shape[3],
                    head_dim=self.head_dim,
                    tree=tree,
                )
        elif self.backend == "torch":
            plan = tpp_torch.build_plan(tree, c, self.device)
        else:
            plan = tree
        self._signature = self._signature_of(batch.decodes, isinstance(plan, fi_decode.FiPlan))
        self._decode_plan = plan
        self.counters.plan_builds += 1
        return plan

    def _signature_of(self, decodes, fi: bool) -> tuple:
        """What a decode plan is valid for: the rows, their tables' versions and lengths; for a
        FlashInfer plan also each row's chunks in use (its page lists stop at the last one)."""
        signature = tuple((s.arrival, s.table_version, len(s.nodes) + len(s.private)) for s in decodes)
        if fi:
            c = self.pool.chunk_size
            signature += tuple(-(-(s.num_computed + 1) // c) for s in decodes)
        return signature

    def _bump(self, plan):
        if isinstance(plan, fi_decode.FiPlan):
            return self._fi.bump(plan)
        if self.backend == "triton":
            plan.seq_lens.add_(1)  # on the device, in place
            return plan
        if self.backend == "torch":
            return tpp_torch.build_plan(self._bump_tree(plan.tree), self.pool.chunk_size, self.device)
        return self._bump_tree(plan)

    def _bump_tree(self, plan: reference.TreePlan) -> reference.TreePlan:
        # the new token (position n) lands in the row's private chunk at table position n // c
        c = self.pool.chunk_size

        def grown(lens: tuple[int, ...], places: tuple[int, ...], n: int) -> tuple[int, ...]:
            i = places.index(n // c)
            return lens[:i] + (lens[i] + 1,) + lens[i + 1 :]

        return dataclasses.replace(
            plan,
            seq_lens=tuple(n + 1 for n in plan.seq_lens),
            private_lens=tuple(
                grown(pl, pp, n) for pl, pp, n in zip(plan.private_lens, plan.private_positions, plan.seq_lens)
            ),
        )

    def sparse_prefill(
        self,
        layer: int,
        q: torch.Tensor,
        out: torch.Tensor,
        spans: list[PrefillSpan],
        budget: SparseBudget | None = None,
    ) -> None:
        """Block-union pieces of one layer: select each span's blocks from its queries, then
        attend over the page lists (chunkserve.kernels.block_union); writes their rows of out. budget: the
        step's planned page ids to fill (a budget through FlashInfer), else chunk masks."""
        cfg, c, hkv = self.sparse, self.pool.chunk_size, self.pool.kv.shape[3]
        k_cache, v_cache = self.pool.k(layer), self.pool.v(layer)
        bc, e = cfg.block // c, self.num_q_heads // self._sub
        bounds = self.pool.key_bounds[layer]
        pieces, outs, chunk_ids = [], [], []
        for i, s in enumerate(spans):
            rows = q[s.start : s.start + s.num_new]
            parts = block_union.piece_spans(s.context_len, s.num_new, cfg.span_rows(s.context_len))
            k0 = parts[-1][0] // c  # the chunks the last span chooses among
            # the blocks' key bounds, from the pool's chunk bounds (the context's filled in earlier
            # steps, queued before this; the piece's own that its later spans choose among, here)
            self._bound_own(layer, s.table[s.context_len // c : k0])
            if self.backend == "triton":
                keys = block_union.block_keys_gpu(bounds, s.table[:k0], bc, rows.dtype)
                agg = block_union.block_scores_gpu(rows, keys, cfg, self._sub, self.sm_scale, s.limits, s.context_len)
            else:
                keys = block_union.block_keys(bounds, s.table[:k0], bc)
                q_limits = block_union.query_limits(s.context_len, s.num_new, c, cfg)
                agg = block_union.block_scores(rows, keys, cfg, self._sub, self.sm_scale, q_limits, s.context_len)
            self.counters.sparse_pages_dense += e * sum(-(-(ctx + n) // c) for ctx, n in parts)
            if budget is not None:  # (the last span's blocks are all of agg's: the largest limit)
                b = budget.pieces[i]
                chosen = block_union.budget_blocks(agg, cfg, None, b.exclude)
                block_union.write_pages(budget.ids, b.dst, b.counts, chosen, s.table, bc, hkv, e)
                self.counters.sparse_pages_read += b.pages
                continue
            limits = [block_union.context_blocks(ctx, c, cfg.block) for ctx, _ in parts for _ in range(e)]
            keep = block_union.select_blocks(agg, cfg, limits)
            for j, (ctx, n) in enumerate(parts):
                used = -(-(ctx + n) // c)
                mask = block_union.chunk_mask(keep[j * e : (j + 1) * e], bc, ctx // c, used)
                if self._prefill is None:  # (the reference path; FlashInfer's counts its pages as it plans)
                    self.counters.sparse_pages_read += int(mask.sum())
                r = ctx - s.context_len
                pieces.append(paged_prefill.SparsePiece(rows[r : r + n], mask, s.table[:used], ctx + n))
                outs.append(out[s.start + r : s.start + r + n])
                chunk_ids.append(s.chunk_ids)
        if budget is not None:  # (each piece's q covers its spans' planned runs)
            at = [slice(s.start, s.start + s.num_new) for s in spans]
            self._prefill.run_planned_sparse([q[r] for r in at], k_cache, v_cache, [out[r] for r in at])
        elif self._prefill is not None:
            self._prefill.run_sparse(pieces, k_cache, v_cache, outs)
            self.counters.sparse_pages_read += self._prefill.sparse_pages_planned
        else:
            for p, o, ids in zip(pieces, outs, chunk_ids, strict=True):
                ctx = p.total - p.q.shape[0]
                o.copy_(reference.sparse_prefill_ref(p.q, k_cache, v_cache, ids, ctx, p.mask, self.sm_scale))

    def _bound_own(self, layer: int, chunks: torch.Tensor) -> None:
        """The key bounds of one layer's chunks this step filled (the rest of the step's are
        bounded after its forward, every layer: StepAttention.keep_key_bounds)."""
        if chunks.numel():
            kv, bounds = self.pool.kv[layer : layer + 1, 0], self.pool.key_bounds[layer : layer + 1]
            block_union.bound_chunks(kv, chunks, bounds, self.backend == "triton")

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan, out: torch.Tensor) -> None:
        """The decode rows' attention q [B, Hq, D] into out [B, Hq, D]."""
        if isinstance(plan, fi_decode.FiPlan):
            out.copy_(self._fi.run(q, k_cache, v_cache))
        elif self.backend == "triton":
            self._decoder(q, k_cache, v_cache, plan, self.sm_scale, out)
        elif self.backend == "torch":
            out.copy_(tpp_torch.tpp_decode(q, k_cache, v_cache, plan, self.sm_scale))
        else:
            out.copy_(reference.tpp_decode_ref(q, k_cache, v_cache, plan, self.sm_scale))


@dataclass(frozen=True)
class StepAttention:
    """One step's attention: what the model calls as `attn.forward(layer, q, k, v)`."""

    attention: Attention
    positions: torch.Tensor  # [T] position of each new token in its sequence
    chunk_idx: torch.Tensor  # [T] chunk id of each new token's K/V slot
    offset: torch.Tensor  # [T] slot inside that chunk
    num_decodes: int  # rows [0, num_decodes) are decodes, in tree DFS order
    # reference.TreePlan, tpp_torch.TorchPlan, tpp.TppPlan or fi_decode.FiPlan; None without decodes
    decode_plan: object
    prefills: tuple[PrefillSpan, ...]
    fused_prefill: bool = False  # the dense prefill spans through the FlashInfer plan made for this step
    dense_rows: torch.Tensor | None = (
        None  # their rows where sparse spans are among the spans (else they follow the decodes)
    )
    filled: torch.Tensor | None = None  # chunks whose last slot this step writes, when the pool keeps key bounds
    budget: SparseBudget | None = None  # a budget's planned page lists (Attention._plan_budget)
    mixed: bool = False  # prefill tokens among the decode rows (Attention._plan_rows)

    def forward(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]; out: [T, Hq, D] to write (every row), else a new one
        self.attention.pool.write(layer, self.chunk_idx, self.offset, k, v)
        return self.attend(layer, q, out)

    def forward_rope(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """forward of q and k not yet rotated (cos, sin [T, D]): RoPE and the K/V store in one
        launch on CUDA (KVPool.write_rope). The model calls it where the attention has it."""
        q = self.attention.pool.write_rope(layer, self.chunk_idx, self.offset, q, k, v, cos, sin)
        return self.attend(layer, q)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """forward, the new tokens' K/V already in the pool (chunkserve/replicas/engine/piecewise.py writes them)."""
        a = self.attention
        k_cache, v_cache = a.pool.k(layer), a.pool.v(layer)
        out = torch.empty_like(q) if out is None else out
        b = self.num_decodes
        if b and b == q.shape[0]:  # a decode-only step (no views to make: this runs per layer)
            a.decode(q, k_cache, v_cache, self.decode_plan, out)
            return out
        if b:
            a.decode(q[:b], k_cache, v_cache, self.decode_plan, out[:b])
        if self.fused_prefill and self.dense_rows is None:  # the spans' rows follow the decode rows
            rows = out[b:]  # (written in place where it can be: a mixed step's 8 MB a layer not copied)
            if rows.dtype == a._prefill.dtype and rows.is_contiguous():
                a._prefill.run(q[b:], k_cache, v_cache, out=rows)
            else:
                rows.copy_(a._prefill.run(q[b:], k_cache, v_cache))
        elif self.fused_prefill:
            out[self.dense_rows] = a._prefill.run(q[self.dense_rows], k_cache, v_cache)
        else:
            for s in self.prefills:
                if not s.sparse:
                    rows = slice(s.start, s.start + s.num_new)
                    out[rows] = reference.prefill_attention_ref(
                        q[rows], k_cache, v_cache, s.chunk_ids, s.context_len, a.sm_scale
                    )
        sparse = [s for s in self.prefills if s.sparse]
        if sparse:
            a.sparse_prefill(layer, q, out, sparse, self.budget)
        return out

    def keep_key_bounds(self) -> None:
        """After the forward: the key bounds of each chunk this step filled, every layer."""
        if self.filled is not None:
            pool = self.attention.pool  # (triton: no [L, F, Hkv, c, D] copy of the chunks)
            block_union.bound_chunks(pool.kv[:, 0], self.filled, pool.key_bounds, self.attention.backend == "triton")
