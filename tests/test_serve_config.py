"""AppConfig, build_app's deployment options, request schemas and the replica's text stream: no Ray cluster."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from chunkserve.cluster.app import build_app
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.logprobs import TokenTexts
from chunkserve.cluster.protocol import (
    MAX_SCHEMA_DEPTH,
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    Usage,
)
from chunkserve.replicas.deployment import _Stops, _take, _TextStream
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.llm_engine import RequestOutput
from chunkserve.replicas.model import load_tokenizer
from chunkserve.replicas.wire import GenerateOutput


def _cmpl(body: dict) -> CompletionRequest:
    """A /v1/completions body as the ingress validates it (`model` is required: given here)."""
    return CompletionRequest.model_validate({"model": "m", **body})


def _chat(body: dict) -> ChatCompletionRequest:
    """A /v1/chat/completions body as the ingress validates it (`model` given here)."""
    return ChatCompletionRequest.model_validate({"model": "m", **body})


@pytest.mark.parametrize(
    "args, field",
    [
        ({"modle": "tiny"}, "modle"),
        ({"engine": {"chunk_size": 64, "kv_cache": 10}}, "kv_cache"),
        ({"router": {"route_chunk": 8}}, "route_chunk"),
        ({"ingress": {"replicas": 2}}, "replicas"),
        ({"engine": {"sparse_prefill": {"alfa": 0.2}}}, "alfa"),
    ],
)
def test_unknown_field_is_an_error_naming_it(args, field):
    with pytest.raises(ValidationError, match=field):
        AppConfig.model_validate(args)


@pytest.mark.parametrize(
    "args",
    [
        {"engine": {"chunk_size": 48}},
        {"num_replicas": 0},
        {"device": "tpu"},
        {"num_replicas": 2, "autoscaling_config": {"max_replicas": 4}},
        {"api_key": "a", "api_key_env": "B"},
        {"tensor_parallel_size": 2, "num_gpus_per_replica": 1},
        {"engine": {"sparse_prefill": {"block": 32}}},  # under the chunk size (64)
        {"engine": {"sparse_prefill": {"budget": 0.2, "window": 0}}},
        {"engine": {"sparse_prefill": {"alpha": 1.5}}},
        {"engine": {"sparse_prefill": {"budget": 0}}},
        {"engine": {"sparse_prefill": {"span": 0}}},  # query blocks a span holds (None: the piece)
        {"engine": {"sparse_prefill": {"span": "auto"}}},  # sized by a budget, which alpha has not
        {"engine": {"sparse_prefill": {"budget": 0.1, "span": "half"}}},
        {"engine": {"sparse_prefill": {"block": 64, "stride": 8}}},  # 8 rows of a block scored
        {"router": {"direct_stream": True, "policy": "pow2"}},  # the direct route is the prefix router's
        {"router": {"direct_stream": True}, "autoscaling_config": {"max_replicas": 4}},
        {"router": {"share_decisions": True, "policy": "pow2"}},  # pow2 keeps no decisions to share
        {"ingress": {"header_timeout_s": 0}},
        {"openapi_docs": "yes"},  # off, key or open
    ],
)
def test_bad_values_are_errors(args):
    with pytest.raises(ValidationError):
        AppConfig.model_validate(args)


@pytest.mark.parametrize(
    "sparse",
    [
        {"budget": 0.2, "window": 0},
        {"alpha": 1.5},
        {"budget": 0},
        {"span": 0},
        {"span": "auto"},
        {"budget": 0.1, "span": "half"},
        {"block": 64, "stride": 8},
        {"stride": 3},
    ],
)
def test_sparse_options_the_config_refuses_blockunion_refuses_too(sparse):
    """The config checks sparse options without importing torch; BlockUnion checks them again
    where the engine is built: the two sets of rules must agree."""
    from chunkserve.kernels.block_union import BlockUnion

    with pytest.raises(ValidationError):
        AppConfig.model_validate({"engine": {"sparse_prefill": sparse}})
    with pytest.raises(ValueError):
        BlockUnion(**sparse)


def test_direct_streams_bind_the_replicas_bound():
    _, llm = _replica(build_app({"device": "cpu", "max_ongoing_requests": 8, "router": {"direct_stream": True}}))
    assert llm.init_args[1].direct_streams == 8  # the replica bounds its engine's requests from both paths at this


def test_api_key_from_the_environment(monkeypatch):
    config = AppConfig(api_key_env="CHUNKSERVE_TEST_KEY")
    monkeypatch.delenv("CHUNKSERVE_TEST_KEY", raising=False)
    with pytest.raises(ValueError, match="CHUNKSERVE_TEST_KEY"):
        config.resolve_api_key()
    monkeypatch.setenv("CHUNKSERVE_TEST_KEY", "s3cret")
    assert config.resolve_api_key() == "s3cret"
    assert "s3cret" not in repr(AppConfig(api_key="s3cret"))
    assert AppConfig(model="tiny").model_name == "tiny" and AppConfig(served_model_name="m").model_name == "m"


def _replica(app):
    ingress = app._bound_deployment
    return ingress, ingress.init_args[0]._bound_deployment


def test_build_app_binds_ingress_and_replicas():
    ingress, llm = _replica(
        build_app(
            {
                "device": "cpu",
                "num_replicas": 3,
                "max_ongoing_requests": 8,
                "max_queued_requests": 5,
                "retry_after_s": 2,
            }
        )
    )
    assert (ingress.name, llm.name) == ("OpenAIIngress", "LLMReplica")
    assert llm.num_replicas == 3 and llm.max_ongoing_requests == 8 and llm.max_queued_requests == 5
    assert llm.backpressure_config.retry_after_s == 2
    assert llm.ray_actor_options["num_gpus"] == 0
    engine_config, options = llm.init_args
    assert options.direct_streams is None  # no direct streams unless router.direct_stream
    assert engine_config.device == "cpu" and engine_config.tp_size == 1
    assert options.stream_interval_ms == 50  # the default: a stream's steps gathered per 50 ms
    assert options.warm_up is False  # warmup: None, on GPUs only
    assert (options.served_model_name, options.route_chunks) == (
        "tiny",
        128,
    )  # the digest is seeded as the ingress hashes, as deep
    assert options.cpus_per_rank == 1  # the tensor-parallel ranks' actors (none here) would take the bundle's CPUs
    assert llm._replica_config.placement_group_bundles is None


def test_build_app_tensor_parallel_bundles_and_autoscaling():
    _, llm = _replica(
        build_app(
            {
                "device": "cuda",
                "tensor_parallel_size": 2,
                "num_cpus_per_replica": 4,
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 6},
            }
        )
    )
    assert llm._replica_config.placement_group_bundles == [{"CPU": 4, "GPU": 1}] * 2
    assert llm._replica_config.placement_group_strategy == "STRICT_PACK"
    assert llm.init_args[1].direct_streams is None
    assert llm.ray_actor_options == {"num_cpus": 4, "num_gpus": 1}
    assert llm._deployment_config.autoscaling_config.max_replicas == 6
    assert llm.init_args[0].device == "cuda" and llm.init_args[0].tp_size == 2
    assert llm.init_args[1].cpus_per_rank == 4  # each tensor-parallel rank's actor takes its bundle's CPUs
    assert llm.init_args[1].warm_up is True  # GPU replicas warm up by default
    _, llm = _replica(build_app({"device": "cuda", "warmup": False}))
    assert llm.init_args[1].warm_up is False


def test_build_app_gpu_share():
    _, llm = _replica(build_app({"device": "cuda", "num_gpus_per_replica": 0.5}))
    assert llm.ray_actor_options == {"num_cpus": 1, "num_gpus": 0.5}
    _, llm = _replica(build_app({"device": "cpu", "num_gpus_per_replica": 0.5}))
    assert llm.ray_actor_options["num_gpus"] == 0 and llm.init_args[0].device == "cpu"


def _deep(depth: int) -> dict:
    """A JSON object nesting `depth` objects and arrays (itself one)."""
    out: list = []
    for _ in range(depth - 2):
        out = [out]
    return {"type": "object", "x": out}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": ["a"] * 257}, "prompt"),  # a batch of at most 256 prompts
        ({"prompt": [[1], []]}, "prompt"),
        ({"prompt": ["a", 1]}, "prompt"),
        ({"prompt": "x", "stop": [""]}, "stop"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),  # OpenAI's range: [-2, 2]
        ({"prompt": "x", "presence_penalty": -3}, "presence_penalty"),
        ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias"),
        ({"prompt": "x", "stop_token_ids": [1] * 4097}, "stop_token_ids"),
        ({"prompt": None}, "prompt"),  # null is no prompt, not a default
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream: true
        ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "x", "skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"prompt": "x", "include_stop_str_in_output": 1}, "include_stop_str_in_output"),
        ({"prompt": "x", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),  # vLLM's, not implemented
        ({"prompt": "x", "guided_choice": []}, "guided_choice"),  # structured outputs, malformed
        ({"prompt": "x", "guided_choice": ["a", 1]}, "guided_choice"),
        ({"prompt": "x", "guided_json": 5}, "guided_json"),
        ({"prompt": "x", "guided_regex": ""}, "guided_regex"),
        ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt": "x", "response_format": {"type": "structural_tag"}}, "response_format"),
        ({"prompt": "x", "structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"prompt": "x", "structured_outputs": {}}, "structured_outputs"),
        ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "logprobs": -1}, "logprobs"),
        ({"prompt": "x", "logprobs": True}, "logprobs"),  # strict: a count, not a flag
        # schemas nested deeper than MAX_SCHEMA_DEPTH, as a dict, as text, in response_format: refused unparsed
        ({"prompt": "x", "guided_json": _deep(MAX_SCHEMA_DEPTH + 1)}, "guided_json"),
        ({"prompt": "x", "guided_json": json.dumps(_deep(MAX_SCHEMA_DEPTH + 1))}, "guided_json"),
        ({"prompt": "x", "structured_outputs": {"json": _deep(MAX_SCHEMA_DEPTH + 1)}}, "structured_outputs"),
        (
            {
                "prompt": "x",
                "response_format": {"type": "json_schema", "json_schema": {"schema": _deep(MAX_SCHEMA_DEPTH + 1)}},
            },
            "response_format",
        ),
    ],
)
def test_completion_request_rejects(body, param):
    with pytest.raises(ValidationError) as e:
        _cmpl(body)
    assert e.value.errors()[0]["loc"][0] == param


@pytest.mark.parametrize("schema", [CompletionRequest, ChatCompletionRequest])
@pytest.mark.parametrize("model", [{}, {"model": None}])
def test_completions_and_chats_require_a_model_as_openai_does(schema, model):
    # OpenAI's API answers a completion or chat without `model` with a 400 (the ingress: the
    # schema's error, param "model"); /tokenize and /detokenize, vLLM's, may leave it out
    body = {"prompt": "x"} if schema is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError) as e:
        schema.model_validate({**body, **model})
    assert [err["loc"] for err in e.value.errors()] == [("model",)]
    assert schema.model_validate({**body, "model": "m"}).model == "m"
    assert TokenizeRequest.model_validate({"prompt": "x"}).model is None


def test_stop_strings_past_the_servers_limits_are_a_400_naming_them():
    """How many stop strings a request gives and their characters in all are the config's
    (max_stop_strings, max_stop_chars): the schema takes any, the ingress refuses past them."""
    from chunkserve.cluster.errors import APIError
    from chunkserve.cluster.prompts import check_stop

    config = AppConfig()
    assert (config.max_stop_strings, config.max_stop_chars) == (64, 8192)
    long = _cmpl({"prompt": "x", "stop": ["s"] * 65 + ["x" * 10**6]})
    assert len(long.stop_strings) == 66
    check_stop(("s",) * 64, config)  # at the limits: taken
    check_stop(("a" * 8000, "b" * 192), config)
    for stop, limit in ((("s",) * 65, "max_stop_strings"), (("a" * 8000, "b" * 193), "max_stop_chars")):
        with pytest.raises(APIError) as e:
            check_stop(stop, config)
        assert (e.value.status, e.value.detail.param) == (400, "stop") and limit in e.value.detail.message
    check_stop(("s",) * 65 + ("x" * 10**6,), AppConfig(max_stop_strings=100, max_stop_chars=2 * 10**6))


def test_responses_with_more_logprob_entries_than_the_limit_are_a_400_naming_it():
    """Per choice, (k + 1) entries for each token it may generate and, with echo and logprobs, each
    prompt token (AppConfig.max_logprob_entries, 2**18): the issue's 4 echoed 3900-token prompts
    with 20 each (a 15 KB request, a 3.2 MB response) are refused, one choice of a whole 8K
    context with 20 is not, nor anything without logprobs, nor a request that sets no max_tokens
    (its output's entries are not counted up front)."""
    from chunkserve.cluster.errors import APIError
    from chunkserve.cluster.prompts import check_logprob_entries

    most = AppConfig().max_logprob_entries
    assert most == 2**18
    prompts = [[1] * 3900] * 4
    echoed = _cmpl({"prompt": prompts, "echo": True, "logprobs": 20, "max_tokens": 16})
    with pytest.raises(APIError) as e:
        check_logprob_entries(echoed, prompts, [16] * 4, most)
    assert (e.value.status, e.value.detail.param) == (400, "logprobs")
    assert "max_logprob_entries" in e.value.detail.message and str(4 * 3916 * 21) in e.value.detail.message
    check_logprob_entries(echoed, prompts, [16] * 4, 4 * 3916 * 21)  # at the limit: taken
    plain = _cmpl({"prompt": prompts, "echo": True, "max_tokens": 16, "n": 16})
    check_logprob_entries(plain, prompts, [16] * 4, 1)
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20, "max_tokens": 8092}
    check_logprob_entries(_chat(chat), [[1] * 100], [8092], most)
    unset = {**chat, "max_tokens": None, "n": 16}  # OpenAI's clients often send none: the rest of the context
    check_logprob_entries(_chat(unset), [[1] * 100], [32668], most)
    with pytest.raises(APIError) as e:  # n choices each
        check_logprob_entries(_chat({**chat, "n": 2}), [[1] * 100], [8092], most)
    assert e.value.detail.param == "top_logprobs"
    # the echoed prompts' entries only with logprobs; without echo, only the generated tokens'
    one = _cmpl({"prompt": [1] * 3900, "logprobs": 20, "max_tokens": 16})
    check_logprob_entries(one, [[1] * 3900], [16], 16 * 21)


