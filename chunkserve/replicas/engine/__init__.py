"""The engine core: one replica's model, cache and step loop, with no process, Ray or HTTP.

    llm_engine    LLMEngine.step(): schedule -> forward -> masks -> sample -> advance
    config        EngineConfig, handed whole to the parts, its run-mode switches resolved once
    scheduler     admission under a token budget, chunked prefill, preemption, prefix waits
    sequence      a request's tokens, state and sampling params; Batch, what one step runs
    prefix_tree   the KV cache as a tree of fixed-size chunks, shared prefixes stored once
    kv_pool       GPU and host chunk pools; tree_events: the tree's stores and evictions
    runner        one batch through the model: flatten, plan attention, forward, sample
    attention     two-phase partition attention over the tree; block-union sparse prefill
    cuda_graph    whole decode steps as CUDA graphs; piecewise: graphs between the attentions
    sampler       greedy, temperature, top-k/top-p, seeded rows; penalties: their token counts
    guided        grammar-constrained decoding (structured outputs, xgrammar)
    distributed   the tensor-parallel groups and the collectives a rank's forward calls
    stats         EngineStats, the counts every part shares; transfer: host lists to the device
    warmup        synthetic batches through the normal path before serving (graphs, JIT)

`from chunkserve.replicas.engine import LLMEngine, SamplingParams` is the Python API;
`python -m chunkserve.replicas.engine --model tiny --prompt "Hello"` prints a completion.
"""

from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from chunkserve.replicas.engine.sequence import SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]
