"""Presence, frequency and repetition penalties, min_p and logit_bias: the batched sampler against
the one-row reference, and the engine's per-request token counts (chunkserve.replicas.engine.penalties) in sync
and async scheduling."""

import random
from collections import defaultdict
from dataclasses import replace

import pytest
import torch

from chunkserve.replicas.engine.llm_engine import LLMEngine
from chunkserve.replicas.engine.penalties import Gathered
from chunkserve.replicas.engine.sampler import sample, sample_row_ref
from chunkserve.replicas.engine.sequence import SamplingParams

ROWS = [
    SamplingParams(temperature=0, presence_penalty=1.5),  # greedy rows are penalized too
    SamplingParams(temperature=0.8, frequency_penalty=0.7, seed=1),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.7, logit_bias={3: 5.0, 9: -100}),
    SamplingParams(temperature=0, logit_bias={11: 2.0}, repetition_penalty=0.8),
    SamplingParams(temperature=0.8, top_k=20, min_p=0.1, presence_penalty=-0.5, frequency_penalty=0.2),
    SamplingParams(temperature=0.6),
]


def test_batched_rows_match_the_reference():
    torch.manual_seed(0)
    v, rng = 400, random.Random(0)
    params = [ROWS[i % len(ROWS)] for i in range(24)]
    prompts = [[rng.randrange(v) for _ in range(rng.randrange(1, 30))] for _ in params]
    outputs = [[rng.randrange(40) for _ in range(rng.randrange(0, 60))] for _ in params]  # repeats
    rows = [i for i, p in enumerate(params) if p.penalized]
    counts = torch.stack([torch.bincount(torch.tensor(outputs[i], dtype=torch.long), minlength=v) for i in rows])
    prompt = torch.zeros(len(rows), v, dtype=torch.bool)
    for j, i in enumerate(rows):
        prompt[j, prompts[i]] = True
    gathered = Gathered(rows, torch.arange(len(rows)), counts.int(), prompt)
    banned = [(i, tuple(range(i, 40, 3))) for i in range(0, len(params), 5)]  # (min_tokens: stop tokens)
    changed = 0
    for step in range(4):
        logits = torch.randn(len(params), v) * 3
        logits[:, :40] += 4  # the tokens the outputs repeat are the likely ones: the penalties matter
        keys = [7 * step + i for i in range(len(params))]
        got = sample(logits, params, keys, [step] * len(params), gathered, banned)
        off = dict(banned)
        want = [
            sample_row_ref(logits[i], p, keys[i], step, prompts[i], outputs[i], off.get(i, ()))
            for i, p in enumerate(params)
        ]
        assert got == want
        assert all(got[i] not in ids for i, ids in banned)
        changed += sum(a != b for a, b in zip(got, sample(logits, params, keys, [step] * len(params), None, banned)))
    assert changed >= 8  # without the penalties many rows draw otherwise


def test_a_large_bias_decides_and_penalties_push_tokens_away():
    logits = torch.zeros(3, 50)
    biased = SamplingParams(temperature=0, logit_bias={17: 100})
    assert sample(logits, [biased] * 3, [None] * 3, [0] * 3) == [17] * 3
    # a greedy row whose every token so far was 4: presence 2 moves it off 4
    logits = torch.zeros(1, 50)
    logits[0, 4] = 1.0
    p = SamplingParams(temperature=0, presence_penalty=2)
    counts = torch.zeros(1, 50, dtype=torch.int32)
    counts[0, 4] = 3
    assert sample(logits, [p], [None], [0]) == [4]
    assert sample(
        logits, [p], [None], [0], Gathered([0], torch.zeros(1), counts, torch.zeros(1, 50, dtype=torch.bool))
    ) != [4]


