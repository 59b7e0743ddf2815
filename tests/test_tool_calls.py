"""Tool calling (chunkserve/cluster/tool_calls.py): forced calls guided by their schemas on the real engine, the
`auto` parsers, streamed deltas against the whole message, chat templates with tools, and the
request's checks."""

import json
import random

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from chunkserve.cluster.protocol import ChatCompletionRequest, ChatMessage, NamedToolChoice, template_tools
from chunkserve.cluster.tool_calls import HermesParser, Llama3JsonParser, ToolOutput
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.model.tokenizer import Tokenizer
from tests.hf_checkpoints import make_hf_checkpoint
from tests.test_guided import BIASES

WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "unit"],
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
}
ALARM = {
    "type": "object",
    "additionalProperties": False,
    "required": ["on", "hour"],
    "properties": {"on": {"type": "boolean"}, "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "today's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]


def _follows(name: str, args: dict) -> bool:
    """args are a valid call of tool `name` (its schema, spelled out)."""
    if name == "get_weather":
        return set(args) == {"city", "unit"} and args["city"] in ("Paris", "Oslo", "Lima") and args["unit"] in "CF"
    return (
        name == "set_alarm"
        and set(args) == {"on", "hour"}
        and type(args["on"]) is bool
        and type(args["hour"]) is int
        and 0 <= args["hour"] <= 23
    )


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})


@pytest.fixture(scope="module")
def engine():
    return LLMEngine.from_model("tiny", chunk_size=16, kv_cache_tokens=8192)


def _generate(engine, request: ChatCompletionRequest, seed: int) -> tuple[str, str]:
    """The request's guided output from the engine: (text, finish reason)."""
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages], tools=template_tools(request.tools)
        ),
        add_special_tokens=False,
    )
    params = SamplingParams(max_tokens=300, temperature=1.0, seed=seed, guided=request.guide, logit_bias=BIASES["json"])
    (out,) = engine.generate([prompt], params)
    assert out[-1] in engine.model_config.eos_token_ids  # the grammar ended, and so did the output
    return engine.tokenizer.decode(out), "stop"


# -- forced calls, guided ----------------------------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_calls_of_the_tools(engine, parallel):
    request = _request(tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    counts = set()
    for seed in range(4):
        text, finish = _generate(engine, request, seed)
        content, calls, finish = ToolOutput.of("required", None).whole(text, finish)
        assert content is None and finish == "tool_calls" and calls, text
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert _follows(call["function"]["name"], json.loads(call["function"]["arguments"])), call
        counts.add(len(calls))
    assert counts == {1} if not parallel else max(counts) > 1  # (seeds 1-3 draw two calls)


def test_a_named_function_gives_its_arguments(engine):
    request = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "set_alarm"}})
    for seed in range(3):
        text, finish = _generate(engine, request, seed)
        content, calls, finish = ToolOutput.of(request.tool_choice, None).whole(text, finish)
        assert content is None and finish == "stop" and len(calls) == 1
        assert calls[0]["function"]["name"] == "set_alarm" and calls[0]["function"]["arguments"] == text
        assert _follows("set_alarm", json.loads(text)), text


def test_without_the_guide_the_model_writes_no_calls(engine):
    # what makes the tests above able to fail: the random model's own text is not calls
    request = _request(tools=TOOLS, tool_choice="none")
    prompt = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages], tools=template_tools(request.tools)
        ),
        add_special_tokens=False,
    )
    for seed in range(3):
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=60, temperature=1.0, seed=seed))
        text = engine.tokenizer.decode(out)
        assert ToolOutput.of("required", None).whole(text, "length") == (text, [], "length")


