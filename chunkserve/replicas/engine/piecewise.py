"""The forward as CUDA graphs between the attentions: for steps no whole-step graph runs.

A whole decode step replays from one graph (chunkserve/replicas/engine/cuda_graph.py) only while its TPP plan
lives: under live traffic rows join, leave and fill tails every few steps, and steps with prefill
tokens never had one, so most steps launched every kernel from Python (about 40 a layer), their
time nearly all host time (figures: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the
code'). Everything but the attention depends on the token count alone, so, as vLLM's piecewise
graphs, each layer's halves are graphed per token-count bucket and the attention runs eagerly
between them, whatever its plan:

    piece 0:     embed, rotary, layer 0 before its attention, its K/V into the pool -> q, residual
    attention 0  (eager: TPP decode, FlashInfer prefill; the step's own plans)
    piece l:     layer l-1 after its attention, layer l before its, its K/V -> q, residual
    ...
    piece L:     layer L-1 after its attention, the final norm              -> hidden

A step of T tokens runs the pieces of the smallest bucket n >= T: its ids, positions and the
chunks of its new tokens' slots go into static buffers; rows past T keep their ids and
positions (valid ones, their results are never read) and write their K/V into the pool's
scratch chunk, which no sequence holds. Each piece reads and writes static buffers (q,
residual, the attention's output), so one set of buffers serves every bucket and the pieces'
temporaries share one memory pool. The buckets reach the step's token budget
(max_num_batched_tokens) up to 8192: run eagerly, a step of a 1024-token prompt and a few
decode rows took longer to launch than to run, the device idle about half of it (figures:
chunkserve/replicas/tools/records/README.md, h200-2026-12-06b). Only steps past 8192 tokens run
eagerly, their matrix products longer than the launches. Captured once, when the engine is built
(a warm run of each piece first compiles its kernels); never on a user's request.

On the CPU (no graphs) the pieces run as plain calls, the same buffers and order: the tests
check the plumbing there against the plain forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from chunkserve.replicas.engine.kv_pool import KVPool
from chunkserve.replicas.engine.stats import EngineStats

if TYPE_CHECKING:
    from chunkserve.replicas.model.llama import LlamaDecoderLayer, LlamaForCausalLM

# token counts graphed: every decode batch up to 8 rows in one, then steps of 16 to 128, of 32
# to 256, of 64 to 512, of 128 to 1024; past it, steps of prefill pieces padded by at most 1/16:
# of 64 to 2048, of 128 to 4096, of 256 to 8192
BUCKETS = (
    8,
    *range(16, 129, 16),
    *range(160, 257, 32),
    *range(320, 513, 64),
    *range(640, 1025, 128),
    *range(1088, 2049, 64),
    *range(2176, 4097, 128),
    *range(4352, 8193, 256),
)


class PiecewiseGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        pool: KVPool,
        max_tokens: int,
        *,
        graphs: bool = True,
        sizes: tuple[int, ...] = BUCKETS,
        counters: EngineStats | None = None,
    ):
        """model: a LlamaForCausalLM; pool: its K/V pool; max_tokens: a step's tokens at most
        (buckets past the first that holds it are not made); graphs: capture CUDA graphs (else
        the pieces run as calls: the CPU); counters: the engine's, where replays are counted
        (None: one of its own)."""
        self.model, self.pool = model.model, pool
        self.layers: list[LlamaDecoderLayer] = list(self.model.layers)
        sizes = tuple(sorted(sizes))
        self.sizes = sizes[: next((i + 1 for i, n in enumerate(sizes) if n >= max_tokens), len(sizes))]
        w = self.model.embed_tokens.weight
        attn = self.layers[0].self_attn
        n, hq, d = self.sizes[-1], attn.num_heads, attn.head_dim
        h = w.shape[1]
        new: dict[str, Any] = dict(dtype=w.dtype, device=w.device)
        self.ids = torch.zeros(n, dtype=torch.long, device=w.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=w.device)
        self.cos, self.sin = torch.zeros(n, d, **new), torch.zeros(n, d, **new)
        # [n] the new tokens' slots: chunk ids (the scratch chunk past a step's rows), offsets in them
        self.chunk_idx = torch.full((n,), pool.scratch, dtype=torch.long, device=w.device)
        self.offset = torch.zeros(n, dtype=torch.long, device=w.device)
        self.q, self.o = torch.zeros(n, hq, d, **new), torch.zeros(n, hq, d, **new)
        self.residual, self.hidden = torch.zeros(n, h, **new), torch.zeros(n, h, **new)
        self.runs: dict[int, list[Callable[[], None]]] = {}  # per bucket: its pieces' replays (or calls)
        self.counters = EngineStats() if counters is None else counters
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if graphs else None
        for size in reversed(self.sizes):  # the largest first: the smaller ones' temporaries fit in its memory
            pieces = [self._piece(i, size) for i in range(len(self.layers) + 1)]
            self.runs[size] = [self._capture(p, pool) for p in pieces] if graphs else pieces
        self.capture_s = time.perf_counter() - t0  # (measured once: not among the counters)

    @staticmethod
    def _capture(piece: Callable[[], None], pool) -> Callable[[], None]:
        piece()  # compiles its kernels (capture cannot) and warms cuBLAS up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads cannot invalidate the capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            piece()
        return graph.replay

    def _piece(self, i: int, n: int) -> Callable[[], None]:
        m, layers, last = self.model, self.layers, len(self.layers)
        cos, sin = self.cos[:n], self.sin[:n]
        chunk_idx, offset = self.chunk_idx[:n], self.offset[:n]

        def keep(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, residual: torch.Tensor) -> None:
            # q, k not yet rotated: rotated with the K/V store, q into its buffer (one launch on CUDA)
            self.pool.write_rope(layer, chunk_idx, offset, q, k, v, cos, sin, self.q[:n])
            if residual.data_ptr() != self.residual.data_ptr():  # (the norms update it in place)
                self.residual[:n].copy_(residual)

        def first() -> None:
            x, c, s = m.embed(self.ids[:n], self.positions[:n])
            cos.copy_(c)
            sin.copy_(s)
            torch.remainder(self.positions[:n], self.pool.chunk_size, out=offset)
            keep(0, *layers[0].before_attention(x, None, cos, sin, rotate=False))

        def middle() -> None:
            x, residual = layers[i - 1].after_attention(self.o[:n], self.residual[:n])
            keep(i, *layers[i].before_attention(x, residual, cos, sin, rotate=False))

        def final() -> None:
            x, residual = layers[last - 1].after_attention(self.o[:n], self.residual[:n])
            self.hidden[:n].copy_(m.norm(x, residual)[0])

        return first if i == 0 else final if i == last else middle

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket holding `tokens`, None past the largest."""
        return next((n for n in self.sizes if n >= tokens), None)

    def forward(self, input_ids: torch.Tensor, step) -> torch.Tensor | None:
        """The hidden states [T, H] of a step (a view of a static buffer, valid until the next
        step's forward), or None where it must run eagerly. input_ids: [T]; step: its StepAttention."""
        t = input_ids.shape[0]
        n = self.bucket(t)
        if n is None:
            return None
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(step.positions)
        self.chunk_idx[:t].copy_(step.chunk_idx)
        if t < n:  # (the last step's rows there wrote into slots that sequences hold)
            self.chunk_idx[t:n].fill_(self.pool.scratch)
        runs = self.runs[n]
        runs[0]()
        for layer, run in enumerate(runs[1:]):
            step.attend(layer, self.q[:t], out=self.o[:t])
            run()
        self.counters.piecewise_replays += 1
        self.counters.piecewise_decode_replays += not step.prefills and not step.mixed
        return self.hidden[:t]
