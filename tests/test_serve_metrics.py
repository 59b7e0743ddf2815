"""GET /metrics on a local Ray cluster (chunkserve/cluster/local.py), real HTTP: the Prometheus text covers
both model replicas, its counters equal what the requests' usage said, the ingress counts its own
responses (a 400 among them), and the Grafana dashboard (configs/grafana/chunkserve.json) asks
only for metrics the endpoint exposes."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.cluster.ingress import PREDICTED_HEADER
from chunkserve.cluster.metrics import AGREEMENTS, CACHE_S
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

KEY = "metrics-key"
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
APP = {
    "model": MODEL,
    "device": "cpu",
    "num_replicas": 2,
    "num_cpus_per_replica": 0.5,
    "api_key": KEY,
    "engine": {"kv_cache_tokens": 4096, "max_model_len": 512},
}
DASHBOARD = Path(__file__).resolve().parent.parent / "configs" / "grafana" / "chunkserve.json"
TIMEOUT = httpx.Timeout(300.0)
# the suffixes a family of each type writes its samples with (what a PromQL query names)
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


@pytest.fixture(scope="module")
def app():
    with serve_on_local_cluster(num_nodes=1) as url:
        serve.run(build_app(APP), name="metrics", route_prefix="/m")
        yield f"{url}/m", serve.get_deployment_handle("LLMReplica", app_name="metrics")


def _scrape(url: str) -> tuple[httpx.Response, dict, float]:
    """GET /metrics (no API key: as vLLM's) -> (the response, {family name: family}, when it was
    sent: perf_counter), parsed strictly."""
    time.sleep(CACHE_S + 0.1)  # past the cache: a fresh fan-out
    sent = time.perf_counter()
    r = httpx.get(f"{url}/metrics", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r, {f.name: f for f in text_string_to_metric_families(r.text)}, sent


def _values(families: dict, sample: str, **labels) -> dict[str, float]:
    """{replica: value} of the samples named `sample` whose labels include `labels`."""
    found = {
        s.labels.get("replica"): s.value
        for f in families.values()
        for s in f.samples
        if s.name == sample and labels.items() <= s.labels.items()
    }
    assert sample in _declared(families), f"/metrics has no {sample}"  # (declared: it may have no sample yet)
    return found


def _declared(families: dict) -> set[str]:
    """The sample names the families' TYPE lines declare (what a PromQL query may name)."""
    return {f.name + suffix for f in families.values() for suffix in _SUFFIXES.get(f.type, ("",))}


def _llm_replica_ids() -> set[str]:
    # Serve's replica actors, as Ray's GCS lists them (independently of chunkserve/cluster/metrics.py's fan-out)
    prefix = "SERVE_REPLICA::metrics#LLMReplica#"
    return {
        a["name"][len(prefix) :]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(prefix)
    }


SHARED = "a context that every request of the test shares, long enough for three chunks of 64 tokens; " * 2