def test_defs_of_the_tools_are_hoisted_and_must_agree(engine):
    point = {
        "type": "object",
        "additionalProperties": False,
        "required": ["x"],
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    }
    with_defs = {
        "type": "object",
        "additionalProperties": False,
        "required": ["at"],
        "properties": {"at": {"$ref": "#/$defs/point"}},
        "$defs": {"point": point},
    }
    tools = [{"type": "function", "function": {"name": "move", "parameters": with_defs}}, TOOLS[1]]
    request = _request(tools=tools, tool_choice="required")
    assert "$defs" in json.loads(request.guide.spec) and request.guide.grammar() is not None
    text, finish = _generate(engine, request, 0)
    _, calls, _ = ToolOutput.of("required", None).whole(text, finish)
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        assert (
            call["function"]["name"] == "move"
            and set(args) == {"at"}
            and 0 <= args["at"]["x"] <= 9
            or _follows(call["function"]["name"], args)
        ), call
    other = {**with_defs, "$defs": {"point": {"type": "string"}}}
    clash = [tools[0], {"type": "function", "function": {"name": "jump", "parameters": other}}]
    with pytest.raises(ValidationError, match="point differently"):
        _request(tools=clash, tool_choice="required")


# -- the request -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, match",
    [
        ({"tool_choice": "required"}, "needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "fly"}}},
            "'fly', which is not in tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "cannot be combined with guided_regex"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "cannot be combined with response_format",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens cannot be combined"),
        ({"tools": TOOLS + TOOLS[:1]}, "distinct function names"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "should match pattern"),
        ({"tools": [{"type": "retrieval"}]}, "type"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_requests_are_refused(body, match):
    with pytest.raises(ValidationError, match=match):
        _request(**body)


def test_tool_choice_defaults_and_guides():
    assert _request().effective_tool_choice == "none" and _request(tools=TOOLS).effective_tool_choice == "auto"
    assert _request(tools=[], tool_choice="auto").effective_tool_choice == "none"  # no tools: nothing to call
    for choice in ("none", "auto"):
        assert _request(tools=TOOLS, tool_choice=choice).guide is None
    named = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.guide.kind == "json" and json.loads(named.guide.spec) == WEATHER and named.guide_field == "tools"
    required = json.loads(_request(tools=TOOLS, tool_choice="required", parallel_tool_calls=False).guide.spec)
    assert required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    untyped = _request(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
    assert json.loads(untyped.guide.spec)["items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object"}
    assert (
        _request(tools=TOOLS, tool_choice="required").sampling_params(8).guided
        == _request(tools=TOOLS, tool_choice="required").guide
    )


def test_messages_reach_the_template_as_transformers_passes_them():
    msg = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, 2]}'}}
            ],
        }
    )
    assert msg.for_template() == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"a": [1, 2]}}}],
    }
    tool = ChatMessage.model_validate({"role": "tool", "content": "12 C", "tool_call_id": "call_1"})
    assert tool.for_template() == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    bad = ChatMessage.model_validate(
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}
    )
    with pytest.raises(ValueError, match="must be JSON text"):
        bad.for_template()


# -- templates -------------------------------------------------------------------------------

CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}},
            }
        ],
    },
    {"role": "tool", "content": "-3", "tool_call_id": "call_1"},
]


def test_byte_template_shows_tools_and_writes_calls_as_hermes_reads_them():
    tok = Tokenizer.byte()
    text = tok.apply_chat_template(CHAT, tools=TOOLS)
    lines = text.split("<|end|>")[0].split("\n")
    assert (
        lines[0]
        == '<|bos|><|system|>You may call these functions, each as <tool_call>{"name": ..., "arguments": {...}}</tool_call>:'
    )
    assert [json.loads(line) for line in lines[1:]] == [t["function"] for t in TOOLS]
    assert text.endswith(
        '<|user|>Weather in Oslo?<|end|><|assistant|><tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Oslo", "unit": "C"}}</tool_call><|end|><|user|><tool_response>-3</tool_response>'
        "<|end|><|assistant|>"
    )
    turn = text.split("<|assistant|>")[1].removesuffix("<|end|><|user|><tool_response>-3</tool_response><|end|>")
    _, calls = HermesParser().parse(turn)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "C"})
    ]
    assert (
        tok.apply_chat_template(CHAT[:1]) == "<|bos|><|user|>Weather in Oslo?<|end|><|assistant|>"
    )  # no tools: as before


