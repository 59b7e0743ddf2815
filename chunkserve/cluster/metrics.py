"""GET /metrics: the application's chunkserve_* metrics in Prometheus text format, from every replica.

A Serve handle call reaches one replica, so the ingress asks each replica itself: Serve names
every replica actor `SERVE_REPLICA::<app>#<deployment>#<id>` in the `serve` namespace; those of
this application's two deployments are listed from Ray's GCS (`ray.util.list_named_actors`) and
each is sent `record_routing_stats`, the call Serve's controller makes for the routers, which
carries the replica's metrics snapshot (chunkserve/replicas/deployment.py `_Metrics.snapshot`, the ingress's
`http_snapshot`). The calls run at once, with a timeout; the text is cached for CACHE_S so a
scrape storm costs one fan-out a second.

Every series carries the replica's id (`replica`) and the served model name (`model_name`);
counters and histograms are the replica's own since it started, so sums over replicas are taken
after `rate()` in PromQL (a replaced replica is then a counter reset, not a drop of the sum), and
histogram buckets are exact counts: `histogram_quantile(0.99, sum by (le) (rate(..._bucket[1m])))`
is the application's p99. The names, and vLLM's for the same thing (vLLM's /metrics):

    chunkserve_running_requests                 vllm:num_requests_running
    chunkserve_waiting_requests                 vllm:num_requests_waiting
    chunkserve_kv_chunks_used / _total          (vLLM counts blocks: vllm:num_gpu_blocks in cache_config_info)
    chunkserve_kv_cache_usage_perc              vllm:kv_cache_usage_perc (a fraction, 0..1, as vLLM's)
    chunkserve_prompt_tokens_total              vllm:prompt_tokens_total
    chunkserve_cached_prompt_tokens_total       vllm:prefix_cache_hits_total (tokens; queries: prompt tokens)
    chunkserve_cached_prompt_tokens_host_total  (none: of those, copied back from the host tier)
    chunkserve_host_chunks_used / _total        (none: KV chunks in the host tier, engine.host_cache_tokens)
    chunkserve_host_spills_total / _loads_total (none: chunks copied GPU -> host, host -> GPU;
    chunkserve_host_write_ahead_total             GPU -> host ahead of eviction; evicted with no
    chunkserve_host_spills_ahead_total            copy; the bytes and milliseconds of the copies)
    chunkserve_host_copy_bytes_total / _ms_total
    chunkserve_generated_tokens_total           vllm:generation_tokens_total
    chunkserve_finished_requests_total          vllm:request_success_total (no finished_reason label)
    chunkserve_time_to_first_token_seconds      vllm:time_to_first_token_seconds (from arrival at the replica)
    chunkserve_time_per_output_token_seconds    vllm:time_per_output_token_seconds (per request, its mean)
    chunkserve_http_responses_total             http_requests_total (vLLM's instrumentator: handler, status)
    chunkserve_http_errors_total                (none: the OpenAI error code of each error response)
    chunkserve_stream_errors_total              (none: error chunks sent in a stream that had begun)
    chunkserve_metrics_replicas                 (none: replicas this scrape reached, or did not)
    chunkserve_router_predictions_total         (none: per ingress replica, requests whose cached prompt
    chunkserve_router_predicted_cached_tokens_total tokens the prefix router predicted, by agreement with
    chunkserve_router_reported_cached_tokens_total  the replica's count; both token sums over them; the
    chunkserve_router_prediction_error_tokens        error |predicted − reported| per request, in tokens)
    chunkserve_router_peers                     (none: router.share_decisions, per ingress replica and
    chunkserve_router_peer_decisions_total       deployment: the other routers it sends to; their decisions booked)
    chunkserve_tenant_requests_total            (none: per tenant, the ingress's answered completions;
    chunkserve_tenant_prompt_tokens_total        prompt, cached prompt and generated tokens; its hit
    chunkserve_tenant_cached_prompt_tokens_total rate: rate(cached) / rate(prompt); requests refused
    chunkserve_tenant_generated_tokens_total     by OpenAI error code: 429 rate_limit_exceeded, ...)
    chunkserve_tenant_rejected_requests_total
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Iterable
from typing import Any

import ray
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve._private.constants import SERVE_NAMESPACE

from chunkserve.cluster.tenants import TenantCounts

# the text format generate_latest writes for names like ours (prometheus_client >= 0.22 calls its default
# 1.0.0, which differs only for names outside [a-zA-Z_:][a-zA-Z0-9_:]*); what vLLM's /metrics sends
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CACHE_S = 1.0  # a scrape within this of the last one gets its text
REPLICA_TIMEOUT_S = 2.0  # a replica that has not answered by then is counted as not reached


class HttpCounts:
    """The ingress's own responses, counted in this process (one ingress replica per actor
    process): by endpoint and status (CountResponses), and errors by status and OpenAI error
    code (chunkserve.cluster.errors.APIError.response) or, for errors sent inside a begun stream, by code."""

    def __init__(self):
        self._lock = threading.Lock()  # (Starlette may answer on several threads: sync code, tests)
        self.responses: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[tuple[str, str]] = collections.Counter()
        self.stream_errors: collections.Counter[str] = collections.Counter()

    def response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.responses[endpoint, str(status)] += 1

    def error(self, status: int, code: str) -> None:
        with self._lock:
            self.errors[str(status), code] += 1

    def stream_error(self, code: str) -> None:
        with self._lock:
            self.stream_errors[code] += 1

    def snapshot(self) -> dict:
        with self._lock:  # (tuples become lists over Ray's pickling either way: lists of rows here)
            return {
                "responses": [[*k, n] for k, n in self.responses.items()],
                "errors": [[*k, n] for k, n in self.errors.items()],
                "stream_errors": [[k, n] for k, n in self.stream_errors.items()],
            }


HTTP = HttpCounts()

# the prediction error histogram's bounds, in chunks (its `le` values are these × the chunk size)
ERROR_BOUNDS_CHUNKS = (0, 1, 2, 4, 8, 16, 32)
AGREEMENTS = ("exact", "within_chunk", "over", "under")


class PredictionCounts:
    """Per request this ingress replica sent, the prompt tokens its prefix router predicted as
    cached on the chosen replica (chunkserve/router/direct.py `take_prediction`) against those the
    replica reported (`GenerateOutput.cached_tokens`), counted in this process as HTTP is: the
    requests by agreement (exact; within one chunk; over or under: the prediction more or fewer
    than a chunk off), both token sums, and |predicted − reported| as a histogram in tokens."""

    def __init__(self):
        self._lock = threading.Lock()
        self.agreement: collections.Counter[str] = collections.Counter()
        self.predicted = self.reported = 0
        self.errors = [0] * (len(ERROR_BOUNDS_CHUNKS) + 1)  # per bucket, +Inf last
        self.error_sum = 0

    def observe(self, predicted: int, reported: int, chunk_size: int) -> None:
        error = abs(predicted - reported)
        kind = (
            "exact"
            if error == 0
            else "within_chunk"
            if error <= chunk_size
            else "over"
            if predicted > reported
            else "under"
        )
        bucket = next(
            (i for i, b in enumerate(ERROR_BOUNDS_CHUNKS) if error <= b * chunk_size), len(ERROR_BOUNDS_CHUNKS)
        )
        with self._lock:
            self.agreement[kind] += 1
            self.predicted += predicted
            self.reported += reported
            self.errors[bucket] += 1
            self.error_sum += error

    def snapshot(self, chunk_size: int) -> dict:
        """chunk_size: the application's, which every observation was made with."""
        with self._lock:
            return {
                "agreement": [[k, n] for k, n in self.agreement.items()],
                "predicted": self.predicted,
                "reported": self.reported,
                "error": {
                    "bounds": [b * chunk_size for b in ERROR_BOUNDS_CHUNKS],
                    "counts": list(self.errors),
                    "sum": self.error_sum,
                },
            }


