"""chunkserve/router/serve_router.py: PrefixAffinityRouter driven directly (fake replicas, no cluster), then
the application with the prefix router on a local multi-node Ray cluster."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.wire import GenerateRequest
from chunkserve.router.hashing import chunk_hashes
from tests.serve_cluster import serve_on_local_cluster

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

# -- the router class, no cluster ------------------------------------------------------------------

C = 4  # chunk size of the unit tests
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)


def _router_env():
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    from chunkserve.router.serve_router import PrefixAffinityRouter

    dep = DeploymentID(name="LLMReplica", app_name="test")

    class FakeReplica:
        max_ongoing_requests = 64

        def __init__(self, uid: str, routing_stats: dict | None = None):
            self.replica_id = ReplicaID(uid, dep)
            self.routing_stats = routing_stats or {}

        async def get_queue_len(self, *, deadline_s: float) -> int:
            return 0

    def pending(prompt: list[int], n: int, max_tokens: int = 8) -> PendingRequest:
        req = GenerateRequest(
            request_id=f"r{n}",
            prompt_token_ids=tuple(prompt),
            params=SamplingParams(max_tokens=max_tokens),
            stop=(),
            model="tiny",
            prefix_hashes=tuple(chunk_hashes(prompt, C, 32, "tiny")),
        )
        return PendingRequest(args=[req], kwargs={}, metadata=RequestMetadata(f"r{n}", f"internal-{n}"))

    def make(replicas):
        router = PrefixAffinityRouter(
            deployment_id=dep, handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True
        )
        router.initialize_state(chunk_size=C)
        router.update_replicas(replicas)
        return router

    return FakeReplica, pending, make


async def _route(router, pr) -> str:
    """What Serve does with the ranks when every replica accepts: the first rank's lowest queue."""
    ranks = await router.choose_replicas(router._replicas_list, pr)
    replica = ranks[0][0]
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id.unique_id


def test_router_keeps_a_prefix_on_one_replica_and_spreads_prefixes():
    FakeReplica, pending, make = _router_env()

    async def main():
        router = make([FakeReplica(f"rep{i}") for i in range(3)])
        homes = {}
        n = 0
        for group in range(12):
            prefix = [group * 7 + j for j in range(8 * C)]
            seen = set()
            for q in range(3):
                n += 1
                pr = pending(prefix + [500 + q], n)
                seen.add(await _route(router, pr))
                router.on_request_completed(None, pr.metadata.internal_request_id)
            assert len(seen) == 1, f"group {group} went to {seen}"
            homes[group] = seen.pop()
        assert len(set(homes.values())) == 3  # different prefixes land on different replicas
        assert not router._tickets  # every completion released its ticket

        # a non-generate call (model_info) and a prompt shorter than a chunk still get a replica
        plain = pending([1, 2], 999)
        plain.args = []
        assert (await router.choose_replicas(router._replicas_list, plain))[0]
        assert (await router.choose_replicas(router._replicas_list, pending([1, 2], 1000)))[0]

    asyncio.run(main())


def test_a_request_completed_before_serve_reports_it_routed_leaves_no_load():
    """Serve (ray 2.60) reports a request routed once its replica has accepted it, and queues the
    completion callback from another thread: a short request can complete first. Its ticket is then
    released by the result's done callback (which fires at once on a finished result), not kept
    in the replica's load for good, where it would steer every short prompt to the other replica."""
    FakeReplica, pending, make = _router_env()

    class Result:  # a ReplicaResult: its done callbacks run when it finishes (at once, if it has)
        def __init__(self, done: bool):
            self.done, self.callbacks = done, []

        def add_done_callback(self, callback):
            if self.done:
                callback(self)
            else:
                self.callbacks.append(callback)

        def finish(self):
            self.done = True
            for callback in self.callbacks:
                callback(self)

    async def main():
        router = make([FakeReplica("rep0"), FakeReplica("rep1")])
        loads = lambda: [router._policy.load(u) for u in ("rep0", "rep1")]  # noqa: E731
        first = pending([1, 2, 3], 1)  # shorter than a chunk: power of two on load
        uid = (await router.choose_replicas(router._replicas_list, first))[0][0].replica_id
        router.on_request_completed(uid, first.metadata.internal_request_id)  # the callback ran first
        router.on_request_routed(first, uid, Result(done=True))
        await asyncio.sleep(0)  # (the release is scheduled on the router's loop, as from Ray's thread)
        assert not router._tickets and loads() == [0, 0]

        second = pending([4, 5, 6], 2)  # the usual order: released once, by whichever comes first
        uid = (await router.choose_replicas(router._replicas_list, second))[0][0].replica_id
        result = Result(done=False)
        router.on_request_routed(second, uid, result)
        assert max(loads()) > 0
        router.on_request_completed(uid, second.metadata.internal_request_id)
        result.finish()
        await asyncio.sleep(0)
        assert not router._tickets and loads() == [0, 0]

    asyncio.run(main())