# A Qwen-2.5-like tool template (written for this test): tools in the system turn, calls and
# responses in tags, arguments through tojson.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hf_template_with_tools_renders_as_transformers_does(tmp_path):
    path = make_hf_checkpoint("Qwen2ForCausalLM", tmp_path)
    (path / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    tok, ref = Tokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    request = _request(tools=TOOLS)
    tools = template_tools(request.tools)
    rendered = ref.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, tools=tools) == rendered
    assert '<tools>{"type": "function"' in rendered and '"arguments": {"city": "Oslo", "unit": "C"}' in rendered


# -- `auto`: parsers -------------------------------------------------------------------------


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Hello there", "Hello there", []),
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
        (
            'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>',
            "Sure.\n",
            [("f", {}), ("g", {"b": 2})],
        ),
        (
            '  \n<tool_call>{"name": "f", "arguments": {"a": "é"}}',
            None,
            [("f", {"a": "é"})],
        ),  # cut short: the last block unclosed
        ("<tool_call>{broken}</tool_call>", "<tool_call>{broken}</tool_call>", []),
        (
            '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'  # calls up to a bad block
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
            None,
            [("f", {})],
        ),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),  # no name
        (
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
            [],
        ),
    ],
)
def test_hermes_parser(text, content, calls):
    got_content, got = HermesParser().parse(text)
    assert got_content == content and _calls(got) == calls


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("The weather is fine", "The weather is fine", []),
        ('{"name": "f", "parameters": {"a": 1}}', None, [("f", {"a": 1})]),
        (
            '<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"b": [2]}}',
            None,
            [("f", {}), ("g", {"b": [2]})],
        ),
        ('  {"name": "f", "parameters": {}} trailing', '  {"name": "f", "parameters": {}} trailing', []),
        ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
        ("{not json}", "{not json}", []),
    ],
)
def test_llama3_json_parser(text, content, calls):
    got_content, got = Llama3JsonParser().parse(text)
    assert got_content == content and _calls(got) == calls


# -- streamed deltas against the whole message -----------------------------------------------

STREAM_CASES = {
    "hermes": [
        "Hello there",
        "  ",
        'Sure.\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
        "<tool_call>{broken}</tool_call> and more",
        "ends in <tool_ca",
        "a < b <tool",
        'x<tool_call>{"name":"f","arguments":{}}</tool_call>\n<tool_call>{"name":"g","arguments":{}}</tool_call>',
        '\n\n<tool_call>{"name": "f", "arguments": {}}',
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>',
        # a block whose JSON looks whole before its end, then is not: no call for it
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
        '"arguments": {}} tail</tool_call>',
    ],
    "llama3_json": [
        "The weather",
        '  {"name": "f", "parameters": {"a": 1}}',
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}',
        "{broken",
        "<|python",
        "  \n ",
    ],
    "required": [
        '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"s": "}]\\"{"}}]',
        '[{"name": "f", "para',
        '[{"name": "f", "parameters": {"b": [1, {"c": 2}]}}, {"name": "g", "parameters": {"x"',
        '[{"name": "f"}, {"name": "g", "parameters": {}}]',
    ],  # (cut short; an item not a call)
    "named": ['{"a": 1, "b": [true]}', '{"a": '],
}


def _splits(text: str, seed: int) -> list[str]:
    """text cut into pieces: one piece, a character each, or random cuts with empty pieces among them."""
    if seed == 0:
        return [text]
    if seed == 1:
        return list(text)
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 6)))) + [len(text)]
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts)]
    return [p for piece in pieces for p in ([piece, ""] if rng.random() < 0.3 else [piece])]


def _output(mode: str) -> ToolOutput:
    if mode == "named":
        return ToolOutput.of(NamedToolChoice.model_validate({"type": "function", "function": {"name": "f"}}), None)
    return ToolOutput.of("required", None) if mode == "required" else ToolOutput.of("auto", mode)


