"""`serve run` of configs/local.yaml with the `tiny` preset (the real CLI, in a subprocess) answers
OpenAI requests: the plumbing, fast (tests/test_readme.py serves the file as it is, SmolLM2).

Through httpx and the official `openai` client, streaming and not; greedy output over HTTP equals
LLMEngine.generate on the same prompt. The Ray cluster under it is a 1-node LocalCluster so the
test controls its size; `serve run` connects to it with --address.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from chunkserve.cluster.loadtest.stack import start_server
from chunkserve.cluster.local import LocalCluster, NodeSpec
from chunkserve.cluster.protocol import ChatCompletionRequest
from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from tests.serve_cluster import wait_until_serving

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "local.yaml"
SERVE = Path(sys.executable).parent / "serve"
PROMPT = "The quick brown fox"
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
STARTUP_S = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """-> (base URL, the config's AppConfig args) of a running `serve run` of configs/local.yaml
    serving `tiny`, with the hermes tool-call parser (tiny's template writes <tool_call> blocks)."""
    config = yaml.safe_load(CONFIG.read_text())
    config["applications"][0]["args"].update(model=MODEL, tool_call_parser="hermes")
    path = tmp_path_factory.mktemp("config") / "local-tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    host, port = config["http_options"]["host"], config["http_options"]["port"]
    with socket.socket() as s:
        if s.connect_ex((host, port)) == 0:
            pytest.fail(f"{host}:{port} is taken; configs/local.yaml serves there")
    base = f"http://{host}:{port}"
    log_path = tmp_path_factory.mktemp("serve") / "serve-run.log"
    with (
        LocalCluster(num_nodes=1, node=NodeSpec(cpus=2, object_store_bytes=100 * 2**20)) as cluster,
        open(log_path, "w") as log,
    ):
        # (SIGINT at its default: serve run stops on it even where this test's SIGINT is ignored)
        proc = start_server([str(SERVE), "run", "--address", cluster.address, str(path)], log, cwd=REPO)
        try:
            wait_until_serving(base, STARTUP_S, proc, log_path)
            yield base, config["applications"][0]["args"]
        finally:
            proc.send_signal(signal.SIGINT)  # serve run shuts Serve down on Ctrl-C
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def engine(server):
    """The engine a replica runs, in this process: same preset, seed and chunk size."""
    _, args = server
    return LLMEngine.from_model(
        args["model"], device="cpu", chunk_size=args["engine"]["chunk_size"], kv_cache_tokens=4096
    )


@pytest.fixture(scope="module")
def client(server):
    base, args = server
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=120)


GREEDY = {"max_tokens": 24, "temperature": 0}


def _sse(base: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_completion_greedy_equals_engine(server, engine):
    base, args = server
    r = httpx.post(
        f"{base}/v1/completions",
        timeout=120,
        json={"model": args["model"], "prompt": PROMPT, "return_token_ids": True, **GREEDY},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    prompt_ids = engine.tokenizer.encode(PROMPT)
    expected = engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0))[0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected
    assert choice["text"] == engine.tokenizer.decode(expected)
    assert choice["finish_reason"] in ("stop", "length")
    assert body["object"] == "text_completion" and body["model"] == args["model"]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(expected)


def test_completion_stream_matches_non_stream(server):
    base, _ = server
    whole = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "model": MODEL, **GREEDY}, timeout=120).json()
    events = _sse(
        base,
        "/v1/completions",
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}, "model": MODEL, **GREEDY},
    )
    *chunks, usage = events
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_chat_greedy_equals_engine(server, engine):
    base, _ = server
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = httpx.post(
        f"{base}/v1/chat/completions",
        timeout=120,
        json={"messages": messages, "return_token_ids": True, "model": MODEL, **GREEDY},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    tok = engine.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    expected = engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0))[0]
    assert body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == prompt_ids
    assert body["choices"][0]["token_ids"] == expected
    assert body["choices"][0]["message"] == {"role": "assistant", "content": tok.decode(expected)}

    events = _sse(base, "/v1/chat/completions", {"messages": messages, "stream": True, "model": MODEL, **GREEDY})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == tok.decode(expected)
    assert events[-1]["choices"][0]["finish_reason"] == body["choices"][0]["finish_reason"]


