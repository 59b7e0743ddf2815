"""Per-request records -> one run's report, with `vllm bench serve --save-result`'s key names.

Everything is computed from the raw records of every client (never averages of averages), as
vLLM computes it: over the successful requests, TTFT from the send to the first chunk, TPOT as
(E2EL - TTFT) / (output tokens - 1) for requests of more than one token, ITL over every gap
between chunks, E2EL to the stream's end; throughputs over the run's duration. Percentile keys
are `p{P}_{metric}_ms`. Ours besides: normalized latency (E2EL / output tokens, the
ChunkAttention paper's figure), the cached fraction and per-tenant hit rates from the replicas'
usage, requests and tokens per replica, errors by kind, goodput against SLOs, the server's
split of the time to first output (its Server-Timing header), and the client's own overhead
(how late it dispatched, its CPU use).

Per tenant, two views. `tenants`: the client's, by the workload's tenant label (requests,
completed, rate-limited 429s, TTFT and TPOT percentiles, hit rate from usage). `server_tenants`:
the server's, by its tenant name: the change of each `chunkserve_tenant_*` counter of its
/metrics (chunkserve/cluster/metrics.py) over the run, summed over replicas (`tenant_counters`
reads the text, `tenant_deltas` subtracts); {} for a server without those series (vLLM).

The router's predictions, likewise two views. `predictions`: per request, its response's
x-chunkserve-predicted-cached-tokens against its usage's cached tokens. `server_router`: the
change of the server's `chunkserve_router_*` counters over the run (`router_counters`,
`router_deltas`): requests by agreement (exact, within one chunk, over, under) and both token sums.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chunkserve.cluster.loadtest.client import ClientResult, Record


@dataclass(frozen=True)
class Slo:
    """Service-level objectives a request must meet, each None when not set."""

    ttft_s: float | None = None
    tpot_ms: float | None = None
    e2el_s: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """'ttft:S,tpot:MS,e2el:S' (any subset, comma or space separated): TTFT and E2EL in
        seconds, TPOT in milliseconds, unless a value says its unit ('500ms', '0.05s')."""
        units = {"ttft": 1.0, "tpot": 1e-3, "e2el": 1.0}  # a bare number's unit, in seconds
        got: dict[str, float] = {}
        for item in filter(None, re.split(r"[,\s]+", text.strip())):
            name, sep, value = item.partition(":")
            if not sep or name not in units:
                raise ValueError(f"goodput takes ttft:S, tpot:MS and e2el:S, got {item!r}")
            m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)(ms|s)?", value.strip())
            if m is None or float(m.group(1)) <= 0:
                raise ValueError(f"goodput {name} must be a positive number, got {value!r}")
            seconds = float(m.group(1)) * ({"ms": 1e-3, "s": 1.0}[m.group(2)] if m.group(2) else units[name])
            if name in got:
                raise ValueError(f"goodput names {name} twice")
            got[name] = seconds
        if not got:
            raise ValueError("goodput needs at least one of ttft, tpot, e2el")
        return cls(got.get("ttft"), None if "tpot" not in got else got["tpot"] * 1e3, got.get("e2el"))

    def met(self, rec: Record) -> bool:
        if not rec.ok:
            return False
        return (
            (self.ttft_s is None or rec.ttft <= self.ttft_s)
            and (self.tpot_ms is None or tpot(rec) * 1e3 <= self.tpot_ms)
            and (self.e2el_s is None or rec.e2el <= self.e2el_s)
        )

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft_s, "tpot_ms": self.tpot_ms, "e2el_s": self.e2el_s}


def tpot(rec: Record) -> float:
    """Seconds per output token after the first (0 for a one-token output, as vLLM)."""
    n = rec.output_tokens or 0
    return (rec.e2el - rec.ttft) / (n - 1) if n > 1 else 0.0


def _pkey(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _stats(name: str, seconds: list[float], percentiles: tuple[float, ...]) -> dict:
    ms = np.asarray(seconds, dtype=float) * 1e3
    if ms.size == 0:
        out = {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
        return out | {f"p{_pkey(p)}_{name}_ms": 0.0 for p in percentiles}
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    return out | {f"p{_pkey(p)}_{name}_ms": float(np.percentile(ms, p)) for p in percentiles}


def _max_concurrency(records: list[Record]) -> int:
    """Most requests in flight at once on one client's clock (summed over clients: an upper bound)."""
    total = 0
    for client in {r.client for r in records}:
        events = sorted(
            e
            for r in records
            if r.client == client and r.sent is not None and r.e2el is not None
            for e in ((r.sent, 1), (r.sent + r.e2el, -1))
        )
        now = most = 0
        for _, d in events:
            now += d
            most = max(most, now)
        total += most
    return total


