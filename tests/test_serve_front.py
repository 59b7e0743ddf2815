"""The ingress replicas' own HTTP front (ingress.http_port, chunkserve/cluster/front.py) in a Serve
application on a local Ray cluster: the same API as through Serve's proxy, on a port two ingress
replicas share; streams, disconnects, request ids; a port clash named at deploy."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.replicas.engine.distributed import free_port
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

TIMEOUT = httpx.Timeout(300.0)
KEY = "front-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)


def _app(port: int, **over) -> dict:
    return {
        "model": MODEL,
        "device": "cpu",
        "num_replicas": 1,
        "api_key": KEY,
        "engine": {"kv_cache_tokens": 8192, "max_model_len": 1024, "max_num_seqs": 16},
        "ingress": {"num_replicas": 2, "http_port": port, "header_timeout_s": 2.0},
        **over,
    }


@pytest.fixture(scope="module")
def urls():
    """(through Serve's proxy, through the front), one application."""
    with serve_on_local_cluster(num_nodes=1) as base:
        port = free_port()
        serve.run(build_app(_app(port)), name="front", route_prefix="/front")
        front = f"http://127.0.0.1:{port}"
        # serve.run returned: the ingress replicas run, so their fronts listen already
        assert httpx.get(f"{front}/health", timeout=TIMEOUT).status_code == 200
        yield f"{base}/front", front, serve.get_deployment_handle("LLMReplica", app_name="front")


def _completion(url: str, **body) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)


def test_the_front_serves_what_the_proxy_serves(urls):
    proxy, front, _ = urls
    a, b = _completion(proxy), _completion(front)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert b.json()["usage"] == a.json()["usage"]
    assert httpx.get(f"{front}/v1/models", timeout=TIMEOUT).status_code == 401  # the key still holds
    assert httpx.get(f"{front}/v1/models", headers=AUTH, timeout=TIMEOUT).json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{front}/ready", timeout=TIMEOUT).status_code == 200
    assert httpx.get(f"{front}/nowhere", timeout=TIMEOUT).json()["error"]["type"] == "not_found_error"


def test_request_ids_and_timing_as_through_the_proxy(urls):
    _, front, _ = urls
    r = httpx.post(
        f"{front}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={**AUTH, "x-request-id": "my-request-7"},
        timeout=TIMEOUT,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-request-7"
    assert "replica;dur=" in r.headers["server-timing"]
    bad = httpx.post(
        f"{front}/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": -1},
        headers=AUTH,
        timeout=TIMEOUT,
    )
    assert bad.status_code == 400 and len(bad.headers["x-request-id"]) == 36