def test_openai_client_completions(server, client, engine):
    _, args = server
    assert [m.id for m in client.models.list().data] == [args["model"]]
    whole = client.completions.create(model=args["model"], prompt=PROMPT, **GREEDY)
    # the greedy text is what the engine makes of the prompt (the replica's preset, seed and chunk size)
    greedy = engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(**GREEDY))[0]
    assert whole.choices[0].text == engine.tokenizer.decode(greedy)
    assert whole.usage.completion_tokens == len(greedy)
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = client.completions.create(model=args["model"], prompt=PROMPT, stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_openai_client_chat(server, client):
    _, args = server
    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(model=args["model"], messages=messages, **GREEDY)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(
        client.chat.completions.create(
            model=args["model"], messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_openai_client_errors(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=server[1]["model"], prompt=PROMPT, max_tokens=2, n=17)


def test_openai_client_penalties_and_logit_bias(server, client, engine):
    # OpenAI's presence / frequency penalties and logit_bias through the openai client: the
    # replica's tokens are the engine's with the same params; a bias past the vocabulary is a 400
    _, args = server
    prompt_ids = engine.tokenizer.encode(PROMPT)
    penalized = dict(presence_penalty=1.5, frequency_penalty=0.5, logit_bias={"65": 3.0})
    r = client.completions.create(
        model=args["model"], prompt=PROMPT, **GREEDY, **penalized, extra_body={"return_token_ids": True}
    )
    expected = engine.generate(
        [prompt_ids],
        SamplingParams(max_tokens=24, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={65: 3.0}),
    )[0]
    assert r.choices[0].token_ids == expected
    assert expected != engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0))[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=2, logit_bias={"999999": 1})
    assert "logit_bias" in str(e.value)
    # vLLM's min_tokens: EOS biased to certainty still gives min_tokens + 1 tokens; more than max_tokens: 400
    eos = engine.model_config.eos_token_ids[0]
    r = client.completions.create(
        model=args["model"],
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"min_tokens": 6, "return_token_ids": True},
    )
    assert (
        len(r.choices[0].token_ids) == 7 and r.choices[0].token_ids[-1] == eos and r.choices[0].finish_reason == "stop"
    )
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=4, extra_body={"min_tokens": 5})
    assert "min_tokens" in str(e.value)


def test_n_choices_are_the_engines_draws_with_seeds_seed_plus_i(server, client, engine):
    # n = 3: choice i is what the engine draws with seed 7 + i; usage counts the prompt once and
    # every choice's tokens; streamed, each choice's text is the same, chunk indices saying which
    _, args = server
    prompt_ids = engine.tokenizer.encode(PROMPT)
    sampled = {"max_tokens": 12, "temperature": 0.9, "seed": 7}
    whole = client.completions.create(
        model=args["model"], prompt=PROMPT, n=3, **sampled, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in whole.choices] == [0, 1, 2]
    want = [
        engine.generate([prompt_ids], SamplingParams(max_tokens=12, temperature=0.9, seed=7 + i))[0] for i in range(3)
    ]
    assert [c.token_ids for c in whole.choices] == want and len({tuple(w) for w in want}) == 3
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == sum(len(w) for w in want)
    texts = ["", "", ""]
    for chunk in client.completions.create(model=args["model"], prompt=PROMPT, n=3, stream=True, **sampled):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]
    chat = client.chat.completions.create(
        model=args["model"], messages=[{"role": "user", "content": "Hi"}], n=2, **sampled
    )
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.role == "assistant" for c in chat.choices)
    # unseeded choices draw apart (each gets a random seed: on two replicas the engines' own keys
    # could coincide)
    unseeded = client.completions.create(model=args["model"], prompt=PROMPT, n=3, max_tokens=12, temperature=0.9)
    assert len({c.text for c in unseeded.choices}) >= 2


def _engine_logprobs(engine, prompt_ids, params):
    """The engine's tokens for prompt_ids and each token's logprob entry (RequestOutput.logprobs)."""
    rid = f"logprobs-{len(prompt_ids)}-{params.logprobs}"
    engine.add_request(rid, prompt_ids, params)
    tokens, entries = [], []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                entries += out.logprobs
    return tokens, entries


