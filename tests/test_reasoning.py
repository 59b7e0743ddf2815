"""Reasoning parsers (chunkserve/cluster/reasoning.py): thinking apart from the answer, whole and streamed."""

import re

import pytest
from tokenizers import AddedToken

from chunkserve.cluster.logprobs import TokenTexts
from chunkserve.cluster.reasoning import ReasoningSplit, think_tags
from chunkserve.cluster.responses import ChatFormat, ResponseHead
from chunkserve.replicas.engine import LLMEngine, SamplingParams
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.model.tokenizer import Tokenizer
from chunkserve.replicas.wire import GenerateOutput
from tests.test_tool_calls import _splits

CASES = {  # text -> (reasoning, content) under each parser
    "deepseek_r1": [
        ("<think>I ponder.</think>The answer.", ("I ponder.", "The answer.")),
        ("I ponder.</think>\n\nThe answer.", ("I ponder.", "\n\nThe answer.")),  # the template opened it
        ("still thinking when cut sh", ("still thinking when cut sh", "")),
        ("<think></think>Just this.", (None, "Just this.")),
        ("a < b </thin", ("a < b </thin", "")),
        ("<thi", ("<thi", "")),
        ("", (None, "")),
    ],
    "qwen3": [
        ("<think>\nHmm.\n</think>\n\nYes.", ("\nHmm.\n", "\n\nYes.")),
        ("Yes, no thinking.", (None, "Yes, no thinking.")),
        ("<think>cut short", ("cut short", "")),
        ("Says </think> mid-answer", (None, "Says </think> mid-answer")),
        ("<thi", (None, "<thi")),
        ("<think></think>", (None, "")),
        ("", (None, "")),
    ],
}


@pytest.mark.parametrize("parser", sorted(CASES))
def test_whole_outputs_split(parser):
    for text, want in CASES[parser]:
        assert ReasoningSplit(parser).whole(text) == want, text


@pytest.mark.parametrize("parser", sorted(CASES))
def test_streamed_deltas_add_up_to_the_whole(parser):
    for text, (reasoning, content) in CASES[parser]:
        for seed in range(6):
            split, pieces = ReasoningSplit(parser), _splits(text, seed)
            got_r = got_c = ""
            for i, piece in enumerate(pieces):
                r, c = split.step(piece, final=i == len(pieces) - 1)
                got_r, got_c = got_r + r, got_c + c
                # never ahead of the whole: a tag's first characters are held until known
                assert (reasoning or "").startswith(got_r) and content.startswith(got_c), (text, pieces)
            assert (got_r, got_c) == (reasoning or "", content), (parser, text, pieces)


def test_a_tag_split_across_deltas_is_held_back():
    split = ReasoningSplit("qwen3")
    assert split.step("<th") == ("", "")
    assert split.step("ink>I think <") == ("I think ", "")
    assert split.step("/thi") == ("", "")
    assert split.step("nk>Done") == ("", "Done")


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="one of"):
        ReasoningSplit("o1")


HEAD = ResponseHead("chatcmpl-1", "m", 1, False, TokenTexts(Tokenizer.byte()))  # one choice, no token ids


def _outputs(pieces: list[str], finish: str) -> list[GenerateOutput]:
    return [
        GenerateOutput(
            replica_id="r",
            text=p,
            token_ids=(),
            finish_reason=finish if i == len(pieces) - 1 else None,
            prompt_tokens=3,
            cached_tokens=0,
            completion_tokens=i + 1,
        )
        for i, p in enumerate(pieces)
    ]


@pytest.mark.parametrize("tools", [False, True])
def test_chat_messages_carry_reasoning_apart_then_content_and_calls(tools):
    # the ingress's chat format: whole and streamed, the thinking in reasoning_content; under
    # tool_choice auto the calls are parsed from the content only
    text = (
        '<think>Call it? Yes: <tool_call> it.</think>Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    )
    args = ("auto", "hermes") if tools else ("none", None)
    fmt = ChatFormat(HEAD, [1, 2, 3], *args, "qwen3")
    whole = fmt.whole([_outputs([text], "stop")]).choices[0]
    assert whole.message.reasoning_content == "Call it? Yes: <tool_call> it."
    if tools:
        assert whole.message.content == "Sure." and whole.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [("f", '{"a": 1}')]
    else:
        assert whole.message.content == text.split("</think>")[1] and whole.message.tool_calls is None
    for seed in range(6):
        fmt = ChatFormat(HEAD, [1, 2, 3], *args, "qwen3")
        chunks = [fmt.chunk(out, 0) for out in _outputs(_splits(text, seed), "stop")]
        deltas = [c.choices[0].delta for c in chunks if c is not None]
        assert deltas[0]["role"] == "assistant"
        assert "".join(d.get("reasoning_content", "") for d in deltas) == whole.message.reasoning_content
        assert "".join(d.get("content", "") for d in deltas) == whole.message.content
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
            (c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()
        ]
        assert [c.choices[0].finish_reason for c in chunks if c is not None][-1] == whole.finish_reason


def test_an_output_all_thinking_has_no_content_and_a_plain_one_no_reasoning():
    fmt = ChatFormat(HEAD, [1], reasoning_parser="deepseek_r1")
    message = fmt.whole([_outputs(["thinking, cut sh"], "length")]).choices[0].message
    assert (message.reasoning_content, message.content) == ("thinking, cut sh", None)
    fmt = ChatFormat(HEAD, [1], reasoning_parser="qwen3")
    body = fmt.whole([_outputs(["plain"], "stop")]).model_dump()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "plain"}  # no reasoning_content key


def _byte_tokenizer_with_think_tags(tokenizer: Tokenizer) -> Tokenizer:
    """The byte tokenizer with <think> and </think> as tokens of their own (ids 262, 263; as
    Qwen3's, not special: they stay in the text)."""
    tokenizer.backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    return tokenizer


def test_think_tags_are_the_tokenizers_own():
    tok = _byte_tokenizer_with_think_tags(Tokenizer.byte())
    assert think_tags(tok, "qwen3", guided=True) == (262, 263)
    assert think_tags(tok, "deepseek_r1", guided=True) == (None, 263)  # its template opens the thinking
    assert think_tags(tok, "qwen3", guided=False) is None and think_tags(tok, None, guided=True) is None
    assert think_tags(Tokenizer.byte(), "qwen3", guided=True) is None  # no such tokens: the guide holds it all


def test_a_guided_chat_thinks_first_then_answers_in_its_grammar():
    # the engine under SamplingParams.think from the tokenizer's tags, its text through the chat
    # format: the thinking in reasoning_content, the content inside the regex
    engine = LLMEngine.from_model("tiny", chunk_size=16)
    tok = _byte_tokenizer_with_think_tags(engine.tokenizer)
    start, end = think_tags(tok, "qwen3", guided=True)
    eos, regex = engine.model_config.eos_token_ids[0], r"[a-z]{3}-\d{2}"
    fmt = ChatFormat(HEAD._replace(texts=TokenTexts(tok)), [1], reasoning_parser="qwen3")
    for seed in range(3):
        params = SamplingParams(
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            guided=Guide("regex", regex),
            think=(start, end),
            logit_bias={start: 10.0, end: 3.0, eos: -100.0},
        )
        ids = engine.generate([tok.encode("Think: ")], params)[0]
        assert ids[0] == start and end in ids and ids[-1] == eos, ids
        message = fmt.whole([_outputs([tok.decode(ids)], "stop")]).choices[0].message
        assert message.reasoning_content and re.fullmatch(regex, message.content), message