def oracle_cached_tokens(prompts: Sequence[tuple[str | None, Sequence[int]]], chunk_size: int) -> list[int]:
    """Per prompt, in the order given (the order sent): the tokens one cache holding every earlier
    prompt would serve, in whole chunks of chunk_size (the leading chunks an earlier prompt of
    the same cache salt had; the last token is always computed, as an engine must, for its
    logits). The bound a router's cached fraction is measured against (issue 47's oracle)."""
    seen: set[int] = set()
    out = []
    for salt, ids in prompts:
        key, matched, hit = hash(("salt", salt)), 0, True
        usable = (len(ids) - 1) // chunk_size
        for k in range(len(ids) // chunk_size):
            key = hash((key, tuple(ids[k * chunk_size : (k + 1) * chunk_size])))  # the chain: a chunk and its head
            if hit and k < usable and key in seen:
                matched += 1
            else:
                hit = False
            seen.add(key)
        out.append(matched * chunk_size)
    return out


def summarize(
    results: list[ClientResult],
    *,
    percentiles: tuple[float, ...] = (90, 99),
    slo: Slo | None = None,
    info: dict | None = None,
    detail: bool = False,
    server_tenants: dict | None = None,
    server_metrics_error: str | None = None,
    server_router: dict | None = None,
    oracle: tuple[dict[int, tuple[str | None, Sequence[int]]], int] | None = None,
) -> dict:
    """One run's report from every client's records. detail: also the raw per-request lists
    (vLLM's input_lens, output_lens, ttfts, itls, errors, ours besides), for plots and merges.
    server_tenants: the server's per-tenant counts over the run (`tenant_deltas`); and why
    they could not be read, if so. server_router: its router's predictions over the run
    (`router_deltas`). oracle: each request's (cache salt, prompt ids) by index, and the chunk
    size: the cached fraction a cache holding everything would give the completed requests, in
    the order they were sent (`oracle_cached_tokens`); None (text prompts): not known."""
    records = [r for res in results for r in res.records]
    duration = max((res.duration for res in results), default=0.0) or 1e-9
    ok = [r for r in records if r.ok]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    norm = [r.e2el / r.output_tokens for r in ok if r.output_tokens]
    good = None if slo is None else sum(map(slo.met, records))  # requests meeting every SLO
    report = dict(info or {})
    report |= {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if good is None else good / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrent_requests": _max_concurrency(records),
    }
    report |= _stats("ttft", [r.ttft for r in ok], percentiles)
    report |= _stats("tpot", [tpot(r) for r in ok if (r.output_tokens or 0) > 1], percentiles)
    report |= _stats("itl", [x for r in ok for x in r.itl], percentiles)
    report |= _stats("e2el", [r.e2el for r in ok], percentiles)
    report |= _stats("norm_latency", norm, percentiles)  # ms per output token, E2EL / output tokens
    report |= {
        "total_cached_tokens": cached,
        "cached_fraction": cached / total_in if total_in else 0.0,
        "oracle_cached_fraction": _oracle_fraction(records, oracle),
        **_tiers(ok, total_in),
        "goodput_fraction": None if good is None else good / max(1, len(records)),
        "slo": None if slo is None else slo.as_dict(),
        "errors_by_kind": dict(Counter(r.error_kind for r in records if r.error_kind is not None)),
        "rate_limited": sum(r.rate_limited for r in records),
        "tenants": _tenants(records),
        "server_tenants": server_tenants or {},
        "server_metrics_error": server_metrics_error,
        "predictions": _predictions(ok),
        "server_router": server_router or {},
        **_replicas(ok),
        "server_timing": _server_timing(ok),
        **_client_overhead(results),
    }
    if detail:
        report |= {
            "input_lens": [r.prompt_tokens for r in records],
            "output_lens": [r.output_tokens for r in records],
            "ttfts": [r.ttft for r in records],
            "itls": [r.itl for r in records],
            "e2els": [r.e2el for r in records],
            "errors": [r.error for r in records],
            "records": [r.as_dict() for r in records],
        }
    return report


def _tiers(ok: list[Record], total_in: int) -> dict:
    """Cached prompt tokens by tier, where the server says (ours: `cached_tokens_host` in usage;
    None where no response said): the host tier's total and fraction, and TTFT p50 / p90 of the
    requests by where their cache hits came from: `host` (some copied back from a host tier),
    `gpu` (cached, all in GPU memory), `miss` (nothing cached)."""
    host = _host_tokens(ok)
    if host is None:
        return {"total_cached_tokens_host": None, "cached_fraction_host": None, "ttft_by_tier": None}
    groups: dict[str, list[float]] = {"host": [], "gpu": [], "miss": []}
    for r in ok:
        tier = "host" if r.cached_tokens_host else "gpu" if r.cached_tokens else "miss"
        if r.ttft is not None:
            groups[tier].append(r.ttft * 1e3)
    by = {
        tier: {
            "requests": len(ms),
            "median_ttft_ms": float(np.median(ms)) if ms else None,
            "p90_ttft_ms": float(np.percentile(ms, 90)) if ms else None,
        }
        for tier, ms in groups.items()
    }
    return {
        "total_cached_tokens_host": host,
        "cached_fraction_host": host / total_in if total_in else 0.0,
        "ttft_by_tier": by,
    }


def _host_tokens(ok: list[Record]) -> int | None:
    """The cached prompt tokens of `ok` copied back from a host tier; None where no response said."""
    if all(r.cached_tokens_host is None for r in ok):
        return None
    return sum(r.cached_tokens_host or 0 for r in ok)


def _oracle_fraction(
    records: list[Record], oracle: tuple[dict[int, tuple[str | None, Sequence[int]]], int] | None
) -> float | None:
    if oracle is None:
        return None
    prompts, chunk_size = oracle
    # the order sent (the clients' clocks start together: one order over all of them)
    sent = sorted((r for r in records if r.sent is not None and r.index in prompts), key=lambda r: r.sent)
    hits = oracle_cached_tokens([prompts[r.index] for r in sent], chunk_size)
    ok = [(r, h) for r, h in zip(sent, hits) if r.ok]
    total = sum(len(prompts[r.index][1]) for r, _ in ok)
    return sum(h for _, h in ok) / total if total else None


def _tenants(records: list[Record]) -> dict:
    """Per tenant label: requests, completed, rate_limited (429s; the longest Retry-After),
    prompt and cached tokens (of those, a host tier's: None where not said), hit rate (cached /
    prompt, from usage), TTFT p50 / p99 and TPOT p50 of its completed requests."""
    per: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        if r.tenant is not None:
            per[r.tenant].append(r)
    out = {}
    for tenant, recs in sorted(per.items()):
        ok = [r for r in recs if r.ok]
        prompt, cached = sum(r.prompt_tokens or 0 for r in ok), sum(r.cached_tokens or 0 for r in ok)
        host = _host_tokens(ok)
        waits = [r.retry_after for r in recs if r.rate_limited and r.retry_after is not None]
        ttfts = np.asarray([r.ttft for r in ok], dtype=float) * 1e3
        tpots = np.asarray([tpot(r) for r in ok if (r.output_tokens or 0) > 1], dtype=float) * 1e3
        out[tenant] = {
            "requests": len(recs),
            "completed": len(ok),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "cached_tokens_host": host,
            "rate_limited": sum(r.rate_limited for r in recs),
            "max_retry_after_s": max(waits, default=None),
            "failed": sum(not r.ok and not r.rate_limited for r in recs),
            "median_ttft_ms": float(np.median(ttfts)) if ttfts.size else 0.0,
            "p99_ttft_ms": float(np.percentile(ttfts, 99)) if ttfts.size else 0.0,
            "median_tpot_ms": float(np.median(tpots)) if tpots.size else 0.0,
        }
    return out


# -- the server's per-tenant counters (its /metrics) -----------------------------------------
_TENANT_SAMPLES = {
    "chunkserve_tenant_requests_total": "requests",
    "chunkserve_tenant_prompt_tokens_total": "prompt_tokens",
    "chunkserve_tenant_cached_prompt_tokens_total": "cached_prompt_tokens",
    "chunkserve_tenant_generated_tokens_total": "generated_tokens",
    "chunkserve_tenant_rejected_requests_total": "rejected",
}
_SAMPLE = re.compile(r"^(chunkserve_tenant_\w+_total)\{(.*)\}\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

# (sample, tenant, code or None, replica) -> value
TenantCounters = dict[tuple[str, str, str | None, str | None], float]


def tenant_counters(text: str) -> TenantCounters | None:
    """The chunkserve_tenant_* samples of Prometheus text ({(sample, tenant, code, replica):
    value}); None when the text declares none of those families (a server without them, or not
    Prometheus text at all). Lines it does not know are passed over."""
    declared, out = False, {}
    for line in text.splitlines():
        if line.startswith("# TYPE chunkserve_tenant_"):
            declared = True
            continue
        m = _SAMPLE.match(line)
        if m is None or m.group(1) not in _TENANT_SAMPLES:
            continue
        labels = {k: re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], v) for k, v in _LABEL.findall(m.group(2))}
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if "tenant" in labels:
            declared = True
            out[m.group(1), labels["tenant"], labels.get("code"), labels.get("replica")] = value
    return out if declared else None