def test_router_follows_membership_and_events():
    FakeReplica, pending, make = _router_env()

    async def main():
        reps = [FakeReplica(f"rep{i}") for i in range(3)]
        router = make(reps)
        prefix = list(range(8 * C))
        home = await _route(router, pending(prefix + [1], 1))
        # the home dies: its prefix goes elsewhere, and the dead one is never offered again
        router.update_replicas([r for r in reps if r.replica_id.unique_id != home])
        for n in range(2, 6):
            ranks = await router.choose_replicas(router._replicas_list, pending(prefix + [n], n))
            assert home not in {r.replica_id.unique_id for rank in ranks for r in rank}
        # a newcomer whose routing events hold the whole prefix attracts it
        chain = tuple(chunk_hashes(prefix, C, 32, "tiny"))
        newcomer = FakeReplica(
            "rep-new",
            {
                "running": 0,
                "waiting": 0,
                "kv_chunks_used": 8,
                "kv_chunks_total": 64,
                "events": (1, 1, ((1, 1, chain, ()),), None),  # (epoch 1, seq 1: the chain stored)
                "as_of": time.time(),
            },
        )
        router.update_replicas([r for r in reps if r.replica_id.unique_id != home] + [newcomer])
        # nobody else holds the prefix (the choices above were not routed): only the events point there
        assert await _route(router, pending(prefix + [9], 9)) == "rep-new"
        assert router._policy.index.synced("rep-new") == (1, 1, True)
        # stats without events (before replicas publish them) are accepted
        router.update_replicas([FakeReplica("rep-new", {"running": 1, "waiting": 0})])
        assert await _route(router, pending(prefix + [10], 10)) == "rep-new"

    asyncio.run(main())


def test_reports_by_router_add_the_other_routers_share_only():
    from chunkserve.router import direct

    FakeReplica, pending, make = _router_env()

    async def main():
        reps = [FakeReplica(f"rep{i}") for i in range(2)]
        router = make(reps)
        held = {"elsewhere": [3, 6000, 1000, 300], direct.ROUTER_ID: [1, 2000, 0, 100]}
        stats = {"running": 4, "waiting": 0, "held_by_router": held, "as_of": time.time()}
        router.update_replicas([FakeReplica("rep0", stats), reps[1]])
        # the other router's requests as work (prompt − cached + 4 × max_tokens); our own share in
        # the report is ignored: our own in-flight count (none here) is exact
        assert router._policy.load("rep0") == 6000 - 1000 + 4 * 300
        assert router._policy.load("rep1") == 0.0
        assert await _route(router, pending(list(range(8 * C)), 1)) == "rep1"

    asyncio.run(main())


def test_large_join_builds_off_loop():
    FakeReplica, pending, make = _router_env()

    async def main():
        router = make([FakeReplica(f"rep{i}") for i in range(40)])  # > INLINE_JOIN_LIMIT
        assert router._building is not None
        # routing still answers while the table is built (Serve's power of two)
        assert (await router.choose_replicas(router._replicas_list, pending(list(range(4 * C)), 1)))[0]
        await router._building
        assert router._policy_ids == {f"rep{i}" for i in range(40)}
        assert await _route(router, pending(list(range(4 * C)), 2)) in router._policy_ids

    asyncio.run(main())


# -- the application on a local cluster --------------------------------------------------------------


@pytest.fixture(scope="module")
def serve_url():
    with serve_on_local_cluster(num_nodes=2) as url:
        yield url


def _deploy(base: str, name: str, router: dict, replicas: int = 2, engine: dict | None = None, **args) -> str:
    """`tiny` on CPU replicas as the application `name` at /name; -> its completions URL."""
    from ray import serve

    from chunkserve.cluster.app import build_app

    config = {
        "model": "tiny",
        "device": "cpu",
        "num_replicas": replicas,
        "num_cpus_per_replica": 0.5,
        "engine": {"kv_cache_tokens": 8192, "max_model_len": 1024, "chunk_size": 64, **(engine or {})},
        "router": {"routing_stats_period_s": 0.5, **router},
        **args,
    }
    serve.run(build_app(config), name=name, route_prefix=f"/{name}")
    return f"{base}/{name}/v1/completions"


