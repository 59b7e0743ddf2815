"""Attention over the chunk pool for one engine step (DESIGN §4, §5).

Split as in mini-sglang: `plan(batch)` once per step builds what every layer needs (slot
indices, the decode tree plan, per-sequence prefill spans); `forward(layer, q, k, v)` once per
layer writes the new K/V into the pool and attends. On CPU (and on GPU until the Triton and
FlashInfer kernels land) both phases use the plain-torch kernels of `kernels.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import reference
from replicas.kv_pool import KVPool
from replicas.scheduler import Batch


@dataclass(frozen=True)
class PrefillSpan:
    start: int  # first row of this sequence in the flattened batch
    num_new: int  # query tokens this step
    context_len: int  # tokens already in the cache before this step
    chunk_ids: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    positions: torch.Tensor  # [T] position of each new token in its sequence
    chunk_idx: torch.Tensor  # [T] chunk id of each new token's K/V slot
    offset: torch.Tensor  # [T] slot inside that chunk
    num_decodes: int  # rows [0, num_decodes) are decodes, in tree DFS order
    decode_plan: reference.TreePlan | None
    prefills: tuple[PrefillSpan, ...]


def plan_step(batch: Batch, chunk_size: int, device: torch.device) -> StepPlan:
    positions, chunk_idx, prefills = [], [], []
    row = 0
    for seq, n in batch.items:
        table = seq.chunk_table
        pos = torch.arange(seq.num_computed, seq.num_computed + n)
        positions.append(pos)
        chunk_idx.append(torch.tensor(table, dtype=torch.long)[pos // chunk_size])
        if row >= len(batch.decodes):
            prefills.append(PrefillSpan(row, n, seq.num_computed, tuple(table)))
        row += n
    decode_plan = None
    if batch.decodes:
        decode_plan = reference.build_tree_plan(
            [s.chunk_table for s in batch.decodes], [s.num_computed + 1 for s in batch.decodes], chunk_size)
    positions = torch.cat(positions)
    return StepPlan(positions.to(device), torch.cat(chunk_idx).to(device), (positions % chunk_size).to(device),
                    len(batch.decodes), decode_plan, tuple(prefills))


class ReferenceAttention:
    """The attention backend the model calls: `forward(layer, q, k, v) -> o`."""

    def __init__(self, pool: KVPool, plan: StepPlan, sm_scale: float):
        self.pool, self.plan, self.sm_scale = pool, plan, sm_scale

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D]
        k_cache, v_cache, p = self.pool.k(layer), self.pool.v(layer), self.plan
        # advanced indices split by a slice: the indexed view is [T, Hkv, D], like k
        k_cache[p.chunk_idx, :, p.offset] = k.to(k_cache.dtype)
        v_cache[p.chunk_idx, :, p.offset] = v.to(v_cache.dtype)
        out = torch.empty_like(q)
        b = p.num_decodes
        if b:
            out[:b] = reference.tpp_decode_ref(q[:b], k_cache, v_cache, p.decode_plan, self.sm_scale)
        for s in p.prefills:
            rows = slice(s.start, s.start + s.num_new)
            out[rows] = reference.prefill_attention_ref(
                q[rows], k_cache, v_cache, s.chunk_ids, s.context_len, self.sm_scale)
        return out
