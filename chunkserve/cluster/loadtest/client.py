"""One load-test client: sends its requests at their scheduled times over streaming HTTP, records each.

Pure asyncio + httpx. Every latency is measured on this client's own monotonic clock, from the
moment its request is sent: TTFT to the first chunk with choices, each inter-chunk gap after
it (ITL), E2EL to the end of the stream. Token counts come from the stream's `usage` chunk
(`stream_options.include_usage`), the serving replica from the `x-chunkserve-replica` header,
and the server's account of the time to first output from its `Server-Timing` header.

Tenants: a request of a tenant label (the workload's: `t0`, `t1`, ... of `tenants`) is sent
with that tenant's API key where one is given (`ClientOptions.tenant_keys`, or
`tenant_key_prefix` + the label), else the run's own (`api_key`), and with `cache_salt` = its
label if asked (`cache_salt_per_tenant`). A 429 is recorded as a rate-limited rejection
(`Record.rate_limited`) with its `Retry-After` in seconds, not retried: the schedule goes on.

Bounded: each request has a timeout, and the whole run `max_duration`: what is still in
flight then is cancelled and recorded as such, what was never sent as `not_sent`, so every
request is accounted for. A session's turn waits for its previous turn (`Request.after`) when
both are this client's.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from chunkserve.cluster.loadtest.render import Request

# (chunkserve.cluster.ingress's, not imported: the tool runs without Serve)
REPLICA_HEADER = "x-chunkserve-replica"
PREDICTED_HEADER = "x-chunkserve-predicted-cached-tokens"  # (chunkserve.cluster.ingress.PREDICTED_HEADER)
TIMING_HEADER = "server-timing"  # (chunkserve.cluster.ingress.TIMING_HEADER)


def predicted_tokens(header: str | None) -> int | None:
    """The prediction header's tokens (per choice, comma-separated: summed); None without one."""
    if not header:
        return None
    try:
        return sum(int(v) for v in header.split(","))
    except ValueError:
        return None


def server_timing(header: str | None) -> dict[str, float] | None:
    """A W3C Server-Timing header -> {metric: seconds} for the metrics that carry a `dur` (ms);
    None without the header. Unparsable entries are left out."""
    if not header:
        return None
    out = {}
    for entry in header.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur" and name:
                try:
                    out[name] = float(value.strip().strip('"')) / 1e3
                except ValueError:
                    pass
    return out


@dataclass
class Record:
    """One request's outcome. Times in seconds; `scheduled` and `sent` from the client's start."""

    index: int
    scheduled: float
    tenant: str | None = None
    session: int | None = None
    client: int = 0
    sent: float | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_host: int | None = None  # of cached_tokens, from the replica's host tier (ours; None: not said)
    output_tokens: int | None = None
    status: int | None = None  # HTTP status, None without a response
    error_kind: str | None = None  # None: success; else the status code or connect / timeout / stream / ...
    error: str | None = None  # what went wrong (the error body's message, trimmed)
    replica: str | None = None
    predicted_cached_tokens: int | None = None  # the server's router's prediction of cached_tokens (its header)
    server_timing: dict[str, float] | None = None  # the response's Server-Timing, seconds by metric
    dispatch_lag: float | None = None  # how late the client got to it past its scheduled time
    retry_after: float | None = None  # a 429's Retry-After, seconds (None: no 429, or no header)

    @property
    def ok(self) -> bool:
        return self.error_kind is None and self.e2el is not None

    @property
    def rate_limited(self) -> bool:
        """Refused by the server's rate limits (429): a rejection, not a broken request."""
        return self.status == 429

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        return cls(**d)


