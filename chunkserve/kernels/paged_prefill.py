"""FlashInfer's paged prefill over our chunk pool: every prefill span of a step in one launch per
layer (DESIGN §8, the dense path).

A step's prefill spans (each a sequence's new tokens after its cached context) are one ragged
batch: query rows ``qo_indptr``, and for each span its chunk table as the page list, the new
tokens' K/V already written into the pool. Causal attention is bottom-right aligned (the span's
token t sees context_len + t + 1 keys), as ``chunkserve.kernels.reference.prefill_attention_ref`` defines it.
Our per-layer cache ``[num_chunks, Hkv, c, D]`` is FlashInfer's "HND" layout with page size c:
nothing is gathered or copied. The plan is made once per step (host work) and serves every layer.

The engine's prefill ran ``prefill_attention_ref`` span by span before: per layer about ten torch
ops per span, so a burst of short prompts after a shared prefix took several times as long as
one launch per layer does (figures: chunkserve/kernels/tools/records/README.md, 'Figures behind the code').

FlashInfer compiles its prefill module for a dtype and head size on first use, for minutes on a
fresh machine (then cached on disk, under FLASHINFER_WORKSPACE_BASE). A GPU replica's warmup
(chunkserve/replicas/engine/warmup.py) runs a prefill, so the compile happens before the replica reports ready.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from chunkserve.kernels.fi_decode import available
from chunkserve.kernels.heads import PagedHeads

__all__ = ["FlashInferPrefill", "SparsePiece", "available", "from_lists", "planned_runs", "to_lists", "usable"]


class SparsePiece(NamedTuple):
    """One prefill piece's block-union page lists (chunkserve.kernels.block_union) for one layer."""

    q: torch.Tensor  # [n, Hq, D], the piece's queries
    mask: torch.Tensor  # [E, used] bool on the device: entry e = kv * S + s's chunks (block_union.chunk_mask)
    table: torch.Tensor  # [used] int64 on the device: the piece's chunks in use
    total: int  # tokens in those chunks (context + n)


def _pinned(x: list[int]) -> torch.Tensor:
    """int32 host tensor, page-locked: FlashInfer's plan copies it to the device without blocking."""
    return torch.tensor(x, dtype=torch.int32).pin_memory()