def test_openai_client_logprobs(server, client, engine):
    # completions' logprobs=k and chat's logprobs / top_logprobs: each token's logprob under the
    # model and the k most likely tokens', the engine's; streamed as in the whole response
    _, args = server
    prompt_ids = engine.tokenizer.encode(PROMPT)
    tokens, entries = _engine_logprobs(engine, prompt_ids, SamplingParams(max_tokens=8, temperature=0, logprobs=2))
    r = client.completions.create(
        model=args["model"],
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.token_ids == tokens
    lp = choice.logprobs
    assert lp.token_logprobs == pytest.approx([e[0] for e in entries], abs=1e-4)
    texts = [engine.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp.tokens == texts
    # each token's first character in the text, which holds no special token's (skip_special_tokens)
    shown = [0 if t in engine.tokenizer.special_ids else len(text) for t, text in zip(tokens, texts)]
    assert lp.text_offset == [sum(shown[:i]) for i in range(len(texts))]
    for top, (drawn, best) in zip(lp.top_logprobs, entries, strict=True):
        assert len(best) == 2 and drawn == pytest.approx(best[0][1])  # greedy: the drawn token is the likeliest
        want = {}
        for t, v in best:  # (tokens that decode alike: the likeliest keeps the key)
            want.setdefault(engine.tokenizer.decode([t], skip_special_tokens=False), v)
        assert top.keys() == want.keys() and list(top.values()) == pytest.approx(list(want.values()), abs=1e-4)
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=args["model"], prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, stream=True
        )
        if c.choices
    ]
    assert [t for s in streamed if s for t in s.tokens] == lp.tokens
    assert [o for s in streamed if s for o in s.text_offset] == lp.text_offset
    assert [v for s in streamed if s for v in s.token_logprobs] == pytest.approx(lp.token_logprobs)
    # without logprobs: none
    assert client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=2).choices[0].logprobs is None
    # a token that is a byte of a multi-byte character (0xE2, drawn by a bias) is "\ufffd" in both
    # forms, and a special token drawn (skipped in the text) counts no characters of text_offset
    forced = dict(max_tokens=3, temperature=0, logit_bias={"226": 100}, extra_body={"ignore_eos": True})
    byte = client.completions.create(model=args["model"], prompt=PROMPT, logprobs=0, **forced).choices[0].logprobs
    chat = (
        client.chat.completions.create(
            model=args["model"], messages=[{"role": "user", "content": "Hi"}], logprobs=True, **forced
        )
        .choices[0]
        .logprobs.content
    )
    assert byte.tokens == [c.token for c in chat] == ["\ufffd"] * 3 and byte.text_offset == [0, 1, 2]
    eos = engine.model_config.eos_token_ids[0]
    ended = client.completions.create(
        model=args["model"],
        prompt=PROMPT,
        logprobs=0,
        max_tokens=3,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert ended.text == "" and ended.logprobs.tokens == ["<|eos|>"] * 3 and ended.logprobs.text_offset == [0, 0, 0]

    messages = [{"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(
        model=args["model"], messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content or any(
        "\ufffd" in c.token for c in content
    )  # (a byte of a multi-byte character decodes alone to U+FFFD)
    for c in content:
        assert len(c.top_logprobs) == 3 and c.logprob == pytest.approx(c.top_logprobs[0].logprob)
        assert c.bytes == list(c.token.encode()) and c.logprob <= 0
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
    bare = client.chat.completions.create(
        model=args["model"], messages=messages, max_tokens=3, temperature=0, logprobs=True
    )
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model=args["model"], messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
    )
    assert [c.token for k in stream if k.choices and k.choices[0].logprobs for c in k.choices[0].logprobs.content] == [
        c.token for c in content
    ]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=args["model"], messages=messages, max_tokens=2, top_logprobs=2)
    assert "top_logprobs" in str(e.value)
    for bad in (dict(logprobs=21), dict(logprobs=2, best_of=3)):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=2, **bad)


