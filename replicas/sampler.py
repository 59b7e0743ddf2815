"""Next-token sampling: greedy rows in one argmax, the rest with temperature, top-k, top-p."""

from __future__ import annotations

import torch

from replicas.sequence import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    # logits: [N, V] float32, one row per sequence that samples this step
    out = logits.argmax(dim=-1)  # ties -> lowest id, like transformers' greedy search
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out.tolist()


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> torch.Tensor:
    # logits: [V]
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(0, idx[drop], float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=gen)[0]