def _complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int = 2) -> httpx.Response:
    r = client.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r


def test_shared_prefixes_stay_on_one_replica(serve_url):
    from ray import serve

    from chunkserve.cluster.ingress import REPLICA_HEADER

    url = _deploy(serve_url, "prefix", {"policy": "prefix"}, replicas=3)
    out = {}
    with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
        # groups of prompts sharing a 256-token prefix, one at a time: each new one placed by
        # its rendezvous order (the replicas are idle between them), so with 4 groups all
        # landed on one of the 3 replicas in 1 run of 27 (seen); with 8, 1 in 2187
        for g in range(8):
            prefix = [(31 * g + 7 * i + 3) % 256 for i in range(256)]
            responses = [_complete(client, url, prefix + [10 + q]) for q in range(3)]
            out[g] = [(r.headers[REPLICA_HEADER], r.json()["usage"]) for r in responses]
    homes = set()
    for g, results in out.items():
        replicas = {rep for rep, _ in results}
        assert len(replicas) == 1, f"group {g} spread over {replicas}"
        homes |= replicas
        for _, usage in results[1:]:
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 192, usage
    assert len(homes) >= 2  # groups are placed on different replicas
    serve.delete("prefix")


def test_rays_own_prefix_router_routes_our_requests(serve_url):
    """router.policy ray_prefix: Ray Serve LLM's PrefixCacheAffinityRouter, the peer #47 compares
    against, routes our requests by GenerateRequest.prompt (a character per token); prompts that
    share a prefix follow the first one's replica, where that prefix is then cached."""
    from ray import serve

    from chunkserve.cluster.ingress import REPLICA_HEADER

    url = _deploy(serve_url, "rayprefix", {"policy": "ray_prefix"})
    prefix = [(13 * i + 5) % 256 for i in range(256)]
    with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
        responses = [_complete(client, url, prefix + [10 + q]) for q in range(4)]
    results = [(r.headers[REPLICA_HEADER], r.json()["usage"]) for r in responses]
    assert len({rep for rep, _ in results}) == 1, results  # one at a time, queues level: the match decides
    for _, usage in results[1:]:
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 192, usage
    serve.delete("rayprefix")


def test_two_ingresses_sharing_decisions_find_each_other_and_serve(serve_url):
    """router.share_decisions with two ingress replicas: each one's router (made by Serve in the
    ingress process, on Serve's router loop) registers in Ray's GCS and serves as before."""
    from ray import serve

    from chunkserve.router.serve_router import GcsRegistry

    url = _deploy(serve_url, "peers", {"policy": "prefix", "share_decisions": True}, ingress={"num_replicas": 2})
    registry = GcsRegistry("peers", "LLMReplica")
    deadline = time.monotonic() + 120
    with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
        # each ingress makes its router at its first request, which Serve's proxy spreads
        while len(registry.others("")) < 2:
            assert time.monotonic() < deadline, f"routers registered: {registry.others('')}"
            _complete(client, url, [(7 * i + 3) % 256 for i in range(128)] + [5])
        # ... connect, and book each other's decisions: /metrics shows it per ingress replica
        while True:
            for q in range(4):
                _complete(client, url, [(11 * i + q) % 256 for i in range(128)])
            text = client.get(f"{serve_url}/peers/metrics").text
            peers = [ln for ln in text.splitlines() if ln.startswith("chunkserve_router_peers{")]
            booked = [ln for ln in text.splitlines() if ln.startswith("chunkserve_router_peer_decisions_total{")]
            if (
                len(peers) == 2
                and all(ln.endswith(" 1.0") for ln in peers)
                and any(float(ln.rsplit(" ", 1)[1]) > 0 for ln in booked)
            ):
                break
            assert time.monotonic() < deadline, f"no decisions shared: {peers} {booked}"
            time.sleep(0.5)
    serve.delete("peers")