def usable(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether FlashInfer's prefill can serve a pool of this dtype and head size on `device`."""
    return (
        device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim in (64, 128, 256)
        and available()
    )


class FlashInferPrefill:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, planned once per step, run once per layer."""

    def __init__(
        self,
        heads: PagedHeads,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sm_scale: float,
    ):
        import flashinfer

        if not usable(dtype, heads.head_dim, device):
            raise ValueError(
                f"FlashInfer prefill needs CUDA, a 16-bit cache and head dim 64/128/256, "
                f"got {dtype}, {heads.head_dim}, {device}"
            )
        self.num_q_heads, self.num_kv_heads, self.head_dim = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        self.chunk_size, self.dtype, self.device, self.sm_scale = heads.chunk_size, dtype, device, sm_scale
        # Two wrappers, planned in turn: a plan stages its metadata in the wrapper's page-locked
        # host buffer and copies it to the device in stream order, and under asynchronous
        # scheduling the next step is planned before this one has run. A step that samples no
        # row (a long prompt's middle piece) is never waited for, so the host may plan several
        # steps ahead of the device (the more where it waits behind the host tier's copies):
        # a wrapper is planned again only once the copy of its last plan has run (`_ready`),
        # or it would overwrite metadata a queued step has not read yet (the likely cause of
        # the illegal address in bench_host_tier's cached run on an H100, records
        # chunkserve/replicas/tools/records h100-2026-12-07). (Their kernels run in stream
        # order, one at a time: they share the float workspace.)
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND") for _ in range(2)]
        self._turn = 1
        # per wrapper: an event recorded after its last plan (its copy queued), None before one
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._sparse_copied: list[torch.cuda.Event | None] = [None, None]
        self.plan_waits = 0  # plans that waited for the device to run an earlier plan's copy
        self._rows = -1  # query rows of the spans planned (-1: not planned yet)
        # block-union pieces: planned layer by layer (alpha: each layer's lists have their own
        # lengths), or once a step (a budget: every layer rewrites the page ids in place), then
        # in turn like the dense ones
        self._sparse = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND") for _ in range(2)]
        self._sparse_turn = 1
        self._sparse_rows: list[tuple[int, int]] = []  # per piece planned: (query rows, page lists)
        self.sparse_pages_planned = 0  # pages in the lists last planned

    def plan(self, spans: Sequence[tuple[Sequence[int], int, int]]) -> int:
        """Plan for spans (chunk table, context_len, num_new), num_new >= 1, whose tables cover
        context_len + num_new tokens; -> the query rows planned (the spans' num_new summed)."""
        c = self.chunk_size
        qo, kv, last, lens = [0], [0], [], []
        pages: list[int] = []
        for table, context, new in spans:
            if new < 1 or context < 0:
                raise ValueError(f"a prefill span needs new tokens and a context >= 0, got {context}, {new}")
            total = context + new
            used = -(-total // c)
            if used > len(table):
                raise ValueError(f"a span of {total} tokens needs {used} chunks, its table has {len(table)}")
            qo.append(qo[-1] + new)
            kv.append(kv[-1] + used)
            last.append(total - (used - 1) * c)
            pages += table[:used]
            lens.append(total)
        # Host index arrays pinned and the page list on the device, so that planning does not
        # wait for the steps already queued (FlashInfer copies them without blocking from there)
        self._turn ^= 1
        self._ready(self._copied, self._turn)
        self._wrappers[self._turn].plan(
            _pinned(qo),
            _pinned(kv),
            _pinned(pages).to(self.device, non_blocking=True),
            _pinned(last),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            c,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            seq_lens=_pinned(lens),
        )
        self._copied[self._turn] = self._recorded()
        self._rows = qo[-1]
        return self._rows

    def _ready(self, copied: list[torch.cuda.Event | None], turn: int) -> None:
        """Wait until the copy of wrapper `turn`'s last plan has run on the device (no wait where
        it has, as when every step in between was collected)."""
        event = copied[turn]
        if event is not None and not event.query():
            self.plan_waits += 1
            event.synchronize()

    @staticmethod
    def _recorded() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def run(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q: [rows, Hq, D], the planned spans' rows in order; caches [num_chunks, Hkv, c, D] ->
        [rows, Hq, D], written into out where given (contiguous, q's shape and the plan's dtype:
        the layer's output rows, no copy)."""
        if q.shape[0] != self._rows:
            raise ValueError(f"the plan is for {self._rows} query rows, got {q.shape[0]}")
        return self._wrappers[self._turn].run(q.to(self.dtype), (k_cache, v_cache), out=out)

    def plan_sparse(self, pages: torch.Tensor, pieces: Sequence[tuple[int, list[int], int]]) -> None:
        """Plan block-union page lists: pieces (query rows n, pages of each of its E lists, the
        last page's tokens); pages: [sum of the lists' pages] int32 on the device, list after
        list. FlashInfer keeps `pages` itself, not a copy: the caller may rewrite its contents
        before each run (a budget's chosen pages, layer by layer)."""
        c = self.chunk_size
        e = len(pieces[0][1])
        if e % self.num_kv_heads or self.num_q_heads % e or any(len(p[1]) != e for p in pieces):
            raise ValueError(f"sparse pieces need the same page lists per KV head, got {[len(p[1]) for p in pieces]}")
        qo, kv, last, lens = [0], [0], [], []
        for n, counts, tail in pieces:
            for chosen in counts:
                qo.append(qo[-1] + n)
                kv.append(kv[-1] + chosen)
                last.append(tail)
                lens.append((chosen - 1) * c + tail)
        if pages.dtype != torch.int32 or pages.numel() != kv[-1]:
            raise ValueError(f"the page lists hold {kv[-1]} int32 pages, got {pages.numel()} {pages.dtype}")

        self._sparse_turn ^= 1
        self._ready(self._sparse_copied, self._sparse_turn)
        self._sparse[self._sparse_turn].plan(
            _pinned(qo),
            _pinned(kv),
            pages,
            _pinned(last),
            self.num_q_heads // e,
            1,
            self.head_dim,
            c,
            causal=True,
            sm_scale=self.sm_scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            seq_lens=_pinned(lens),
        )
        self._sparse_copied[self._sparse_turn] = self._recorded()
        self._sparse_rows = [(n, e) for n, _, _ in pieces]
        self.sparse_pages_planned = kv[-1]

    def run_planned_sparse(
        self,
        qs: Sequence[torch.Tensor],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        outs: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """The planned pieces' attention: qs [n, Hq, D] per piece -> [n, Hq, D] per piece, written
        into outs if given (views of the layer's output: one copy fewer). A q may cover several
        consecutive planned pieces, all of its first's rows but the last (a sparse piece's spans,
        chunkserve.kernels.block_union.piece_spans): regrouped together, in one copy.

        A list serves `sub` query heads of one KV head, so FlashInfer runs with one KV head over
        the pool viewed as (chunk, KV head) pages, [num_chunks * Hkv, 1, c, D]; each planned
        piece's queries are regrouped list-major ([E * n, sub, D], a copy of q only)."""
        c, d = self.chunk_size, self.head_dim
        e = self._sparse_rows[0][1]
        runs = planned_runs([n for n, _ in self._sparse_rows], [x.shape[0] for x in qs])
        paged = (k_cache.view(-1, 1, c, d), v_cache.view(-1, 1, c, d))
        o = self._sparse[self._sparse_turn].run(to_lists(qs, runs, e).to(self.dtype), paged)  # [sum E * n, sub, D]
        outs = [torch.empty_like(x) for x in qs] if outs is None else outs
        from_lists(o, outs, runs, e)
        return list(outs)

    def run_sparse(
        self,
        pieces: Sequence[SparsePiece],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        outs: Sequence[torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """Plan and run pieces whose lists are chunk masks (alpha's threshold, layer by layer):
        [n, Hq, D] per piece. Reads the lists' lengths back to the host (FlashInfer's plan
        takes them there): waits for the device."""
        c, hkv = self.chunk_size, self.num_kv_heads
        e = pieces[0].mask.shape[0]
        counts = torch.cat([p.mask.sum(1) for p in pieces]).tolist()  # waits for the device
        heads = torch.arange(hkv, device=self.device).repeat_interleave(e // hkv)
        pages, planned = [], []
        for i, p in enumerate(pieces):
            if p.mask.shape[0] != e:
                raise ValueError(f"sparse pieces need the same page lists per KV head, got {p.mask.shape[0]} and {e}")
            page = p.table[None, :] * hkv + heads[:, None]  # [E, used]
            pages.append(page[p.mask])  # row-major: each list's pages in chunk order
            planned.append((p.q.shape[0], counts[i * e : (i + 1) * e], p.total - (p.mask.shape[1] - 1) * c))
        self.plan_sparse(torch.cat(pages).to(torch.int32), planned)
        return self.run_planned_sparse([p.q for p in pieces], k_cache, v_cache, outs)


def planned_runs(planned: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """The planned pieces' rows and the rows of each q given -> per q the planned pieces it
    covers, consecutive: (m, the rows of its first; full, how many of m rows; rest, the rows of a
    shorter last one, or 0). A sparse piece's spans: all of m rows but the last."""
    out, i = [], 0
    for t in lengths:
        lens: list[int] = []
        while sum(lens) < t and i < len(planned):
            lens.append(planned[i])
            i += 1
        m = lens[0] if lens else 0
        if not lens or sum(lens) != t or any(x != m for x in lens[:-1]) or lens[-1] > m:
            raise ValueError(f"the sparse plan is for pieces of {list(planned)} rows, got {list(lengths)}")
        full = len(lens) if lens[-1] == m else len(lens) - 1
        out.append((m, full, 0 if lens[-1] == m else lens[-1]))
    if i != len(planned):
        raise ValueError(f"the sparse plan is for pieces of {list(planned)} rows, got {list(lengths)}")
    return out


def to_lists(qs: Sequence[torch.Tensor], runs: Sequence[tuple[int, int, int]], e: int) -> torch.Tensor:
    """qs [n, Hq, D] each, in planned pieces (`planned_runs`) -> [sum E * n, Hq / E, D]: each
    planned piece list-major (its E lists' rows in turn, a list's `sub` heads per row), a
    q's runs of equal length in one copy."""
    parts = []
    for x, (m, full, rest) in zip(qs, runs, strict=True):
        _, hq, d = x.shape
        sub = hq // e
        if full:  # [full, m, E, sub, D] -> [full, E, m, sub, D]
            parts.append(x[: full * m].reshape(full, m, e, sub, d).transpose(1, 2).reshape(-1, sub, d))
        if rest:
            parts.append(x[full * m :].reshape(rest, e, sub, d).transpose(0, 1).reshape(-1, sub, d))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def from_lists(o: torch.Tensor, outs: Sequence[torch.Tensor], runs: Sequence[tuple[int, int, int]], e: int) -> None:
    """The inverse of `to_lists`: o [sum E * n, sub, D] back into outs [n, Hq, D] each."""
    row = 0
    for out, (m, full, rest) in zip(outs, runs, strict=True):
        _, hq, d = out.shape
        sub = hq // e
        if full:
            got = o[row : row + full * e * m].view(full, e, m, sub, d).transpose(1, 2)
            out[: full * m].view(full, m, e, sub, d).copy_(got)
            row += full * e * m
        if rest:
            out[full * m :].view(rest, e, sub, d).copy_(o[row : row + e * rest].view(e, rest, sub, d).transpose(0, 1))
            row += e * rest
