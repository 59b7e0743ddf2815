"""Discrete-event simulation of N replicas behind one router, per routing policy (DESIGN §6).

    python -m chunkserve.router.tools.simulate --policy prefix|pow2|ray-prefix --workload gsp|zipf|unique --replicas N
                              [--requests K] [--seed S]
    python -m chunkserve.router.tools.simulate --all        # the whole grid, every policy; one JSON object per line

Model:
  - workload `gsp`: SGLang bench_serving's generated-shared-prefix defaults — 64 groups × 16
    prompts, a 2048-token system prompt + a 128-token question each, 256 output tokens, all prompts
    shuffled (sgl-project/sglang python/sglang/bench_serving.py @ 50a61368: --gsp-num-groups 64
    --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128
    --gsp-output-len 256, then random.shuffle(input_requests)). Groups scale to
    max(64, 16 × replicas) so every replica has prefixes to share (at 4 replicas: exactly
    SGLang's 64); the JSON says `groups`, `groups_scaled`. `zipf`: as gsp, but each prompt's group
    is drawn with p(rank k) ∝ k^-1.1 (the zipf group distribution of newer bench_serving
    versions), so the top prompt carries ~16 % of the traffic. `unique`: 2176 tokens, no
    prefix shared by two prompts (each has its own random first chunk, then filler).
  - arrivals: Poisson, at the rate that keeps the cluster `--util` (0.75) busy at the oracle's hit
    rate: busy when a policy shares well, overloaded (utilisation > 1, queues grow) when not.
  - replica: one FIFO server; a request's work = uncached prompt tokens + 4 × output tokens, in
    prefill-token units, served at 16k prefill tokens/s (H100/H200-class GPU, 8B model). Its cache
    is an LRU over chunk hashes (the tree's full chunks, prompt then output) with leaf-first
    eviction, `--cache-factor` (2) × its share of the distinct system prompts, in tokens. A prompt
    is matched and inserted when it arrives (requests queued behind it find it).
  - what a router sees: its own decisions and completions, the queue lengths those imply, and —
    prefix policy only — each replica's digest (the chunk hashes it holds at depth ≤ route_chunks)
    published every `--digest-period` s, delivered `--digest-delay` s later. Never the caches.
  - metrics: hit_rate = cached prompt tokens / prompt tokens; oracle_hit_rate = the same for one
    pooled LRU of the whole cluster's capacity seeing every request (the reference a router aims
    at); max_mean_load = max over replicas of the time-averaged outstanding work ÷ its mean;
    p99_queue = 99th percentile of the requests already at the chosen replica when one arrives;
    p99_wait_s = of the time queued before service; decision_us / decision_p50_us = mean / median
    wall time of the policy's routing call (choose + bookkeeping; the ingress's hashing and
    Ray's text extraction excluded), with cpu_ref_us to say how fast the machine was.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import itertools
import json
import random
import time
import timeit
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from chunkserve.router.hashing import chunk_hashes, model_seed
from chunkserve.router.index import common_prefix
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, Ticket

CHUNK = 64
ROUTE_CHUNKS = 32
SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN, PER_GROUP, GROUPS = 2048, 128, 256, 16, 64  # SGLang gsp defaults
GROUPS_PER_REPLICA = 16
ZIPF_ALPHA = 1.1
VOCAB = 32000
DECODE_WEIGHT = 4.0  # an output token costs a replica 4 prefill tokens of time
PREFILL_TPS = 16000.0  # prefill tokens per second per replica
MODEL = "sim-model"
POLICIES = ("prefix", "pow2", "ray-prefix")
WORKLOADS = ("gsp", "zipf", "unique")


# -- workload --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds
    chain: tuple[int, ...]  # chained hashes of every full prompt chunk; chain[:ROUTE_CHUNKS] routes
    prompt_tokens: int
    output_tokens: int
    source: tuple[int, int]  # (group or -1, question index): regenerates the tokens (ray-prefix text)


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int
    groups: int
    groups_scaled: bool
    cache_tokens: int  # per replica
    oracle_hit_rate: float
    rate: float  # arrivals per second
    requests: tuple[Request, ...]
    systems: np.ndarray  # [groups, SYSTEM_LEN] (unique: [1, SYSTEM_LEN − CHUNK], the filler)
    heads: np.ndarray  # unique: [requests, CHUNK], each prompt's own first chunk; else empty
    questions: np.ndarray  # [requests, QUESTION_LEN]

    def tokens(self, req: Request) -> np.ndarray:
        group, q = req.source
        system = self.systems[group] if group >= 0 else np.concatenate([self.heads[q], self.systems[0]])
        return np.concatenate([system, self.questions[q]])


def build_workload(
    name: str, replicas: int, requests: int | None = None, seed: int = 0, util: float = 0.75, cache_factor: float = 2.0
) -> Workload:
    groups = -(-requests // PER_GROUP) if requests else max(GROUPS, GROUPS_PER_REPLICA * replicas)
    total = requests or groups * PER_GROUP
    rng = np.random.default_rng(seed)
    if name == "gsp":
        group_of = np.repeat(np.arange(groups), PER_GROUP)[:total]
        rng.shuffle(group_of)
    elif name == "zipf":
        p = 1.0 / np.arange(1, groups + 1) ** ZIPF_ALPHA
        group_of = rng.choice(groups, size=total, p=p / p.sum())
    elif name == "unique":
        group_of = np.full(total, -1)
    else:
        raise ValueError(f"unknown workload {name!r}")

    def tokens(*shape: int) -> np.ndarray:
        return rng.integers(0, VOCAB, shape, dtype=np.uint16)

    if name == "unique":  # a random first chunk per prompt: no two share any prefix (the rest is filler)
        systems, heads = tokens(1, SYSTEM_LEN - CHUNK), tokens(total, CHUNK)
    else:
        systems, heads = tokens(groups, SYSTEM_LEN), tokens(0, CHUNK)
    questions = tokens(total, QUESTION_LEN)
    prompt_len = SYSTEM_LEN + QUESTION_LEN
    cache_tokens = max(int(cache_factor * groups * SYSTEM_LEN / replicas), 4 * (prompt_len + OUTPUT_LEN))
    seed_h = model_seed(MODEL)
    filler = systems[0].tolist()
    chains: dict[int, list[int]] = {}  # group -> its system prompt's chain, hashed once
    reqs = []
    for q, g in enumerate(group_of.tolist()):
        system = chains.get(g) if g >= 0 else chunk_hashes(heads[q].tolist() + filler, CHUNK, 1 << 30, seed_h)
        if system is None:
            system = chains[g] = chunk_hashes(systems[g].tolist(), CHUNK, 1 << 30, seed_h)
        question = chunk_hashes(questions[q].tolist(), CHUNK, 1 << 30, seed_h, after=system[-1])
        reqs.append((tuple(system + question), g, q))
    # Arrival rate: `util` busy at the oracle's hit rate (computed on the arrival order, which
    # does not depend on the times).
    capacity = replicas * cache_tokens // CHUNK
    oracle = _LRU(capacity)
    cached = sum(oracle.serve(chain, _output_ids(q)) for chain, _, q in reqs) * CHUNK
    work = (total * prompt_len - cached + DECODE_WEIGHT * total * OUTPUT_LEN) / total
    rate = util * replicas * PREFILL_TPS / work
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=total)).tolist()
    return Workload(
        name,
        replicas,
        groups,
        groups > GROUPS,
        cache_tokens,
        cached / (total * prompt_len),
        rate,
        tuple(Request(t, chain, prompt_len, OUTPUT_LEN, (g, q)) for t, (chain, g, q) in zip(arrivals, reqs)),
        systems,
        heads,
        questions,
    )


def _output_ids(q: int) -> tuple[int, ...]:
    """Stand-ins for a request's output chunks: unique (negative, unlike real hashes), never hit."""
    return tuple(-(q * 8 + k) - 1 for k in range(OUTPUT_LEN // CHUNK))


# -- replica cache ---------------------------------------------------------------------------------


class _LRU:
    """A replica's cached chunks: LRU over chunk hashes, leaf-first eviction (a tree only evicts
    leaves), so the held set stays prefix-closed along every chain."""

    def __init__(self, capacity_chunks: int):
        self.capacity = capacity_chunks
        self.chunks: OrderedDict[int, None] = OrderedDict()
        self.routable: set[int] = set()  # held hashes at depth ≤ ROUTE_CHUNKS: the digest

    def serve(self, chain: Sequence[int], output_ids: Sequence[int]) -> int:
        """Match `chain`, then insert it and the output chunks; returns matched chunks."""
        chunks = self.chunks
        matched = 0
        for h in chain:
            if h not in chunks:
                break
            matched += 1
        for h in output_ids:  # deepest first: the root ends most recently used
            chunks[h] = None
        for k in range(len(chain) - 1, -1, -1):
            h = chain[k]
            if h in chunks:
                chunks.move_to_end(h)
            else:
                chunks[h] = None
                if k < ROUTE_CHUNKS:
                    self.routable.add(h)
        while len(chunks) > self.capacity:
            self.routable.discard(chunks.popitem(last=False)[0])
        return matched


# -- routers: what each policy does with what a router sees ----------------------------------------


class _PrefixRouter:
    """Ours: chunkserve/router/policy.py, fed own decisions, completions and delayed digests."""

    uses_digests = True

    def __init__(self, ids: list[str], seed: int):
        self.policy = PrefixPolicy(PolicyConfig(chunk_size=CHUNK, decode_weight=DECODE_WEIGHT), ids, seed)
        self.slot = {r: i for i, r in enumerate(ids)}

    def prepare(self, wl: Workload, req: Request):
        return req.chain[:ROUTE_CHUNKS]

    def route(self, hashes, req: Request, now: float) -> tuple[int, Ticket]:
        r = self.policy.choose(hashes, req.prompt_tokens, req.output_tokens, now)[0]
        return self.slot[r], self.policy.on_routed(r, hashes, req.prompt_tokens, req.output_tokens, now)

    def finished(self, ticket: Ticket) -> None:
        self.policy.on_finished(ticket)

    def digest(self, replica: str, hashes: frozenset[int], as_of: float) -> None:
        self.policy.update_digest(replica, hashes, as_of)


class _Pow2Router:
    """Serve's default PowerOfTwoChoicesRequestRouter: two replicas at random, the shorter queue
    (first on ties), queue lengths as this router tracks them."""

    uses_digests = False

    def __init__(self, ids: list[str], seed: int):
        self.queue = [0] * len(ids)
        self.rng = random.Random(seed)

    def prepare(self, wl: Workload, req: Request):
        return None

    def pick(self, candidates: Sequence[int]) -> int:
        q = self.queue
        best = candidates[0]
        for c in candidates[1:]:
            if q[c] < q[best]:
                best = c
        return best

    def route(self, _, req: Request, now: float) -> tuple[int, int]:
        i = self.pick(self.rng.sample(range(len(self.queue)), min(2, len(self.queue))))
        self.queue[i] += 1
        return i, i

    def finished(self, i: int) -> None:
        self.queue[i] -= 1


class _TextNode:
    __slots__ = ("text", "children", "tenants")

    def __init__(self, text: str):
        self.text = text
        self.children: dict[str, _TextNode] = {}
        self.tenants: set[int] = set()


class _TextTree:
    """Ray Serve LLM's PrefixTree (prefix_aware/prefix_tree.py at ray-project/ray
    19a1eaa35d84e17c62a759ce6ab92fa1919723d2): a radix tree over prompt *characters* shared by
    all tenants (replicas), each node listing the tenants that inserted through it, plus a
    character count per tenant. With the router's default do_eviction=False nothing is ever
    evicted, so the per-tenant LRU lists and access times are not modelled."""

    def __init__(self, tenants: range):
        self.root = _TextNode("")
        self.chars = {t: 0 for t in tenants}  # insertion order = Ray's dict order
        self.root.tenants.update(tenants)

    def insert(self, text: str, tenant: int) -> None:
        node, i = self.root, 0
        while True:
            if tenant not in node.tenants:
                node.tenants.add(tenant)
                self.chars[tenant] += len(node.text)
            if i == len(text):
                return
            child = node.children.get(text[i])
            if child is None:
                child = node.children[text[i]] = _TextNode(text[i:])
            shared = common_prefix(child.text, text[i:])
            if shared < len(child.text):  # split: the new parent inherits the child's tenants
                parent = _TextNode(child.text[:shared])
                parent.tenants = set(child.tenants)
                child.text = child.text[shared:]
                parent.children[child.text[0]] = child
                node.children[text[i]] = parent
                child = parent
            node, i = child, i + shared

    def prefix_match(self, text: str, available: Sequence[int]) -> tuple[int, list[int]]:
        """(matched characters, tenants of the deepest node reached that are available)."""
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None or not any(t in child.tenants for t in available):
                break
            shared = common_prefix(child.text, text[i:])
            i += shared
            node = child
            if shared < len(child.text):
                break
        return i, [t for t in available if t in node.tenants]

    def smallest_tenants(self) -> list[int]:
        low = min(self.chars.values())
        return [t for t, n in self.chars.items() if n == low]


class _RayPrefixRouter(_Pow2Router):
    """Ray Serve LLM's PrefixCacheAffinityRouter, reimplemented from
    python/ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py at
    ray-project/ray ef82d1d979d285dafd39767c4e82a6d4c1e1cf0d (same policy as the older
    request_router/prefix_aware/ path):
      1. fallback = a power-of-two pair;
      2. queue lengths of all candidates; if max − min > imbalanced_threshold (10): fallback;
      3. else match the prompt text in the shared character tree; match rate = matched chars /
         prompt chars; below match_rate_threshold (0.1): the tenants with the fewest characters
         in the tree, else the tenants holding the match;
      4. Serve takes the candidate with the shortest queue (first on ties), then the prompt text
         is inserted in the tree for the chosen replica (on_request_routed).
    Newer revisions default imbalanced_threshold to inf (no fallback); we keep the published 10.
    The prompt text: each token as 4 hex characters (about a real tokenizer's 4 characters per
    token). decision_us excludes the two actor round trips per request the real router pays."""

    IMBALANCED_THRESHOLD = 10
    MATCH_RATE_THRESHOLD = 0.1

    def __init__(self, ids: list[str], seed: int):
        super().__init__(ids, seed)
        self.tenants = range(len(ids))
        self.tree = _TextTree(self.tenants)

    def prepare(self, wl: Workload, req: Request) -> str:
        return wl.tokens(req).astype(">u2").tobytes().hex()

    def route(self, text: str, req: Request, now: float) -> tuple[int, int]:
        n = len(self.queue)
        fallback = self.rng.sample(range(n), min(2, n))
        chosen: list[int] = []
        if max(self.queue) - min(self.queue) <= self.IMBALANCED_THRESHOLD:
            matched, tenants = self.tree.prefix_match(text, self.tenants)
            if matched / len(text) < self.MATCH_RATE_THRESHOLD:
                chosen = self.tree.smallest_tenants()
            else:
                chosen = tenants
        i = self.pick(chosen or fallback)
        self.tree.insert(text, i)
        self.queue[i] += 1
        return i, i


ROUTERS = {"prefix": _PrefixRouter, "pow2": _Pow2Router, "ray-prefix": _RayPrefixRouter}


# -- the event loop --------------------------------------------------------------------------------


def _backlog_area(since: float, until: float, busy_until: float) -> float:
    """∫ max(0, busy_until − s) ds over [since, until]: a FIFO server's outstanding work."""
    if busy_until <= since:
        return 0.0
    end = min(busy_until, until)
    return ((busy_until - since) ** 2 - (busy_until - end) ** 2) / 2


def cpu_ref_us() -> float:
    """This machine's speed at plain Python: best time of sum(range(1000)), in µs (it was
    ~25 on the shared 2-core VM these numbers were first taken on; ~8-10 is a current desktop)."""
    return round(min(timeit.repeat("sum(range(1000))", number=200, repeat=5)) / 200 * 1e6, 2)


def simulate(wl: Workload, policy: str, seed: int = 0, digest_period: float = 1.0, digest_delay: float = 0.5) -> dict:
    # The simulator's own heap (every replica's cache) is large and cycle-free: with the cyclic
    # GC on, its pauses would be billed to whichever routing call happens to allocate.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(wl, policy, seed, digest_period, digest_delay)
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(wl: Workload, policy: str, seed: int, digest_period: float, digest_delay: float) -> dict:
    started = time.perf_counter()
    n = wl.replicas
    ids = [f"replica-{i}" for i in range(n)]
    router = ROUTERS[policy](ids, seed)
    caches = [_LRU(wl.cache_tokens // CHUNK) for _ in range(n)]
    busy_until, area, last_t = [0.0] * n, [0.0] * n, [0.0] * n
    outstanding = [0] * n
    events: list[tuple[float, int, int, Any]] = []  # (time, unique seq, kind, payload)
    seq = itertools.count()
    FINISH, SNAPSHOT, DELIVER = 0, 1, 2
    if router.uses_digests:
        for r in range(n):  # staggered publication
            events.append((digest_period * (r + 1) / n, next(seq), SNAPSHOT, r))
    hit = prompt = 0
    queue_seen, waits, decisions = [], [], []
    for req in wl.requests:
        now = req.arrival
        while events and events[0][0] <= now:
            t, _, kind, payload = heapq.heappop(events)
            if kind == FINISH:
                r, ticket = payload
                outstanding[r] -= 1
                router.finished(ticket)
            elif kind == SNAPSHOT:
                snapshot = (payload, frozenset(caches[payload].routable), t)
                heapq.heappush(events, (t + digest_delay, next(seq), DELIVER, snapshot))
                heapq.heappush(events, (t + digest_period, next(seq), SNAPSHOT, payload))
            else:
                r, hashes, as_of = payload
                router.digest(ids[r], hashes, as_of)
        view = router.prepare(wl, req)
        t0 = time.perf_counter()
        r, ticket = router.route(view, req, now)
        decisions.append(time.perf_counter() - t0)
        q = req.source[1]
        matched = caches[r].serve(req.chain, _output_ids(q)) * CHUNK
        hit += matched
        prompt += req.prompt_tokens
        work = (req.prompt_tokens - matched + DECODE_WEIGHT * req.output_tokens) / PREFILL_TPS
        area[r] += _backlog_area(last_t[r], now, busy_until[r])
        last_t[r] = now
        start = max(now, busy_until[r])
        waits.append(start - now)
        queue_seen.append(outstanding[r])
        busy_until[r] = start + work
        outstanding[r] += 1
        heapq.heappush(events, (busy_until[r], next(seq), FINISH, (r, ticket)))
    horizon = wl.requests[-1].arrival
    for r in range(n):
        area[r] += _backlog_area(last_t[r], horizon, busy_until[r])
    mean_area = sum(area) / n
    oracle = wl.oracle_hit_rate
    busy = (prompt - hit + DECODE_WEIGHT * sum(rq.output_tokens for rq in wl.requests)) / PREFILL_TPS
    return {
        "policy": policy,
        "workload": wl.name,
        "replicas": n,
        "requests": len(wl.requests),
        "groups": wl.groups,
        "groups_scaled": wl.groups_scaled,
        "hit_rate": round(hit / prompt, 4),
        "oracle_hit_rate": round(oracle, 4),
        "hit_vs_oracle": round(hit / prompt / oracle, 4) if oracle else None,
        "max_mean_load": round(max(area) / mean_area, 4) if mean_area else None,
        "p99_queue": float(np.percentile(queue_seen, 99)),
        "p99_wait_s": round(float(np.percentile(waits, 99)), 4),
        "utilisation": round(busy / (n * horizon), 4),
        "decision_us": round(float(np.mean(decisions)) * 1e6, 2),
        "decision_p50_us": round(float(np.median(decisions)) * 1e6, 2),
        "cpu_ref_us": cpu_ref_us(),
        "cache_tokens": wl.cache_tokens,
        "digest_period_s": digest_period if router.uses_digests else None,
        "digest_delay_s": digest_delay if router.uses_digests else None,
        "seed": seed,
        "sim_s": round(time.perf_counter() - started, 2),
    }


# -- command line ----------------------------------------------------------------------------------

GRID_REPLICAS = (4, 16, 64, 256)
# decision_us at scale: timing rows (4 groups per replica to keep the run short), not grid cells
DECISION_REPLICAS, DECISION_REQUESTS = 1024, 65536


def _targets(rows: list[dict]) -> dict:
    """The issue's acceptance targets, evaluated on the grid's rows."""
    ours = {(r["workload"], r["replicas"]): r for r in rows if r["policy"] == "prefix"}
    pow2 = {(r["workload"], r["replicas"]): r for r in rows if r["policy"] == "pow2"}
    out = {}
    for (w, n), r in sorted(ours.items()):
        if n == DECISION_REPLICAS:
            out[f"decision_us<=50@{n}:{w}"] = r["decision_us"] <= 50
        elif w == "gsp":
            out[f"gsp@{n}"] = r["hit_vs_oracle"] >= 0.95 and r["max_mean_load"] <= 1.25
        elif w == "zipf":
            out[f"zipf@{n}"] = r["hit_vs_oracle"] >= 0.8 and r["max_mean_load"] <= 1.5
        elif w == "unique":
            out[f"unique@{n}"] = r["max_mean_load"] <= 1.05 * pow2[(w, n)]["max_mean_load"]
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.router.tools.simulate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--policy", choices=POLICIES, default="prefix")
    ap.add_argument("--workload", choices=WORKLOADS, default="gsp")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--requests", type=int, default=None, help="default: 16 per group, max(64, 16 x replicas) groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--util", type=float, default=0.75, help="cluster utilisation at the oracle's hit rate")
    ap.add_argument(
        "--cache-factor",
        type=float,
        default=2.0,
        help="replica cache = this x its share of the distinct system prompts",
    )
    ap.add_argument("--digest-period", type=float, default=1.0, help="seconds between a replica's digests")
    ap.add_argument("--digest-delay", type=float, default=0.5, help="seconds from snapshot to router")
    ap.add_argument(
        "--all",
        action="store_true",
        help=f"every policy x workload x replicas {GRID_REPLICAS}, plus decision_us at "
        f"{DECISION_REPLICAS} replicas; then a line of targets",
    )
    args = ap.parse_args(argv)

    def run(workload: str, replicas: int, policies: Sequence[str], requests: int | None) -> list[dict]:
        wl = build_workload(workload, replicas, requests, args.seed, args.util, args.cache_factor)
        rows = []
        for p in policies:
            row = simulate(wl, p, args.seed, args.digest_period, args.digest_delay)
            print(json.dumps(row), flush=True)
            rows.append(row)
        return rows

    if not args.all:
        run(args.workload, args.replicas, [args.policy], args.requests)
        return
    rows = []
    for w in WORKLOADS:
        for n in GRID_REPLICAS:
            rows += run(w, n, POLICIES, None)
    for w in WORKLOADS:
        rows += run(w, DECISION_REPLICAS, POLICIES, DECISION_REQUESTS)
    print(json.dumps({"targets": _targets(rows)}), flush=True)


if __name__ == "__main__":
    main()