@dataclass(frozen=True)
class ClientOptions:
    model: str  # the served model's name, sent in every request (OpenAI's API requires it)
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    request_timeout: float = 300.0  # seconds a request may take in all
    connect_timeout: float = 10.0
    extra_body: dict = field(default_factory=dict)
    tenant_keys: dict[str, str] = field(default_factory=dict)  # tenant label -> its API key
    tenant_key_prefix: str | None = None  # else: a labelled request's key is this + its label
    cache_salt_per_tenant: bool = False  # send `cache_salt`: the request's tenant label

    def key(self, tenant: str | None = None) -> str | None:
        """The API key a request of `tenant` (a workload's label, None: none) is sent with."""
        if tenant is not None:
            if tenant in self.tenant_keys:
                return self.tenant_keys[tenant]
            if self.tenant_key_prefix is not None:
                return self.tenant_key_prefix + tenant
        return self.api_key

    def headers(self, tenant: str | None = None) -> dict[str, str]:
        key = self.key(tenant)
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class ClientResult:
    records: list[Record]
    duration: float  # this client's start to its last request's end (its own clock)
    cpu_s: float  # the client process's CPU time over the run
    client: int = 0
    node: str | None = None
    url: str | None = None


def http_client(options: ClientOptions, connections: int | None = None) -> httpx.AsyncClient:
    timeout = httpx.Timeout(options.request_timeout, connect=options.connect_timeout)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(timeout=timeout, limits=limits)


def request_body(req: Request, options: ClientOptions) -> dict:
    body = {
        "model": options.model,
        "max_tokens": req.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": options.temperature,
        "ignore_eos": options.ignore_eos,
        **options.extra_body,
    }
    if options.cache_salt_per_tenant and req.tenant is not None:
        body["cache_salt"] = req.tenant
    if req.messages is not None:
        body["messages"] = req.messages
    else:
        body["prompt"] = req.prompt
    return body


async def send(
    client: httpx.AsyncClient,
    url: str,
    req: Request,
    rec: Record,
    options: ClientOptions,
    clock: Callable[[], float] = time.perf_counter,
) -> None:
    """Send one streaming request and fill `rec` (never raises but for cancellation)."""
    start = clock()
    last = None
    done = False
    try:
        async with client.stream(
            "POST", url + req.path, json=request_body(req, options), headers=options.headers(req.tenant)
        ) as resp:
            rec.status = resp.status_code
            rec.replica = resp.headers.get(REPLICA_HEADER)
            rec.predicted_cached_tokens = predicted_tokens(resp.headers.get(PREDICTED_HEADER))
            rec.server_timing = server_timing(resp.headers.get(TIMING_HEADER))
            if resp.status_code == 429:
                rec.retry_after = retry_after_s(resp.headers.get("retry-after"))
            if resp.status_code != 200:
                rec.error_kind, rec.error = str(resp.status_code), _message(await resp.aread())
                return
            chunks = 0
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                now = clock()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec.error_kind, rec.error = "stream", _message(data.encode())
                    break
                if event.get("choices"):
                    if rec.ttft is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    chunks += 1
                usage = event.get("usage")
                if usage:
                    rec.prompt_tokens = usage.get("prompt_tokens")
                    rec.output_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens")
                    rec.cached_tokens_host = details.get("cached_tokens_host")
            rec.e2el = clock() - start
            if rec.error_kind is None and not done:
                rec.error_kind, rec.error = "disconnected", "the stream ended before [DONE]"
            elif rec.error_kind is None and rec.output_tokens is None:
                rec.output_tokens = chunks  # (a server that sends no usage: a token a chunk)
    except asyncio.CancelledError:
        rec.error_kind, rec.error = "cancelled", "cancelled in flight: the run reached its max duration"
        raise
    except httpx.ConnectError as e:
        rec.error_kind, rec.error = "connect", str(e) or type(e).__name__
    except httpx.TimeoutException as e:
        rec.error_kind, rec.error = "timeout", f"{type(e).__name__} after {clock() - start:.1f} s"
    except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError) as e:
        rec.error_kind, rec.error = "disconnected", f"{type(e).__name__}: {e}"


