"""Guided decoding (structured outputs): guides and their errors, the token mask, and the engine's
outputs inside their grammar (sync and async, beside free rows, with logprobs)."""

import json
import re
from collections import defaultdict

import pytest
import torch

from chunkserve.replicas.engine.guided import Guide, Guides, allowed_mask, fill_bitmask, mask_logits
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.model.tokenizer import BYTE_SPECIALS, Tokenizer
from tests.test_penalties import _record_logits

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "ok", "color"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
    },
}
REGEX = r"[a-z]{3}-\d{2}"
CHOICES = ("red", "green", "blue")
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'


def _follows_schema(obj) -> bool:
    """obj follows SCHEMA (what the schema says, spelled out)."""
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "ok", "color"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 6
        and type(obj["age"]) is int
        and 0 <= obj["age"] <= 99
        and type(obj["ok"]) is bool
        and obj["color"] in CHOICES
    )


# The random-weight model picks among the tokens a grammar allows about evenly, so some grammars
# would run to max_tokens: a JSON object's free keys and values end on a quote (about 1 in 200), any
# whitespace is 4 tokens of the few allowed between JSON's. A bias makes those ends likely and
# whitespace less so; the mask alone still decides what may come.
BIASES = {"json": {ord(c): -2.0 for c in " \n\t\r"}, "json_object": {ord('"'): 4.0, ord("}"): 4.0}}
CASES = {  # guide -> whether a finished text follows it (True; False or a parse error: it does not)
    "json": (Guide("json", json.dumps(SCHEMA)), lambda text: _follows_schema(json.loads(text))),
    "json_compact": (
        Guide("json", json.dumps(SCHEMA), any_whitespace=False),
        lambda text: (
            _follows_schema(json.loads(text))  # and in its one compact form
            and json.dumps(json.loads(text), ensure_ascii=False) == text
        ),
    ),
    "json_object": (Guide("json_object"), lambda text: isinstance(json.loads(text), dict)),
    "regex": (Guide("regex", REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (Guide("choice", CHOICES), lambda text: text in CHOICES),
    "grammar": (Guide("grammar", EBNF), lambda text: re.fullmatch(r"yes|no|maybe [0-9]", text) is not None),
}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=8192)


# -- guides ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, spec, match",
    [
        ("xml", "", "kind must be one of"),
        ("json", "", "must not be empty"),
        ("regex", 5, "takes a string"),
        ("choice", (), "non-empty list"),
        ("choice", ("a", ""), "non-empty strings"),
        ("choice", "ab", "non-empty list"),
    ],
)
def test_malformed_guides_are_refused(kind, spec, match):
    with pytest.raises(ValueError, match=match):
        Guide(kind, spec)


@pytest.mark.parametrize(
    "guide, match",
    [
        (Guide("json", "{not json"), r"^guided json: Failed to parse JSON"),
        (Guide("json", '{"type": "nonsense"}'), r"^guided json: .*nonsense"),
        (Guide("regex", "a(b"), r"^guided regex: .*parenthesis"),
        (Guide("grammar", "root ::= x"), r'^guided grammar: .*Rule "x" is not defined'),
    ],
)
def test_guides_that_do_not_parse_say_why(guide, match):
    with pytest.raises(ValueError, match=match):
        guide.grammar()


def test_whitespace_is_a_json_option_only():
    assert Guide("regex", "a+", any_whitespace=False) == Guide("regex", "a+")  # one cache entry
    assert Guide("json_object", any_whitespace=False) != Guide("json_object")


def test_sampling_params_refuse_min_tokens_with_a_guide_and_a_non_guide():
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(max_tokens=8, min_tokens=2, guided=Guide("choice", ("a",)))
    with pytest.raises(ValueError, match="guided must be"):
        SamplingParams(guided={"kind": "json_object"})


# -- the mask --------------------------------------------------------------------------------


def test_allowed_mask_reads_bit_t_of_word_t_over_32():
    v = 70
    words = torch.zeros(2, 3, dtype=torch.int32)
    words[0, 0] = 1 - 2**31  # tokens 0 and 31 (bit 31 is the sign bit)
    words[0, 2] = 1 << 5  # token 69
    words[1, 1] = -1  # tokens 32 .. 63 (every bit, the sign bit too)
    got = allowed_mask(words, v)
    assert got.shape == (2, v)
    assert got[0].nonzero().flatten().tolist() == [0, 31, 69]
    assert got[1].nonzero().flatten().tolist() == list(range(32, 64))


def test_mask_logits_touches_only_the_guided_rows():
    logits = torch.randn(3, 40)
    words = torch.zeros(1, 2, dtype=torch.int32)
    words[0, 1] = 0b101  # tokens 32 and 34
    out = mask_logits(logits, [1], words)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [32, 34]
    assert torch.equal(out[1, [32, 34]], logits[1, [32, 34]])
    assert torch.isinf(logits).sum() == 0  # the input is left as it was