def tenant_deltas(before: TenantCounters | None, after: TenantCounters | None) -> dict:
    """Per tenant, what its counters grew by between two scrapes, summed over replicas: requests,
    prompt_tokens, cached_prompt_tokens, hit_rate (cached / prompt), generated_tokens, rejected
    {code: n}. A series that went down is a replica restarted (a counter reset): its growth is
    its value after. Tenants whose counters did not grow are left out; {} without counters."""
    if after is None:
        return {}
    before = before or {}
    grown: dict[str, dict] = {}
    for key, value in after.items():
        sample, tenant, code, _ = key
        prev = before.get(key, 0.0)
        delta = value - prev if value >= prev else value
        if delta <= 0:
            continue
        t = grown.setdefault(tenant, {})
        field = _TENANT_SAMPLES[sample]
        if field == "rejected":
            rejected = t.setdefault("rejected", {})
            rejected[code or "unknown"] = rejected.get(code or "unknown", 0) + delta
        else:
            t[field] = t.get(field, 0) + delta
    out = {}
    for tenant, t in sorted(grown.items()):
        row = {f: _num(t.get(f, 0)) for f in ("requests", "prompt_tokens", "cached_prompt_tokens")}
        row["hit_rate"] = row["cached_prompt_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
        row["generated_tokens"] = _num(t.get("generated_tokens", 0))
        row["rejected"] = {code: _num(n) for code, n in sorted(t.get("rejected", {}).items())}
        out[tenant] = row
    return out


# -- the router's predictions -------------------------------------------------------------------
def _predictions(ok: list[Record]) -> dict:
    """Over the completed requests whose response carried the router's prediction: how many, and
    how many predicted their cached tokens exactly, more or fewer, with the mean |error| in
    tokens; {} when none did (a server without the header)."""
    pairs = [(r.predicted_cached_tokens, r.cached_tokens or 0) for r in ok if r.predicted_cached_tokens is not None]
    if not pairs:
        return {}
    exact = sum(p == c for p, c in pairs)
    return {
        "requests": len(pairs),
        "exact": exact,
        "exact_fraction": exact / len(pairs),
        "over": sum(p > c for p, c in pairs),
        "under": sum(p < c for p, c in pairs),
        "mean_abs_error_tokens": sum(abs(p - c) for p, c in pairs) / len(pairs),
    }


_ROUTER_SAMPLES = {
    "chunkserve_router_predictions_total": "requests",
    "chunkserve_router_predicted_cached_tokens_total": "predicted_cached_tokens",
    "chunkserve_router_reported_cached_tokens_total": "reported_cached_tokens",
}
_ROUTER_SAMPLE = re.compile(r"^(chunkserve_router_\w+_total)\{(.*)\}\s+(\S+)(?:\s+\S+)?$")
AGREEMENTS = ("exact", "within_chunk", "over", "under")  # (chunkserve.cluster.metrics.AGREEMENTS)

# (sample, agreement or None, replica) -> value
RouterCounters = dict[tuple[str, str | None, str | None], float]


def router_counters(text: str) -> RouterCounters | None:
    """The chunkserve_router_* counter samples of Prometheus text; None when the text declares
    none of them (a server without them)."""
    declared, out = False, {}
    for line in text.splitlines():
        if line.startswith("# TYPE chunkserve_router_"):
            declared = True
            continue
        m = _ROUTER_SAMPLE.match(line)
        if m is None or m.group(1) not in _ROUTER_SAMPLES:
            continue
        labels = dict(_LABEL.findall(m.group(2)))  # (ids and agreement names: nothing escaped)
        try:
            out[m.group(1), labels.get("agreement"), labels.get("replica")] = float(m.group(3))
        except ValueError:
            continue
        declared = True
    return out if declared else None


def router_deltas(before: RouterCounters | None, after: RouterCounters | None) -> dict:
    """What the router's prediction counters grew by between two scrapes, summed over ingress
    replicas: requests, each agreement's count, `agreement` (the exact share) and
    `within_one_chunk` (exact or within a chunk), predicted and reported cached tokens. A series
    that went down is a replica restarted (a counter reset): its growth is its value after. {}
    without counters, or when no prediction was counted."""
    if after is None:
        return {}
    before = before or {}
    grown: dict[str, float] = {}
    for key, value in after.items():
        sample, agreement, _ = key
        prev = before.get(key, 0.0)
        delta = value - prev if value >= prev else value
        field = _ROUTER_SAMPLES[sample]
        grown[field] = grown.get(field, 0) + delta
        if agreement is not None:
            grown[agreement] = grown.get(agreement, 0) + delta
    n = grown.get("requests", 0)
    if not n:
        return {}
    return {
        "requests": _num(n),
        **{a: _num(grown.get(a, 0)) for a in AGREEMENTS},
        "agreement": grown.get("exact", 0) / n,
        "within_one_chunk": (grown.get("exact", 0) + grown.get("within_chunk", 0)) / n,
        "predicted_cached_tokens": _num(grown.get("predicted_cached_tokens", 0)),
        "reported_cached_tokens": _num(grown.get("reported_cached_tokens", 0)),
    }


def _num(x: float) -> int | float:
    """Counts as ints (the text writes them as floats: 4.0)."""
    return int(x) if float(x).is_integer() else x


def _replicas(ok: list[Record]) -> dict:
    """Requests and tokens per serving replica (the ingress's header), and how even they are."""
    per: dict = defaultdict(lambda: {"requests": 0, "prompt_tokens": 0, "output_tokens": 0})
    for r in ok:
        for rep in (r.replica or "unknown").split(","):
            p = per[rep]
            p["requests"] += 1
            p["prompt_tokens"] += r.prompt_tokens or 0
            p["output_tokens"] += r.output_tokens or 0
    counts = [p["requests"] for p in per.values()]
    mean = sum(counts) / len(counts) if counts else 0.0
    return {
        "replicas": dict(sorted(per.items())),
        "replica_requests_max": max(counts, default=0),
        "replica_requests_mean": mean,
        "replica_requests_max_over_mean": max(counts) / mean if mean else 0.0,
    }


def _server_timing(ok: list[Record]) -> dict:
    """Median and p99 ms of each Server-Timing metric over the requests that carried it, and
    `outside`: the client's TTFT less the server's prepare + first-output (the HTTP proxy, the
    network and this client), where both are known. {} when no response carried the header."""
    per: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        timing = r.server_timing or {}
        for name, seconds in timing.items():
            per[name].append(seconds)
        if "prepare" in timing and "first-output" in timing:
            per["outside"].append(r.ttft - timing["prepare"] - timing["first-output"])
    return {
        name: {"median_ms": float(np.median(v)) * 1e3, "p99_ms": float(np.percentile(v, 99)) * 1e3, "requests": len(v)}
        for name, v in per.items()
    }


def _client_overhead(results: list[ClientResult]) -> dict:
    lags = np.asarray([r.dispatch_lag for res in results for r in res.records if r.dispatch_lag is not None]) * 1e3
    clients = [
        {
            "client": res.client,
            "node": res.node,
            "url": res.url,
            "requests": len(res.records),
            "duration": res.duration,
            "cpu_s": res.cpu_s,
            "cpu_util": res.cpu_s / max(res.duration, 1e-9),
        }
        for res in results
    ]
    return {
        "client_dispatch_lag_p50_ms": float(np.median(lags)) if lags.size else 0.0,
        "client_dispatch_lag_p99_ms": float(np.percentile(lags, 99)) if lags.size else 0.0,
        "client_dispatch_lag_max_ms": float(lags.max()) if lags.size else 0.0,
        "client_cpu_util_max": max((c["cpu_util"] for c in clients), default=0.0),
        "clients": clients,
    }


def sweep_summary(runs: list[dict], norm_latency_slo_ms: float = 40.0) -> dict:
    """Over a sweep's runs: the highest request throughput at a mean normalized latency within
    the SLO (ms per output token), and each run's rate, throughput and latencies in one table."""
    within = [r for r in runs if r["completed"] and r["mean_norm_latency_ms"] <= norm_latency_slo_ms]
    best = max(within, key=lambda r: r["request_throughput"], default=None)
    keys = (
        "request_rate",
        "max_concurrency",
        "request_throughput",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_norm_latency_ms",
        "cached_fraction",
        "oracle_cached_fraction",
        "failed",
    )
    return {
        "norm_latency_slo_ms": norm_latency_slo_ms,
        "max_request_throughput_within_slo": None if best is None else best["request_throughput"],
        "at_request_rate": None if best is None else best["request_rate"],
        "table": [{k: r.get(k) for k in keys} for r in runs],
    }


def finite_or_none(x: float) -> float | None:
    """JSON has no infinity: an infinite rate is written as null (vLLM writes "inf")."""
    return None if x is None or math.isinf(x) else x