def test_openai_client_echo_and_prompt_logprobs(server, client, engine):
    # completions' echo: the prompt before the completion; with logprobs (lm-eval-harness's
    # loglikelihood request: echo, logprobs=1, max_tokens=1) the prompt tokens' logprobs too,
    # the first null, each the engine's
    _, args = server
    prompt_ids = engine.tokenizer.encode(PROMPT)
    plain = client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=args["model"], prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=args["model"], prompt=PROMPT, max_tokens=4, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == echoed.choices[0].text
    by_ids = client.completions.create(model=args["model"], prompt=prompt_ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == engine.tokenizer.decode(prompt_ids) + plain.choices[0].text  # the ids decoded

    rid = "echo-logprobs"
    engine.add_request(rid, prompt_ids, SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1))
    first = next(o for _ in range(100) for o in engine.step() if o.request_id == rid)
    r = client.completions.create(
        model=args["model"], prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    lp = r.choices[0].logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:n] == [engine.tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    want = [e[0] for e in first.prompt_logprobs[1:]] + [first.logprobs[0][0]]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    # text_offset: each token's first character in the returned text, which does not hold the BOS
    # the tokenizer added (its offset is where the text starts, and it adds no characters)
    text = r.choices[0].text
    assert text.startswith(PROMPT) and prompt_ids[0] == engine.tokenizer.bos_token_id and lp.tokens[0] == "<|bos|>"
    assert lp.text_offset == [0] + [sum(map(len, lp.tokens[1:i])) for i in range(1, n + 1)]
    assert all(text[o:].startswith(t) for o, t in zip(lp.text_offset[1:], lp.tokens[1:]))
    # the same of an echoed token id prompt (its echo decoded without special tokens) and streamed
    by_ids = client.completions.create(
        model=args["model"], prompt=prompt_ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    ).choices[0]
    assert by_ids.text == text and by_ids.logprobs.text_offset == lp.text_offset
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=args["model"], prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1, stream=True
        )
        if c.choices
    ]
    assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


def test_tokenize_and_detokenize(server, client, engine):
    # vLLM's /tokenize and /detokenize: the ids the completions and chat endpoints use, and back
    base, args = server
    r = httpx.post(f"{base}/tokenize", json={"model": args["model"], "prompt": PROMPT}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == engine.tokenizer.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == engine.max_model_len
    bare = httpx.post(f"{base}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=60).json()
    assert bare["tokens"] == engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hi there"}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}, timeout=60).json()
    used = client.chat.completions.create(model=args["model"], messages=messages, max_tokens=1)
    assert chat["count"] == used.usage.prompt_tokens
    r = httpx.post(f"{base}/detokenize", json={"tokens": body["tokens"]}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    for path, bad, param in (
        ("/tokenize", {"prompt": "x", "messages": messages}, None),
        ("/tokenize", {}, None),
        ("/detokenize", {"tokens": [1, 10**7]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"model": "other", "prompt": "x"}, "model"),
    ):
        r = httpx.post(f"{base}{path}", json=bad, timeout=60)
        assert r.status_code in (400, 404), (path, bad, r.text)
        assert param is None or r.json()["error"]["param"] == param


def test_openai_client_batched_prompts(server, client, engine):
    # a list of prompts (as lm-eval-harness batches them): choice p * n + i is prompt p's i-th;
    # usage counts each prompt once and every completion; streamed per index as in the whole
    _, args = server
    prompts = [PROMPT, "Hello there", "x"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    sampled = {"max_tokens": 6, "temperature": 0.9, "seed": 11}
    r = client.completions.create(
        model=args["model"], prompt=prompts, n=2, **sampled, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in r.choices] == list(range(6))
    want = [
        engine.generate([p], SamplingParams(max_tokens=6, temperature=0.9, seed=11 + i))[0]
        for p in ids
        for i in range(2)
    ]
    assert [c.token_ids for c in r.choices] == want
    assert [c.prompt_token_ids for c in r.choices] == [p for p in ids for _ in range(2)]
    assert r.usage.prompt_tokens == sum(map(len, ids)) and r.usage.completion_tokens == sum(map(len, want))
    texts = [""] * 6
    for chunk in client.completions.create(model=args["model"], prompt=prompts, n=2, stream=True, **sampled):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    by_ids = client.completions.create(model=args["model"], prompt=ids, max_tokens=4, temperature=0, echo=True)
    for c, text in zip(by_ids.choices, prompts, strict=True):
        assert c.text.startswith(text)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=args["model"], prompt=["a"] * 200, n=2, max_tokens=1)
    assert "256" in str(e.value)


def test_openai_client_structured_outputs(server, client, engine):
    # OpenAI's response_format and vLLM's guided_* through the openai client: the replica's tokens
    # are the engine's under the same guide, the text follows it, streams equal the whole; a
    # schema, regex or grammar that does not parse, or two guides at once, is a 400 naming it
    _, args = server
    model = args["model"]
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"type": "boolean"}},
        "required": ["color", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Pick a color"}]
    chat = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=200,
        temperature=0,
        response_format=fmt,
        extra_body={"return_token_ids": True},
    )
    obj = json.loads(chat.choices[0].message.content)
    assert obj["color"] in ("red", "green", "blue") and type(obj["n"]) is bool and set(obj) == {"color", "n"}
    assert chat.choices[0].finish_reason == "stop"
    prompt_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = engine.generate(
        [prompt_ids], SamplingParams(max_tokens=200, temperature=0, guided=Guide("json", json.dumps(schema)))
    )[0]
    assert chat.choices[0].token_ids == want
    streamed = client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0, response_format=fmt, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == chat.choices[0].message.content

    for extra, check in (
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2}", t)),
        ({"structured_outputs": {"grammar": 'root ::= "a" [0-9] | "b"'}}, lambda t: re.fullmatch(r"a[0-9]|b", t)),
    ):
        r = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=32, temperature=0.9, seed=3, n=2, extra_body=extra
        )
        assert all(check(c.text) and c.finish_reason == "stop" for c in r.choices), (extra, r.choices)

    for extra, param in (
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, None),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "two"}},
            },
        )
    assert e.value.body["param"] == "response_format"
    # the replica still serves
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=2).choices[0].finish_reason == "length"