def test_streams_over_many_connections_to_two_replicas_sharing_the_port(urls):
    _, front, _ = urls
    status = serve.status().applications["front"].deployments["OpenAIIngress"]
    assert status.replica_states.get("RUNNING") == 2  # both replicas listen on the one port

    async def one(i: int) -> str:
        body = {
            "model": MODEL,
            "prompt": f"story {i}",
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        text = ""
        # a connection each: the kernel spreads them over the replicas sharing the port
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", f"{front}/v1/completions", json=body, headers=AUTH) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    texts = asyncio.run(main())
    assert texts == [
        _completion(front, prompt=f"story {i}", max_tokens=12).json()["choices"][0]["text"] for i in range(16)
    ]


def test_a_disconnect_through_the_front_aborts_the_request(urls):
    _, front, handle = urls
    generated = handle.stats.remote().result(timeout_s=60)["generated_tokens"]

    async def read_a_little():
        body = {"model": MODEL, "prompt": "x" * 50, "max_tokens": 900, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", f"{front}/v1/completions", json=body, headers=AUTH) as r:
                lines = r.aiter_lines()
                for _ in range(3):
                    await anext(lines)
        # leaving the block closes the connection mid-stream

    asyncio.run(read_a_little())
    deadline = time.monotonic() + 120
    while (s := handle.stats.remote().result(timeout_s=60))["running"] or s["kv_chunks_used"]:
        assert time.monotonic() < deadline, f"the aborted stream still runs: {s}"
        time.sleep(0.2)
    assert s["generated_tokens"] - generated < 900  # stopped, not run to its end


ABORT_WAIT_S = 1.0  # an abandoned request's sequences are gone this soon after its client (running them out: ~15 s)


@pytest.mark.parametrize("port", ["front", "proxy"])
def test_an_abandoned_whole_response_is_aborted(urls, port):
    # a non-streaming request sends nothing until every choice ends: only the connection's close
    # (the ASGI receive's http.disconnect on the front, Serve's cancellation through the proxy)
    # tells the ingress that no one waits for it
    proxy, front, handle = urls
    url = front if port == "front" else proxy
    stats = lambda: handle.stats.remote().result(timeout_s=60)  # noqa: E731
    deadline = time.monotonic() + 120
    while (s := stats())["running"] or s["waiting"]:  # (no other test's request left running)
        assert time.monotonic() < deadline, f"the engine never went idle: {s}"
        time.sleep(0.2)
    generated = s["generated_tokens"]
    body = {"model": MODEL, "prompt": ["x" * 50, "y" * 50], "n": 4, "max_tokens": 900, "ignore_eos": True}

    async def abandon():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            sent = asyncio.create_task(client.post(f"{url}/v1/completions", json=body, headers=AUTH))
            deadline = time.monotonic() + 120
            while (await asyncio.to_thread(stats))["running"] < 8:  # all 8 choices decode
                assert not sent.done(), sent.result()
                assert time.monotonic() < deadline, "the request's choices never all ran"
                await asyncio.sleep(0.05)
            sent.cancel()  # the client gives up: httpx closes the connection
            await asyncio.gather(sent, return_exceptions=True)

    asyncio.run(abandon())
    gone = time.monotonic()
    while (s := stats())["running"] or s["kv_chunks_used"]:
        assert time.monotonic() - gone < ABORT_WAIT_S, f"the abandoned request still runs: {s}"
        time.sleep(0.05)
    assert s["generated_tokens"] - generated < 8 * 900  # stopped, not run to its end


def test_whole_responses_of_many_choices_are_served_on_both_ports(urls):
    # (watching for the client's disconnect must not end a request whose client waits)
    proxy, front, _ = urls
    bodies = []
    for url in (proxy, front):
        r = _completion(url, prompt=["a b", "c d"], n=3, max_tokens=40, temperature=1.0, seed=5)
        assert r.status_code == 200, r.text
        bodies.append(r.json())
        assert [c["index"] for c in r.json()["choices"]] == list(range(6))
        assert all(c["finish_reason"] == "length" for c in r.json()["choices"])
        assert r.json()["usage"]["completion_tokens"] == 6 * 40
    assert [c["text"] for c in bodies[0]["choices"]] == [c["text"] for c in bodies[1]["choices"]]  # (seeded)


def test_a_head_sent_too_slowly_is_closed_by_the_front(urls):
    _, front, _ = urls
    host, port = front.removeprefix("http://").split(":")

    async def main():
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        assert (await asyncio.wait_for(reader.read(), 60)).startswith(b"HTTP/1.1 408 ")  # ingress.header_timeout_s
        writer.close()

    asyncio.run(main())


DOCS = ("/docs", "/redoc", "/openapi.json")


def _check_docs(base: str, root: str, headers: dict) -> None:
    """The three docs pages answer at base, their pages pointing at root/openapi.json."""
    pages = {path: httpx.get(f"{base}{path}", headers=headers, timeout=TIMEOUT) for path in DOCS}
    assert {path: r.status_code for path, r in pages.items()} == dict.fromkeys(DOCS, 200)
    assert f"url: '{root}/openapi.json'" in pages["/docs"].text  # (Swagger UI's)
    assert f'spec-url="{root}/openapi.json"' in pages["/redoc"].text
    schema = pages["/openapi.json"].json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema["paths"])
    assert not set(DOCS) & set(schema["paths"])
    assert schema.get("servers", [{"url": ""}])[0]["url"] == root


def test_api_docs_are_behind_the_api_key_by_default(urls):
    proxy, front, _ = urls
    for base, root in ((proxy, "/front"), (front, "")):
        for path in DOCS:
            r = httpx.get(f"{base}{path}", timeout=TIMEOUT)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        _check_docs(base, root, AUTH)


@pytest.mark.parametrize("mode", ["off", "open"])
def test_api_docs_off_or_open(urls, mode):
    proxy, _, _ = urls
    base = f"{proxy.rsplit('/', 1)[0]}/docs-{mode}"
    args = {**_app(0), "api_key": KEY, "openapi_docs": mode, "ingress": {"num_replicas": 1}}
    serve.run(build_app(args), name=f"docs-{mode}", route_prefix=f"/docs-{mode}")
    try:
        if mode == "open":  # no key needed, though the API has one
            _check_docs(base, f"/docs-{mode}", {})
            assert httpx.get(f"{base}/v1/models", timeout=TIMEOUT).status_code == 401
        else:  # not there, key or not
            for path in DOCS:
                r = httpx.get(f"{base}{path}", headers=AUTH, timeout=TIMEOUT)
                assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", path
    finally:
        serve.delete(f"docs-{mode}")


def test_the_proxys_own_port_is_refused_naming_both(urls):
    proxy, _, _ = urls
    proxy_port = int(proxy.split(":")[2].split("/")[0])
    app = build_app(_app(proxy_port, api_key=None))
    with pytest.raises(RuntimeError, match="Deploying application clash failed"):
        serve.run(app, name="clash", route_prefix="/clash")
    message = serve.status().applications["clash"].deployments["OpenAIIngress"].message
    assert f"ingress.http_port {proxy_port} is Serve's own http_options.port" in message
    serve.delete("clash")


def test_a_stream_through_the_front_finishes_when_its_app_goes_down(urls):
    # Serve's graceful shutdown calls the ingress's __del__: its front takes no new connection
    # and finishes the open ones (the model replica drains the stream's call meanwhile)
    proxy, _, _ = urls
    base = proxy.rsplit("/", 1)[0]
    port = free_port()
    serve.run(build_app(_app(port, api_key=None)), name="drain", route_prefix="/drain")
    front = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": "long", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async with client.stream("POST", f"{front}/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()
                events = [await anext(lines)]  # the stream has begun
                deleting = asyncio.create_task(asyncio.to_thread(serve.delete, "drain"))
                events += [line async for line in lines]
            await deleting
        return [e for e in events if e.startswith("data: ")]

    events = asyncio.run(main())
    assert events[-1] == "data: [DONE]"
    assert not any('"error"' in e for e in events)
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    want = httpx.post(
        f"{base}/front/v1/completions", json={**body, "stream": False}, headers=AUTH, timeout=TIMEOUT
    ).json()["choices"][0]["text"]
    assert text == want  # the whole stream, not a cut one
    with pytest.raises(httpx.ConnectError):  # its front is gone
        httpx.get(f"{front}/health", timeout=10)
