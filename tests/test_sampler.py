"""Batched sampling (chunkserve.replicas.engine.sampler.sample) against the one-row reference, and the filters."""

import json
import math

import pytest
import torch

from chunkserve.replicas.engine import sampler
from chunkserve.replicas.engine.sampler import sample, sample_row_ref
from chunkserve.replicas.engine.sequence import SamplingParams

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
    # every row keyed: the batch gives each row the token the reference gives it alone with the
    # same key and counter (greedy rows: the argmax)
    torch.manual_seed(0)
    v = 3000
    params = [MIXED[i % len(MIXED)] for i in range(40)]
    for step in range(5):
        logits = torch.randn(len(params), v) * 4
        keys = [100 * step + i - 20 for i in range(len(params))]  # negative ones too
        got = sample(logits, params, keys, [step] * len(params))
        want = [
            int(logits[i].argmax()) if p.greedy else sample_row_ref(logits[i], p, keys[i], step)
            for i, p in enumerate(params)
        ]
        assert got == want


def test_tiny_temperatures_sample_greedily_beside_other_rows():
    """Temperatures under 1e-5 are greedy (as vLLM's): far smaller ones overflowed logits / T to
    inf, torch.multinomial raised on the NaN probabilities, and every row of the batch failed
    with the one that asked (a replica's step loop died of a request with temperature 1e-40)."""
    torch.manual_seed(2)
    logits = torch.randn(4, 300) * 30
    params = [SamplingParams(temperature=t) for t in (1e-40, 1e-45, 9e-6, 0.8)]
    assert [p.greedy for p in params] == [True, True, True, False]
    got = sample(logits, params, [None, None, None, 3], [0] * 4)
    assert got[:3] == logits[:3].argmax(-1).tolist()
    assert got[3] == sample_row_ref(logits[3], params[3], 3, 0)


def test_unseeded_rows_keep_their_filters_and_probabilities():
    # 64 rows without keys (each drawn from the global RNG): every token inside its row's top-k /
    # top-p set, and the frequencies of a plain temperature row follow its probabilities
    torch.manual_seed(1)
    v = 50
    base = torch.randn(v) * 2
    logits = base.expand(64, v).clone()
    params = [
        SamplingParams(temperature=0.9, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
    ] * 16
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
        got = sample(logits, params, [None] * 64, [0] * 64)
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
        params = others[:row] + [p] + others[row + 1 :]
        keys = [None] * 6
        keys[row] = 7
        assert sample(logits, params, keys, [row + 5] * 6)[row] == sample(logits[:1], [p], [7], [row + 5])[0]


def test_a_key_draws_its_probabilities_over_its_counters():
    # one key, counters 0 .. 3999: the exponential race's frequencies follow the row's
    # probabilities (top-k 6 leaves six tokens; the rest are never drawn); another key or
    # counter gives other draws
    torch.manual_seed(4)
    logits = torch.randn(1, 40) * 1.5
    p = SamplingParams(temperature=1.0, top_k=6)
    probs = sampler._probs([p], logits.clone())[0]
    n = 4000
    got = sample(logits.expand(n, 40).clone(), [p] * n, [11] * n, list(range(n)))
    freq = torch.bincount(torch.tensor(got), minlength=40).float() / n
    assert set(torch.tensor(got).unique().tolist()) <= set((probs > 0).nonzero()[:, 0].tolist())
    assert (freq - probs).abs().max() < 0.03
    flat = torch.zeros(1, 1000)  # 1000 equally likely tokens: a change of key or counter changes the token
    one = SamplingParams(temperature=1.0)
    assert sample(flat, [one], [11], [0]) != sample(flat, [one], [12], [0])
    assert sample(flat, [one], [11], [0]) != sample(flat, [one], [11], [1])
    assert sample(flat, [one], [11], [0]) == sample(flat, [one], [11 + 2**64], [0])  # keys mod 2**64


@pytest.mark.parametrize("n", [1, 7])
def test_all_greedy_is_the_argmax(n):
    logits = torch.randn(n, 99, generator=torch.Generator().manual_seed(n))
    assert sample(logits, [SamplingParams(temperature=0)] * n, [None] * n, [0] * n) == logits.argmax(-1).tolist()


def _nucleus_by_hand(logits: list[float], top_p: float) -> set[int]:
    """Tokens top-p keeps: a token stays unless the tokens more likely than it reach top_p (top_p
    1: every token not filtered out already)."""
    z = sum(math.exp(x) for x in logits)
    return {
        t
        for t, x in enumerate(logits)
        if x > -math.inf and (top_p >= 1 or sum(math.exp(y) / z for y in logits if y > x) < top_p)
    }


@pytest.mark.parametrize("top_p", [0.2, 0.45, 0.5, 0.7, 0.95])
def test_top_p_keeps_or_drops_tied_tokens_together(top_p):
    # three tokens tied at the cut: the tokens above them hold ~0.47 of the mass
    logits = [2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -1.0, -3.0]
    probs = sampler._probs([SamplingParams(temperature=1.0, top_p=top_p)], torch.tensor([logits]))
    assert set((probs[0] > 0).nonzero()[:, 0].tolist()) == _nucleus_by_hand(logits, top_p)


@pytest.mark.parametrize("top_k", [2, 40, 300])
def test_top_k_rows_cut_their_nucleus_among_the_top_k(top_k):
    # rows with top-k find their nucleus among their k + 1 largest logits (no sort), rows
    # without sort theirs; peaked rows (a nucleus of a few tokens) beside flat ones (hundreds).
    # Every row keeps what the hand rule keeps, and seeded rows draw what the one-row reference
    # draws (bf16-rounded logits: many ties, the k-th's too)
    torch.manual_seed(3)
    v = 600
    scale = torch.tensor([8.0, 0.3, 5.0, 0.05] * 3)[:, None]
    logits = (torch.randn(12, v) * scale).bfloat16().float()
    params = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_p=0.6, top_k=top_k),
        SamplingParams(temperature=1.2, top_p=0.95, top_k=top_k),
        SamplingParams(temperature=0.9, top_k=top_k),
    ] * 3
    probs = sampler._probs(params, logits.clone())
    for i, p in enumerate(params):
        x = logits[i] / p.temperature
        if p.top_k > 0:
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        assert set((probs[i] > 0).nonzero()[:, 0].tolist()) == _nucleus_by_hand(x.tolist(), p.top_p)
    got = sample(logits, params, list(range(12)), [3] * 12)
    assert got == [sample_row_ref(logits[i], p, i, 3) for i, p in enumerate(params)]


