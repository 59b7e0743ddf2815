"""What a router's index pays to follow N replicas' caches: chunk-tree events against snapshots (DESIGN §3).

    python -m chunkserve.router.tools.bench_events [--replicas 1024] [--seconds 10] [--warmup 5]
                                                   [--rate 9] [--spill 0.1] [--seed 0]

Each replica is a real PrefixTree (chunkserve/replicas/engine/prefix_tree.py over a KV pool of one byte a token
slot) recording routing events (chunkserve/replicas/engine/tree_events.py), relayed by a Relay as LLMReplica
relays them (chunkserve/router/events.py). Its requests are gsp-like (the simulator's gsp in chunks:
a 32-chunk system prompt of one of `--groups-per-replica` groups homed on it, 2 chunks of its own
question, 4 of output; `--spill` of them a group homed elsewhere, as a router's load spill sends
them), `--rate` a second, into a pool of `--cache-factor` x its home groups' system prompts, so
foreign prompts evict and churn the routable set. Every simulated second each replica reports once
and one router applies every report twice: with PrefixIndex.apply_events (the events path) and,
in a second index, the replica's whole routable set with replace_digest (the snapshot path: what
applying a digest every period cost before events).

One JSON line: per path the router's CPU seconds (its thread's: a busy machine's other processes
are not billed) per simulated second (= the fraction of one core it keeps busy; the target for events is <= 0.02 at 1024 replicas reporting once a second), µs per
report (mean, p99), and the pickled bytes a second the reports come to (what Serve's broadcast
carries to each router); the replica side's cost (`relay_us_per_replica_s`: µs a replica a second
of its log's take and its Relay's apply and report; the log's notes inside the tree's calls are
not separated); the churn (routable hashes stored + evicted per replica a second) and the
mean routable set. The first `--warmup` seconds (caches filling) are not measured. The cyclic GC
is off while it runs (a heap of a thousand trees: its pauses would be billed to whichever call
allocates), as in chunkserve/router/tools/simulate.py.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import random
import time
import timeit
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from chunkserve.replicas.engine.kv_pool import KVPool, KVShape
from chunkserve.replicas.engine.prefix_tree import PrefixTree
from chunkserve.replicas.engine.tree_events import RouteEvents
from chunkserve.router.events import PublishConfig, Relay
from chunkserve.router.hashing import model_seed
from chunkserve.router.index import PrefixIndex

CHUNK = 16  # tokens a chunk (the counts below are gsp's in chunks of 64; hashing cost scales little)
SYSTEM, QUESTION, OUTPUT = 32, 2, 4  # chunks: gsp's 2048-token system prompt, 128-token question, 256 output
ROUTE_CHUNKS = 128


class _Replica:
    def __init__(self, home: list[int], pool_chunks: int, seed: int):
        pool = KVPool(
            KVShape(num_layers=1, num_kv_heads=1, chunk_size=CHUNK, head_dim=1, dtype=torch.uint8), pool_chunks, "cpu"
        )
        self.tree = PrefixTree(pool)
        self.tree.events = RouteEvents(self.tree, seed, PublishConfig(ROUTE_CHUNKS))
        self.relay = Relay()
        self.relay.apply(self.tree.events.take())
        self.home = home

    def serve(self, tokens: list[int], now: int) -> None:
        """A request through the tree as the scheduler drives it: match, fill, finish (cached)."""
        tree = self.tree
        path = tree.match(tokens, len(tokens))
        tree.acquire(path, now)
        parent = path[-1] if path else tree.root
        for k in range(len(path), len(tokens) // CHUNK):
            cid = tree.alloc()
            if cid is None:  # (the pool holds several whole requests: not reached)
                break
            parent = tree.insert(parent, tuple(tokens[k * CHUNK : (k + 1) * CHUNK]), cid, now)
            path.append(parent)
        tree.release(path, now)


def run(
    replicas: int = 1024,
    seconds: int = 10,
    warmup: int = 5,
    rate: float = 9.0,
    spill: float = 0.1,
    groups_per_replica: int = 16,
    cache_factor: float = 2.0,
    seed: int = 0,
) -> dict:
    rng = random.Random(seed)
    groups = groups_per_replica * replicas
    systems = np.random.default_rng(seed).integers(0, 32000, (groups, SYSTEM * CHUNK)).tolist()
    hseed = model_seed("bench-model")
    pool = int(cache_factor * groups_per_replica * SYSTEM) + 4 * (SYSTEM + QUESTION + OUTPUT)
    fleet = [
        _Replica(list(range(r * groups_per_replica, (r + 1) * groups_per_replica)), pool, hseed)
        for r in range(replicas)
    ]
    ids = [f"replica-{r}" for r in range(replicas)]
    events_index, snapshot_index = PrefixIndex(), PrefixIndex()
    paths: dict[str, dict[str, Any]] = {n: {"s": 0.0, "us": [], "bytes": 0} for n in ("events", "snapshot")}
    churn = held = 0
    relay_s = 0.0  # the replica side's take + Relay.apply + Relay.report (its engine's ChunkLog notes are in serve)
    last_seq = [0] * replicas  # each replica's seq at its last report
    question = 0
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for second in range(warmup + seconds):
            measured = second >= warmup
            for r, rep in enumerate(fleet):
                n = int(rate) + (rng.random() < rate - int(rate))
                for _ in range(n):
                    g = rng.choice(rep.home) if rng.random() >= spill else rng.randrange(groups)
                    question += 1
                    own = [(question * 7919 + k) % 32000 for k in range((QUESTION + OUTPUT) * CHUNK)]
                    rep.serve(systems[g] + own, second * 1000 + question)
                r0 = time.thread_time()
                published = rep.tree.events.take()
                if published is not None:
                    rep.relay.apply(published)
                report = rep.relay.report(float(second))
                relay_s += (time.thread_time() - r0) if measured else 0.0
                snapshot = tuple(rep.relay.held)  # (a digest as it arrived: a sequence off the wire)
                t0 = time.thread_time()
                events_index.apply_events(ids[r], report, float(second))
                t1 = time.thread_time()
                snapshot_index.replace_digest(ids[r], snapshot, float(second))
                t2 = time.thread_time()
                if measured:
                    for name, dt, payload in (("events", t1 - t0, report), ("snapshot", t2 - t1, snapshot)):
                        p = paths[name]
                        p["s"] += dt
                        p["us"].append(dt * 1e6)
                        p["bytes"] += len(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
                    churn += sum(len(d[2]) + len(d[3]) for d in report[2] if d[0] > last_seq[r])
                    held += len(rep.relay.held)
                last_seq[r] = report[1]
    finally:
        if gc_was_enabled:
            gc.enable()
    for r in range(replicas):  # both indexes followed every replica exactly
        assert events_index.published(ids[r]) == snapshot_index.published(ids[r]) == fleet[r].relay.held
    out: dict = {
        "replicas": replicas,
        "seconds": seconds,
        "rate_per_replica": rate,
        "spill": spill,
        "groups_per_replica": groups_per_replica,
        "pool_chunks": pool,
        "churn_per_replica_s": round(churn / (replicas * seconds), 2),
        "routable_mean": round(held / (replicas * seconds), 1),
        "gaps": events_index.gaps,
    }
    for name, p in paths.items():
        us = np.asarray(p["us"])
        out[f"{name}_core_fraction"] = round(p["s"] / seconds, 5)
        out[f"{name}_us_mean"] = round(float(us.mean()), 2)
        out[f"{name}_us_p99"] = round(float(np.percentile(us, 99)), 2)
        out[f"{name}_bytes_per_s"] = int(p["bytes"] / seconds)
    out["events_target_met"] = out["events_core_fraction"] <= 0.02
    out["relay_us_per_replica_s"] = round(relay_s / (replicas * seconds) * 1e6, 2)
    # this machine's speed at plain Python (as chunkserve/router/tools/simulate.py reports it): best µs of sum(range(1000))
    out["cpu_ref_us"] = round(min(timeit.repeat("sum(range(1000))", number=200, repeat=5)) / 200 * 1e6, 2)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.router.tools.bench_events", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--replicas", type=int, default=1024)
    ap.add_argument("--seconds", type=int, default=10, help="simulated seconds measured")
    ap.add_argument("--warmup", type=int, default=5, help="simulated seconds first, not measured")
    ap.add_argument("--rate", type=float, default=9.0, help="requests a second per replica")
    ap.add_argument("--spill", type=float, default=0.1, help="fraction of requests to a group homed elsewhere")
    ap.add_argument("--groups-per-replica", type=int, default=16)
    ap.add_argument("--cache-factor", type=float, default=2.0, help="pool = this x the home groups' system prompts")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    row = run(
        args.replicas,
        args.seconds,
        args.warmup,
        args.rate,
        args.spill,
        args.groups_per_replica,
        args.cache_factor,
        args.seed,
    )
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
