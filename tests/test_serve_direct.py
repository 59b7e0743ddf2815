"""Direct streams on a local Ray cluster, real HTTP (router.direct_stream, chunkserve/replicas/direct_stream.py).

App "direct" (one tiny replica, `router.direct_stream: true`) and app "serve" (the same without): once the replica's routing stats publish its address, the
ingress's requests go on its own connection to the replica (the replica counts them), with the
tokens, text and usage the Serve path gives, streamed or whole, n choices included, and the
router's prediction of the cached tokens; a replica
holding max_ongoing_requests already passes the rest to Serve's queue; a client that goes away
mid-stream aborts its sequence in the engine.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.cluster.ingress import PREDICTED_HEADER
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

BASE = {
    "model": "tiny",
    "device": "cpu",
    "num_replicas": 1,
    "num_cpus_per_replica": 0.5,
    "max_ongoing_requests": 4,
    "engine": {"kv_cache_tokens": 8192, "max_model_len": 1024},
    "router": {"routing_stats_period_s": 0.2, "direct_stream": True},
}
TIMEOUT = httpx.Timeout(300.0)
PROMPT = "the direct stream carries " * 6


@pytest.fixture(scope="module")
def apps():
    with serve_on_local_cluster(num_nodes=1) as url:
        serve.run(build_app(BASE), name="direct", route_prefix="/d")
        serve.run(
            build_app({**BASE, "router": {**BASE["router"], "direct_stream": False}}), name="serve", route_prefix="/s"
        )
        yield (
            url,
            serve.get_deployment_handle("LLMReplica", app_name="direct"),
            serve.get_deployment_handle("LLMReplica", app_name="serve"),
        )


def _direct(handle) -> int:
    return handle.record_routing_stats.remote().result(timeout_s=60)["metrics"]["counters"]["direct_requests"]


def _body(i: int, **over) -> dict:
    return {"model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 12, "temperature": 0, "ignore_eos": True, **over}


def _until_direct(url: str, handle) -> None:
    """Requests until one goes direct (the router starts with the first, the address comes with
    the routing stats after it)."""
    deadline = time.monotonic() + 60
    while _direct(handle) == 0:
        assert time.monotonic() < deadline, "no request went on a direct stream in 60 s"
        r = httpx.post(f"{url}/d/v1/completions", json=_body(-1, max_tokens=2), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        time.sleep(0.2)


async def _completions(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    r = await client.post(url, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def _streamed(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, list[int], dict]:
    text, ids, usage = "", [], None
    async with client.stream(
        "POST", url, json={**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                text += c["text"]
                ids += c.get("token_ids") or []
    return text, ids, usage


def test_direct_requests_answer_as_the_serve_path(apps):
    url, direct, through_serve = apps
    _until_direct(url, direct)
    before = _direct(direct)

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            bodies = [_body(i, n=1 + i % 2) for i in range(6)]
            # one at a time: within the replica's room (max_ongoing_requests 4), so all go direct
            d = [await _completions(client, f"{url}/d/v1/completions", b) for b in bodies]
            s = await asyncio.gather(*(_completions(client, f"{url}/s/v1/completions", b) for b in bodies))
            streamed = [await _streamed(client, f"{url}/d/v1/completions", _body(i)) for i in range(3)]
            whole = [
                await _completions(client, f"{url}/s/v1/completions", {**_body(i), "return_token_ids": True})
                for i in range(3)
            ]
        return d, s, streamed, whole

    d, s, streamed, whole = asyncio.run(run())
    for a, b in zip(d, s, strict=True):
        assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
        # (cached_tokens differ: the two apps' caches hold different requests)
        assert [a["usage"][k] for k in ("prompt_tokens", "completion_tokens")] == [
            b["usage"][k] for k in ("prompt_tokens", "completion_tokens")
        ]
    for (text, ids, usage), w in zip(streamed, whole, strict=True):
        assert text == w["choices"][0]["text"] and ids == w["choices"][0]["token_ids"] and len(ids) == 12
        assert usage["completion_tokens"] == w["usage"]["completion_tokens"] == 12
    # every choice of every request above went direct (3 streamed + 6 requests of 1 or 2 choices)
    assert _direct(direct) - before == 3 + sum(1 + i % 2 for i in range(6))
    assert _direct(through_serve) == 0


def test_a_direct_request_carries_its_routers_prediction(apps):
    # route_direct records the prediction as Serve's on_request_routed does: the second of two
    # equal prompts is predicted (the router's own record of the first) as the replica counts it
    url, direct, _ = apps
    _until_direct(url, direct)
    before = _direct(direct)
    answers = [httpx.post(f"{url}/d/v1/completions", json=_body(100), timeout=TIMEOUT) for _ in range(2)]
    assert _direct(direct) - before == 2
    for r in answers:
        assert r.status_code == 200, r.text
    predicted = [int(r.headers[PREDICTED_HEADER]) for r in answers]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in answers]
    assert predicted[1] == cached[1] > 0 and predicted[0] <= predicted[1]


def test_a_full_replica_passes_requests_to_serve(apps):
    url, direct, _ = apps
    _until_direct(url, direct)
    before = _direct(direct)
    room, more = BASE["max_ongoing_requests"], 8

    async def run():
        # `room` long streams fill the replica (each has its first chunk), then `more` requests
        # come while they run: the replica answers those `full`. (Twelve sent at once did not
        # always fill it on a loaded 2-core CPU: the ingress let them in a few at a time.)
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            first = [asyncio.Event() for _ in range(room)]

            async def long(i: int) -> int:
                body = {**_body(100 + i, max_tokens=400), "stream": True}
                tokens = 0
                async with client.stream("POST", f"{url}/d/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            first[i].set()
                            tokens += len(json.loads(line[6:])["choices"][0]["text"])
                return tokens

            holding = [asyncio.create_task(long(i)) for i in range(room)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)
            outs = await asyncio.gather(
                *(_completions(client, f"{url}/d/v1/completions", _body(i, max_tokens=24)) for i in range(more))
            )
            return outs, await asyncio.gather(*holding)

    outs, long_chars = asyncio.run(run())
    assert all(o["usage"]["completion_tokens"] == 24 for o in outs) and all(c > 0 for c in long_chars)
    took = _direct(direct) - before
    assert room <= took < room + more  # the long ones direct, those past the replica's room through Serve
    # and the engine never held more than max_ongoing_requests of them (Serve's calls past the
    # replica's bound waited in it: Serve counts only its own calls)
    assert direct.stats.remote().result(timeout_s=60)["max_decode_batch"] <= BASE["max_ongoing_requests"]


def test_a_client_leaving_mid_stream_aborts_in_the_engine(apps):
    url, direct, _ = apps
    _until_direct(url, direct)
    before = _direct(direct)
    generated = direct.stats.remote().result(timeout_s=60)["generated_tokens"]

    async def run():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            body = {**_body(0, max_tokens=800), "stream": True}
            async with client.stream("POST", f"{url}/d/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk, then the client goes

    asyncio.run(run())
    assert _direct(direct) - before == 1
    deadline = time.monotonic() + 60
    while True:  # the sequence is aborted, not run to its 800 tokens
        stats = direct.stats.remote().result(timeout_s=60)
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    assert stats["generated_tokens"] - generated < 800
