"""FlashInfer's paged decode over our chunk pool: the engine's decode fallback when nothing is shared.

With no shared chunk in the decode batch, TPP has no phase 1 and is a plain paged decode;
FlashInfer's tensor-core paged decode is then faster for grouped-query heads (figures:
chunkserve/kernels/tools/records/README.md, 'Figures behind the code'), so the engine uses it
there when flashinfer is installed (``EngineConfig.flashinfer_fallback``). Our per-layer cache
``[num_chunks, Hkv, c, D]`` is FlashInfer's "HND" paged layout with page size c as it is: the
chunk tables are the page tables, nothing is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chunkserve.kernels.heads import PagedHeads

__all__ = ["FlashInferDecode", "FiPlan", "available"]


def available() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or its import fails on this machine
        return False
    return True


@dataclass(frozen=True)
class FiPlan:
    """One decode batch's chunk tables (a reserved next chunk included); ``lens`` are the rows'
    lengths the wrapper is planned for."""

    tables: tuple[tuple[int, ...], ...]
    lens: tuple[int, ...]


class FlashInferDecode:
    """One `BatchDecodeWithPagedKVCacheWrapper` (tensor cores for GQA), re-planned per step."""

    def __init__(
        self,
        heads: PagedHeads,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sm_scale: float,
    ):
        import flashinfer

        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"FlashInfer decode needs a 16-bit cache, got {dtype}")
        num_q_heads, num_kv_heads, head_dim = heads.num_q_heads, heads.num_kv_heads, heads.head_dim
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.chunk_size, self.dtype, self.device, self.sm_scale = heads.chunk_size, dtype, device, sm_scale
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "HND", use_tensor_cores=num_q_heads != num_kv_heads
        )

    def plan(self, tables: Sequence[Sequence[int]], lens: Sequence[int]) -> FiPlan:
        """Plan for rows reading chunk_tables[r][:ceil(lens[r] / c)] (every row at least 1 token)."""
        c = self.chunk_size
        used = [tuple(t[: -(-n // c)]) for t, n in zip(tables, lens)]
        if any(n < 1 for n in lens):
            raise ValueError("FlashInfer decode rows need at least one token")
        indptr = [0]
        for t in used:
            indptr.append(indptr[-1] + len(t))
        i32 = dict(dtype=torch.int32, device=self.device)
        self._wrapper.plan(
            torch.tensor(indptr, **i32),
            torch.tensor([x for t in used for x in t], **i32),
            torch.tensor([n - (len(t) - 1) * c for t, n in zip(used, lens)], **i32),
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            c,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.sm_scale,
        )
        return FiPlan(tuple(tuple(t) for t in tables), tuple(int(n) for n in lens))

    def bump(self, plan: FiPlan) -> FiPlan:
        """Every row one token longer: re-plan the wrapper (host work, a few page-table copies)."""
        return self.plan(plan.tables, [n + 1 for n in plan.lens])

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, D]; caches [num_chunks, Hkv, c, D] -> [B, Hq, D]."""
        return self._wrapper.run(q, (k_cache, v_cache))