def test_schemas_nested_to_the_limit_pass_and_tools_are_bounded_too():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert _cmpl({"prompt": "x", "guided_json": _deep(MAX_SCHEMA_DEPTH)}).guide
    tool = {"type": "function", "function": {"name": "f", "parameters": _deep(MAX_SCHEMA_DEPTH + 1)}}
    with pytest.raises(ValidationError, match="nests more than") as e:
        _chat({**chat, "tools": [tool]})
    assert e.value.errors()[0]["loc"][0] == "tools"


def test_prompt_forms_and_batches():
    for prompt, want in (
        ("ab", ["ab"]),
        (["ab"], ["ab"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6], [[5, 6]]),
        ([[5], [6, 7]], [[5], [6, 7]]),
    ):
        assert _cmpl({"prompt": prompt}).prompts == want


def test_usage_counts_each_prompt_once_and_every_completion():
    def out(prompt, cached, completion):
        return GenerateOutput("r", "", (), "length", prompt, cached, completion)

    lasts = [out(10, 4, 3), out(10, 4, 5), out(7, 0, 2), out(7, 0, 1)]  # 2 prompts x n = 2
    usage = Usage.of(lasts, 2)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (17, 11, 4)
    assert Usage.of(lasts[:2], 2).prompt_tokens == 10 and Usage.of(lasts[:1]).total_tokens == 13
    # of the cached tokens, those the replica copied back from its host tier: summed alike
    tiered = [dataclasses.replace(o, cached_tokens_host=h) for o, h in zip(lasts, (3, 3, 0, 0))]
    details = Usage.of(tiered, 2).prompt_tokens_details
    assert (details.cached_tokens, details.cached_tokens_host) == (
        4,
        3,
    ) and usage.prompt_tokens_details.cached_tokens_host == 0