def test_special_tokens_and_padded_ids_are_never_allowed():
    # the byte tokenizer's chat markers read as text to xgrammar unless we mark them; a regex of
    # any 8 characters would otherwise take `<|user|>` as one token
    tok = Tokenizer.byte()
    vocab = tok.vocab_size + 40  # a model's padded rows past the tokenizer's
    guides = Guides(tok, vocab, tok.eos_token_ids)
    m = guides.matcher(Guide("regex", r"[\s\S]{8}"))
    allowed = allowed_mask(fill_bitmask([m], vocab, tok.eos_token_ids), vocab)[0]
    assert allowed[:128].all()  # every ASCII byte (a lone UTF-8 continuation byte starts no character)
    assert not allowed[256:].any()  # no special token (EOS neither: 8 characters must come first), no padding
    for t in tok.encode("<|user|", add_special_tokens=False):
        assert m.accept_token(t)
    allowed = allowed_mask(fill_bitmask([m], vocab, tok.eos_token_ids), vocab)[0]
    assert allowed[ord(">")] and not allowed[256 + BYTE_SPECIALS.index("<|user|>")]


# -- the engine ------------------------------------------------------------------------------


def _text(engine, ids):
    assert ids[-1] in engine.model_config.eos_token_ids  # the grammar ended and so did the request
    return engine.tokenizer.decode(ids)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_their_grammar(engine, name, temperature):
    guide, check = CASES[name]
    prompt = engine.tokenizer.encode("Answer: ")
    for seed in range(3):
        (out,) = engine.generate(
            [prompt],
            SamplingParams(
                max_tokens=200, temperature=temperature, seed=seed, guided=guide, logit_bias=BIASES.get(name, {})
            ),
        )
        text = _text(engine, out)
        assert check(text), text


def test_the_random_model_alone_follows_no_grammar(engine):
    # what makes the test above able to fail: without the guide these prompts give noise
    prompt = engine.tokenizer.encode("Answer: ")
    for seed in range(3):
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=seed))
        text = engine.tokenizer.decode(out)
        assert not any(_passes(check, text) for _, check in CASES.values()), text


def _passes(check, text) -> bool:
    try:
        return check(text)
    except (ValueError, TypeError):
        return False


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_guided_rows_beside_free_rows_sync_and_async(async_scheduling):
    # free rows give what they give with no guided row beside them; guided rows follow their
    # grammar; async scheduling (which collects each step inside the next one's launch while a
    # guided row lives) gives the sync engine's tokens, a guided request arriving mid-run included
    def run(with_guided: bool, async_on: bool):
        engine = LLMEngine.from_model("tiny", chunk_size=16, async_scheduling=async_on)
        free = [SamplingParams(max_tokens=20, temperature=0.7, seed=s, ignore_eos=True) for s in range(3)]
        prompts = [list(range(20, 60)), list(range(30, 45)), list(range(50, 90))]
        for i, (p, sp) in enumerate(zip(prompts, free)):
            engine.add_request(f"free{i}", p, sp)
        outs, late = defaultdict(list), with_guided
        if with_guided:
            engine.add_request(
                "json",
                prompts[0],
                SamplingParams(max_tokens=96, temperature=0.9, seed=5, guided=CASES["json_compact"][0]),
            )
        steps = 0
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
            steps += 1
            if late and steps == 4:
                engine.add_request("choice", prompts[1], SamplingParams(max_tokens=8, guided=Guide("choice", CHOICES)))
                late = False
        return engine, outs

    engine, alone = run(False, async_scheduling)
    engine, mixed = run(True, async_scheduling)
    for i in range(3):
        assert mixed[f"free{i}"] == alone[f"free{i}"]
    assert CASES["json_compact"][1](_text(engine, mixed["json"]))
    assert _text(engine, mixed["choice"]) in CHOICES
    if async_scheduling:  # (the sync run would repeat itself)
        assert dict(mixed) == dict(run(True, False)[1])
    assert engine._num_guided == 0  # every guided request gone with its end


