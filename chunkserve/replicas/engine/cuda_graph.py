"""The decode step's forward as one CUDA graph per padded batch size, valid for any TPP plan.

An eager decode step launches every kernel from Python (about 40 per layer, counted from the
ops), and the GPU idles between them; the piecewise graphs (chunkserve/replicas/engine/piecewise.py) still launch
each layer's attention from Python. A graph replays a whole step in one launch. It bakes in
every launch's grid, constexprs and pointers, which a TPP plan made per batch would change
whenever a row joins, leaves or fills a tail: so, as vLLM's graphs per padded batch size, the
decode plans of a graphed engine are fixed plans (chunkserve.kernels.tpp_plan.FixedPlans): the launches of
their padded batch size, the pieces, chunk runs, slots and counts as data in fixed device
buffers, which each new plan's one upload rewrites.

For each size n (`sizes`, every decode batch up to the engine's max_num_seqs in one), one graph
is captured when the engine is built, never on a user's request: a warm run first compiles its
kernels (capture cannot), then the capture, over a plan with nothing to do. A decode-only step
of B rows whose plan is fixed runs the graph of its plan's size n >= B: its ids, positions and
the chunks of its new tokens' slots go into static buffers; rows B .. n - 1 keep their last ids
and positions and write their K/V into the pool's scratch chunk, and no piece reads or writes
them. A step with prefill tokens replays them too where its tokens fit a size: each token is
then a decode row of the plan, of its causal length (Attention._plan_rows). Other mixed steps,
and decode steps whose plan did not fit a fixed one (a tree deeper than the capacities hold),
run from the piecewise graphs.

The logits are computed eagerly from the graph's hidden states, so a graph holds the model's
forward only. On the CPU (no graphs) the forward runs as plain calls over the same buffers and
plan objects: the tests check the plumbing there against the plain forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chunkserve.replicas.engine.attention import Attention, StepAttention
from chunkserve.replicas.engine.piecewise import BUCKETS
from chunkserve.replicas.engine.stats import EngineStats

if TYPE_CHECKING:
    from chunkserve.replicas.model.llama import LlamaForCausalLM


def batch_sizes(max_rows: int) -> tuple[int, ...]:
    """The padded decode batch sizes graphed for batches of up to max_rows rows: the piecewise
    graphs' token-count buckets (every batch up to 8 rows in one) up to the first >= max_rows."""
    below = tuple(n for n in BUCKETS if n < max_rows)
    return below + (next((n for n in BUCKETS if n >= max_rows), max_rows),)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: Attention,
        sizes: tuple[int, ...],
        *,
        graphs: bool = True,
        counters: EngineStats | None = None,
    ):
        """model: a LlamaForCausalLM over attention's pool; sizes: the padded batch sizes, the
        same as `attention.fix_plans` was given; graphs: capture CUDA graphs (else plain calls);
        counters: the engine's, where replays are counted (None: one of its own)."""
        fixed = attention.fixed
        if fixed is None or set(fixed.shapes) != set(sizes):
            raise ValueError("DecodeGraphs needs the attention's fixed plans of the same sizes (Attention.fix_plans)")
        self.sizes = tuple(sorted(sizes))
        pool = attention.pool
        n, device = self.sizes[-1], pool.kv.device
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.chunk_idx = torch.full((n,), pool.scratch, dtype=torch.long, device=device)
        self.offset = torch.zeros(n, dtype=torch.long, device=device)
        self.scratch, self.chunk_size = pool.scratch, pool.chunk_size
        self.hidden: dict[int, torch.Tensor] = {}  # per size: its forward's hidden states [n, H]
        self.runs: dict[int, Callable[[], None]] = {}
        self.counters = EngineStats() if counters is None else counters
        t0 = time.perf_counter()
        mempool = torch.cuda.graph_pool_handle() if graphs else None
        for size in reversed(self.sizes):  # the largest first: the smaller ones' temporaries fit in its memory
            step = StepAttention(
                attention,
                self.positions[:size],
                self.chunk_idx[:size],
                self.offset[:size],
                size,
                fixed.idle(size),  # its launches are every plan's of this size; their data the buffers'
                (),
            )
            self.runs[size] = self._capture(model, step, size, mempool) if graphs else self._call(model, step, size)
        self.capture_s = time.perf_counter() - t0  # (measured once: not among the counters)

    def _forward(self, model: LlamaForCausalLM, step: StepAttention, size: int) -> torch.Tensor:
        torch.remainder(self.positions[:size], self.chunk_size, out=self.offset[:size])
        return model(self.ids[:size], self.positions[:size], step)

    def _call(self, model: LlamaForCausalLM, step: StepAttention, size: int) -> Callable[[], None]:
        def run() -> None:
            self.hidden[size] = self._forward(model, step, size)

        return run

    def _capture(self, model: LlamaForCausalLM, step: StepAttention, size: int, mempool) -> Callable[[], None]:
        self._forward(model, step, size)  # compiles its kernels (capture cannot) and warms cuBLAS up
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (a replica's event loop) cannot invalidate the capture
        with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
            self.hidden[size] = self._forward(model, step, size)
        return graph.replay

    def forward(self, input_ids: torch.Tensor, step: StepAttention) -> torch.Tensor | None:
        """The hidden states [B, H] of a step of decode rows only whose plan is fixed (a view of
        a static buffer, valid until the next step's forward), else None. input_ids: [B]."""
        size = getattr(step.decode_plan, "max_rows", None)
        if size is None or step.prefills:
            return None
        t = input_ids.shape[0]
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(step.positions)
        self.chunk_idx[:t].copy_(step.chunk_idx)
        if t < size:  # (the last step's rows there wrote into slots that sequences hold)
            self.chunk_idx[t:size].fill_(self.scratch)
        self.runs[size]()
        self.counters.graph_replays += not step.mixed
        self.counters.mixed_graph_replays += step.mixed
        return self.hidden[size][:t]