def test_penalties_min_p_and_logit_bias_reach_the_sampling_params():
    body = _cmpl(
        {
            "prompt": "x",
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.2,
            "min_p": 0.1,
            "logit_bias": {"7": -100, "3": 2.5},
        }
    )
    p = body.sampling_params(8)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1, 1.2, 0.1)
    assert p.logit_bias == ((3, 2.5), (7, -100)) and p.penalized
    plain = _cmpl({"prompt": "x", "presence_penalty": None, "logit_bias": None})
    assert not plain.sampling_params(8).penalized and plain.sampling_params(8).logit_bias == ()


def test_logprobs_reach_the_sampling_params():
    assert _cmpl({"prompt": "x", "logprobs": 3}).sampling_params(8).logprobs == 3
    assert _cmpl({"prompt": "x", "logprobs": 0}).sampling_params(8).logprobs == 0
    assert _cmpl({"prompt": "x", "logprobs": None}).sampling_params(8).logprobs is None
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, want in (
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": False, "top_logprobs": 0}, None),
    ):
        assert _chat({**chat, **extra}).sampling_params(8).logprobs == want
    for bad in ({"top_logprobs": 2}, {"logprobs": True, "top_logprobs": 21}, {"logprobs": 1}):
        with pytest.raises(ValidationError):
            _chat({**chat, **bad})


