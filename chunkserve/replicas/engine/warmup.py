"""Warm an engine up before it serves: run a few synthetic batches through the normal path, so
that the kernels they use are compiled (Triton JIT-compiles each variant at its first launch;
FlashInfer's prefill module, chunkserve/kernels/paged_prefill.py, compiles at its first use, for minutes on
a fresh machine, then cached on disk) and the CUDA caches and graphs set up, before a user's
request waits on them. vLLM and SGLang do the same at startup (dummy runs, graph captures).

What it runs (all through add_request / step, so tensor-parallel ranks follow, TPEngine):
- a batch of up to ``max_num_seqs`` rows sharing a two-chunk prefix, their own parts of 1 .. c
  tokens (tails at every fill), greedy, temperature, top-p and top-k-with-top-p rows side by side,
  a few decode steps each (with decode_graphs, from the graphs captured when the engine was built);
- a few rows sharing nothing, every sampling row with top-k and top-p;
- batches of 1 .. 32 rows after a prefix of 8 and of 32 chunks (as the context and pool hold),
  greedy: the TPP variants of few rows after a long prefix, what live traffic decodes at low rates;
- with block-union sparse prefill (``sparse_prefill``), one prompt long enough that its last
  piece runs sparse (where the pool and max_model_len hold it): its Triton kernels compiled.
Then it zeroes the engine's counters. Its chunks stay in the prefix cache like any finished
request's (evicted first, being oldest): evicting them on rank 0 alone would part its pool from
the other ranks'.

Without it a fresh node's first requests wait on those compiles (its first decode steps mostly
host time); after it, the first decode steps run as fast as warm ones (figures:
chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code').
"""

from __future__ import annotations

import time

from chunkserve.replicas.engine.sequence import SamplingParams

_KINDS = (  # sampling side by side: greedy, temperature, top-p, top-k with top-p
    dict(temperature=0),
    dict(temperature=0.8, seed=1),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=0.8, top_p=0.9, top_k=20),
)
_DECODE_STEPS = 5  # tokens each row generates: the plan's first step, capture, replays


_LONG_PREFIX_CHUNKS = (8, 32)  # shared prefixes of the few-row batches, in chunks
_FEW_ROWS = (1, 2, 4, 8, 16, 32)  # their batch sizes
_OWN_CHUNKS = 3  # a row's own tokens: up to this many chunks


def _few_rows_after_long_prefixes(engine, token, longest: int) -> list[list[int]]:
    """Decode batches of 1 .. 32 rows after a prefix of 8 and of 32 chunks, each row's own part
    1 .. 3 chunks long: what live traffic of one long shared prefix decodes at low rates, and
    whose TPP plans take kernel variants the big batch above does not (a segment cut into pieces,
    its partials folded into the rows or merged, the query tile of a few rows)."""
    cfg = engine.config
    c = cfg.chunk_size
    outs, done = [], 2 * c  # (the batch above had a prefix of two chunks)
    greedy = SamplingParams(max_tokens=_DECODE_STEPS, ignore_eos=True, temperature=0)
    for n, chunks in enumerate(_LONG_PREFIX_CHUNKS):
        prefix_len = min(chunks * c, longest - _OWN_CHUNKS * c - _DECODE_STEPS)
        if prefix_len <= done:
            break  # the context holds no longer prefix than one already run
        done = prefix_len
        prefix = [token(50_021 * (n + 1) + i) for i in range(prefix_len)]
        for b in _FEW_ROWS:
            # the pool holds the prefix, each row's own chunks and a reserved one (and the rows
            # stay under max_num_seqs)
            if b > cfg.max_num_seqs or prefix_len // c + b * (_OWN_CHUNKS + 2) > engine.pool.num_chunks:
                break
            rows = [
                prefix + [token(70_001 * (b + r) + j) for j in range(1 + (37 * r + 11 * b) % (_OWN_CHUNKS * c))]
                for r in range(b)
            ]
            outs += engine.generate(rows, greedy)
    return outs


def warmup(engine) -> dict:
    """Run the synthetic batches on an idle engine (an LLMEngine or a TPEngine) and zero its
    counters; returns {"warmup_s", "warmup_requests", "warmup_tokens"}."""
    if engine.has_unfinished():
        raise RuntimeError("warmup needs an idle engine")
    t0 = time.perf_counter()
    cfg, vocab = engine.config, engine.model_config.vocab_size
    c = cfg.chunk_size
    # room: a row holds its own chunk, a reserved one and its share of the prefix; the prompt and
    # its tokens stay under max_model_len
    rows = max(1, min(cfg.max_num_seqs, engine.pool.num_chunks // 4))
    longest = max(1, engine.max_model_len - 1)  # a prompt's tokens at most (add_request)
    prefix_len = max(1, min(2 * c, longest - c - _DECODE_STEPS))
    token = lambda i: (i * 7919 + 17) % vocab  # noqa: E731 - fixed, arbitrary ids
    prefix = [token(i) for i in range(prefix_len)]
    shared = [(prefix + [token(prefix_len + 97 * r + j) for j in range(1 + r % c)])[:longest] for r in range(rows)]
    lone = [[token(10_007 * (r + 1) + j) for j in range(min(longest, prefix_len + 1 + r))] for r in range(min(rows, 8))]
    params = [SamplingParams(max_tokens=_DECODE_STEPS, ignore_eos=True, **_KINDS[r % len(_KINDS)]) for r in range(rows)]
    outs = engine.generate(shared, params)
    outs += engine.generate(lone, SamplingParams(max_tokens=_DECODE_STEPS, ignore_eos=True, **_KINDS[-1]))
    outs += _few_rows_after_long_prefixes(engine, token, longest)
    sparse = cfg.sparse_prefill
    if sparse is not None:  # a context past min_context and past the blocks always kept, then a piece
        n = sparse.first_sparse_context(c) + cfg.max_num_batched_tokens + 1
        if n <= longest and n + 2 * c <= engine.pool.num_chunks * c:
            outs += engine.generate([[token(31 * j + 5) for j in range(n)]], SamplingParams(max_tokens=1))
    engine.reset_counters()
    return {
        "warmup_s": round(time.perf_counter() - t0, 3),
        "warmup_requests": len(outs),
        "warmup_tokens": sum(len(o) for o in outs),
    }
