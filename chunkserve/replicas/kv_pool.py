"""Chunk allocator over the preallocated K/V tensors of every layer (DESIGN §3).

One chunk id addresses `chunk_size` token slots in every layer. Per layer, K and V are
`[num_chunks + 1, kv_heads, c, head_dim]` ("HND" inside a chunk; the last chunk the scratch one),
views of one allocation so that K and V share strides: `k.view(-1, 1, c, head_dim)` is a page
table of (chunk, head) pages for kernels that want a different page list per KV head.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        *,
        num_layers: int,
        num_chunks: int,
        num_kv_heads: int,
        chunk_size: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        key_bounds: bool = False,
    ):
        if num_chunks < 1:
            raise ValueError(f"KV pool needs at least one chunk, got {num_chunks}")
        self.num_layers = num_layers
        self.num_chunks = num_chunks
        self.chunk_size = chunk_size
        # kv: [L, 2, N + 1, Hkv, c, D]; zeroed so never-written slots are finite. Chunk N is the
        # scratch chunk, never allocated: the padding rows of a graphed step write their K/V there
        # (chunkserve/replicas/piecewise.py)
        self.scratch = num_chunks
        self.kv = torch.zeros(
            num_layers, 2, num_chunks + 1, num_kv_heads, chunk_size, head_dim, dtype=dtype, device=device
        )
        # each layer's views, made once: every layer of every step asks for them
        self._k, self._v = [self.kv[i, 0] for i in range(num_layers)], [self.kv[i, 1] for i in range(num_layers)]
        # key_bounds: [L, N, Hkv, 2D] in the keys' dtype (exact), per full chunk [max | min] of
        # its keys per dimension (block-union's selection, chunkserve.kernels.block_union), or None without
        # sparse prefill
        self.key_bounds = (
            torch.zeros(num_layers, num_chunks, num_kv_heads, 2 * head_dim, dtype=dtype, device=device)
            if key_bounds
            else None
        )
        # stack of free ids, lowest id on top so allocation order is deterministic
        self._free = list(range(num_chunks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_chunks

    def k(self, layer: int) -> torch.Tensor:  # [N + 1, Hkv, c, D]
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:  # [N + 1, Hkv, c, D]
        return self._v[layer]

    def write(
        self, layer: int, chunk_idx: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """New tokens' K/V into their slots: k, v [T, Hkv, D]; token t into chunk chunk_idx[t] at
        slot offset[t]."""
        k_cache, v_cache = self.k(layer), self.v(layer)
        # advanced indices split by a slice: the indexed view is [T, Hkv, D], like k
        k_cache[chunk_idx, :, offset] = k.to(k_cache.dtype)
        v_cache[chunk_idx, :, offset] = v.to(v_cache.dtype)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError("KV pool exhausted: caller must evict or preempt first")
        cid = self._free.pop()
        self._is_free[cid] = 0
        return cid

    def free(self, chunk_id: int) -> None:
        if self._is_free[chunk_id]:
            raise RuntimeError(f"double free of KV chunk {chunk_id}")
        self._is_free[chunk_id] = 1
        self._free.append(chunk_id)

    def is_free(self, chunk_id: int) -> bool:
        return bool(self._is_free[chunk_id])

    @staticmethod
    def bytes_per_chunk(
        num_layers: int, num_kv_heads: int, chunk_size: int, head_dim: int, dtype: torch.dtype, key_bounds: bool = False
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        bounds = num_layers * num_kv_heads * 2 * head_dim * elem if key_bounds else 0
        return 2 * num_layers * num_kv_heads * chunk_size * head_dim * elem + bounds