def test_echo_with_logprobs_asks_for_the_prompts():
    body = {"prompt": "x", "logprobs": 1}
    assert _cmpl({**body, "echo": True}).sampling_params(8).prompt_logprobs == 1
    assert _cmpl(body).sampling_params(8).prompt_logprobs is None
    assert _cmpl({"prompt": "x", "echo": True}).sampling_params(8).prompt_logprobs is None


def test_logprob_forms():
    from chunkserve.cluster.logprobs import chat_logprobs, completion_logprobs

    texts = TokenTexts(load_tokenizer("tiny"))
    entries = [(-0.5, ((72, -0.5), (73, -1.5))), (-2.0, ((105, -0.25), (33, -2.0)))]
    got = completion_logprobs([72, 33], entries, texts, offset=4)
    assert got.tokens == ["H", "!"] and got.token_logprobs == [-0.5, -2.0] and got.text_offset == [4, 5]
    assert got.top_logprobs == [{"H": -0.5, "I": -1.5}, {"i": -0.25, "!": -2.0}]
    chat = chat_logprobs([72, 33], entries, texts).content
    assert [(c.token, c.logprob, c.bytes) for c in chat] == [("H", -0.5, [72]), ("!", -2.0, [33])]
    assert [(t.token, t.logprob) for t in chat[1].top_logprobs] == [("i", -0.25), ("!", -2.0)]
    assert TokenTexts(None)(42) == "token_id:42"  # a model without a tokenizer: vLLM's names
    echoed = completion_logprobs([72, 33], [None, entries[1]], texts)  # an echoed prompt's first token
    assert echoed.token_logprobs == [None, -2.0] and echoed.top_logprobs == [None, {"i": -0.25, "!": -2.0}]
    # a token whose text the choice's text does not hold (an added BOS) stands where the text does
    bos = completion_logprobs([256, 72, 33], [None, *entries], texts, hidden={0})
    assert bos.tokens == ["<|bos|>", "H", "!"] and bos.text_offset == [0, 0, 1]


