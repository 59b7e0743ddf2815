"""Chunk allocator over the preallocated K/V tensors of every layer (DESIGN §6).

One chunk id addresses `chunk_size` token slots in every layer. Per layer, K and V are
`[num_chunks + 1, kv_heads, c, head_dim]` ("HND" inside a chunk; the last chunk the scratch one),
views of one allocation so that K and V share strides: `k.view(-1, 1, c, head_dim)` is a page
table of (chunk, head) pages for kernels that want a different page list per KV head.

`HostPool` is the host tier below it: chunks the GPU pool evicted, kept in (pinned) host memory
until a request that matches them copies them back.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from chunkserve.replicas.engine.stats import EngineStats

_LOAD, _SPILL, _AHEAD = 0, 1, 2  # HostPool's copies: host -> GPU, GPU -> host, GPU -> host ahead


class ChunkIds:
    """A pool's chunk ids: a stack of free ids, the lowest on top so allocation order is
    deterministic, and a free flag per id (double frees are errors). `KVPool` and `HostPool`
    allocate through it."""

    _name = "chunk"  # in errors
    _exhausted = "caller must evict first"

    def __init__(self, num_chunks: int):
        self._free = list(range(num_chunks - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_chunks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"{self._name} pool exhausted: {self._exhausted}")
        cid = self._free.pop()
        self._is_free[cid] = 0
        return cid

    def free(self, chunk_id: int) -> None:
        if self._is_free[chunk_id]:
            raise RuntimeError(f"double free of {self._name} chunk {chunk_id}")
        self._is_free[chunk_id] = 1
        self._free.append(chunk_id)

    def is_free(self, chunk_id: int) -> bool:
        return bool(self._is_free[chunk_id])


@dataclass(frozen=True)
class KVShape:
    """One rank's K/V of one chunk, every layer: what a pool of such chunks is made of."""

    num_layers: int
    num_kv_heads: int  # this rank's
    chunk_size: int
    head_dim: int
    dtype: torch.dtype
    key_bounds: bool = False  # each full chunk's key bounds kept too (sparse prefill)

    @property
    def bytes_per_chunk(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_layer = self.num_kv_heads * self.head_dim * elem
        bounds = self.num_layers * per_layer * 2 if self.key_bounds else 0
        return 2 * self.num_layers * per_layer * self.chunk_size + bounds


class KVPool(ChunkIds):
    _name, _exhausted = "KV", "caller must evict or preempt first"

    def __init__(self, shape: KVShape, num_chunks: int, device: torch.device | str):
        if num_chunks < 1:
            raise ValueError(f"KV pool needs at least one chunk, got {num_chunks}")
        self.shape = shape
        num_layers, heads, c, dim, dtype = (
            shape.num_layers,
            shape.num_kv_heads,
            shape.chunk_size,
            shape.head_dim,
            shape.dtype,
        )
        self.num_layers = num_layers
        self.num_chunks = num_chunks
        self.chunk_size = c
        # kv: [L, 2, N + 1, Hkv, c, D]; zeroed so never-written slots are finite. Chunk N is the
        # scratch chunk, never allocated: the padding rows of a graphed step write their K/V there
        # (chunkserve/replicas/engine/piecewise.py)
        self.scratch = num_chunks
        self.kv = torch.zeros(num_layers, 2, num_chunks + 1, heads, c, dim, dtype=dtype, device=device)
        # each layer's views, made once: every layer of every step asks for them
        self._k, self._v = [self.kv[i, 0] for i in range(num_layers)], [self.kv[i, 1] for i in range(num_layers)]
        # key_bounds: [L, N, Hkv, 2D] in the keys' dtype (exact), per full chunk [max | min] of
        # its keys per dimension (block-union's selection, chunkserve.kernels.block_union), or None without
        # sparse prefill
        self.key_bounds = (
            torch.zeros(num_layers, num_chunks, heads, 2 * dim, dtype=dtype, device=device)
            if shape.key_bounds
            else None
        )
        super().__init__(num_chunks)

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
        if k_cache.is_cuda and k.dtype == v.dtype == k_cache.dtype and k.stride(-1) == v.stride(-1) == 1:
            from chunkserve.kernels.norm_rope import store_kv  # imports triton: the CPU path must not need it

            store_kv(k_cache, v_cache, chunk_idx, offset, k, v)  # one launch, the same bits
            return
        # advanced indices split by a slice: the indexed view is [T, Hkv, D], like k
        k_cache[chunk_idx, :, offset] = k.to(k_cache.dtype)
        v_cache[chunk_idx, :, offset] = v.to(v_cache.dtype)

    def write_rope(
        self,
        layer: int,
        chunk_idx: torch.Tensor,
        offset: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`write` of q and k not yet rotated: k rotated (cos, sin [T, D]) into its slots, v as
        it is; returns q rotated, into q_out where given ([T, Hq, D], contiguous). On CUDA one
        Triton launch (norm_rope.rope_store) where RoPE, the store and q's copy took three; the
        same bits as rotating (model.layers.apply_rotary_qk) then writing."""
        k_cache, v_cache = self.k(layer), self.v(layer)
        same = q.dtype == k.dtype == v.dtype == k_cache.dtype == cos.dtype == sin.dtype
        if (
            k_cache.is_cuda
            and same
            and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and cos.is_contiguous()
            and sin.is_contiguous()
            and (q_out is None or q_out.is_contiguous())
        ):
            from chunkserve.kernels.norm_rope import rope_store  # imports triton: the CPU path must not need it

            return rope_store(q, k, v, cos, sin, k_cache, v_cache, chunk_idx, offset, q_out)
        from chunkserve.replicas.model.layers import apply_rotary_qk

        q, k = apply_rotary_qk(q, k, cos, sin)
        self.write(layer, chunk_idx, offset, k, v)
        return q if q_out is None else q_out.copy_(q)


class HostPool(ChunkIds):
    """The host tier (DESIGN §6): chunks of K/V in host memory, the GPU pool's evicted leaves.

    `kv` is `[Nh, L, 2, Hkv, c, D]`, chunk-major so one chunk (every layer's K and V) is one
    contiguous block and its copy one transfer; pinned (page-locked) where the GPU pool is on
    CUDA, so copies run asynchronously; a second CPU tensor on CPU engines (tests). With sparse
    prefill `key_bounds` `[Nh, L, Hkv, 2D]` travels with each chunk.

    The prefix tree decides, the pool copies: `spill`, `load` and `write_ahead` queue a copy in
    decision order (a chunk id freed by a spill may be loaded into, or a host chunk freed by a load
    spilled into, later in the same step), and `flush`, which the engine calls once a step after
    scheduling and before launching, issues them in that order. On CUDA they run on a side stream
    that first waits for everything queued on the compute stream (the spilled chunks' last writes
    and reads; with asynchronous scheduling a chunk freed at a collect may still be used by the
    step in flight, so a load's target waits for it too) and the compute stream then waits for the
    spills before the step's forward: no kernel writes a spilled chunk's reused id before its copy
    is done. Loads and write-aheads (a cached chunk copied to host before its eviction,
    `PrefixTree.write_ahead`) after the last spill are not waited for: they run beside the step's
    forward, which reads no chunk loaded in its own schedule (the scheduler runs a sequence that
    holds one from the next step on), and the next flush makes its step wait for them. A chunk
    freed while an unwaited copy of it is queued (`spilled_ahead`) makes its step wait for all.
    On the CPU they run at once, in order.
    """

    _name = "host"

    def __init__(self, gpu: KVPool, num_chunks: int, counters: EngineStats | None = None):
        if num_chunks < 1:
            raise ValueError(f"host pool needs at least one chunk, got {num_chunks}")
        self.gpu, self.num_chunks = gpu, num_chunks
        self.counters = EngineStats() if counters is None else counters
        num_layers, _, _, heads, c, dim = gpu.kv.shape
        pinned = gpu.kv.is_cuda
        self.kv = torch.zeros(num_chunks, num_layers, 2, heads, c, dim, dtype=gpu.kv.dtype, pin_memory=pinned)
        self.key_bounds = (
            None
            if gpu.key_bounds is None
            else torch.zeros(num_chunks, num_layers, heads, 2 * dim, dtype=gpu.kv.dtype, pin_memory=pinned)
        )
        self.chunk_bytes = self.kv[0].nbytes + (0 if self.key_bounds is None else self.key_bounds[0].nbytes)
        super().__init__(num_chunks)
        # (kind, GPU chunk id, host chunk id), in the order the tree decided them
        self.pending: list[tuple[int, int, int]] = []
        self.stream = torch.cuda.Stream(gpu.kv.device) if pinned else None
        # CUDA: (start, end) events of flushes whose copy time is not read yet (settle)
        self._timed: collections.deque[tuple[torch.cuda.Event, torch.cuda.Event]] = collections.deque()
        # the next step's kernels wait for the copies issued before (prior: loads were, or a chunk
        # written ahead was evicted and its id may be written again), or for all of that flush's
        # too (all: a chunk freed while an unwaited copy of it was still queued)
        self._wait_prior = self._wait_all = False
        self._unwaited: set[int] = set()  # GPU chunk ids of the loads and write-aheads queued

    # -- copies ---------------------------------------------------------------------------------
    def spill(self, chunk_id: int, host_id: int) -> None:
        """Queue GPU chunk `chunk_id` -> host chunk `host_id` (the caller may free chunk_id now)."""
        self.pending.append((_SPILL, chunk_id, host_id))

    def load(self, host_id: int, chunk_id: int) -> None:
        """Queue host chunk `host_id` -> GPU chunk `chunk_id` (the caller may free host_id now)."""
        self.pending.append((_LOAD, chunk_id, host_id))
        self._unwaited.add(chunk_id)

    def write_ahead(self, chunk_id: int, host_id: int) -> None:
        """Queue a copy of cached GPU chunk `chunk_id` -> host chunk `host_id` ahead of its
        eviction (the chunk stays in use; no kernel waits for this copy)."""
        self.pending.append((_AHEAD, chunk_id, host_id))
        self._unwaited.add(chunk_id)

    def spilled_ahead(self, chunk_id: int) -> None:
        """GPU chunk `chunk_id`, written ahead, was evicted (its id freed, no copy now): the next
        flush makes the step's kernels wait for that copy."""
        self.counters.host_spills_ahead += 1
        self._wait_prior = True
        self._wait_all |= chunk_id in self._unwaited

    def flush(self) -> None:
        """Issue the queued copies in order (see the class); counts them."""
        if not self.pending and not self._wait_prior:
            return
        ops, self.pending = self.pending, []
        self._unwaited.clear()
        wait_prior, wait_all = self._wait_prior, self._wait_all
        c = self.counters
        kinds = [kind for kind, _, _ in ops]
        loads = kinds.count(_LOAD)
        self._wait_prior, self._wait_all = loads > 0, False  # (the next step reads the loaded chunks)
        c.host_write_ahead += kinds.count(_AHEAD)
        c.host_spills += kinds.count(_SPILL)
        c.host_loads += loads
        c.host_copy_bytes += len(ops) * self.chunk_bytes
        if self.stream is None:
            t = time.perf_counter()
            self._copy(ops, non_blocking=False)
            c.host_copy_s += time.perf_counter() - t
            return
        # the step's kernels wait for the spills: for the copies up to the last of them (issued in
        # order); the loads and write-aheads after it run beside the step
        waited = max((i + 1 for i, kind in enumerate(kinds) if kind == _SPILL), default=0)
        compute = torch.cuda.current_stream(self.gpu.kv.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            prior = self.stream.record_event() if wait_prior else None  # (never waits for compute)
            self.stream.wait_stream(compute)  # the spilled chunks' writes (and reads) done first
            start.record(self.stream)
            self._copy(ops[:waited], non_blocking=True)
            mid = self.stream.record_event() if waited else None
            self._copy(ops[waited:], non_blocking=True)
            end.record(self.stream)
        # the step's kernels (reusing ids, reading loads) after the copies they need
        for event in (end,) if wait_all else (prior, mid):
            if event is not None:
                compute.wait_event(event)
        self._timed.append((start, end))
        self.settle()

    def _copy(self, ops: list[tuple[int, int, int]], non_blocking: bool) -> None:
        # one chunk of every layer: [L, 2, Hkv, c, D] strided in the GPU pool, one block here
        # (torch makes the strided side contiguous on the device, on this stream, then one transfer)
        kv, bounds = self.gpu.kv, self.gpu.key_bounds
        for kind, cid, hid in ops:
            if kind != _LOAD:
                self.kv[hid].copy_(kv[:, :, cid], non_blocking=non_blocking)
                if bounds is not None:
                    self.key_bounds[hid].copy_(bounds[:, cid], non_blocking=non_blocking)
            else:
                kv[:, :, cid].copy_(self.kv[hid], non_blocking=non_blocking)
                if bounds is not None:
                    bounds[:, cid].copy_(self.key_bounds[hid], non_blocking=non_blocking)

    def settle(self) -> None:
        """CUDA: add the copy time of the flushes that have finished to the counters (never waits)."""
        while self._timed and self._timed[0][1].query():
            start, end = self._timed.popleft()
            self.counters.host_copy_s += start.elapsed_time(end) / 1000