def test_openai_client_tool_calls(server, client, engine):
    # tools through the openai client: `required` and a named function give calls that follow the
    # tool's schema (the replica's tokens the engine's under the same guide), their streamed
    # deltas add up to the whole; `auto` (the hermes parser) over a conversation holding
    # a call and its result gives the random model's greedy text as content; bad tool requests
    # are 400s and the replica serves on
    _, args = server
    model = args["model"]
    weather = {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "unit"],
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    bias = {ord(c): -2.0 for c in " \n\t\r"}  # whitespace less likely (see tests/test_guided.py's BIASES)
    base = dict(
        model=model,
        messages=messages,
        tools=tools,
        max_tokens=300,
        temperature=0,
        logit_bias={str(t): b for t, b in bias.items()},
    )
    prompt_ids = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, tools=tools), add_special_tokens=False
    )

    def follows(call) -> bool:
        args = json.loads(call.function.arguments)
        return call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in "CF"

    def streamed_calls(**extra) -> tuple[list[tuple[str, str]], str | None]:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(**base, **extra, stream=True):
            delta = chunk.choices[0].delta
            assert not delta.content
            for c in delta.tool_calls or ():
                if c.id is not None:
                    calls[c.index] = [c.function.name, ""]
                calls[c.index][1] += c.function.arguments
            finish = chunk.choices[0].finish_reason or finish
        return [tuple(calls[i]) for i in sorted(calls)], finish

    for choice, finish in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ):
        r = client.chat.completions.create(
            **base, tool_choice=choice, parallel_tool_calls=False, extra_body={"return_token_ids": True}
        )
        message = r.choices[0].message
        assert r.choices[0].finish_reason == finish and message.content is None and len(message.tool_calls) == 1
        assert follows(message.tool_calls[0]) and message.tool_calls[0].id.startswith("call_"), message
        guide = ChatCompletionRequest.model_validate(
            {"messages": messages, "tools": tools, "tool_choice": choice, "parallel_tool_calls": False, "model": MODEL}
        ).guide
        want = engine.generate(
            [prompt_ids], SamplingParams(max_tokens=300, temperature=0, guided=guide, logit_bias=bias)
        )[0]
        assert r.choices[0].token_ids == want
        calls, stream_finish = streamed_calls(tool_choice=choice, parallel_tool_calls=False)
        assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert stream_finish == finish

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
    }
    talk = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
    ]
    auto = client.chat.completions.create(model=model, messages=talk, tools=tools, max_tokens=16, temperature=0)
    # as the template takes them: content text, a call's arguments an object
    parsed = {**call, "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}}
    rendered = engine.tokenizer.apply_chat_template(
        [messages[0], {"role": "assistant", "content": "", "tool_calls": [parsed]}, talk[2]], tools=tools
    )
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}</tool_call>' in rendered
    want = engine.generate(
        [engine.tokenizer.encode(rendered, add_special_tokens=False)], SamplingParams(max_tokens=16, temperature=0)
    )[0]
    assert not auto.choices[0].message.tool_calls and auto.choices[0].message.content == engine.tokenizer.decode(want)

    unparsable = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "minProperties": "two"}}}
    ]
    for extra, param in (
        ({"tool_choice": {"type": "function", "function": {"name": "fly"}}}, None),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, None),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        ({"tools": unparsable, "tool_choice": "required"}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**base, **extra})
        assert e.value.body["param"] == param, e.value.body
    assert client.chat.completions.create(model=model, messages=messages, max_tokens=2).choices[0].finish_reason