def test_null_means_the_default():
    """openai-python sends null for arguments passed as None: OpenAI and vLLM take it as the
    default (max_tokens: no limit but the context, as vLLM)."""
    nulls = dict.fromkeys(
        (
            "temperature",
            "top_p",
            "top_k",
            "n",
            "stream",
            "ignore_eos",
            "seed",
            "stop",
            "stop_token_ids",
            "stream_options",
            "max_tokens",
            "return_token_ids",
            "user",
        )
    )
    got = _cmpl({"prompt": "x", **nulls})
    want = _cmpl({"prompt": "x"})
    assert got.model_dump() == dict(want.model_dump(), max_tokens=None)
    streamed = _cmpl({"prompt": "x", "stream": True, "stream_options": {"include_usage": None}})
    assert streamed.stream_options.include_usage is False
    chat = _chat({"messages": [{"role": "user", "content": "hi"}], **nulls, "max_completion_tokens": None})
    assert chat.temperature == 1.0 and chat.requested_max_tokens is None and not chat.stream


def test_requests_accept_prompt_forms_and_ignore_unknown_fields():
    for prompt in ("hi", ["hi"], [1, 2], [[1, 2]]):
        assert _cmpl({"prompt": prompt, "store": True}).prompt == prompt
    chat = _chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "parallel_tool_calls": False,
            "stop": "x",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert chat.messages[0].text() == "ab" and chat.requested_max_tokens == 7
    assert chat.stop_strings == ("x",) and chat.include_usage


