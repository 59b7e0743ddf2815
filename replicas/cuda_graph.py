"""The decode step's forward as one CUDA graph, captured per TPP decode plan.

An eager decode step launches every kernel from Python (about 40 per layer, counted from the
ops), and the GPU idles between them. A graph replays them all in one launch (H200, llama3-8b
b=64: 39.7 ms per step eager, 10.5 graphed). The graph bakes in
every launch's grid and arguments, and the TPP plan's grids (its pieces and merge rows) are
fixed for as long as the plan lives (`Attention` keeps it while the rows and their tables stay,
about one chunk of tokens; a plain step only bumps the plan's device-side `seq_lens`). So one
graph serves exactly one plan object:

- the plan's first step runs eagerly (it compiles any kernel variant the plan needs; capture
  cannot compile);
- from its `capture_after`-th step on, the forward runs from the graph, captured at the first
  of them. Inputs (token ids, positions, the new tokens' slots) go through static buffers;
- a new plan (a row joined or left, a table changed) drops the graph.

Under churn (rows joining and leaving every few steps) a capture may not pay for itself: it
costs about one eager step (a Python pass over the model, then instantiation; H200, llama3-8b:
23-30 ms, the eager step 27 ms) on top of the plan's eager first step. So a graph
dropped after fewer than `min_replays` replays doubles the steps a plan must live before the
next capture (up to 64); one that paid off resets it.

Only decode-only steps of the Triton backend with a TPP plan use it (and only with
EngineConfig.decode_graphs; the piecewise graphs, replicas/piecewise.py, run every other step). Steps with prefill tokens,
FlashInfer plans and the torch and reference backends run eagerly. The logits are computed eagerly from
the graph's hidden states, so a graph holds the model's forward only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.tpp import TppPlan


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, chunk_size: int, capture_after: int = 2, min_replays: int = 4):
        if capture_after < 2:
            raise ValueError(f"capture_after must be >= 2 (a plan's first step compiles), got {capture_after}")
        from kernels.tpp import TppPlan  # imports triton: only CUDA engines build DecodeGraphs

        self._tpp_plan = TppPlan
        self.model, self.chunk_size = model, chunk_size
        self.capture_after, self.min_replays = capture_after, min_replays
        self.after = capture_after  # the decode steps a plan must live before its capture, now
        self.captures = 0  # graphs captured, replays, seconds spent capturing (tests and benchmarks)
        self.replays = 0
        self.capture_s = 0.0
        self._replays_of_graph = 0
        self._plan: TppPlan | None = None
        self._steps = 0  # decode-only steps seen with self._plan
        self._graph: torch.cuda.CUDAGraph | None = None
        self._ids = self._positions = self._chunk_idx = self._hidden = None

    def forward(self, input_ids: torch.Tensor, step) -> torch.Tensor | None:
        """The hidden states [B, H] of a decode-only step from the graph of its plan, or None
        where this step must run eagerly. input_ids: [B]; step: its `StepAttention`."""
        plan = step.decode_plan
        if not isinstance(plan, self._tpp_plan) or step.prefills or input_ids.shape[0] != plan.batch_size:
            return None
        if plan is not self._plan:
            self._drop()
            self._plan = plan
        self._steps += 1
        if self._steps < self.after:
            return None
        if self._graph is None:
            self._capture(input_ids, step)
        self._ids.copy_(input_ids)
        self._positions.copy_(step.positions)
        self._chunk_idx.copy_(step.chunk_idx)
        self._graph.replay()
        self.replays += 1
        self._replays_of_graph += 1
        return self._hidden

    def _capture(self, input_ids: torch.Tensor, step) -> None:
        t0 = time.perf_counter()
        self._ids, self._positions, self._chunk_idx = (x.clone() for x in (input_ids, step.positions, step.chunk_idx))
        graph = torch.cuda.CUDAGraph()
        # A private memory pool per graph, released with it (a pool shared across graphs is gone
        # once its last graph is: capturing into its handle then fails). thread_local: CUDA
        # calls of other threads (a replica's event loop) cannot invalidate the capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            static = dataclasses.replace(
                step, positions=self._positions, chunk_idx=self._chunk_idx, offset=self._positions % self.chunk_size
            )
            self._hidden = self.model(self._ids, self._positions, static)
        self._graph = graph
        self.captures += 1
        self._replays_of_graph = 0
        self.capture_s += time.perf_counter() - t0

    def _drop(self) -> None:
        if self._graph is not None:
            paid = self._replays_of_graph >= self.min_replays
            self.after = self.capture_after if paid else min(2 * self.after, 64)
        self._graph = self._hidden = self._ids = self._positions = self._chunk_idx = None
        self._plan, self._steps = None, 0
