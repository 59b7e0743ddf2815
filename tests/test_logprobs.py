"""Logprobs: each generated token's log-probability under the model's raw logits and the most
likely tokens', from the engine (sync and async) to the OpenAI responses."""

from collections import defaultdict

import pytest
import torch

from replicas.engine import LLMEngine, SamplingParams
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


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_logprobs_are_the_raw_logits_log_softmax(async_scheduling, device):
    engine = LLMEngine.from_model("tiny", device=device, chunk_size=16, async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=3, ignore_eos=True),
              # penalized and biased: the logprobs are still the raw logits' (vLLM's default)
              SamplingParams(max_tokens=8, temperature=0, logprobs=0, repetition_penalty=1.5,
                             logit_bias={5: 3.0}, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)]
    outs, seen = _run(engine, PROMPTS, params)
    for rid, k in (("0", 3), ("1", 0)):
        assert len(outs[rid]) == 8
        for out, logits in zip(outs[rid], seen[rid], strict=True):
            lp = torch.log_softmax(logits.float(), -1)
            (drawn, top), = out.logprobs
            token = out.new_token_ids[0]
            assert drawn == pytest.approx(lp[token].item(), abs=1e-5)
            assert len(top) == k
            want = lp.topk(k)
            assert [t for t, _ in top] == want.indices.tolist() or device == "cuda"  # (ties may part)
            assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)
    assert all(out.logprobs is None for out in outs["2"])
    # the biased row's tokens follow the bias; its logprobs do not
    assert any(out.new_token_ids == [5] for out in outs["1"])


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_logprobs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=bad)