def test_top_k_and_top_p_rows_are_not_sorted(monkeypatch):
    # every nucleus row has a top-k and a peaked distribution: its cut is among the k + 1
    # largest logits, so no row is sorted; a flat row without top-k, whose nucleus reaches past
    # them, is
    sorts = []
    real_sort = torch.sort
    monkeypatch.setattr(torch, "sort", lambda *a, **kw: sorts.append(a[0].shape) or real_sort(*a, **kw))
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(5)) * 6
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50)] * 3 + [SamplingParams(temperature=0.8)]
    sample(logits, params, [None] * 4, [0] * 4)
    assert sorts == []
    logits[3] *= 0.01
    sample(logits, params[:3] + [SamplingParams(temperature=0.8, top_p=0.9)], [None] * 4, [0] * 4)
    assert sorts == [torch.Size([1, 500])]


@pytest.mark.gpu
def test_rows_on_the_gpu_draw_what_each_row_alone_draws():
    # CUDA's path (the philox kernel, the sort-free top-p cut) against the one-row reference
    # (a sort), vocabulary-sized rows, peaked and flat
    torch.manual_seed(6)
    params = [MIXED[i % len(MIXED)] for i in range(64)]
    logits = (torch.randn(64, 128256) * torch.tensor([6.0, 0.5, 2.0, 0.05])[torch.arange(64) % 4, None]).cuda()
    topk = [
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=100),
    ]  # every nucleus row with top-k: searched among candidates
    for rows in (params, [topk[i % 3] for i in range(64)]):
        for step in range(3):
            got = sample(logits, rows, list(range(64)), [step] * 64)
            assert got == [
                int(logits[i].argmax()) if p.greedy else sample_row_ref(logits[i], p, i, step)
                for i, p in enumerate(rows)
            ]


def test_sampler_bench_prints_a_line_per_case(capsys):
    from chunkserve.replicas.tools import bench_sampler

    bench_sampler.main(["--rows", "3", "--vocab", "300", "--scales", "2", "--reps", "1", "--reference"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["case"] for r in rows] == list(bench_sampler.CASES)
    kept = {r["case"]: r["kept_max"] for r in rows}
    assert kept["temperature 0.8"] == 300 and kept["top-k 50"] == 50 and kept["top-k 50, top-p 0.9"] <= 50
    assert all(r["batched_ms"] > 0 and r["row_by_row_ms"] > 0 for r in rows)