async def _requests(url: str, n: int) -> list[tuple[dict, str | None]]:
    """One completion, then n at once (every other one streamed, with its usage), each prompt
    after SHARED (cached after the first) -> each one's usage and the router's prediction of its
    cached tokens (the response's x-chunkserve-predicted-cached-tokens)."""
    auth = {"Authorization": f"Bearer {KEY}"}

    async def one(client: httpx.AsyncClient, i: int) -> tuple[dict, str | None]:
        body = {
            "model": MODEL,
            "prompt": f"{SHARED}request {i} " + "word " * (5 * i),
            "max_tokens": 3 + i,
            "temperature": 0,
            "ignore_eos": True,
        }
        if i % 2:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            usage = None
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=auth) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                        usage = json.loads(line[6:])["usage"]
            assert usage is not None
            return usage, r.headers.get(PREDICTED_HEADER)
        r = await client.post(f"{url}/v1/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()["usage"], r.headers.get(PREDICTED_HEADER)

    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        first = await one(client, 0)
        return [first, *await asyncio.gather(*(one(client, i) for i in range(1, n)))]


def test_metrics_aggregate_every_replica(app):
    url, handle = app
    _, before, _ = _scrape(url)
    # the prediction error's bounds (multiples of the chunk size), each once, before any request too
    les = [s.labels["le"] for s in before["chunkserve_router_prediction_error_tokens"].samples if "le" in s.labels]
    assert les == ["0.0", "64.0", "128.0", "256.0", "512.0", "1024.0", "2048.0", "+Inf"]
    replicas = _llm_replica_ids()
    assert len(replicas) == 2
    assert set(_values(before, "chunkserve_kv_chunks_total")) == replicas  # both replicas, by their ids

    n = 8
    answers = asyncio.run(_requests(url, n))
    usages = [usage for usage, _ in answers]
    bad = httpx.post(
        f"{url}/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
        timeout=TIMEOUT,
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"

    r, after, sent = _scrape(url)
    fanned_out, started = time.perf_counter() - sent, time.perf_counter()
    again = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    cached = time.perf_counter() - started
    if time.perf_counter() - sent < CACHE_S:  # (the text was made after `sent`: cached, unless this box stalled)
        assert again == r.text  # the same text: its own /metrics response is not counted in it yet
    print(f"/metrics with 2 model replicas: {fanned_out * 1e3:.1f} ms asking them, {cached * 1e3:.1f} ms cached")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for name in (
        "chunkserve_running_requests",
        "chunkserve_prompt_tokens_total",
        "chunkserve_time_to_first_token_seconds_bucket",
        "chunkserve_http_responses_total",
    ):
        assert f"\n{name}{{" in r.text  # (grep-able names, as the README's curl | grep shows them)

    def delta(sample: str, **labels) -> float:
        return sum(_values(after, sample, **labels).values()) - sum(_values(before, sample, **labels).values())

    # the replicas' counters: exactly what the requests' usage reported, summed over both replicas
    assert set(_values(after, "chunkserve_generated_tokens_total")) == replicas
    assert delta("chunkserve_generated_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("chunkserve_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0  # (the prefix router sends SHARED's requests to the replica that holds it)
    assert delta("chunkserve_cached_prompt_tokens_total") == cached
    assert delta("chunkserve_finished_requests_total") == n
    # each request's first token once; its decode time once (every request made >= 3 tokens)
    assert delta("chunkserve_time_to_first_token_seconds_count") == n
    assert delta("chunkserve_time_per_output_token_seconds_count") == n
    assert delta("chunkserve_time_to_first_token_seconds_bucket", le="+Inf") == n
    # idle again: nothing running or held; the pools as both replicas report them
    stats = handle.stats.remote().result(timeout_s=60)
    assert _values(after, "chunkserve_kv_chunks_total") == dict.fromkeys(replicas, stats["kv_chunks_total"])
    assert sum(_values(after, "chunkserve_kv_chunks_total").values()) == 2 * 4096 // 64
    assert sum(_values(after, "chunkserve_kv_chunks_used").values()) == 0
    assert sum(_values(after, "chunkserve_running_requests").values()) == 0
    assert sum(_values(after, "chunkserve_waiting_requests").values()) == 0
    # the ingress's own responses: the n good ones and the bad one, and the bad one's error code
    assert delta("chunkserve_http_responses_total", endpoint="/v1/completions", status="200") == n
    assert delta("chunkserve_http_responses_total", endpoint="/v1/completions", status="400") == 1
    assert delta("chunkserve_http_errors_total", status="400", code="invalid_json") == 1
    assert _values(after, "chunkserve_metrics_replicas", deployment="LLMReplica", answered="true") == {None: 2}
    # the router's prediction of each request's cached tokens (its header) against the replica's
    # count (its usage): every request compared once, both sums as the responses said
    predicted = [int(header) for _, header in answers if header is not None]
    assert len(predicted) == n  # (the prefix router routed each one)
    assert all(p % 64 == 0 and p < u["prompt_tokens"] for p, u in zip(predicted, usages))
    assert sum(predicted) > 0  # (its own record of the first request: SHARED's chunks on its replica)
    agreement = {a: delta("chunkserve_router_predictions_total", agreement=a) for a in AGREEMENTS}
    assert sum(agreement.values()) == n
    assert delta("chunkserve_router_predicted_cached_tokens_total") == sum(predicted)
    assert delta("chunkserve_router_reported_cached_tokens_total") == cached
    assert delta("chunkserve_router_prediction_error_tokens_count") == n
    errors = [abs(p - u["prompt_tokens_details"]["cached_tokens"]) for p, u in zip(predicted, usages)]
    assert delta("chunkserve_router_prediction_error_tokens_sum") == sum(errors)
    assert agreement["exact"] == errors.count(0)
    assert agreement["within_chunk"] == sum(0 < e <= 64 for e in errors)
    assert delta("chunkserve_router_prediction_error_tokens_bucket", le="0.0") == errors.count(0)


def test_dashboard_asks_only_for_exposed_metrics(app):
    url, _ = app
    _, families, _ = _scrape(url)
    exposed = _declared(families)
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard["panels"]}
    for title in (
        "Time to first token",
        "Time per output token",
        "Cached prompt fraction",
        "KV cache use",
        "Requests running / waiting",
        "Tokens per second",
        "Errors by status and code",
        "Requests per second by tenant",
        "Tokens per second by tenant",
        "Cached prompt fraction by tenant",
        "Rejected requests by tenant and code",
        "Router prediction agreement",
        "Predicted vs reported cached tokens per second",
        "Router prediction error",
        "Host tier use",
        "Host tier spills and loads per second",
        "Host tier copies",
        "Host tier copy time",
        "Cached prompt tokens per second by tier",
    ):
        assert title in exprs
    for title, queries in exprs.items():
        for expr in queries:
            names = set(re.findall(r"\bchunkserve_\w+", expr))
            assert names, f"panel {title!r}: {expr!r} names no chunkserve metric"
            assert names <= exposed, f"panel {title!r} asks for {names - exposed}, which /metrics does not expose"
    for panel in dashboard["panels"]:
        assert panel["datasource"]["type"] == "prometheus"
