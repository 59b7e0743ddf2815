"""The one shape every paged attention wrapper is built for."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PagedHeads:
    """One rank's attention heads over a pool of fixed-size chunks, laid out [N, Hkv, c, D] per
    layer (chunkserve/replicas/engine/kv_pool.py): what the FlashInfer wrappers and the fixed TPP
    plans are built for."""

    num_q_heads: int  # this rank's
    num_kv_heads: int  # this rank's; divides num_q_heads
    head_dim: int
    chunk_size: int