@pytest.mark.parametrize("mode", sorted(STREAM_CASES))
@pytest.mark.parametrize("finish", ["stop", "length"])
def test_streamed_deltas_add_up_to_the_whole_message(mode, finish):
    for text in STREAM_CASES[mode]:
        content, calls, reason = _output(mode).whole(text, finish)
        for seed in range(6):
            out, pieces = _output(mode), _splits(text, seed)
            streamed, by_index, reasons = "", {}, []
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                delta, got_finish = out.step(piece, finish if last else None)
                reasons.append(got_finish)
                streamed += delta.get("content", "")
                for call in delta.get("tool_calls", []):
                    if "id" in call:  # a call's first delta: its id, type and name
                        assert call["index"] not in by_index and call["type"] == "function"
                        by_index[call["index"]] = [call["function"]["name"], ""]
                    by_index[call["index"]][1] += call["function"]["arguments"]
                if not last:
                    # content never runs ahead of what the whole message keeps as content
                    assert (content or "").startswith(streamed), (text, pieces, streamed)
            assert reasons[:-1] == [None] * (len(pieces) - 1) and reasons[-1] == reason
            assert streamed == (content or ""), (mode, text, pieces)
            assert [tuple(by_index[i]) for i in sorted(by_index)] == [
                (c["function"]["name"], c["function"]["arguments"]) for c in calls
            ], (mode, text, pieces)


def test_auto_streams_each_hermes_call_once_its_block_closes():
    out = ToolOutput.of("auto", "hermes")
    assert out.step('Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}', None) == ({"content": "Sure."}, None)
    delta, _ = out.step("</tool_call>\n<tool_call>", None)
    assert [(c["index"], c["function"]["name"]) for c in delta["tool_calls"]] == [(0, "f")]
    delta, finish = out.step('{"name": "g", "arguments": {}}</tool_call>', "stop")
    assert finish == "tool_calls" and [(c["index"], c["function"]["name"]) for c in delta["tool_calls"]] == [(1, "g")]
    # a block closing in the same delta as the next one's JSON looks whole: only the closed one
    out = ToolOutput.of("auto", "hermes")
    delta, _ = out.step(
        '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}', None
    )
    assert [c["function"]["name"] for c in delta["tool_calls"]] == ["f"]
    assert out.step(" tail</tool_call>", "stop") == ({}, "tool_calls")  # g's block does not parse whole


def test_auto_without_a_parser_is_refused_not_read_as_text():
    with pytest.raises(ValueError, match="needs a tool_call_parser"):
        ToolOutput.of("auto", None)
    assert ToolOutput.of("none", None) is None


def test_auto_holds_back_what_may_begin_a_call():
    out = ToolOutput.of("auto", "hermes")
    assert out.step("Sure <tool", None) == ({"content": "Sure "}, None)
    assert out.step("_c", None) == ({}, None)
    assert out.step("at is not it", None) == ({"content": "<tool_cat is not it"}, None)
    out = ToolOutput.of("auto", "llama3_json")
    assert out.step("  ", None) == ({}, None)  # leading whitespace waits: a call may follow
    assert out.step("{", None) == ({}, None)


def test_required_streams_each_call_as_its_object_closes():
    out = ToolOutput.of("required", None)
    assert out.step('[{"name": "f", "parameters": {"a": ', None) == ({}, None)
    delta, finish = out.step('1}}, {"name"', None)
    assert finish is None and [
        (c["index"], c["id"][:5], c["function"]["name"], c["function"]["arguments"]) for c in delta["tool_calls"]
    ] == [(0, "call_", "f", '{"a": 1}')]
    delta, finish = out.step(': "g", "parameters": {}}]', "stop")
    assert finish == "tool_calls" and [(c["index"], c["function"]["name"]) for c in delta["tool_calls"]] == [(1, "g")]
    # cut short: the whole items are the calls, the finish reason stays the engine's
    content, calls, finish = ToolOutput.of("required", None).whole('[{"name": "f", "parameters": {}}, {"na', "length")
    assert (content, _calls(calls), finish) == (None, [("f", {})], "length")
