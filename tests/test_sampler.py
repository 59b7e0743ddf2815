"""Batched sampling (replicas.sampler.sample) against the one-row reference, and the filters."""

import pytest
import torch

from replicas.sampler import sample, sample_row_ref
from replicas.sequence import SamplingParams

MIXED = [
    SamplingParams(temperature=0),  # greedy
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=1),  # greedy too
    SamplingParams(temperature=0.5, top_k=10_000),  # k past the vocabulary: whole vocabulary
    SamplingParams(temperature=1.1, top_p=0.3),
]


def test_seeded_rows_draw_what_each_row_alone_draws():
    # every row seeded: the batch gives each row the token the reference gives it alone, with
    # a fresh generator of the same seed (greedy rows: the argmax)
    torch.manual_seed(0)
    v = 3000
    params = [MIXED[i % len(MIXED)] for i in range(40)]
    for step in range(5):
        logits = torch.randn(len(params), v) * 4
        got = sample(logits, params, [torch.Generator().manual_seed(100 * step + i) for i in range(len(params))])
        want = [int(logits[i].argmax()) if p.greedy else
                sample_row_ref(logits[i], p, torch.Generator().manual_seed(100 * step + i))
                for i, p in enumerate(params)]
        assert got == want


def test_unseeded_rows_keep_their_filters_and_probabilities():
    # 64 unseeded rows drawn from the global RNG: every token inside its row's top-k / top-p
    # set, and the frequencies of a plain temperature row follow its probabilities
    torch.manual_seed(1)
    v = 50
    base = torch.randn(v) * 2
    logits = base.expand(64, v).clone()
    params = [SamplingParams(temperature=0.9, top_k=3), SamplingParams(temperature=1.0, top_p=0.5),
              SamplingParams(temperature=1.0), SamplingParams(temperature=0)] * 16
    order = base.argsort(descending=True).tolist()
    probs = base.softmax(-1)
    nucleus, mass = [], 0.0  # tokens kept by top_p = 0.5: until the ones before reach 0.5
    for t in order:
        if mass >= 0.5:
            break
        nucleus.append(t)
        mass += float(probs[t])
    counts = torch.zeros(v)
    for _ in range(200):
        got = sample(logits, params, [None] * 64)
        assert all(got[i] in order[:3] for i in range(0, 64, 4))
        assert all(got[i] in nucleus for i in range(1, 64, 4))
        assert all(got[i] == order[0] for i in range(3, 64, 4))
        for i in range(2, 64, 4):
            counts[got[i]] += 1
    freq = counts / counts.sum()  # 3200 draws
    assert (freq - probs).abs().max() < 0.03


def test_same_seed_same_tokens_anywhere_in_the_batch():
    torch.manual_seed(2)
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7)
    logits = torch.randn(1, 1000).expand(6, 1000).clone()
    others = [SamplingParams(temperature=1.0)] * 6
    for row in range(6):
        params = others[:row] + [p] + others[row + 1:]
        gens = [None] * 6
        gens[row] = torch.Generator().manual_seed(7)
        assert sample(logits, params, gens)[row] == sample(logits[:1], [p], [torch.Generator().manual_seed(7)])[0]


@pytest.mark.parametrize("n", [1, 7])
def test_all_greedy_is_the_argmax(n):
    logits = torch.randn(n, 99, generator=torch.Generator().manual_seed(n))
    assert sample(logits, [SamplingParams(temperature=0)] * n, [None] * n) == logits.argmax(-1).tolist()
