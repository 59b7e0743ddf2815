"""Chunk-tree events over real Serve (chunkserve/router/events.py): replicas' events reach a router
through Serve's routing stats, the router's index equals what each replica holds, and a replica
killed mid-run leaves no entry behind while its replacement is followed from its first report."""

from __future__ import annotations

import asyncio
import time

import pytest

from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.wire import GenerateRequest
from chunkserve.router.hashing import chunk_hashes
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own

APP, PERIOD_S = "events", 0.5


def _request(prompt: list[int], n: int) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"ev{n}",
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(max_tokens=2, temperature=0),
        stop=(),
        model="tiny",
        prefix_hashes=tuple(chunk_hashes(prompt, 64, 32, "tiny")),
    )


def test_a_restarted_replica_is_resynced_and_its_entries_dropped():
    import ray
    from ray import serve

    from chunkserve.cluster.app import build_app
    from chunkserve.router import direct

    with serve_on_local_cluster(num_nodes=2):
        serve.run(
            build_app(
                {
                    "model": "tiny",
                    "device": "cpu",
                    "num_replicas": 3,
                    "num_cpus_per_replica": 0.5,
                    "engine": {"kv_cache_tokens": 8192, "max_model_len": 1024, "chunk_size": 64},
                    "router": {"policy": "prefix", "routing_stats_period_s": PERIOD_S},
                }
            ),
            name=APP,
            route_prefix=f"/{APP}",
        )
        # this process's handle routes through a PrefixAffinityRouter of its own, fed by Serve's
        # routing-stats broadcasts as the ingress's is
        handle = serve.get_deployment_handle("LLMReplica", app_name=APP).options(stream=True)
        held: dict[str, set[int]] = {}  # replica -> the routable hashes of the prompts it served
        sent = 0

        def send(groups: range) -> None:
            nonlocal sent
            for g in groups:  # 256 shared tokens (4 chunks) + one of its own; outputs fill no chunk
                prompt = [(31 * g + 7 * i + 3) % 256 for i in range(256)] + [10 + sent]
                sent += 1
                replica = [out.replica_id for out in handle.generate.remote(_request(prompt, sent))][-1]
                held.setdefault(replica, set()).update(chunk_hashes(prompt, 64, 32, "tiny"))

        def router_view() -> tuple[set[str], dict[str, tuple], set[str]]:
            """(the router's live replicas, replica -> (synced, published), replicas its index knows)."""
            router, loop = direct._ROUTERS[(APP, "LLMReplica")], direct._LOOPS[(APP, "LLMReplica")]

            async def read():
                index = router._policy.index
                live = set(router._policy_ids)
                return live, {r: (index.synced(r), index.published(r)) for r in live}, index.replicas()

            return asyncio.run_coroutine_threadsafe(read(), loop).result(30)

        def wait_in_sync(what: str, timeout_s: float = 120) -> tuple[set[str], dict[str, tuple]]:
            """Until the router's index holds exactly what each live replica holds."""
            deadline = time.monotonic() + timeout_s
            while True:
                live, view, known = router_view()
                if len(live) == 3 and all(
                    s is not None and s[2] and pub == held.get(r, set()) for r, (s, pub) in view.items()
                ):
                    return live, view
                assert time.monotonic() < deadline, f"{what}: {view} vs {held}"
                time.sleep(PERIOD_S)

        send(range(6))
        live, view = wait_in_sync("the first requests")
        assert len({r for r in held}) >= 2 and set(held) <= live  # groups spread, each replica's set followed

        victim = max(held, key=lambda r: len(held[r]))
        victim_hashes = held.pop(victim)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#LLMReplica#{victim}", namespace="serve"), no_restart=True)
        deadline = time.monotonic() + 120
        while True:  # Serve notices the death, starts a replacement; the router follows
            live, view, known = router_view()
            if victim not in live and len(live) == 3:
                break
            assert time.monotonic() < deadline, f"no replacement for {victim}: {live}"
            time.sleep(PERIOD_S)
        assert victim not in known  # its entries went with it
        newcomer = (live - set(held)).pop() if live - set(held) else None
        send(range(6))  # the victim's groups again: they land on live replicas
        live, view = wait_in_sync("after the restart")
        assert victim not in live and victim_hashes <= set().union(*held.values())  # its groups live elsewhere
        if newcomer is not None:
            assert view[newcomer][0][2]  # the replacement, followed from its epoch's start: exact
        serve.delete(APP)
