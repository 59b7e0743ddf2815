"""Prefix router vs Serve's power of two, over real Serve on a local multi-node cluster (issue 4).

    python -m chunkserve.cluster.tools.compare_routers [--replicas 4] [--groups 32] [--per-group 8] [--prefix 512]

Defaults, measured on a 2-core machine (2 nodes, 4 replicas, 256 requests, ~1 min in all):
    {"policy": "prefix", ..., "cached_fraction": 0.8235, ...}   (= the oracle: 7/8 × 512/544)
    {"policy": "pow2",   ..., "cached_fraction": 0.261, ...}
With a KV pool holding every group's prefix (--kv-tokens 16384) pow2 reaches ~0.39 (prefix 0.81).

Starts a LocalCluster, and for each policy (prefix, pow2; ray_prefix: Ray Serve LLM's own) deploys `tiny` with that
`router.policy`, sends a scaled-down gsp workload (groups of prompts sharing a long system prompt,
each prompt = prefix + a short question; the groups interleaved in random order, `--concurrency`
requests in flight), and prints one JSON line per policy:

    {"policy", "replicas", "requests", "prompt_tokens", "cached_prompt_tokens", "cached_fraction",
     "replicas_used", "wall_s"}

cached_fraction = Σ cached prompt tokens / Σ prompt tokens, as the replicas report them in each
response's usage (prompt_tokens_details.cached_tokens comes from the serving replica's engine).
Each policy gets a fresh application, so both start with cold caches.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import httpx
import ray
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.cluster.ingress import REPLICA_HEADER
from chunkserve.cluster.local import LocalCluster, NodeSpec
from chunkserve.replicas.engine.distributed import free_port


def workload(groups: int, per_group: int, prefix_len: int, question_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(256) for _ in range(prefix_len)]
        prompts += [prefix + [rng.randrange(256) for _ in range(question_len)] for _ in range(per_group)]
    rng.shuffle(prompts)  # groups interleaved
    return prompts


MODEL = "tiny"  # the model both applications serve, named in every request


async def send(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[tuple[str, dict]]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def one(prompt):
            async with sem:
                body = {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                r = await client.post(url, json=body)
                r.raise_for_status()
                return r.headers[REPLICA_HEADER], r.json()["usage"]

        return await asyncio.gather(*(one(p) for p in prompts))


def run_policy(base: str, policy: str, args) -> dict:
    name = f"cmp-{policy}"
    serve.run(
        build_app(
            {
                "model": MODEL,
                "device": "cpu",
                "num_replicas": args.replicas,
                "num_cpus_per_replica": 0.5,
                "max_ongoing_requests": 16,
                "engine": {"kv_cache_tokens": args.kv_tokens, "max_model_len": 2048, "chunk_size": 64},
                "router": {"policy": policy, "routing_stats_period_s": 1.0},
            }
        ),
        name=name,
        route_prefix=f"/{name}",
    )
    prompts = workload(args.groups, args.per_group, args.prefix, args.question, args.seed)
    t0 = time.monotonic()
    results = asyncio.run(send(f"{base}/{name}/v1/completions", prompts, args.max_tokens, args.concurrency))
    wall = time.monotonic() - t0
    serve.delete(name)
    prompt = sum(u["prompt_tokens"] for _, u in results)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for _, u in results)
    return {
        "policy": policy,
        "replicas": args.replicas,
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "cached_fraction": round(cached / prompt, 4),
        "replicas_used": len({r for r, _ in results}),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--cpus-per-node", type=float, default=2)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix", type=int, default=512, help="shared prefix tokens per group")
    p.add_argument("--question", type=int, default=32, help="unique tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--kv-tokens",
        type=int,
        default=6144,
        help="KV pool per replica, in tokens: a quarter of the groups' prefixes fit, all of them do not",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default="prefix,pow2")
    args = p.parse_args()
    port = free_port()
    with LocalCluster(num_nodes=args.nodes, node=NodeSpec(cpus=args.cpus_per_node)) as cluster:
        ray.init(address=cluster.address, log_to_driver=False)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            for policy in args.policies.split(","):
                print(json.dumps(run_policy(f"http://127.0.0.1:{port}", policy, args)), flush=True)
        finally:
            serve.shutdown()


if __name__ == "__main__":
    main()