def test_a_prefix_spilled_to_a_host_tier_is_routed_back_and_predicted_in_both_tiers(serve_url):
    """Two replicas with a host tier and a small GPU pool: a prompt's chunks spill on its replica
    as other prompts arrive there; once the replica's tier-coded events reach the router, the
    prompt again goes there, is loaded back (cached_tokens_host), and the router's prediction
    counts those tokens as cached."""
    from ray import serve

    from chunkserve.cluster.ingress import PREDICTED_HEADER, REPLICA_HEADER

    # 16 chunks of GPU pool: two prompts' worth
    url = _deploy(
        serve_url, "tiered", {"policy": "prefix"}, engine={"kv_cache_tokens": 1024, "host_cache_tokens": 8192}
    )

    def one(client: httpx.Client, prompt: list[int]) -> tuple[str, dict, str | None]:
        r = _complete(client, url, prompt, max_tokens=1)
        return r.headers[REPLICA_HEADER], r.json()["usage"], r.headers.get(PREDICTED_HEADER)

    with httpx.Client(timeout=httpx.Timeout(300.0)) as client:
        a = [(5 * i + 1) % 256 for i in range(512)]  # eight chunks
        home, _, _ = one(client, a + [7])
        others = 0
        for g in range(40):  # other prompts, until three of them have landed on a's replica
            if others == 3:
                break
            rep, _, _ = one(client, [(11 * g + 3 * i + 2) % 256 for i in range(512)] + [7])
            others += rep == home
        assert others == 3
        time.sleep(2.0)  # a few routing-stats periods: the router sees a's chunks in the host tier
        rep, usage, predicted = one(client, a + [9])
    details = usage["prompt_tokens_details"]
    assert rep == home and details["cached_tokens"] == 512 and details["cached_tokens_host"] > 0, usage
    assert predicted == "512"  # both tiers count: the host part loads back, it is not recomputed
    serve.delete("tiered")


def test_config_selects_the_router(monkeypatch):
    import yaml
    from ray.serve._private.constants import DEFAULT_REQUEST_ROUTER_PATH

    from chunkserve.cluster.app import PREFIX_ROUTER, RAY_PREFIX_ROUTER, build_app
    from chunkserve.cluster.config import AppConfig

    def router_config(args):
        llm = build_app(args)._bound_deployment.init_args[0]._bound_deployment
        return llm._deployment_config.request_router_config

    rc = router_config({"device": "cpu", "engine": {"chunk_size": 32}, "router": {"routing_stats_period_s": 2}})
    assert rc.request_router_class == PREFIX_ROUTER  # prefix is the default
    assert rc.request_router_kwargs == {"chunk_size": 32, "host_hit_credit": 0.8, "share_decisions": False}
    assert rc.request_routing_stats_period_s == 2
    rc = router_config({"device": "cpu", "router": {"host_hit_credit": 0}})  # (--set router.host_hit_credit=0)
    assert rc.request_router_kwargs["host_hit_credit"] == 0
    assert router_config({"device": "cpu", "router": {"share_decisions": True}}).request_router_kwargs[
        "share_decisions"
    ]
    # by default the routers share where there are several of them (one an ingress replica)
    assert router_config({"device": "cpu", "ingress": {"num_replicas": 2}}).request_router_kwargs["share_decisions"]
    assert not router_config(
        {"device": "cpu", "ingress": {"num_replicas": 2}, "router": {"share_decisions": False}}
    ).request_router_kwargs["share_decisions"]
    # ... and a policy that keeps no decisions is not refused for it (pow2 on a preset of 4 ingresses)
    assert (
        router_config(
            {"device": "cpu", "ingress": {"num_replicas": 4}, "router": {"policy": "pow2"}}
        ).request_router_class
        == DEFAULT_REQUEST_ROUTER_PATH
    )
    assert (
        router_config({"device": "cpu", "router": {"policy": "pow2"}}).request_router_class
        == DEFAULT_REQUEST_ROUTER_PATH
    )
    rc = router_config({"device": "cpu", "router": {"policy": "ray_prefix", "routing_stats_period_s": 3}})
    assert rc.request_router_class == RAY_PREFIX_ROUTER and rc.request_routing_stats_period_s == 3
    # a Ray without ray.llm (some builds strip it): the config says so, not each replica's import
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray.llm" else real(name, *a))
    with pytest.raises(ValueError, match=r"ray_prefix .* no ray\.llm"):
        router_config({"device": "cpu", "router": {"policy": "ray_prefix"}})
    with pytest.raises(ValueError, match="policy"):
        AppConfig.model_validate({"router": {"policy": "random"}})
    for path in ("configs/local.yaml", "configs/serve.yaml"):
        with open(path) as f:
            args = yaml.safe_load(f)["applications"][0]["args"]
        assert AppConfig.model_validate(args).router.policy == "prefix"