# (chunkserve.cluster.metrics.CACHE_S: a scrape within this of the last one gets that one's text)
METRICS_CACHE_S = 1.0


async def scrape_metrics(client: httpx.AsyncClient, url: str, key: str | None = None) -> tuple[str | None, str | None]:
    """GET url/metrics (with `key` as a Bearer token: a server's metrics_api_key) -> (its text,
    None), or (None, what went wrong): a server without /metrics is no error of the run's."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = await client.get(url + "/metrics", headers=headers)
    except httpx.HTTPError as e:
        return None, f"GET {url}/metrics: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, f"GET {url}/metrics: HTTP {r.status_code}: {_message(r.content)[:200]}"
    return r.text, None


def retry_after_s(header: str | None, now: float | None = None) -> float | None:
    """A Retry-After header in seconds: delay-seconds, or an HTTP date (seconds from `now`, wall
    clock, at least 0); None without one or unparsable."""
    if not header:
        return None
    header = header.strip()
    with contextlib.suppress(ValueError):
        return max(0.0, float(header))
    try:
        when = email.utils.parsedate_to_datetime(header)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _message(body: bytes) -> str:
    """An error body's message (OpenAI's {"error": {"message"}}), else the body, trimmed."""
    text = body.decode("utf-8", errors="replace")
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(text)["error"]["message"])[:500]
    return text[:500]


async def run_client(
    requests: list[Request],
    offsets: list[float],
    urls: list[str],
    options: ClientOptions,
    *,
    max_concurrency: int | None = None,
    max_duration: float = 600.0,
    client_index: int = 0,
    progress: Callable[[Record], None] | None = None,
    client: httpx.AsyncClient | None = None,
) -> ClientResult:
    """Send each request at its offset (seconds from now) to urls[i % len(urls)], at most
    max_concurrency in flight; stop at max_duration. Returns a record for every request."""
    if len(offsets) != len(requests):
        raise ValueError(f"{len(requests)} requests but {len(offsets)} offsets")
    if not urls:
        raise ValueError("no URL to send to")
    own = client is None
    client = client or http_client(options, max_concurrency)
    clock = time.perf_counter
    cpu0, t0 = time.process_time(), clock()
    order = sorted(range(len(requests)), key=lambda i: offsets[i])
    records = {r.index: Record(r.index, offsets[i], r.tenant, r.session, client_index) for i, r in enumerate(requests)}
    waited = {r.after for r in requests if r.after is not None}
    finished = {i: asyncio.Event() for i in waited if i in records}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    tasks: list[asyncio.Task] = []
    end = t0

    async def one(k: int, req: Request) -> None:
        nonlocal end
        rec = records[req.index]
        try:
            if req.after in finished:
                await finished[req.after].wait()
            async with sem or contextlib.nullcontext():
                rec.sent = clock() - t0
                await send(client, urls[k % len(urls)], req, rec, options, clock)
        finally:
            end = max(end, clock())
            if req.index in finished:
                finished[req.index].set()
            if progress is not None:
                progress(rec)

    async def dispatch() -> None:
        for k in order:
            due = t0 + offsets[k]
            if (delay := due - clock()) > 0:
                await asyncio.sleep(delay)
            records[requests[k].index].dispatch_lag = max(0.0, clock() - due)
            tasks.append(asyncio.create_task(one(k, requests[k])))
        await asyncio.gather(*tasks)

    try:
        await asyncio.wait_for(dispatch(), timeout=max_duration)
    except asyncio.TimeoutError:  # (TimeoutError itself from Python 3.11 on)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if own:
            await client.aclose()
    for rec in records.values():
        if rec.sent is None and rec.error_kind is None:
            rec.error_kind, rec.error = "not_sent", "the run reached its max duration before this request was sent"
    return ClientResult([records[r.index] for r in requests], end - t0, time.process_time() - cpu0, client_index)