def test_async_guided_steps_keep_a_step_in_flight():
    # with a guided row alive, each step's forward is queued (its logits computed) before the
    # step in flight is collected, and a step stays in flight after each: the overlap holds
    engine = LLMEngine.from_model("tiny", chunk_size=16, async_scheduling=True)
    events = []
    compute, collect = engine.model.compute_logits, engine.runner.collect
    engine.model.compute_logits = lambda hidden: (events.append("logits"), compute(hidden))[1]
    engine.runner.collect = lambda launched: (events.append("collect"), collect(launched))[1]
    engine.add_request(
        "json",
        list(range(20, 40)),
        SamplingParams(max_tokens=96, temperature=0.9, seed=1, guided=CASES["json_compact"][0]),
    )
    engine.add_request("free", list(range(40, 60)), SamplingParams(max_tokens=120, seed=2, ignore_eos=True))
    seq = engine._seqs["json"]
    outs, steps = defaultdict(list), []
    while engine.has_unfinished():
        guided_alive, start = engine._num_guided > 0, len(events)
        for out in engine.step():
            outs[out.request_id] += out.new_token_ids
        if guided_alive:  # (the step's events, a step in flight after it)
            steps.append((events[start:], engine._inflight is not None and engine._inflight.host is not None))
    # the first step launches only; each after it: logits (its own), then collect (the one before)
    assert steps[0] == (["logits"], True) and len(steps) > 10
    assert all(step == (["logits", "collect"], True) for step in steps[1:-1]), steps
    assert steps[-1][0] == ["logits", "collect"]  # (the guided row's last token: collected here)
    assert CASES["json_compact"][1](_text(engine, outs["json"]))
    # it ended at a collect inside the next step's launch, which holds its row: no placeholder
    # for that step's token was left behind it
    assert seq.output_ids == outs["json"]
    del engine.model.compute_logits, engine.runner.collect


def test_logprobs_of_a_guided_row_are_over_its_allowed_tokens(engine):
    seen = _record_logits(engine)
    try:
        engine.add_request(
            "g",
            engine.tokenizer.encode("Pick: "),
            SamplingParams(max_tokens=8, temperature=0, logprobs=5, guided=Guide("choice", CHOICES)),
        )
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
    finally:
        del engine.runner.forward, engine.model.compute_logits  # the instance's own, back to the class's
    first = outs[0]
    ((drawn, top),) = first.logprobs
    allowed = {ord(c[0]) for c in CHOICES}  # r, g, b: the choices' first bytes
    raw = torch.log_softmax(seen["g"][0].float(), -1)
    ids = list(allowed)
    want = raw[ids] - torch.logsumexp(raw[ids], 0)  # renormalised over the allowed tokens
    assert drawn == pytest.approx(want[ids.index(first.new_token_ids[0])].item(), abs=1e-5)
    assert {t for t, v in top if v > float("-inf")} == allowed
    assert all(v == float("-inf") for t, v in top if t not in allowed)


def test_the_engine_refuses_a_bad_guide_and_keeps_nothing(engine):
    before = engine.stats()
    with pytest.raises(ValueError, match="guided regex"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(guided=Guide("regex", "(")))
    assert not engine.has_unfinished() and engine.stats() == before and engine._num_guided == 0


def test_abort_drops_the_guided_request(engine):
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, guided=Guide("json_object")))
    engine.step()
    assert engine._num_guided == 1 and engine._seqs["a"].guided
    assert engine.abort("a")
    assert engine._num_guided == 0 and not engine.has_unfinished()


def test_a_model_without_a_tokenizer_cannot_guide():
    fresh = LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=1024)
    fresh.tokenizer = None
    with pytest.raises(ValueError, match="needs a tokenizer"):
        fresh.add_request("x", [1, 2], SamplingParams(guided=Guide("json_object")))
    assert not fresh.has_unfinished()


def test_a_row_that_ignores_eos_draws_only_eos_after_its_grammar_ends(engine):
    (out,) = engine.generate(
        [[1, 2, 3]],
        SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True, guided=Guide("choice", ("ab",))),
    )
    eos = engine.model_config.eos_token_ids[0]
    assert out == engine.tokenizer.encode("ab", add_special_tokens=False) + [eos] * 10


def test_bit_31_is_the_sign_bit():
    from chunkserve.replicas.engine.guided import _bit

    words = torch.tensor([[_bit(31) | _bit(0)]], dtype=torch.int32)
    assert allowed_mask(words, 32)[0].nonzero().flatten().tolist() == [0, 31]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_guides_as_the_cpu_engine_does():
    # tiny fp32 on CUDA (async scheduling, its default there, and whole-step decode graphs): guided rows
    # beside free rows give the CPU engine's tokens, the grammars hold, and a guided request that
    # arrives mid-run is taken
    torch.backends.cuda.matmul.allow_tf32 = False

    def run(device):
        engine = LLMEngine.from_model(
            "tiny", device=device, dtype="float32", chunk_size=16, kv_cache_tokens=8192, decode_graphs=True
        )
        prompts = [list(range(20, 60)), list(range(30, 45)), list(range(50, 90)), list(range(25, 70))]
        names = ["json_compact", "regex", "choice"]
        for i, name in enumerate(names):
            engine.add_request(name, prompts[i], SamplingParams(max_tokens=120, temperature=0, guided=CASES[name][0]))
        for i in range(4):
            engine.add_request(f"free{i}", prompts[i], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
        outs, steps = defaultdict(list), 0
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] += out.new_token_ids
            steps += 1
            if steps == 10:
                engine.add_request(
                    "grammar", prompts[3], SamplingParams(max_tokens=20, temperature=0, guided=CASES["grammar"][0])
                )
        return engine, dict(outs)

    engine, got = run("cuda")
    assert engine.config.async_scheduling and engine.runner.graphs is not None and engine.counters.graph_replays > 0
    _, want = run("cpu")
    assert got == want
    for name in ("json_compact", "regex", "choice", "grammar"):
        assert CASES[name][1](_text(engine, got[name]))


