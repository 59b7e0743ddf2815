"""`python -m chunkserve.cluster.loadtest`: the command line (see the package docstring for what it measures)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx

from chunkserve.cluster.loadtest import traces
from chunkserve.cluster.loadtest import workloads as wl
from chunkserve.cluster.loadtest.client import (
    METRICS_CACHE_S,
    ClientOptions,
    ClientResult,
    Record,
    http_client,
    run_client,
    scrape_metrics,
)
from chunkserve.cluster.loadtest.metrics import (
    Slo,
    router_counters,
    router_deltas,
    summarize,
    sweep_summary,
    tenant_counters,
    tenant_deltas,
)
from chunkserve.cluster.loadtest.render import ENDPOINTS, FORMATS, Renderer, Request, server_has_tokenizer

DEFAULT_URL = "http://127.0.0.1:8000"


def _positive(kind: type, what: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not x > 0:
            raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text}")
        return x

    return parse


def _rates(text: str) -> list[float]:
    rate = _positive(float, "every sweep rate")
    rates = [rate(t) for t in text.replace(" ", "").split(",") if t]
    if not rates:
        raise argparse.ArgumentTypeError("--sweep takes a comma-separated list of rates, e.g. 2,4,8")
    return rates


def _token_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-range takes LO:HI, got {text!r}") from None
    if not 0 <= lo < hi:
        raise argparse.ArgumentTypeError(f"--token-range needs 0 <= LO < HI, got {text!r}")
    return lo, hi


def _window(text: str) -> tuple[float, float]:
    try:
        return traces.parse_window(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slo(text: str) -> Slo:
    try:
        return Slo.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.cluster.loadtest",
        description="Load test an OpenAI-compatible server with multi-tenant shared-prefix traffic.",
    )
    pint, pfloat = _positive(int, "the value"), _positive(float, "the value")
    g = ap.add_argument_group("server")
    g.add_argument(
        "--url",
        action="append",
        help=f"base URL (repeat, or comma-separate, to spread over several; "
        f"default {DEFAULT_URL}, or with --address each node's proxy)",
    )
    g.add_argument("--address", help="Ray cluster address (auto, or host:port): client actors on its nodes")
    g.add_argument("--clients", type=pint, help="client actors with --address (default: one per node)")
    g.add_argument("--port", type=pint, default=8000, help="each node's Serve HTTP port (--address without --url)")
    g.add_argument("--model", help="the `model` to send (default: the server's first, from /v1/models)")
    g.add_argument(
        "--api-key",
        default=os.environ.get("CHUNKSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $CHUNKSERVE_API_KEY or $OPENAI_API_KEY)",
    )
    keys = g.add_mutually_exclusive_group()
    keys.add_argument(
        "--tenant-key-prefix",
        help="send each tenant's requests with key PREFIX + its label (the tenants workload's t0, t1, ...; "
        "gsp's g0, ...; a trace's tenant); requests without a tenant use --api-key",
    )
    keys.add_argument(
        "--tenant-keys",
        metavar="FILE",
        help='a JSON object {"<tenant label>": "<its API key>", ...}: each tenant\'s requests sent with its '
        "key (tenants it does not name: --api-key)",
    )
    g.add_argument(
        "--cache-salt-per-tenant",
        action="store_true",
        help="send each request's tenant label as its cache_salt (vLLM's): tenants' prompts never share cache",
    )
    g.add_argument(
        "--metrics-key",
        default=os.environ.get("CHUNKSERVE_METRICS_KEY"),
        help="Bearer token for the server's /metrics, read before and after each run for the per-tenant "
        "server counts (a chunkserve server's metrics_api_key; default: $CHUNKSERVE_METRICS_KEY)",
    )
    g.add_argument(
        "--metrics-settle",
        type=float,
        default=10.0,
        help="seconds to wait after a run for the server's /metrics to count every answered request",
    )
    g = ap.add_argument_group("workload")
    g.add_argument("--workload", choices=wl.WORKLOADS, default="gsp")
    g.add_argument(
        "--dataset",
        help="a JSON-lines trace instead of a workload (prompt or messages, max_tokens, optional timestamp and "
        "tenant), or Mooncake's or Bailian's block trace (--trace-format)",
    )
    g.add_argument("--num-prompts", type=pint, help="requests per run (default: the workload's own)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--prompt-format",
        choices=FORMATS,
        default="auto",
        help="text (the server's tokenizer makes exact lengths) or token ids; auto: text where the server tokenizes",
    )
    g.add_argument(
        "--endpoint",
        choices=ENDPOINTS,
        default="auto",
        help="auto: chat for multi-turn text (tenants), completions otherwise",
    )
    g.add_argument("--token-range", type=_token_range, default=(32, 127), help="ids of token prompts, LO:HI")
    g.add_argument("--gsp-num-groups", type=pint, default=wl.Gsp.num_groups)
    g.add_argument("--gsp-prompts-per-group", type=pint, default=wl.Gsp.prompts_per_group)
    g.add_argument("--gsp-system-prompt-len", type=pint, default=wl.Gsp.system_prompt_len)
    g.add_argument("--gsp-question-len", type=pint, default=wl.Gsp.question_len)
    g.add_argument("--gsp-output-len", type=pint, default=wl.Gsp.output_len)
    g.add_argument("--tenants", type=pint, default=wl.Tenants.num_tenants)
    g.add_argument("--tenant-prompt-len", type=pint, default=wl.Tenants.prompt_len)
    g.add_argument("--tenant-zipf", type=float, default=wl.Tenants.zipf)
    g.add_argument("--tenant-turns", type=pint, default=wl.Tenants.turns)
    g.add_argument("--tenant-turn-len", type=pint, default=wl.Tenants.turn_len)
    g.add_argument("--tenant-output-len", type=pint, default=wl.Tenants.output_len)
    g.add_argument("--tenant-active-sessions", type=pint, default=wl.Tenants.active_sessions)
    g.add_argument("--prefix-repetition-prefix-len", type=pint, default=wl.PrefixRepetition.prefix_len)
    g.add_argument("--prefix-repetition-suffix-len", type=pint, default=wl.PrefixRepetition.suffix_len)
    g.add_argument("--prefix-repetition-num-prefixes", type=pint, default=wl.PrefixRepetition.num_prefixes)
    g.add_argument("--prefix-repetition-output-len", type=pint, default=wl.PrefixRepetition.output_len)
    g.add_argument("--random-input-len", type=pint, default=wl.Random_.input_len)
    g.add_argument("--random-output-len", type=pint, default=wl.Random_.output_len)
    g.add_argument("--random-range-ratio", type=float, default=wl.Random_.range_ratio)
    g.add_argument("--random-prefix-len", type=int, default=wl.Random_.prefix_len)
    g.add_argument("--output-len", type=pint, default=128, help="a trace line's max_tokens when it has none")
    g.add_argument(
        "--trace-format",
        choices=traces.FORMATS,
        default="auto",
        help="the --dataset's format: jsonl (above), mooncake or bailian (block traces: timestamp, "
        "input_length, output_length, hash_ids); auto: from its first line",
    )
    g.add_argument(
        "--trace-block-size",
        type=pint,
        help="tokens per hash id of a block trace (default the format's: mooncake 512, bailian 16)",
    )
    g.add_argument(
        "--trace-window",
        type=_window,
        metavar="START:END",
        help="only the trace's requests in these seconds of it (from its first request; either side "
        "may be left out), the first sent at 0",
    )
    g.add_argument(
        "--max-input-len",
        type=pint,
        help="drop a block trace's requests of longer prompts (counted in the report)",
    )
    ap.set_defaults(trace_info={})
    g = ap.add_argument_group("arrivals")
    g.add_argument(
        "--request-rate", type=pfloat, default=math.inf, help="requests per second (default inf: all at once)"
    )
    g.add_argument("--burstiness", type=pfloat, default=1.0, help="gamma shape of the gaps: 1 Poisson, < 1 burstier")
    g.add_argument("--max-concurrency", type=pint, help="requests in flight at most (over all clients)")
    g.add_argument("--sweep", type=_rates, help="run each of these rates in turn, e.g. 2,4,8,16")
    g.add_argument("--replay", action="store_true", help="a trace's timestamps set the send times")
    g.add_argument(
        "--replay-speed", type=pfloat, default=1.0, help="with --replay: the trace's pace times this (2: twice as fast)"
    )
    g.add_argument(
        "--same-prompts",
        action="store_true",
        help="every run of a sweep sends the same content (default: fresh content per run, so no run "
        "finds another's prompts cached)",
    )
    g = ap.add_argument_group("goodput")
    g.add_argument(
        "--goodput",
        type=_slo,
        help="SLOs a good request meets: ttft:S,tpot:MS,e2el:S "
        "(TTFT and E2EL in seconds, TPOT in ms, unless suffixed ms or s)",
    )
    g.add_argument(
        "--search-goodput",
        type=pfloat,
        metavar="P",
        help="find the highest rate at which P %% of the requests meet --goodput",
    )
    g.add_argument("--search-max-rate", type=pfloat, default=1024.0)
    g.add_argument("--search-probes", type=pint, default=8, help="runs the search makes at most")
    g.add_argument(
        "--norm-latency-slo",
        type=pfloat,
        default=40.0,
        help="a sweep's summary: the highest throughput at this mean ms per output token at most",
    )
    g = ap.add_argument_group("sending")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="outputs run to max_tokens (default on: fixed output lengths)",
    )
    g.add_argument(
        "--token-ids",
        action="store_true",
        help="ask for each chunk's token ids (return_token_ids, a vLLM extension): a chunk per token "
        "even where its text is empty, so ITLs are per token",
    )
    g.add_argument("--request-timeout", type=pfloat, default=300.0, help="seconds one request may take")
    g.add_argument(
        "--oracle-chunk-size",
        type=pint,
        default=64,
        help="the chunk (block) size of the oracle's cached fraction, reported beside the server's for "
        "token prompts: one cache holding every earlier prompt (chunkserve's chunk_size; vLLM's block is 16)",
    )
    g.add_argument(
        "--max-duration",
        type=pfloat,
        default=600.0,
        help="seconds a run may take: then what is in flight is cancelled and reported",
    )
    g = ap.add_argument_group("output")
    g.add_argument("--save-result", help="write each run's report (with per-request lists) to this JSON-lines file")
    g.add_argument("--plot", help="write PNG plots into this directory (needs matplotlib)")
    g.add_argument("--label", help="a name for the runs, kept in the report")
    g.add_argument("--metric-percentiles", default="90,99", help="percentiles of every latency, e.g. 50,90,99")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--client-capacity",
        action="store_true",
        help="only measure how fast this process drives requests against a stub endpoint, and exit",
    )
    return ap


def _check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.search_goodput is not None and args.goodput is None:
        ap.error("--search-goodput needs --goodput (the SLOs)")
    if args.search_goodput is not None and not args.search_goodput <= 100:
        ap.error(f"--search-goodput is a percentage in (0, 100], got {args.search_goodput}")
    if args.search_goodput is not None and args.sweep:
        ap.error("--search-goodput chooses the rates itself: drop --sweep")
    if args.replay and (args.dataset is None or args.sweep or args.search_goodput):
        ap.error("--replay takes a --dataset's timestamps, without --sweep or --search-goodput")
    if args.replay_speed != 1.0 and not args.replay:
        ap.error("--replay-speed paces --replay: give --replay")
    trace_flags = {
        "--trace-format": args.trace_format != "auto",
        "--trace-block-size": args.trace_block_size is not None,
        "--trace-window": args.trace_window is not None,
        "--max-input-len": args.max_input_len is not None,
    }
    if args.dataset is None and any(trace_flags.values()):
        ap.error(f"{', '.join(k for k, v in trace_flags.items() if v)} read a trace: give --dataset")
    if args.clients and not args.address:
        ap.error("--clients places client actors on a Ray cluster: give --address")
    if args.random_range_ratio < 0 or args.random_range_ratio >= 1:
        ap.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.random_prefix_len < 0:
        ap.error(f"--random-prefix-len must be >= 0, got {args.random_prefix_len}")
    try:
        args.percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    except ValueError:
        ap.error(f"--metric-percentiles takes numbers, e.g. 90,99; got {args.metric_percentiles!r}")
    if not all(0 < p < 100 for p in args.percentiles):
        ap.error(f"--metric-percentiles must be in (0, 100), got {args.metric_percentiles!r}")
    if args.metrics_settle < 0:
        ap.error(f"--metrics-settle must be >= 0, got {args.metrics_settle}")
    args.tenant_key_map = {}
    if args.tenant_keys:
        try:
            keys = json.loads(Path(args.tenant_keys).read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            ap.error(f"--tenant-keys {args.tenant_keys}: cannot read a JSON object: {e}")
        if not isinstance(keys, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()
        ):
            ap.error(f'--tenant-keys {args.tenant_keys}: must be a JSON object {{"<tenant label>": "<key>", ...}}')
        args.tenant_key_map = keys
    args.urls = [u.rstrip("/") for arg in args.url or [] for u in arg.split(",") if u]
    for u in args.urls:
        if not u.startswith(("http://", "https://")):
            ap.error(f"--url must start with http:// or https://, got {u!r}")


def workload(args: argparse.Namespace) -> list[wl.Spec]:
    if args.dataset:
        specs, args.trace_info = traces.load(
            args.dataset,
            args.trace_format,
            block_size=args.trace_block_size,
            default_max_tokens=args.output_len,
            window=args.trace_window,
            max_input_len=args.max_input_len,
            num=args.num_prompts,
        )
        if args.replay:
            args.trace_info["replay_speed"] = args.replay_speed
        return specs
    if args.workload == "gsp":
        gen = wl.Gsp(
            args.gsp_num_groups,
            args.gsp_prompts_per_group,
            args.gsp_system_prompt_len,
            args.gsp_question_len,
            args.gsp_output_len,
        )
    elif args.workload == "tenants":
        gen = wl.Tenants(
            args.tenants,
            args.tenant_prompt_len,
            args.tenant_zipf,
            args.tenant_turns,
            args.tenant_turn_len,
            args.tenant_output_len,
            args.tenant_active_sessions,
        )
    elif args.workload == "prefix_repetition":
        gen = wl.PrefixRepetition(
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.prefix_repetition_output_len,
        )
    else:
        gen = wl.Random_(args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len)
    return gen.specs(args.seed, args.num_prompts)


def connects(host: str, port: int) -> bool:
    """Whether something accepts TCP connections at host:port (IPv4 or IPv6)."""
    try:
        socket.create_connection((host, port), timeout=5).close()
    except OSError:
        return False
    return True


def loopback_only(url: str) -> str | None:
    """Why no request can reach `url` (a node's address: http://<node ip>:<port>, where --address
    sends) when that is because the server listens on 127.0.0.1 only, as a config binding it there
    does (http_options.host, ingress.http_host: configs/local.yaml); None when `url` takes
    connections, or when 127.0.0.1 does not either (then the requests' own errors say so)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname, parts.port or 80
    if host is None or host == "localhost" or host.startswith("127.") or host == "::1" or connects(host, port):
        return None
    if not connects("127.0.0.1", port):
        return None
    return (
        f"loadtest: --address sends to each node's address, and nothing listens at {host}:{port} (a node's) "
        f"while 127.0.0.1:{port} answers: the server's config binds 127.0.0.1 (Serve's http_options.host, "
        "or ingress.http_host), which a node's address does not reach. On one machine (a local cluster) "
        f"pass --url http://127.0.0.1:{port}; across machines serve on 0.0.0.0 (as configs/serve.yaml does)"
    )


async def served_model(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """The name of the model `url` serves, its /v1/models' first: every request names it (OpenAI's
    API requires `model`). Exits saying why when the server does not tell it (pass --model)."""
    try:
        r = await client.get(url + "/v1/models", headers=headers)
        if r.status_code == 200 and r.json().get("data"):
            return r.json()["data"][0]["id"]
        why = f"it answered {r.status_code}: {r.text[:200]}"
    except (httpx.HTTPError, ValueError) as e:
        why = f"{type(e).__name__}: {e}"
    raise SystemExit(f"loadtest: cannot learn the served model's name from {url}/v1/models ({why}); pass --model")


class Runner:
    """Runs one rate at a time against the server, in this process or from client actors."""

    def __init__(self, args: argparse.Namespace, specs: list[wl.Spec]):
        self.args, self.specs = args, specs
        self.options = ClientOptions(
            model=args.model or "",  # (none given: the server's first, asked in _prepare)
            api_key=args.api_key,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            request_timeout=args.request_timeout,
            extra_body={"return_token_ids": True} if args.token_ids else {},
            tenant_keys=args.tenant_key_map,
            tenant_key_prefix=args.tenant_key_prefix,
            cache_salt_per_tenant=args.cache_salt_per_tenant,
        )
        # the server's own requests (/v1/models, /tokenize): the run's key, else the first tenant's
        self.prep_tenant = None if args.api_key else next((s.tenant for s in specs if s.tenant is not None), None)
        self.urls = args.urls
        if args.address:
            from chunkserve.cluster.loadtest.distributed import node_urls  # Ray only where a cluster is asked for

            self.prep_url = (self.urls or node_urls(args.address, args.port))[0]
            why = None if self.urls else loopback_only(self.prep_url)
            if why is not None:
                raise SystemExit(why)
        else:
            self.urls = self.urls or [DEFAULT_URL]
            self.prep_url = self.urls[0]
        self.fmt = args.prompt_format
        self.runs = 0

    async def _prepare(self, seed: int) -> list[Request]:
        """The model name and prompt format (asked of the server once), then this run's requests."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=10.0)) as client:
            headers = self.options.headers(self.prep_tenant)
            if not self.options.model:
                self.options = replace(self.options, model=await served_model(client, self.prep_url, headers))
            if self.fmt == "auto":
                self.fmt = (
                    "text"
                    if await server_has_tokenizer(client, self.prep_url, headers, self.options.model)
                    else "tokens"
                )
            renderer = Renderer(self.fmt, seed, self.args.token_range, self.args.endpoint)
            await renderer.prepare(client, self.prep_url, self.specs, headers, self.options.model)
        return [renderer.request(s) for s in self.specs]

    def run(self, rate: float) -> dict:
        args = self.args
        seed = args.seed if args.same_prompts else args.seed + self.runs
        self.runs += 1
        requests = asyncio.run(self._prepare(seed))
        offsets = wl.Arrivals(rate, args.burstiness, args.replay, args.seed, args.replay_speed).offsets(self.specs)
        before = asyncio.run(self._scrape())
        bar = _progress(len(requests), args.no_progress)
        if args.address:
            from chunkserve.cluster.loadtest.distributed import run_on_cluster

            results = run_on_cluster(
                args.address,
                requests,
                offsets,
                self.options,
                clients=args.clients,
                urls=self.urls or None,
                port=args.port,
                max_concurrency=args.max_concurrency,
                max_duration=args.max_duration,
                progress=bar.set_done,
            )
        else:
            results = [self._in_process(requests, offsets, bar.step)]
        bar.close()
        server, router, error = asyncio.run(self._server_counts(before, [r for res in results for r in res.records]))
        salted = self.options.cache_salt_per_tenant
        oracle = (
            {q.index: (q.tenant if salted else None, q.prompt) for q in requests if isinstance(q.prompt, list)},
            args.oracle_chunk_size,
        )
        return summarize(
            results,
            percentiles=args.percentiles,
            slo=args.goodput,
            detail=True,
            info=self._info(rate, len(results)),
            server_tenants=server,
            server_metrics_error=error,
            server_router=router,
            oracle=oracle if self.fmt == "tokens" else None,
        )

    async def _scrape(self) -> tuple[str | None, str | None, float]:
        """The server's /metrics now: (its text, None) or (None, why not), and when (monotonic)."""
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0)) as client:
            text, error = await scrape_metrics(client, self.prep_url, self.args.metrics_key)
        return text, error, time.monotonic()

    async def _server_counts(
        self, before: tuple[str | None, str | None, float], records: list[Record]
    ) -> tuple[dict, dict, str | None]:
        """The server's per-tenant counts and its router's predictions over the run: its /metrics
        after less before. A server counts a request's tenant when its response has ended, so the
        text is read again (past the server's cache) until it has counted the requests it
        answered here (status 200 or 429), for at most --metrics-settle seconds; it counts a
        prediction at the first output, so by then all of them. -> (per tenant, the router's, why
        they are empty or short, if so); ({}, {}, None) for a server without those series (vLLM)."""
        text, error, at = before
        if text is None:
            return {}, {}, error
        first, first_router = tenant_counters(text), router_counters(text)
        if first is None and first_router is None:
            return {}, {}, None
        answered = sum(r.status in (200, 429) for r in records) if first is not None else 0
        deadline = time.monotonic() + self.args.metrics_settle
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0)) as client:
            while True:
                await asyncio.sleep(max(0.0, at + METRICS_CACHE_S + 0.05 - time.monotonic()))
                text, error = await scrape_metrics(client, self.prep_url, self.args.metrics_key)
                at = time.monotonic()
                if text is None:
                    return {}, {}, error
                deltas = tenant_deltas(first, tenant_counters(text)) if first is not None else {}
                router = router_deltas(first_router, router_counters(text))
                counted = sum(t["requests"] + sum(t["rejected"].values()) for t in deltas.values())
                if counted >= answered:
                    return deltas, router, None
                if at + METRICS_CACHE_S > deadline:
                    return (
                        deltas,
                        router,
                        (
                            f"after {self.args.metrics_settle:g} s the server's /metrics counted {counted} of the "
                            f"{answered} requests it answered"
                        ),
                    )

    def _in_process(self, requests: list[Request], offsets: list[float], step: Callable) -> ClientResult:
        args = self.args

        async def go() -> ClientResult:
            async with http_client(self.options, args.max_concurrency) as client:
                res = await run_client(
                    requests,
                    offsets,
                    self.urls,
                    self.options,
                    max_concurrency=args.max_concurrency,
                    max_duration=args.max_duration,
                    progress=lambda _: step(),
                    client=client,
                )
            res.url = ",".join(self.urls)
            return res

        return asyncio.run(go())

    def _info(self, rate: float, clients: int) -> dict:
        args = self.args
        return {
            "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai",
            "label": args.label,
            "model_id": self.options.model,
            "endpoint_type": "openai",
            "workload": "trace" if args.dataset else args.workload,
            "dataset": args.dataset,
            "prompt_format": self.fmt,
            "num_prompts": len(self.specs),
            "request_rate": "inf" if math.isinf(rate) else rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
            "num_clients": clients,
            "urls": self.urls or f"each node's :{args.port}",
            **args.trace_info,
        }