def _record_logits(engine):
    """Per request id, the logits of every token it sampled (the engine's own forward)."""
    seen, rows = defaultdict(list), []
    forward, compute = engine.runner.forward, engine.model.compute_logits

    def forward_and_name_rows(batch, prev):
        rows[:] = [s.request_id for s, n in batch.items if s.num_computed + n == s.num_tokens]
        return forward(batch, prev)

    def compute_and_keep(hidden):
        logits = compute(hidden)
        for rid, row in zip(rows, logits, strict=True):
            seen[rid].append(row.clone())
        return logits

    engine.runner.forward, engine.model.compute_logits = forward_and_name_rows, compute_and_keep
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_tokens_follow_the_reference(async_scheduling):
    # every token the engine gives equals the reference's on the logits the engine computed,
    # with the request's prompt and outputs so far: the device counts stay right step by step,
    # with tokens in flight (async), rows joining and leaving, and slots reused
    rng = random.Random(1)
    prefix = [rng.randrange(256) for _ in range(70)]
    prompts = [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    params = [
        replace(ROWS[i % len(ROWS)], max_tokens=6 + 3 * (i % 4), ignore_eos=True, seed=100 + i)
        for i in range(len(prompts))
    ]
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=4096, max_num_seqs=5, async_scheduling=async_scheduling)
    seen = _record_logits(engine)
    outs = engine.generate(prompts, params)
    assert engine.runner.penalties.in_use == 0  # every finished request gave its slot back
    assert 0 < engine.runner.penalties.counts.shape[0] <= 8  # at most 5 at a time: slots reused
    ids = sorted(seen, key=lambda r: int(r.rsplit("-", 1)[1]))
    for i, (rid, out) in enumerate(zip(ids, outs)):
        assert len(out) == params[i].max_tokens == len(seen[rid])
        for k, token in enumerate(out):
            assert token == sample_row_ref(seen[rid][k], params[i], params[i].seed, k, prompts[i], out[:k]), (i, k)
    plain = LLMEngine.from_model("tiny", kv_cache_tokens=4096, max_num_seqs=5, async_scheduling=async_scheduling)
    assert (
        plain.generate(
            prompts,
            [
                replace(p, presence_penalty=0, frequency_penalty=0, repetition_penalty=1, min_p=0, logit_bias=())
                for p in params
            ],
        )
        != outs
    )


def test_an_aborted_request_gives_its_slot_back_and_bad_bias_is_refused():
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=4096)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, presence_penalty=1, temperature=0))
    engine.step()
    seq = engine._seqs["a"]
    assert engine.runner.penalties.in_use == 1 and seq.penalty_slot is not None
    assert engine.abort("a") and engine.runner.penalties.in_use == 0 and seq.penalty_slot is None
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("b", [1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}))
    assert not engine.has_unfinished()
    for bad in (
        dict(presence_penalty=2.5),
        dict(frequency_penalty=-3),
        dict(repetition_penalty=0),
        dict(min_p=1.5),
        dict(min_p=float("nan")),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={3: 200}),
        dict(logit_bias={3: "x"}),
        dict(logit_bias=[(1, 2, 3)]),
        dict(logit_bias={"3": 1.0}),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_hold_off_eos_and_stop_tokens(async_scheduling):
    # EOS biased to certainty: without min_tokens a request ends on its first token; with it, on
    # token min_tokens + 1. A stop token the same way; ignore_eos rows may draw EOS at any time.
    engine = LLMEngine.from_model("tiny", kv_cache_tokens=4096, async_scheduling=async_scheduling)
    eos = engine.model_config.eos_token_ids[0]
    to_eos = SamplingParams(max_tokens=20, temperature=0, logit_bias={eos: 100})
    to_stop = SamplingParams(max_tokens=20, temperature=0.8, seed=3, logit_bias={42: 100}, stop_token_ids=(42,))
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 5, 9], [2, 4, 6]]
    params = [
        to_eos,
        replace(to_eos, min_tokens=5),
        to_stop,
        replace(to_stop, min_tokens=9),
        replace(to_eos, min_tokens=5, ignore_eos=True, max_tokens=7),
    ]
    outs = engine.generate(prompts, params)
    assert [len(o) for o in outs] == [1, 6, 1, 10, 7]
    assert outs[1][-1] == eos and eos not in outs[1][:-1] and outs[3][-1] == 42 and 42 not in outs[3][:-1]
    assert outs[4] == [eos] * 7  # with ignore_eos EOS ends nothing, so it is not held off
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)