def test_the_batched_fill_equals_each_matchers_own_and_ended_rows_allow_the_stop_tokens():
    tok = Tokenizer.byte()
    vocab = tok.vocab_size + 40
    guides = Guides(tok, vocab, tok.eos_token_ids)
    ms = [guides.matcher(CASES[name][0]) for name in ("json", "regex", "choice", "grammar")]
    for t in tok.encode("red", add_special_tokens=False) + [tok.eos_token_ids[0]]:
        assert ms[2].accept_token(t)  # the choice ended
    assert ms[1].accept_token(ord("q"))
    got = fill_bitmask(ms, vocab, tok.eos_token_ids)
    for i in (0, 1, 3):
        own = torch.zeros(1, got.shape[1], dtype=torch.int32)
        ms[i].fill_next_token_bitmask(own, 0)
        assert torch.equal(got[i], own[0])
    assert allowed_mask(got[2:3], vocab)[0].nonzero().flatten().tolist() == list(tok.eos_token_ids)


def test_compiled_grammars_are_cached_and_bounded(monkeypatch):
    tok = Tokenizer.byte()
    guides = Guides(tok, tok.vocab_size, tok.eos_token_ids)
    monkeypatch.setattr(Guides, "MAX_COMPILED", 3)
    first = guides.compile(Guide("regex", "a0"))
    assert guides.compile(Guide("regex", "a0")) is first  # cached
    for i in range(1, 5):
        guides.compile(Guide("regex", f"a{i}"))
        guides.compile(Guide("regex", "a0"))  # used again: kept
    assert list(guides._compiled) == [Guide("regex", "a3"), Guide("regex", "a4"), Guide("regex", "a0")]  # LRU order


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_thinking_runs_free_and_the_grammar_holds_what_follows(async_scheduling):
    # SamplingParams.think, with '<' and '>' as the tags (the tiny model has no <think> tokens):
    # thinking opened by the prompt (start None) or by the first token, free until '>', then the
    # regex; a first token that is the grammar's leaves no thinking at all
    engine = LLMEngine.from_model("tiny", chunk_size=16, async_scheduling=async_scheduling)
    lt, gt, eos = ord("<"), ord(">"), engine.model_config.eos_token_ids[0]
    prompt = engine.tokenizer.encode("Think, then answer: ")
    free = set()
    for think, bias in (((None, gt), {gt: 3.0}), ((lt, gt), {lt: 8.0, gt: 3.0}), ((lt, gt), {lt: -100.0})):
        for seed in range(3):
            params = SamplingParams(
                max_tokens=200,
                temperature=1.0,
                seed=seed,
                guided=Guide("regex", REGEX),
                think=think,
                logit_bias={eos: -100.0, **bias},
            )
            text = _text(engine, engine.generate([prompt], params)[0])
            if bias.get(lt) == -100.0:  # never opened: the grammar from the first token
                assert re.fullmatch(REGEX, text), text
                continue
            head, sep, answer = text.partition(">")
            assert sep and re.fullmatch(REGEX, answer), text
            assert head.startswith("<") == (think[0] is not None), text
            free |= set(head.lstrip("<")) - set("abcdefghijklmnopqrstuvwxyz0123456789-")
    assert free  # the thinking held what the grammar never allows


def test_think_needs_a_guide_and_token_ids(engine):
    for think, guided in (
        ((1, 2), None),
        (("<", 2), Guide("regex", "a")),
        ((1, None), Guide("regex", "a")),
        ((1, 2, 3), Guide("regex", "a")),
    ):
        with pytest.raises(ValueError, match="think must be"):
            SamplingParams(think=think, guided=guided)
    with pytest.raises(ValueError, match="token ids are in"):  # past the vocabulary: refused, nothing kept
        engine.add_request("far", [1, 2], SamplingParams(guided=Guide("regex", "a"), think=(None, 10**6)))
    assert not engine.has_unfinished()