def _run(stream: _TextStream, tokenizer, text: str) -> tuple[str, bool]:
    """Push `text` one token at a time, the last one final; -> (all text sent, stopped)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    sent = ""
    for i, t in enumerate(ids):
        new, stopped = stream.push((t,), final=i == len(ids) - 1)
        sent += new
        if stopped:
            return sent, True
    return sent, False


def test_text_stream_stop_strings_and_utf8():
    tok = load_tokenizer("tiny")
    prompt = tuple(tok.encode("p"))
    assert _run(_TextStream(tok, prompt), tok, "héllo wörld €") == ("héllo wörld €", False)
    assert _run(_TextStream(tok, prompt, _Stops(("wör",))), tok, "héllo wörld") == ("héllo ", True)
    assert _run(_TextStream(tok, prompt, _Stops(("zzz", "lo"))), tok, "héllo wörld") == ("hél", True)
    # min_tokens: no stop string is looked for before that many tokens (byte tokens here: "lo"
    # ends at token 5 of "héllo", é being two; from token 7 on, "wör" ends at 11)
    assert _run(_TextStream(tok, prompt, _Stops(("lo", "wör"), min_tokens=5)), tok, "héllo wörld") == ("hél", True)
    assert _run(_TextStream(tok, prompt, _Stops(("lo", "wör"), min_tokens=7)), tok, "héllo wörld") == ("héllo ", True)
    assert _run(_TextStream(tok, prompt, _Stops(("lo",), min_tokens=7)), tok, "héllo wörld") == ("héllo wörld", False)
    # vLLM's include_stop_str_in_output: the text ends after the stop string
    assert _run(_TextStream(tok, prompt, _Stops(("wör",), include=True)), tok, "héllo wörld") == ("héllo wör", True)
    assert _run(_TextStream(tok, prompt, _Stops(("zzz", "lo"), include=True)), tok, "héllo wörld") == ("héllo", True)
    # vLLM's skip_special_tokens=False: special tokens' text too
    ids = tok.encode("ab", add_special_tokens=False) + [257] + tok.encode("c", add_special_tokens=False)
    for skip, want in ((True, "abc"), (False, "ab<|eos|>c")):
        stream = _TextStream(tok, prompt, skip_special_tokens=skip)
        assert "".join(stream.push((t,), final=i == len(ids) - 1)[0] for i, t in enumerate(ids)) == want
    # the last len(longest stop) - 1 chars are held back (they may begin a stop string) until the end
    stream = _TextStream(tok, prompt, _Stops(("abc",)))
    assert stream.push(tuple(tok.encode("xab", add_special_tokens=False)), final=False) == ("x", False)
    assert stream.push(tuple(tok.encode("d", add_special_tokens=False)), final=False) == ("a", False)
    assert stream.push(tuple(tok.encode("e", add_special_tokens=False)), final=True) == ("bde", False)
    # a trailing incomplete character is flushed when the request ends
    euro = tok.encode("€", add_special_tokens=False)
    stream = _TextStream(tok, prompt)
    assert stream.push(tuple(euro[:2]), final=True) == (tok.decode(euro[:2]), False)


def test_text_stream_keeps_only_the_text_not_yet_sent():
    """A stop string can only begin in the held-back text, so nothing before it is kept or searched
    again: each token's search covers the stop strings' lengths and the new text (once, all the
    text so far, for each stop string at each token)."""
    tok = load_tokenizer("tiny")
    stops = ("abc", "z" * 40)
    stream, sent, kept = _TextStream(tok, tuple(tok.encode("p")), _Stops(stops)), "", 0
    text = "lorem ipsum dolor sit amet, " * 200  # 5600 byte tokens, no stop string
    for t in tok.encode(text, add_special_tokens=False):
        new, stopped = stream.push((t,), final=False)
        sent, kept = sent + new, max(kept, len(stream._text))
        assert not stopped
    assert sent + stream._text == text and kept == 39  # (the longest stop string but one: held back)
    # the held-back text and the new: a stop string is found there, and the text ends before it
    assert stream.push(tuple(tok.encode("xabcy", add_special_tokens=False)), final=False) == (text[-39:] + "x", True)


def test_a_requests_choices_hold_one_copy_of_its_stop_strings_in_the_replica():
    """Each of a request's n choices is a call of its own, which pickles its GenerateRequest (Ray's
    serialization; a direct stream's pickle): unpickled, every choice's stop strings are one tuple
    object, which the replica's text streams share, dropped with the last request holding it."""
    import gc
    import pickle

    from ray import cloudpickle

    from chunkserve.replicas.engine.sequence import SamplingParams
    from chunkserve.replicas.wire import HELD_STOPS, GenerateRequest

    tok = load_tokenizer("tiny")
    stop = ("q" * 100_000, "STOP")
    sent = [GenerateRequest(f"r-{i}", (1, 2, 3), SamplingParams(max_tokens=4), stop, "tiny") for i in range(16)]
    got = [
        (pickle if i % 2 else cloudpickle).loads((pickle if i % 2 else cloudpickle).dumps(r))
        for i, r in enumerate(sent)
    ]
    assert got == sent and got[0].stop == stop and got[0].stop is not stop  # (a copy of this process's own)
    assert all(r.stop is got[0].stop for r in got) and len(HELD_STOPS) == 1
    streams = [_TextStream(tok, r.prompt_token_ids, _Stops(r.stop)) for r in got]
    assert all(s._stop is got[0].stop for s in streams)
    other = pickle.loads(pickle.dumps(dataclasses.replace(sent[0], stop=("other",))))
    assert other.stop == ("other",) and len(HELD_STOPS) == 2
    del got, streams, other
    gc.collect()
    assert len(HELD_STOPS) == 0  # (given back with the requests)
    assert pickle.loads(pickle.dumps(dataclasses.replace(sent[0], stop=()))).stop == () and len(HELD_STOPS) == 0


def _outputs(
    ids: list[int], per_step: int, finish: str | None, prompt: int = 3, logprobs: bool = False
) -> list[RequestOutput]:
    """The engine's step outputs of one request that generates ids, per_step tokens a step (with
    logprobs: token t's entry (-t, ((t, -t),)))."""
    steps = [ids[i : i + per_step] for i in range(0, len(ids), per_step)]
    return [
        RequestOutput(
            "r",
            s,
            finish is not None and i == len(steps) - 1,
            finish if i == len(steps) - 1 else None,
            prompt,
            0,
            per_step * i + len(s),
            [(-t, ((t, -t),)) for t in s] if logprobs else None,
        )
        for i, s in enumerate(steps)
    ]