PREDICTIONS = PredictionCounts()


class CountResponses:
    """ASGI middleware: counts every response by endpoint (the route's path, else "other", so a
    scan of random paths adds one series, not one per path) and status, when its start is sent.
    Pure ASGI, not Starlette's BaseHTTPMiddleware: a stream's messages pass straight through, and
    a client's disconnect still reaches the endpoint as before. An exception that escapes before
    the response starts is counted with the status the app's outermost handler answers it with
    (`status_of`, the ingress's: 499 for a client gone, else 500); one cancelled before it started
    (Serve cancels the request of a client that left) as a 499."""

    def __init__(self, app, status_of=lambda e: 500):
        self.app, self.status_of = app, status_of

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                HTTP.response(_endpoint(scope), message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except asyncio.CancelledError:
            # Serve cancels a request whose client disconnected (here before any answer): a 499
            if not started:
                HTTP.response(_endpoint(scope), 499)
            raise
        except Exception as e:
            if not started:  # Starlette's outermost middleware answers it with the catch-all handler
                HTTP.response(_endpoint(scope), self.status_of(e))
            raise


def _endpoint(scope) -> str:
    """The matched route's path (Starlette's router puts the route in the shared scope), else "other"."""
    return getattr(scope.get("route"), "path", None) or "other"


# -- reaching every replica ---------------------------------------------------------------
class ReplicaStats:
    """record_routing_stats of every replica of some deployments of one application."""

    def __init__(self, app_name: str, deployments: Iterable[str]):
        self.app_name, self.deployments = app_name, tuple(deployments)
        self._actors: dict[str, Any] = {}  # actor name -> handle (a replica's name is never reused)

    async def collect(self, skip: str | None = None) -> tuple[dict[tuple[str, str], dict], dict[str, int]]:
        """-> ({(deployment, replica id): its stats}, {deployment: replicas that did not answer});
        `skip`: a replica id not to ask (the caller, which has its own)."""
        names = await asyncio.to_thread(self._replica_names)  # (GCS calls block: off the event loop)
        ids = {name: ReplicaID.from_full_id_str(name) for name in names}
        wanted = [n for n in names if ids[n].unique_id != skip]
        missing = [n for n in wanted if n not in self._actors]
        if missing:
            self._actors.update(await asyncio.to_thread(lambda: {n: _actor(n) for n in missing}))
        for gone in set(self._actors) - set(names):
            del self._actors[gone]
        results = await asyncio.gather(*(self._ask(self._actors.get(n)) for n in wanted))
        stats, failed = {}, dict.fromkeys(self.deployments, 0)
        for name, result in zip(wanted, results):
            rid = ids[name]
            if result is None:
                failed[rid.deployment_id.name] += 1
            else:
                stats[rid.deployment_id.name, rid.unique_id] = result
        return stats, failed

    def _replica_names(self) -> list[str]:
        # ("<prefix><app>#<deployment>#": the full id of a replica whose unique id is "")
        prefixes = tuple(
            ReplicaID("", DeploymentID(name=d, app_name=self.app_name)).to_full_id_str() for d in self.deployments
        )
        return sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == SERVE_NAMESPACE and a["name"].startswith(prefixes)
        )

    @staticmethod
    async def _ask(actor) -> dict | None:
        if actor is None:
            return None
        try:  # a starting replica raises (its user code is not built yet); a stopping one may hang
            return await asyncio.wait_for(actor.record_routing_stats.remote(), REPLICA_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - not reached this time: counted in chunkserve_metrics_replicas
            return None


def _actor(name: str):
    try:
        return ray.get_actor(name, namespace=SERVE_NAMESPACE)
    except ValueError:  # gone since it was listed
        return None


class MetricsText:
    """The /metrics body, made at most once per CACHE_S: concurrent scrapes wait for one fan-out."""

    def __init__(self, model_name: str, app_name: str, deployments: Iterable[str], own_id: str, own_stats):
        """own_stats() -> (the calling replica's deployment, its record_routing_stats): not asked over Ray."""
        self._model_name, self._own_id, self._own_stats = model_name, own_id, own_stats
        self._replicas = ReplicaStats(app_name, deployments)
        self._lock = asyncio.Lock()
        self._made: tuple[float, bytes] = (-1e18, b"")

    async def text(self) -> bytes:
        async with self._lock:
            at, body = self._made
            if time.monotonic() - at > CACHE_S:
                stats, unreached = await self._replicas.collect(skip=self._own_id)
                own_deployment, own = self._own_stats()
                stats[own_deployment, self._own_id] = own
                body = exposition(self._model_name, stats, unreached)
                self._made = (time.monotonic(), body)
            return body


# -- the text ---------------------------------------------------------------------------
_REPLICA_COUNTERS = {
    "prompt_tokens": "Prompt tokens of finished requests (aborted ones once admitted).",
    "cached_prompt_tokens": "Of those, prompt tokens served from the prefix cache.",
    "cached_prompt_tokens_host": "Of those, prompt tokens copied back from the host tier.",
    "host_spills": "KV chunks copied from the GPU pool to the host tier as it evicted them (still cached).",
    "host_write_ahead": "KV chunks copied from the GPU pool to the host tier ahead of their eviction.",
    "host_spills_ahead": "KV chunks evicted to the host tier with no copy: written ahead, or loaded from there.",
    "host_loads": "KV chunks copied from the host tier back to the GPU pool (a request matched them).",
    "host_copy_bytes": "Bytes the host tier's copies moved, both ways.",
    "host_copy_ms": "Milliseconds the host tier's copies took.",
    "generated_tokens": "Tokens generated.",
    "finished_requests": "Requests the engine finished (aborted ones included).",
    "direct_requests": "Requests an ingress sent on a direct stream (router.direct_stream), not through Serve.",
}
_REPLICA_GAUGES = {
    "running_requests": "Requests in the running batch.",
    "waiting_requests": "Requests waiting for admission.",
    "kv_chunks_used": "KV cache chunks held by live requests.",
    "kv_chunks_total": "KV cache chunks in the pool.",
    "host_chunks_used": "KV cache chunks in the host tier.",
    "host_chunks_total": "KV cache chunks the host tier holds (0: no host tier).",
}
_HISTOGRAMS = {
    "chunkserve_time_to_first_token_seconds": "Arrival at the replica to its first token.",
    "chunkserve_time_per_output_token_seconds": "A finished request's decode time per token after the first.",
}


def exposition(model_name: str, replicas: dict[tuple[str, str], dict], unreached: dict[str, int]) -> bytes:
    """The Prometheus text of replicas' stats ({(deployment, replica id): record_routing_stats}):
    model replicas' carry `metrics`, ingress replicas' `http`."""
    return generate_latest(_Families(list(_families(model_name, replicas, unreached))))


class _Families:
    """What generate_latest takes: anything with collect()."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def _families(model_name: str, replicas: dict[tuple[str, str], dict], unreached: dict[str, int]) -> Iterable[Metric]:
    labels = ["model_name", "replica"]
    models = {rid: s["metrics"] for (_, rid), s in sorted(replicas.items()) if "metrics" in s}
    https = {rid: s["http"] for (_, rid), s in sorted(replicas.items()) if "http" in s}
    for name, doc in _REPLICA_GAUGES.items():
        g = GaugeMetricFamily(f"chunkserve_{name}", doc, labels=labels)
        for rid, m in models.items():
            g.add_metric([model_name, rid], m["gauges"][name])
        yield g
    g = GaugeMetricFamily(
        "chunkserve_kv_cache_usage_perc", "KV cache chunks in use (0..1): used / total.", labels=labels
    )
    for rid, m in models.items():
        g.add_metric([model_name, rid], m["gauges"]["kv_chunks_used"] / max(1, m["gauges"]["kv_chunks_total"]))
    yield g
    for name, doc in _REPLICA_COUNTERS.items():
        c = CounterMetricFamily(f"chunkserve_{name}", doc, labels=labels)
        for rid, m in models.items():
            c.add_metric([model_name, rid], m["counters"][name])
        yield c
    for name, doc in _HISTOGRAMS.items():
        h = HistogramMetricFamily(name, doc, labels=labels)
        for rid, m in models.items():
            hist = m["histograms"][name]
            h.add_metric([model_name, rid], _buckets(hist), hist["sum"])
        yield h
    responses = CounterMetricFamily(
        "chunkserve_http_responses",
        "The ingress's HTTP responses by endpoint and status.",
        labels=["replica", "endpoint", "status"],
    )
    errors = CounterMetricFamily(
        "chunkserve_http_errors",
        "The ingress's error responses by status and OpenAI error code (or type, for errors without a code).",
        labels=["replica", "status", "code"],
    )
    stream = CounterMetricFamily(
        "chunkserve_stream_errors",
        "Errors sent inside a stream that had begun (status 200 was sent), by OpenAI error code.",
        labels=["replica", "code"],
    )
    for rid, http in https.items():
        for endpoint, status, n in http["responses"]:
            responses.add_metric([rid, endpoint, status], n)
        for status, code, n in http["errors"]:
            errors.add_metric([rid, status, code], n)
        for code, n in http["stream_errors"]:
            stream.add_metric([rid, code], n)
    yield from (responses, errors, stream)
    yield from _prediction_families(replicas)
    yield from _peer_families(replicas)
    yield from _tenant_families(replicas)
    reached = GaugeMetricFamily(
        "chunkserve_metrics_replicas",
        "Replicas this scrape reached (answered: true) or did not (starting, stopping, or timed out), by deployment.",
        labels=["deployment", "answered"],
    )
    answered = collections.Counter(d for d, _ in replicas)
    for deployment in sorted(set(answered) | set(unreached)):
        reached.add_metric([deployment, "true"], answered[deployment])
        reached.add_metric([deployment, "false"], unreached.get(deployment, 0))
    yield reached


_TENANT_COUNTERS = {
    "requests": "Completion requests answered (streams cut short included), by tenant.",
    "prompt_tokens": "Prompt tokens of those, by tenant (a prompt of n choices once).",
    "cached_prompt_tokens": "Of those, prompt tokens served from the tenant's cache (its salt's prefix tree).",
    "generated_tokens": "Tokens generated for the tenant.",
}


def _tenant_families(replicas: dict[tuple[str, str], dict]) -> Iterable[Metric]:
    """Per-tenant counts of every ingress replica (chunkserve/cluster/tenants.py TenantCounts)."""
    counts = {rid: s["tenants"] for (_, rid), s in sorted(replicas.items()) if "tenants" in s}
    families = {
        field: CounterMetricFamily(f"chunkserve_tenant_{field}", doc, labels=["replica", "tenant"])
        for field, doc in _TENANT_COUNTERS.items()
    }
    rejected = CounterMetricFamily(
        "chunkserve_tenant_rejected_requests",
        "Completion requests refused, by tenant and OpenAI error code (429 rate_limit_exceeded, 503 overloaded, ...).",
        labels=["replica", "tenant", "code"],
    )
    for rid, tenants in counts.items():
        for tenant, *values in tenants["totals"]:
            for field, value in zip(TenantCounts.FIELDS, values):  # (the snapshot's row order)
                families[field].add_metric([rid, tenant], value)
        for tenant, code, n in tenants["rejected"]:
            rejected.add_metric([rid, tenant, code], n)
    yield from families.values()
    yield rejected


def _prediction_families(replicas: dict[tuple[str, str], dict]) -> Iterable[Metric]:
    """The routers' predictions against the replicas' reports, per ingress replica (PredictionCounts)."""
    counts = {rid: s["predictions"] for (_, rid), s in sorted(replicas.items()) if "predictions" in s}
    agreement = CounterMetricFamily(
        "chunkserve_router_predictions_total",
        "Requests whose cached prompt tokens the prefix router predicted, by agreement with the replica's count: "
        "exact, within_chunk (off by at most one chunk), over or under (more than a chunk more, or fewer).",
        labels=["replica", "agreement"],
    )
    predicted = CounterMetricFamily(
        "chunkserve_router_predicted_cached_tokens",
        "Prompt tokens the prefix router counted as cached on the replica it chose, over those requests.",
        labels=["replica"],
    )
    reported = CounterMetricFamily(
        "chunkserve_router_reported_cached_tokens",
        "Prompt tokens the chosen replicas reported as cached (usage's cached_tokens), over the same requests.",
        labels=["replica"],
    )
    error = HistogramMetricFamily(
        "chunkserve_router_prediction_error_tokens",
        "Per request, |predicted − reported| cached prompt tokens (bounds: multiples of the chunk size).",
        labels=["replica"],
    )
    for rid, p in counts.items():
        by = dict(p["agreement"])
        for kind in AGREEMENTS:
            agreement.add_metric([rid, kind], by.get(kind, 0))
        predicted.add_metric([rid], p["predicted"])
        reported.add_metric([rid], p["reported"])
        error.add_metric([rid], _buckets(p["error"]), p["error"]["sum"])
    yield from (agreement, predicted, reported, error)


def _peer_families(replicas: dict[tuple[str, str], dict]) -> Iterable[Metric]:
    """Routers that share decisions (router.share_decisions), per ingress replica and deployment."""
    peers = GaugeMetricFamily(
        "chunkserve_router_peers",
        "Other ingresses' routers this ingress's router sends its decisions to (router.share_decisions).",
        labels=["replica", "deployment"],
    )
    booked = CounterMetricFamily(
        "chunkserve_router_peer_decisions",
        "Other ingresses' routing decisions this ingress's router booked as its own (router.share_decisions).",
        labels=["replica", "deployment"],
    )
    for (_, rid), s in sorted(replicas.items()):
        for deployment, (n, decisions) in sorted((s.get("peers") or {}).items()):
            peers.add_metric([rid, deployment], n)
            booked.add_metric([rid, deployment], decisions)
    yield from (peers, booked)


def _buckets(hist: dict) -> list[tuple[str, float]]:
    """A snapshot's histogram ({bounds, counts per bucket with +Inf last, sum}) as cumulative buckets."""
    cumulative, buckets = 0, []
    for bound, n in zip([*map(_bound, hist["bounds"]), "+Inf"], hist["counts"]):
        cumulative += n
        buckets.append((bound, cumulative))
    return buckets


def _bound(b: float) -> str:
    return repr(float(b))  # Prometheus' le: "0.005", "1.0", as prometheus_client writes them
