"""Client actors on a Ray cluster: the load spread over nodes, results merged exactly.

`run_on_cluster` places one `ClientActor` per node (node affinity, round robin over the alive
nodes when asked for more or fewer), hands each its share of the requests (a session's turns
stay on one client) with their global send offsets, and a common start time. Each actor
waits for that start on its own wall clock, then measures everything on its own monotonic
clock, so clock offsets between nodes shift only when a client begins, never a latency. The
raw records come back and are summarized together (chunkserve.cluster.loadtest.metrics).

Each actor sends to its own node's Serve proxy (`http://<node ip>:<port>`, Serve's
`proxy_location: EveryNode`) unless URLs are given: then client i sends to urls[i % len].
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from chunkserve.cluster.loadtest.client import ClientOptions, ClientResult, Record, run_client
from chunkserve.cluster.loadtest.render import Request

START_LEAD_S = 2.0  # between handing out the shares and the common start


@ray.remote(num_cpus=0)
class ClientActor:
    def __init__(self, index: int):
        self.index, self.done = index, 0

    def node(self) -> tuple[str, str]:
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address()

    async def run(
        self,
        requests: list[Request],
        offsets: list[float],
        urls: list[str],
        options: ClientOptions,
        max_concurrency: int | None,
        max_duration: float,
        start_at: float,
    ) -> dict:
        await asyncio.sleep(max(0.0, start_at - time.time()))

        def progress(_: Record) -> None:
            self.done += 1

        res = await run_client(
            requests,
            offsets,
            urls,
            options,
            max_concurrency=max_concurrency,
            max_duration=max_duration,
            client_index=self.index,
            progress=progress,
        )
        return {"records": [r.as_dict() for r in res.records], "duration": res.duration, "cpu_s": res.cpu_s}

    async def progress(self) -> int:
        return self.done


def shares(requests: list[Request], n: int) -> list[list[int]]:
    """Which requests (positions) each of n clients sends: by session where there is one (a
    session's turns wait on each other, so they stay together), else round robin."""
    out: list[list[int]] = [[] for _ in range(n)]
    for i, r in enumerate(requests):
        out[(r.session if r.session is not None else r.index) % n].append(i)
    return out


def _connect(address: str) -> list[dict]:
    """The cluster's alive nodes (connecting this driver first if it is not)."""
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    nodes = sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])
    if not nodes:
        raise RuntimeError(f"the Ray cluster at {address} has no alive node")
    return nodes


def node_urls(address: str, port: int) -> list[str]:
    """Each alive node's Serve proxy URL, http://<node ip>:<port>."""
    return [f"http://{n['NodeManagerAddress']}:{port}" for n in _connect(address)]


def run_on_cluster(
    address: str,
    requests: list[Request],
    offsets: list[float],
    options: ClientOptions,
    *,
    clients: int | None = None,
    urls: list[str] | None = None,
    port: int = 8000,
    max_concurrency: int | None = None,
    max_duration: float = 600.0,
    progress: Callable[[int], None] | None = None,
) -> list[ClientResult]:
    """Run the requests from client actors on the cluster at `address`; one ClientResult each."""
    nodes = _connect(address)
    n = clients or len(nodes)
    actors = [
        ClientActor.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)]["NodeID"], soft=False)
        ).remote(i)
        for i in range(n)
    ]
    try:
        return _run(actors, requests, offsets, options, urls, port, max_concurrency, max_duration, progress)
    finally:
        for a in actors:
            ray.kill(a)


def _run(
    actors: list,
    requests: list[Request],
    offsets: list[float],
    options: ClientOptions,
    urls: list[str] | None,
    port: int,
    max_concurrency: int | None,
    max_duration: float,
    progress: Callable[[int], None] | None,
) -> list[ClientResult]:
    n = len(actors)
    placed = ray.get([a.node.remote() for a in actors])
    parts = shares(requests, n)
    per_client = None if max_concurrency is None else max(1, math.ceil(max_concurrency / n))
    start_at = time.time() + START_LEAD_S
    targets = [[urls[i % len(urls)]] if urls else [f"http://{ip}:{port}"] for i, (_, ip) in enumerate(placed)]
    refs = [
        a.run.remote(
            [requests[k] for k in part], [offsets[k] for k in part], target, options, per_client, max_duration, start_at
        )
        for a, part, target in zip(actors, parts, targets)
    ]
    pending = list(refs)
    while pending:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        if progress is not None:
            progress(sum(ray.get([a.progress.remote() for a in actors])))
    out = []
    for i, (ref, (node_id, _), target) in enumerate(zip(refs, placed, targets)):
        got = ray.get(ref)
        out.append(
            ClientResult(
                [Record.from_dict(d) for d in got["records"]], got["duration"], got["cpu_s"], i, node_id, target[0]
            )
        )
    return out