@pytest.mark.parametrize("per_step", [1, 2])
@pytest.mark.parametrize("finish", [None, "length"])
def test_a_stop_string_inside_a_batch_of_steps_ends_text_tokens_and_usage_there(per_step, finish):
    # a caller that fell behind gets several steps as one batch: the stop string's token ends
    # it, and the steps' later tokens are neither sent nor counted (vLLM counts through that token)
    tok = load_tokenizer("tiny")
    prompt = tuple(tok.encode("p"))
    ids = tok.encode("ab cd STOP ef gh", add_special_tokens=False)
    upto = next(i for i in range(len(ids)) if "STOP" in tok.decode(ids[: i + 1])) + 1  # tokens through the stop
    assert upto < len(ids) - 2
    batch = _outputs(ids, per_step, finish)
    got = _take(_TextStream(tok, prompt, _Stops(("STOP",))), batch)
    assert got.stopped and got.reason == "stop" and got.text == "ab cd "
    assert got.token_ids == tuple(ids[:upto]) and got.output_tokens == upto and got.logprobs is None
    # logprobs stay with their tokens: through the stop string's, none after
    batch = _outputs(ids, per_step, finish, logprobs=True)
    batch[0] = batch[0]._replace(prompt_logprobs=[None, (-1.0, ())])  # the first output's
    got = _take(_TextStream(tok, prompt, _Stops(("STOP",))), batch)
    assert got.token_ids == tuple(ids[:upto]) and got.logprobs == tuple((-t, ((t, -t),)) for t in ids[:upto])
    assert got.prompt_logprobs == (None, (-1.0, ()))
    assert got.engine_done == (finish is not None)  # only then does the engine hold it no more
    # without the stop string the whole batch goes, and its end with the last step
    got = _take(_TextStream(tok, prompt), batch)
    assert not got.stopped and got.token_ids == tuple(ids) and got.output_tokens == len(ids)
    assert got.reason == finish and got.engine_done == (finish is not None)
    assert got.text == (tok.decode(ids) if finish else got.text) and tok.decode(ids).startswith(got.text)
    # step by step, the same text and the same end
    stream, sent = _TextStream(tok, prompt, _Stops(("STOP",))), ""
    for out in batch:
        got = _take(stream, [out])
        sent += got.text
        if got.stopped:
            break
    assert sent == "ab cd " and got.output_tokens == upto


def test_engine_options_are_engine_config_fields():
    # every deployment engine option reaches EngineConfig under its own name (enforce_eager too),
    # with EngineConfig's default (the config module stays free of torch: it restates them)
    from chunkserve.replicas.engine.config import EngineConfig

    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    options = AppConfig.model_validate({}).engine.model_dump()
    assert options == {name: engine_defaults[name] for name in options}  # one set of defaults

    options = AppConfig.model_validate({"engine": {"enforce_eager": True, "async_scheduling": True}})
    options = options.engine.model_dump()
    assert options["enforce_eager"] is True and options["async_scheduling"] is True
    config = EngineConfig(model="tiny", **options)
    assert config.enforce_eager and config.async_scheduling and config.sparse_prefill is None
    sparse = {"min_context": 4096, "block": 128, "alpha": 0.2, "budget": 0.3, "sink": 2, "window": 3, "subgroup": 2}
    sparse["dense_tail"], sparse["spread"], sparse["span"], sparse["stride"] = 32, 0.25, 2, 2
    options = AppConfig.model_validate({"engine": {"sparse_prefill": sparse}}).engine.model_dump()
    config = EngineConfig(model="tiny", **options)
    assert dataclasses.asdict(config.sparse_prefill) == sparse  # every option reaches BlockUnion by its name
    defaults = AppConfig.model_validate({"engine": {"sparse_prefill": {}}}).engine.sparse_prefill.model_dump()
    from chunkserve.kernels.block_union import BlockUnion

    assert defaults == dataclasses.asdict(BlockUnion())  # one set of defaults
    auto = {"engine": {"sparse_prefill": {"budget": 0.1, "span": "auto"}}}
    options = AppConfig.model_validate(auto).engine.model_dump()
    assert EngineConfig(model="tiny", **options).sparse_prefill.span == "auto"