class _progress:
    """A tqdm bar on stderr (or nothing)."""

    def __init__(self, total: int, off: bool):
        self.bar = None
        if not off:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def set_done(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_BRIEF_DROP = ("input_lens", "output_lens", "ttfts", "itls", "e2els", "errors", "records")


def brief(report: dict) -> dict:
    """A report without its per-request lists (what goes to stdout)."""
    return {k: v for k, v in report.items() if k not in _BRIEF_DROP}


def search_goodput(runner: Runner, args: argparse.Namespace, emit: Callable[[dict], None]) -> dict:
    """The highest rate at which args.search_goodput % of requests meet the SLOs: doubling
    from the start rate until a run misses, then bisecting between the last pass and the first miss."""
    target = args.search_goodput / 100
    rate = args.request_rate if math.isfinite(args.request_rate) else 1.0
    passed = failed = None
    probes = []
    for _ in range(args.search_probes):
        report = runner.run(rate)
        emit(report)
        frac = report["goodput_fraction"]
        probes.append(
            {"request_rate": rate, "goodput_fraction": frac, "request_throughput": report["request_throughput"]}
        )
        if frac >= target:
            passed = rate
            if failed is None and rate * 2 > args.search_max_rate:
                break
            rate = rate * 2 if failed is None else (rate + failed) / 2
        else:
            failed = rate
            rate = rate / 2 if passed is None else (passed + rate) / 2
        if passed is not None and failed is not None and (failed - passed) / failed < 0.05:
            break
    return {
        "goodput_search": {
            "target_fraction": target,
            "slo": args.goodput.as_dict(),
            "best_request_rate": passed,
            "first_missed_rate": failed,
            "probes": probes,
        }
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    _check(ap, args)
    if args.client_capacity:
        from chunkserve.cluster.loadtest.capacity import measure

        print(json.dumps(measure()), flush=True)
        return 0
    try:
        specs = workload(args)
    except wl.TraceError as e:
        ap.error(str(e))
    if args.replay and any(s.timestamp is None for s in specs):
        ap.error(f"--replay needs a timestamp on every line of {args.dataset}")
    runner = Runner(args, specs)
    out = open(args.save_result, "w") if args.save_result else None  # noqa: SIM115 - written run by run
    runs: list[dict] = []

    def emit(report: dict) -> None:
        runs.append(report)
        print(json.dumps(brief(report)), flush=True)
        if out is not None:
            out.write(json.dumps(report) + "\n")
            out.flush()

    try:
        if args.search_goodput is not None:
            summary = search_goodput(runner, args, emit)
        else:
            for rate in args.sweep or [args.request_rate]:
                emit(runner.run(rate))
            summary = {"sweep": sweep_summary(runs, args.norm_latency_slo)} if args.sweep else None
        if summary is not None:
            print(json.dumps(summary), flush=True)
            if out is not None:
                out.write(json.dumps(summary) + "\n")
        if args.plot:
            from chunkserve.cluster.loadtest.plots import write_plots

            for path in write_plots(runs, Path(args.plot)):
                print(f"wrote {path}", file=sys.stderr)
    finally:
        if out is not None:
            out.close()
    if not any(r["completed"] for r in runs):
        print("no request completed: see errors_by_kind in the report", file=sys.stderr)
        return 1
    return 0
