"""FlashInfer's paged prefill over our chunk pool: every prefill span of a step in one launch per
layer (DESIGN §5, the dense path).

A step's prefill spans (each a sequence's new tokens after its cached context) are one ragged
batch: query rows ``qo_indptr``, and for each span its chunk table as the page list, the new
tokens' K/V already written into the pool. Causal attention is bottom-right aligned (the span's
token t sees context_len + t + 1 keys), as ``kernels.reference.prefill_attention_ref`` defines it.
Our per-layer cache ``[num_chunks, Hkv, c, D]`` is FlashInfer's "HND" layout with page size c:
nothing is gathered or copied. The plan is made once per step (host work) and serves every layer.

The engine's prefill ran ``prefill_attention_ref`` span by span before: per layer about ten torch
ops per span, so a burst of short prompts after a shared prefix cost seconds. H200, llama3-8b,
``python -m replicas.bench --model llama3-8b --backend triton [--no-flashinfer-prefill]``, warm
runs, prefill seconds: 256 prompts of a 2048-token shared prefix + 64 own tokens 5.82-5.84 ->
0.74; 32 prompts of 1024 shared + 1024 own 2.78 -> 1.00.

FlashInfer compiles its prefill module for a dtype and head size on first use: 106-127 s on a
fresh H200 (then cached on disk, under FLASHINFER_WORKSPACE_BASE). A GPU replica's warmup
(replicas/warmup.py) runs a prefill, so the compile happens before the replica reports ready.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels.fi_decode import available

__all__ = ["FlashInferPrefill", "available", "usable"]


def usable(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether FlashInfer's prefill can serve a pool of this dtype and head size on `device`."""
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim in (64, 128, 256) \
        and available()


class FlashInferPrefill:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper``, planned once per step, run once per layer."""

    def __init__(self, *, num_q_heads: int, num_kv_heads: int, head_dim: int, chunk_size: int,
                 dtype: torch.dtype, device: torch.device, sm_scale: float):
        import flashinfer

        if not usable(dtype, head_dim, device):
            raise ValueError(f"FlashInfer prefill needs CUDA, a 16-bit cache and head dim 64/128/256, "
                             f"got {dtype}, {head_dim}, {device}")
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.chunk_size, self.dtype, self.device, self.sm_scale = chunk_size, dtype, device, sm_scale
        # Two wrappers, planned in turn: a plan stages its metadata in the wrapper's page-locked
        # host buffer and copies it to the device in stream order, and under asynchronous
        # scheduling the next step is planned before this one has run; the step after it is
        # planned only once this one's tokens are collected, so its copy is done by then. (Their
        # kernels run in stream order, one at a time: they share the float workspace.)
        self._workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        self._wrappers = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "HND") for _ in range(2)]
        self._turn = 1
        self._rows = -1  # query rows of the spans planned (-1: not planned yet)

    def plan(self, spans: Sequence[tuple[Sequence[int], int, int]]) -> int:
        """Plan for spans (chunk table, context_len, num_new), num_new >= 1, whose tables cover
        context_len + num_new tokens; -> the query rows planned (the spans' num_new summed)."""
        c = self.chunk_size
        qo, kv, last, pages, lens = [0], [0], [], [], []
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
        def pinned(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32).pin_memory()

        self._turn ^= 1
        self._wrappers[self._turn].plan(
            pinned(qo), pinned(kv), pinned(pages).to(self.device, non_blocking=True), pinned(last),
            self.num_q_heads, self.num_kv_heads, self.head_dim, c, causal=True, sm_scale=self.sm_scale,
            q_data_type=self.dtype, kv_data_type=self.dtype, seq_lens=pinned(lens))
        self._rows = qo[-1]
        return self._rows

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q: [rows, Hq, D], the planned spans' rows in order; caches [num_chunks, Hkv, c, D] ->
        [rows, Hq, D]."""
        if q.shape[0] != self._rows:
            raise ValueError(f"the plan is for {self._rows} query rows, got {q.shape[0]}")
        return self._wrappers[self._turn].run(q.to(self.dtype), (k_cache, v_cache))
