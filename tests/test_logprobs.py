"""Logprobs: each generated token's log-probability under the model's raw logits and the most
likely tokens', from the engine (sync and async) to the OpenAI responses."""

from collections import defaultdict

import pytest
import torch

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from tests.test_penalties import _record_logits

PROMPTS = [list(range(20, 60)), list(range(20, 50)) + [7, 7, 7], [300, 301, 302]]


def _run(engine, prompts, params):
    """Step the engine to the end: per request, its outputs in order, and the raw logits of every
    token it sampled (the model's own forward, recorded)."""
    seen = _record_logits(engine)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outs = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs, seen


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_logprobs_are_the_raw_logits_log_softmax(async_scheduling, device):
    engine = LLMEngine.from_model("tiny", device=device, chunk_size=16, async_scheduling=async_scheduling)
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=3, ignore_eos=True),
        # penalized and biased: the logprobs are still the raw logits' (vLLM's default)
        SamplingParams(
            max_tokens=8, temperature=0, logprobs=0, repetition_penalty=1.5, logit_bias={5: 3.0}, ignore_eos=True
        ),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    outs, seen = _run(engine, PROMPTS, params)
    for rid, k in (("0", 3), ("1", 0)):
        assert len(outs[rid]) == 8
        for out, logits in zip(outs[rid], seen[rid], strict=True):
            lp = torch.log_softmax(logits.float(), -1)
            ((drawn, top),) = out.logprobs
            token = out.new_token_ids[0]
            assert drawn == pytest.approx(lp[token].item(), abs=1e-5)
            assert len(top) == k
            want = lp.topk(k)
            # each listed token's own logprob, and the k largest (on CUDA ties may order apart)
            assert [lp[t].item() for t, _ in top] == pytest.approx([v for _, v in top], abs=1e-5)
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)
            if device == "cpu":
                assert [t for t, _ in top] == want.indices.tolist()
    assert all(out.logprobs is None for out in outs["2"])
    # the biased row's tokens follow the bias; its logprobs do not
    assert any(out.new_token_ids == [5] for out in outs["1"])


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)


def _first_token_logits(prompt):
    """The model's logits after `prompt` (a fresh engine: nothing cached)."""
    engine = LLMEngine.from_model("tiny", device="cpu", chunk_size=16)
    seen = _record_logits(engine)
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    (rows,) = seen.values()
    return rows[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompt_logprobs_score_each_prompt_token_given_those_before(async_scheduling):
    """Each prompt token's logprob (and the k likeliest) under the logits after the tokens before
    it; in pieces (chunked prefill), and with the prompt's prefix already cached (the request
    computes it anyway); the first token has none; they come with the first output only."""
    prompt = [(37 * i + 11) % 250 for i in range(45)]
    engine = LLMEngine.from_model(
        "tiny", device="cpu", chunk_size=16, max_num_batched_tokens=16, async_scheduling=async_scheduling
    )
    engine.generate([prompt[:40]], SamplingParams(max_tokens=2))  # caches the first 32 tokens
    engine.add_request(
        "p", prompt, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=1, ignore_eos=True)
    )
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    got = outs[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    assert engine.stats()["cached_prompt_tokens"] == 0  # (only the first, which found nothing cached, counted so far)
    for i in (1, 2, 17, 31, 32, 33, 44):
        lp = torch.log_softmax(_first_token_logits(prompt[:i]).float(), -1)
        drawn, top = got[i]
        assert drawn == pytest.approx(lp[prompt[i]].item(), abs=1e-4)
        assert [t for t, _ in top] == lp.topk(2).indices.tolist()
        assert [v for _, v in top] == pytest.approx(lp.topk(2).values.tolist(), abs=1e-4)
    # a plain request over the same prompt is served from the cache as before
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert engine.stats()["cached_prompt_tokens"] >= 32
