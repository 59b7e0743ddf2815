"""The Serve application on a 3-node local Ray cluster (chunkserve/cluster/local.py), real HTTP.

App "one" (one LLMReplica, API key, small body limit) shows batching across HTTP requests, prefix
caching, every error path, overload and disconnects; app "spread" shows 3 replicas on >= 2 nodes;
app "tp" a replica of two tensor-parallel ranks.
Tests run in file order: the batching test comes first so its batch is the first one counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from ray import serve
from ray.util.state import list_actors

from chunkserve.cluster.app import build_app
from chunkserve.cluster.ingress import REPLICA_HEADER
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 1024
MAX_ONGOING = 16
MAX_QUEUED = 16  # a burst of MAX_ONGOING requests is queued at the ingress until they are assigned
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
ONE = {
    "model": MODEL,
    "device": "cpu",
    "num_replicas": 1,
    "max_ongoing_requests": MAX_ONGOING,
    "max_queued_requests": MAX_QUEUED,
    "retry_after_s": 3,
    "api_key": KEY,
    "max_request_bytes": 32 * 1024,
    # scheduled asynchronously (not the CPU's default): streams, stop strings, disconnects and
    # overload through a replica whose engine returns each step's tokens a step later; warmed up
    # before it serves (not the CPU's default either)
    "engine": {"kv_cache_tokens": 16384, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 32, "async_scheduling": True},
    "warmup": True,
    "reasoning_parser": "qwen3",  # (the tiny model never opens with <think>: all of its text is content)
}
TIMEOUT = httpx.Timeout(300.0)


@pytest.fixture(scope="module")
def cluster():
    # the dashboard serves ray.util.state, which tells on which node each replica runs
    with serve_on_local_cluster(num_nodes=3, include_dashboard=True) as url:
        yield url


@pytest.fixture(scope="module")
def one(cluster):
    serve.run(build_app(ONE), name="one", route_prefix="/one")
    return f"{cluster}/one", serve.get_deployment_handle("LLMReplica", app_name="one")


def _stats(handle) -> dict:
    return handle.stats.remote().result(timeout_s=60)


def _wait_for(handle, done, what: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = _stats(handle)
        if done(s):
            return s
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {s}"
        time.sleep(0.2)


async def _until(done) -> None:
    while not done():
        await asyncio.sleep(0.01)


def _completion(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)


async def _stream(client: httpx.AsyncClient, url: str, **body) -> list[dict]:
    """-> the JSON events of one SSE completion stream, checked to end with [DONE]."""
    body = {"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True, **body}
    events = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_concurrent_streams_share_decode_batches(one):
    url, handle = one
    s = _stats(handle)
    assert s["max_decode_batch"] == s["finished_requests"] == 0  # the warmup's requests are not counted
    assert s["kv_chunks_cached"] > 0  # but it ran: its chunks are in the prefix cache

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(
                *(
                    _stream(client, url, prompt=f"request {i}:", max_tokens=48, stream_options={"include_usage": True})
                    for i in range(16)
                )
            )

    for events in asyncio.run(main()):
        *chunks, usage = events
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 48
    s = _wait_for(handle, lambda s: s["running"] == 0, "the replica to go idle")
    assert s["max_decode_batch"] > 1
    assert s["finished_requests"] == 16 and s["generated_tokens"] == 16 * 48


def test_shared_prefix_is_served_from_cache(one):
    url, handle = one
    prefix = [(7 * i + 3) % 256 for i in range(256)]
    first = _completion(url, prompt=prefix + [10], max_tokens=4)
    second = _completion(url, prompt=prefix + [11], max_tokens=4)
    assert first.status_code == second.status_code == 200
    usage = second.json()["usage"]
    assert usage["prompt_tokens"] == 257
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 192
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # the replica publishes the prefix in its routing events, hashed as the router hashes prompts
    from chunkserve.router.hashing import chunk_hashes
    from chunkserve.router.index import PrefixIndex

    want = set(chunk_hashes(prefix + [10], 64, 32, "tiny"))
    index = PrefixIndex()  # followed as a router follows them (this caller's polls beside Serve's)
    deadline = time.monotonic() + 60
    while True:
        routing = handle.record_routing_stats.remote().result(timeout_s=60)
        if index.apply_events("r", routing["events"], 0.0) and want <= index.published("r"):
            break
        assert time.monotonic() < deadline, f"the events never held the prefix: {routing}"
        time.sleep(0.3)
    assert routing["as_of"] > 0 and routing["kv_chunks_total"] > 0


BAD = [  # (id, body bytes or JSON, headers, status, error code)
    ("malformed-json", b'{"prompt": "x", ', AUTH, 400, "invalid_json"),
    ("wrong-type", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, AUTH, 400, None),
    ("prompt-missing", {"model": MODEL, "max_tokens": 5}, AUTH, 400, None),
    ("model-missing", {"prompt": "x"}, AUTH, 400, None),  # as OpenAI's API: `model` is required
    ("max-tokens-0", {"model": MODEL, "prompt": "x", "max_tokens": 0}, AUTH, 400, None),
    ("temperature-3", {"model": MODEL, "prompt": "x", "temperature": 3}, AUTH, 400, None),
    ("top-p-0", {"model": MODEL, "prompt": "x", "top_p": 0}, AUTH, 400, None),
    ("n-17", {"model": MODEL, "prompt": "x", "n": 17}, AUTH, 400, None),
    ("token-out-of-vocab", {"model": MODEL, "prompt": [1, 2, 100000]}, AUTH, 400, None),
    ("unknown-model", {"prompt": "x", "model": "gpt-5"}, AUTH, 404, "model_not_found"),
    ("too-long", {"model": MODEL, "prompt": [1] * 1000, "max_tokens": 100}, AUTH, 400, "context_length_exceeded"),
    ("prompt-fills-context", {"model": MODEL, "prompt": [1] * MAX_MODEL_LEN}, AUTH, 400, "context_length_exceeded"),
    ("no-key", {"model": MODEL, "prompt": "x"}, {}, 401, "invalid_api_key"),
    ("wrong-key", {"model": MODEL, "prompt": "x"}, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    ("too-large", {"model": MODEL, "prompt": "x" * 40000}, AUTH, 413, "request_too_large"),
    ("nested-too-deep", b"[" * 20000, AUTH, 400, "invalid_json"),  # parsed off the event loop (> 16 KB)
    # validated off the loop too
    ("big-body-bad-field", {"model": MODEL, "prompt": "x" * 20000, "top_p": 2}, AUTH, 400, None),
    ("too-many-stops", {"model": MODEL, "prompt": "x", "stop": ["s"] * 65}, AUTH, 400, None),
]


@pytest.mark.parametrize("body, headers, status, code", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_gets_openai_error_and_replica_survives(one, body, headers, status, code):
    url, handle = one
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{url}/v1/completions",
        content=content,
        timeout=TIMEOUT,
        headers={"Content-Type": "application/json", **headers},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code
    ok = _completion(url)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_requests_that_once_broke_the_replica_or_the_api(one):
    """A temperature of 1e-40 (greedy now: logits / T overflowed and the replica's step loop died
    with every request in it); null for fields with defaults, as openai-python sends None; a text
    prompt long enough to be tokenized off the event loop."""
    url, _ = one
    greedy = _completion(url, max_tokens=4, ignore_eos=True).json()["choices"][0]["text"]
    tiny = _completion(url, max_tokens=4, ignore_eos=True, temperature=1e-40)
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy
    nulls = _completion(
        url, max_tokens=4, ignore_eos=True, temperature=None, top_p=None, n=None, stream=None, stop=None, seed=None
    )
    assert nulls.status_code == 200, nulls.text  # temperature null is 1.0: sampled, so no text to compare
    long = _completion(url, prompt="ab" * 9000, max_tokens=1)  # 18000 characters (byte tokenizer: 18000 ids)
    assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
    assert _completion(url).status_code == 200


def test_ready_and_health_need_no_key(one):
    # probes carry no API key; the replica warmed up before Serve ran it, so /ready says ready
    url, _ = one
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
    r = httpx.get(f"{url}/ready", timeout=TIMEOUT)
    assert r.status_code == 200 and r.json() == {"ready": True, "model_replicas": {"RUNNING": 1}}, r.text


def test_unknown_routes_and_methods_get_openai_errors(one):
    url, _ = one
    for method, path, status in (
        ("GET", "/v1/nonexistent", 404),
        ("POST", "/v1/models", 405),
        ("GET", "/v1/completions", 405),
    ):
        r = httpx.request(method, f"{url}{path}", headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == status, (path, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
    assert r.headers.get("allow")  # a 405 names the methods the route takes


def test_bad_chat_input(one):
    url, _ = one
    for body in (
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
    ):  # without logprobs
        r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    # as in OpenAI's API, a chat without `model` is a 400 naming it (it used to be served)
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "metadata": {"a": "b"}},
    )
    assert r.status_code == 200, r.text  # an OpenAI field we do not use is ignored
    assert set(r.json()["choices"][0]["message"]) == {"role", "content"}  # no reasoning_content: none was split off
    # a guided output is not split: its guide holds the whole of it
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "guided_regex": "<think>[a-z]{3}</think>[a-z]{2}",
        },
    )
    message = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and "reasoning_content" not in message, r.text
    assert message["content"].startswith("<think>") and len(message["content"]) == 20, message
    # tools whose tool_choice is `auto` (the default) on an app with no tool_call_parser (as vLLM)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
            },
        }
    ]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert "tool_call_parser" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/v1/chat/completions",
        headers=AUTH,
        timeout=TIMEOUT,
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": tools,
            "tool_choice": "required",
            "max_tokens": 256,
            "parallel_tool_calls": False,
        },
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"


def test_stop_string_truncates_text(one):
    url, _ = one
    full = _completion(url, max_tokens=40, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[5:8]
    assert len(stop) == 3, full
    cut = _completion(url, max_tokens=40, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]
    # vLLM's include_stop_str_in_output: through the stop string
    cut = _completion(url, max_tokens=40, ignore_eos=True, stop=[stop], include_stop_str_in_output=True).json()
    assert cut["choices"][0]["text"] == full[: full.index(stop) + len(stop)]


def test_special_tokens_in_the_text_on_request(one):
    # vLLM's skip_special_tokens=false: an EOS drawn (biased to certainty, ignore_eos) shows as its text
    url, _ = one
    eos = 257  # the tiny preset's <|eos|>
    body = dict(max_tokens=3, ignore_eos=True, logit_bias={str(eos): 100})
    assert _completion(url, **body).json()["choices"][0]["text"] == ""
    assert _completion(url, **body, skip_special_tokens=False).json()["choices"][0]["text"] == "<|eos|>" * 3


def test_disconnected_stream_frees_its_chunks(one):
    url, handle = one
    generated = _stats(handle)["generated_tokens"]

    async def read_a_little(n: int):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            body = {
                "model": MODEL,
                "prompt": "x" * 50,
                "max_tokens": 960,
                "ignore_eos": True,
                "stream": True,
                "temperature": 0,
                "n": n,
            }
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
                lines = r.aiter_lines()
                for _ in range(3 * n):
                    await anext(lines)
        # leaving the block closes the connection mid-stream

    for n in (1, 3):  # n choices: every one of them is aborted
        asyncio.run(read_a_little(n))
        s = _wait_for(handle, lambda s: s["running"] == 0 and s["kv_chunks_used"] == 0, "the aborted requests' chunks")
        assert s["generated_tokens"] - generated < 960 * n  # they were stopped, not run to the end
        generated = s["generated_tokens"]
        assert _completion(url).status_code == 200


def test_overload_gets_503_with_retry_after(one):
    url, handle = one

    async def hold(client: httpx.AsyncClient, started: asyncio.Queue | None) -> None:
        """A long stream that holds one slot of the replica until cancelled (a disconnect)."""
        body = {"model": MODEL, "prompt": "hold", "max_tokens": MAX_MODEL_LEN - 8, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            async for _ in r.aiter_lines():
                if started is not None:
                    started.put_nowait(None)
                    started = None

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            # MAX_ONGOING streams take every slot of the replica (while they run, even handle
            # calls such as stats() would queue behind them) ...
            started: asyncio.Queue = asyncio.Queue()
            holds = [asyncio.create_task(hold(client, started)) for _ in range(MAX_ONGOING)]
            for _ in holds:
                await started.get()
            # ... so these queue at the ingress (MAX_QUEUED at most) and the rest are refused at once; while
            # the streams hold the replica, nothing queued can finish.
            extra = [
                asyncio.create_task(
                    client.post(
                        f"{url}/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "x", "max_tokens": 2}
                    )
                )
                for _ in range(MAX_QUEUED + 8)
            ]
            done, _ = await asyncio.wait(extra, return_when=asyncio.FIRST_COMPLETED)
            assert not any(task.done() for task in holds)
            assert all(task.result().status_code == 503 for task in done)
            for task in holds:  # disconnect the long streams: their requests are aborted
                task.cancel()
            await asyncio.gather(*holds, return_exceptions=True)
            return await asyncio.gather(*extra)

    responses = asyncio.run(main())
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses)
    assert all(int(r.headers["retry-after"]) == 3 for r in refused)
    assert all(r.json()["error"]["code"] == "overloaded" for r in refused)
    _wait_for(handle, lambda s: s["running"] == 0 and s["kv_chunks_used"] == 0, "the aborted streams' chunks")
    assert _completion(url).status_code == 200


def test_three_replicas_on_three_nodes_all_serve(cluster):
    serve.run(
        build_app(
            {
                "model": "tiny",
                "device": "cpu",
                "num_replicas": 3,
                "engine": {"kv_cache_tokens": 4096, "max_model_len": 1024},
            }
        ),
        name="spread",
        route_prefix="/spread",
    )
    actors = list_actors(filters=[("class_name", "=", "ServeReplica:spread:LLMReplica"), ("state", "=", "ALIVE")])
    assert len(actors) == 3
    node_of = {a.name.rsplit("#", 1)[1]: a.node_id for a in actors}  # SERVE_REPLICA::app#deployment#<replica id>
    assert len(set(node_of.values())) >= 2

    async def main():
        seen: set[str] = set()
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            for _ in range(20):  # waves of concurrent requests until every replica has answered one
                responses = await asyncio.gather(
                    *(
                        client.post(
                            f"{cluster}/spread/v1/completions",
                            json={"model": MODEL, "prompt": f"wave {i}", "max_tokens": 2},
                        )
                        for i in range(6)
                    )
                )
                assert all(r.status_code == 200 for r in responses)
                seen |= {r.headers[REPLICA_HEADER] for r in responses}
                if seen == set(node_of):
                    break
        return seen

    assert asyncio.run(main()) == set(node_of)
    serve.delete("spread")


def _deploy_with_interval(base: str, name: str, interval: float) -> str:
    """One `tiny` replica whose streams send a chunk per `interval` seconds; -> its completions URL."""
    config = {
        "model": "tiny",
        "device": "cpu",
        "num_replicas": 1,
        "stream_interval_ms": interval * 1000,
        "engine": {"kv_cache_tokens": 4096, "max_model_len": 1024},
    }
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    return f"{base}/{name}/v1/completions"


def test_stream_interval_gathers_steps_into_fewer_chunks(cluster):
    # stream_interval_ms: after the first chunk, a stream sends at most one chunk per interval, the
    # steps between gathered into it; the text and token count are those of one chunk per step
    interval = 0.1
    url = _deploy_with_interval(cluster, "gathered", interval)
    body = {"model": MODEL, "prompt": "gather these", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url, json=body, timeout=TIMEOUT).json()["choices"][0]["text"]

    async def main():
        times, texts = [], []
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream(
                "POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[len("data: ") :])
                        if event["choices"]:
                            times.append(time.perf_counter())
                            texts.append(event["choices"][0]["text"])
                        else:
                            usage = event["usage"]
        return times, texts, usage

    times, texts, usage = asyncio.run(main())
    assert "".join(texts) == whole and usage["completion_tokens"] == 300
    assert 4 <= len(texts) < 300 / 3  # steps gathered over several intervals: far fewer chunks than tokens
    # the replica sends at most one chunk per interval (the last may follow its previous at once:
    # the end); a chunk the proxy held up arrives close to the next, so the client's gaps are
    # judged by their median and by the chunks' count over the stream's span (give or take half
    # an interval: the first chunk, which comes with the response's start, can arrive later after
    # its send than the others do)
    gaps = sorted(b - a for a, b in zip(times, times[1:-1]))
    assert gaps and gaps[len(gaps) // 2] > interval * 0.8, gaps
    span = times[-2] - times[0]
    assert len(texts) <= (span + interval / 2) / interval + 2, (len(texts), span)
    serve.delete("gathered")


def test_a_streams_end_is_not_held_for_its_interval(cluster):
    # a 5 s interval over a stream the engine ends in well under a second: the first chunk goes at
    # once, the steps after it are gathered, and the end goes as it comes, not when the interval is
    # up (it held back the last chunk, and every request's E2EL and TPOT with it, by up to an interval)
    interval = 5.0
    url = _deploy_with_interval(cluster, "ends", interval)
    body = {"model": MODEL, "prompt": "end now", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    httpx.post(url, json=body, timeout=TIMEOUT).raise_for_status()  # (warm)

    async def main():
        times = []
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", url, json={**body, "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        times.append(time.perf_counter())
        return times

    times = asyncio.run(main())
    assert 2 <= len(times) <= 3  # the first token, the rest gathered (the finish reason may come apart)
    assert times[-1] - times[0] < interval / 2, times
    serve.delete("ends")


TP = {
    "model": "tiny",
    "device": "cpu",
    "num_replicas": 1,
    "tensor_parallel_size": 2,
    "num_cpus_per_replica": 0.5,
    "engine": {"kv_cache_tokens": 4096, "max_model_len": 1024},
}


def _alive(class_name: str) -> list:
    return list_actors(filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")])


@pytest.fixture(scope="module")
def tp(cluster):
    serve.run(build_app(TP), name="tp", route_prefix="/tp")
    return f"{cluster}/tp"


def test_tensor_parallel_replica_serves_what_one_rank_does(tp):
    """tensor_parallel_size 2 on CPU: the replica starts its second rank as a Ray actor in its
    placement group (both on one node), the ranks run every step together over gloo, and greedy
    output over HTTP, with a shared prefix cached, is one rank's."""
    ranks, replicas = _alive("_TPRank"), _alive("ServeReplica:tp:LLMReplica")
    assert len(ranks) == 1 and len(replicas) == 1 and ranks[0].node_id == replicas[0].node_id

    engine = LLMEngine.from_model("tiny", device="cpu", kv_cache_tokens=4096)
    shared = "You are a terse assistant who answers in one line. " * 3
    prompts = [shared + q for q in ("Name a colour.", "Name a fruit.", "Name a city.")]

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        f"{tp}/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": p,
                            "max_tokens": 12,
                            "temperature": 0,
                            "ignore_eos": True,
                            "return_token_ids": True,
                        },
                    )
                    for p in prompts
                )
            )

    responses = asyncio.run(main())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    want = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == want
    again = _completion(tp, prompt=prompts[0], max_tokens=4)  # the prefix from the tree
    assert again.status_code == 200 and again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128