def test_streams_of_n_choices_interleave_with_their_indices_and_sum_their_usage():
    """Three choices, outputs coming at different times: every chunk carries its choice's index,
    each choice's text in order, its role first (chat), and the usage chunk counts the prompt once
    and every choice's tokens."""
    import asyncio
    import json

    from chunkserve.cluster.responses import ChatFormat, ResponseHead, sse_response

    def out(text, n, end=None):
        return GenerateOutput(
            replica_id="r",
            text=text,
            token_ids=(n,),
            finish_reason=end,
            prompt_tokens=3,
            cached_tokens=2,
            completion_tokens=n,
        )

    class Replies:
        def __init__(self, outs, delay):
            self.outs, self.delay, self.cancelled = list(outs), delay, False

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(self.delay)
            if not self.outs:
                raise StopAsyncIteration
            return self.outs.pop(0)

        def cancel(self):
            self.cancelled = True

    texts = [["a", "b", "c"], ["x", "y"], ["p", "q", "r", "s"]]
    started = [
        (
            out(t[0], 1),
            Replies([out(c, k + 2, "length" if k == len(t) - 2 else None) for k, c in enumerate(t[1:])], delay),
        )
        for t, delay in zip(texts, (0.003, 0.001, 0.002))
    ]

    async def body() -> list[str]:
        response = sse_response(
            started, ChatFormat(ResponseHead("chatcmpl-1", "tiny", 3, False, TokenTexts(None)), [1, 2, 3]), True, {}
        )
        return [piece async for piece in response.body_iterator]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(body())]
    assert events[-1] == "[DONE]"
    chunks, usage = [json.loads(e) for e in events[:-2]], json.loads(events[-2])
    got: dict[int, str] = {}
    for c in chunks:
        (choice,) = c["choices"]
        if choice["index"] not in got:
            assert choice["delta"]["role"] == "assistant"
        got[choice["index"]] = got.get(choice["index"], "") + choice["delta"].get("content", "")
    assert got == {i: "".join(t) for i, t in enumerate(texts)}
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]  # the first outputs, in order
    assert [c["choices"][0]["index"] for c in chunks[3:]] != sorted(c["choices"][0]["index"] for c in chunks[3:])
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 3 + 2 + 4,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 2, "cached_tokens_host": 0},
    }
    assert not any(rest.cancelled for _, rest in started)


def test_stream_that_fails_midway_says_so_and_ends():
    """The replica fails after the first output: the client gets that output, an error event (a
    generic server_error naming the request's id, not what failed), and the stream's usual end
    (data: [DONE]), as vLLM's streams end; the replica's generator is cancelled."""
    import asyncio
    import json

    from chunkserve.cluster.responses import CompletionFormat, ResponseHead, sse_response

    out = GenerateOutput(
        replica_id="r",
        text="Hel",
        token_ids=(1,),
        finish_reason=None,
        prompt_tokens=3,
        cached_tokens=0,
        completion_tokens=1,
    )

    class Failing:
        cancelled = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            raise RuntimeError("replica died")

        def cancel(self):
            Failing.cancelled = True

    async def body() -> list[str]:
        response = sse_response(
            [(out, Failing())],
            CompletionFormat(ResponseHead("cmpl-1", "tiny", 1, False, TokenTexts(None)), [[1, 2, 3]]),
            False,
            {},
        )
        return [piece async for piece in response.body_iterator]

    events = [e.removeprefix("data: ").strip() for e in asyncio.run(body())]
    assert json.loads(events[0])["choices"][0]["text"] == "Hel"
    error = json.loads(events[1])["error"]
    assert error["type"] == "server_error" and "request id" in error["message"] and "died" not in error["message"]
    assert events[2:] == ["[DONE]"] and Failing.cancelled


def test_structured_outputs_reach_the_sampling_params_in_every_form():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    text = json.dumps(schema)
    forms = [
        ({"response_format": {"type": "json_object"}}, Guide("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema, "strict": True},
                }
            },
            Guide("json", text),
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, Guide("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": schema}, Guide("json", text)),
        ({"guided_json": text}, Guide("json", text)),
        ({"guided_regex": "a+"}, Guide("regex", "a+")),
        ({"guided_choice": ["a", "b"]}, Guide("choice", ("a", "b"))),
        ({"guided_grammar": 'root ::= "a"'}, Guide("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"json": schema, "disable_any_whitespace": True}}, Guide("json", text, False)),
        ({"structured_outputs": {"json_object": True}}, Guide("json_object")),
        ({"structured_outputs": {"choice": ["x"]}}, Guide("choice", ("x",))),
        ({"guided_regex": None, "response_format": None}, None),
    ]
    for extra, want in forms:
        body = _cmpl({"prompt": "x", **extra})
        assert body.sampling_params(8).guided == want, extra
        chat = _chat({"messages": [{"role": "user", "content": "hi"}], **extra})
        assert chat.sampling_params(8).guided == want and chat.guide_field == body.guide_field
    assert _cmpl({"prompt": "x", "guided_regex": "a"}).guide_field == "guided_regex"


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one of"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "at most one of"),
        ({"guided_choice": ["a"], "min_tokens": 2}, "min_tokens cannot be combined with guided_choice"),
    ],
)
def test_structured_outputs_one_at_a_time_and_not_with_min_tokens(extra, match):
    with pytest.raises(ValidationError, match=match):
        _cmpl({"prompt": "x", **extra})
