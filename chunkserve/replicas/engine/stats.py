"""EngineStats: every count an engine keeps, in one object its parts share.

The engine makes one and hands it to its scheduler, attention, runner and graphs; each bumps its
own fields where the thing happens. `LLMEngine.stats()` reports the engine's share of them (its
keys are those fields' names), the benchmarks and tests read the rest, and
`LLMEngine.reset_counters()` is one `reset()` (after chunkserve.replicas.engine.warmup). What is measured once, when
the engine is built (the graphs' capture times), is not a count and stays with its part.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    # requests and tokens (LLMEngine)
    prompt_tokens: int = 0  # prompt tokens of finished requests that were admitted
    cached_prompt_tokens: int = 0  # of them, served from the prefix cache at first admission
    cached_prompt_tokens_host: int = 0  # of those, copied back from the host tier (both tiers: the above)
    computed_prompt_tokens: int = 0  # prompt positions run through the model (recomputes too)
    generated_tokens: int = 0  # output tokens emitted (collected and settled)
    finished_requests: int = 0  # requests retired: stop, length or abort
    # steps (LLMEngine)
    steps: int = 0  # steps that ran a batch
    decode_steps: int = 0  # of them, decode-only: the ones a whole-step CUDA graph may run
    max_decode_batch: int = 0  # most decode rows in one step
    last_decode_batch: int = 0  # decode rows in the last step
    max_kv_chunks_used: int = 0  # most chunks held by live sequences after a step
    # scheduling (Scheduler)
    preemptions: int = 0  # running sequences preempted (recompute) for want of a chunk
    prefix_waits: int = 0  # admissions put off a step: the next prompt chunk was being computed
    # the host tier (HostPool): chunks copied each way, their bytes and the copies' time (CUDA:
    # the side stream's, read once finished; CPU: the copies themselves)
    host_spills: int = 0  # chunks copied GPU -> host as the GPU pool evicted them (kept in the tree)
    host_write_ahead: int = 0  # chunks copied GPU -> host ahead of their eviction, beside a step
    host_spills_ahead: int = 0  # chunks evicted to the host tier whose copy was written ahead
    host_loads: int = 0  # chunks copied host -> GPU (a request matched them)
    host_copy_bytes: int = 0  # bytes those copies moved, both ways
    host_copy_s: float = 0.0  # seconds they took
    # attention plans (Attention)
    plan_builds: int = 0  # decode plans built (not bumped): tests count them
    fallback_plans: int = 0  # of them, FlashInfer plans (nothing shared)
    unfixed_plans: int = 0  # of them, plain TPP plans where fixed ones are built (none fitted)
    prefill_plans: int = 0  # steps whose prefill spans FlashInfer planned
    # block-union sparse prefill (Attention; counted on the host: the page lists' lengths are
    # there, or read back for the plan)
    sparse_pages_read: int = 0  # (chunk, KV head) pages the sparse pieces' layers read
    sparse_pages_dense: int = 0  # the pages they would have read dense
    # the runner (ModelRunner, DecodeGraphs, PiecewiseGraphs)
    wait_s: float = 0.0  # seconds the host waited for sampled tokens (a step less this: host time)
    graph_replays: int = 0  # decode-only steps run from a whole-step decode graph
    mixed_graph_replays: int = 0  # steps with prefill tokens run from one (their tokens as decode rows)
    piecewise_replays: int = 0  # steps run from the piecewise graphs
    piecewise_decode_replays: int = 0  # of them, decode-only steps

    def reset(self) -> None:
        """Every field back to its default (zero)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default)