def test_tensor_parallel_replica_with_a_dead_rank_is_replaced(tp):
    """A rank's process killed: rank 0 would wait in its next collective, so the replica's health
    check pings its ranks and fails; Serve replaces the replica (ranks and all) and it serves
    again. Deleting the app then ends every rank."""
    [rank] = _alive("_TPRank")
    old = _completion(tp).headers[REPLICA_HEADER]
    os.kill(rank.pid, signal.SIGKILL)
    # no requests meanwhile: an idle rank 0 never steps, so only the health check can notice
    deadline = time.monotonic() + 150
    while not [r for r in _alive("_TPRank") if r.pid != rank.pid]:
        assert time.monotonic() < deadline, "the replica with a dead rank was not replaced"
        time.sleep(1)
    while (r := _completion(tp)).status_code != 200:  # the new replica may still be starting
        assert time.monotonic() < deadline and r.status_code == 503, r.text
        time.sleep(1)
    assert r.headers[REPLICA_HEADER] != old
    serve.delete("tp")
    deadline = time.monotonic() + 60
    while _alive("_TPRank"):
        assert time.monotonic() < deadline, "a tensor-parallel rank outlived its replica"
        time.sleep(0.5)


def test_request_past_its_deadline_is_refused_and_the_running_stream_goes_on(cluster):
    # request_deadline_s: a request that has no first output that long after it reached the
    # ingress gets a 503 deadline_exceeded (with Retry-After), its call cancelled; a stream that
    # started is not cut by it, and the replica serves on with nothing left over
    deadline = 2.0
    serve.run(
        build_app(
            {
                "model": "tiny",
                "device": "cpu",
                "num_replicas": 1,
                "max_ongoing_requests": 1,
                "request_deadline_s": deadline,
                "retry_after_s": 3,
                "engine": {"kv_cache_tokens": 8192, "max_model_len": 4096},
            }
        ),
        name="deadline",
        route_prefix="/deadline",
    )
    url = f"{cluster}/deadline"
    handle = serve.get_deployment_handle("LLMReplica", app_name="deadline")

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            started, chunks = asyncio.Event(), []  # (when each chunk of the held stream came)

            async def hold():  # the replica's one slot, for as long as it streams
                # (seconds long)
                body = {"model": MODEL, "prompt": "hold", "max_tokens": 4000, "ignore_eos": True, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            chunks.append(time.perf_counter())
                            started.set()

            holding = asyncio.create_task(hold())
            await started.wait()
            t0 = time.perf_counter()
            late = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
            waited = time.perf_counter() - t0
            seen = len(chunks)
            await asyncio.wait_for(_until(lambda: len(chunks) > seen), 60)  # the stream goes on past the deadline
            assert not holding.done()
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)
            return late, waited, chunks

    late, waited, chunks = asyncio.run(main())
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "deadline_exceeded" and late.headers["retry-after"] == "3"
    assert deadline <= waited < deadline + 5
    _wait_for(
        handle, lambda s: s["running"] == s["waiting"] == 0 and s["kv_chunks_used"] == 0, "the held stream's chunks"
    )
    ok = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=TIMEOUT)
    assert ok.status_code == 200, ok.text
    serve.delete("deadline")
