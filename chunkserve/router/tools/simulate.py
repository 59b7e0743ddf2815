"""Discrete-event simulation of N replicas behind k routers, per routing policy (DESIGN §3).

    python -m chunkserve.router.tools.simulate --policy prefix|approx|pow2|ray-prefix
        --workload gsp|zipf|unique|tenants --replicas N [--routers K] [--scale-up] [--requests M] [--seed S]
        [--tenants T --tenant-prompt-len L [--active-sessions S] [--closed-loop]] [--cache-tokens C]
        [--engine [--tpot-ms T] [--shared-gpu]] [--rate R]
    python -m chunkserve.router.tools.simulate --llmd [--rates 3,10,...]   # llm-d's setup, per rate
    python -m chunkserve.router.tools.simulate --all [--jobs J]  # the grid + llm-d + targets, JSON lines

Model:
  - workload `gsp`: SGLang bench_serving's generated-shared-prefix defaults — 64 groups × 16
    prompts, a 2048-token system prompt + a 128-token question each, 256 output tokens, all prompts
    shuffled (sgl-project/sglang python/sglang/bench_serving.py @ 50a61368: --gsp-num-groups 64
    --gsp-prompts-per-group 16 --gsp-system-prompt-len 2048 --gsp-question-len 128
    --gsp-output-len 256, then random.shuffle(input_requests)). Groups scale to
    max(64, 16 × replicas) so every replica has prefixes to share (at 4 replicas: exactly
    SGLang's 64), or to requests / 16 when --requests is given; the JSON says `groups`,
    `groups_scaled`. `zipf`: as gsp, but each prompt's group is drawn with p(rank k) ∝ k^-1.1 (the
    zipf group distribution of newer bench_serving versions), so the top prompt carries ~16 % of
    the traffic. `unique`: 2176 tokens, no prefix shared by two prompts (each has its own random
    first chunk, then filler). `tenants`: the load test's shape (chunkserve/cluster/loadtest/
    workloads.py `Tenants`): 4 tenants per replica, each a 2048-token system prompt, chosen by
    Zipf(1.1) popularity; each request continues one of 4 × replicas active sessions, resending
    its conversation (system prompt, earlier 64-token user turns and 128-token replies) plus a new
    turn, 4 turns a session; the session id goes with it (the router's session hint). (The load
    test sends a turn only after the previous one completed; here sessions are many enough that a
    session's turns are far apart, not ordered; `--closed-loop` sends a turn at its arrival or
    once its previous turn is done, whichever is later, as the load test's client does, and
    `--active-sessions S` sets how many are in progress: 16 in the load test.) `--tenants T
    --tenant-prompt-len L --cache-tokens C` give a load test's run its own shape (T tenants of L
    tokens, C-token pools: a GPU run of loadtest.stack), ray-prefix included (the prompts' tokens
    are kept for it). `llmd` (--llmd): llm-d's precise-prefix benchmark
    (llm-d's inference-perf shared_prefix profile: 150 groups × 5 users, a 6000-token system prompt
    and a 1200-token question per user, 1000 output tokens; a user's prompt repeats) on 16
    replicas of 307,328 KV tokens; a warm-up of one full set (750 requests at 15 req/s) then
    `--llmd-seconds` at each Poisson rate of `--rates`; only the stage is measured.
  - arrivals: Poisson, at the rate that keeps the cluster `--util` (0.75) busy at the oracle's hit
    rate (llmd: the given rates). `--scale-up`: the fleet is N for the first half of the requests,
    then 2N (the new replicas empty, every router told at once), the rate doubled with it: the
    autoscaler's answer to a doubled load. Each request comes in through one of `--routers` k
    routers at random (Serve's proxies in front of k ingress replicas).
  - replica: a request's work = uncached prompt tokens + 4 × output tokens, in prefill-token units,
    at 16k prefill tokens/s (H100/H200-class GPU, 8B model), served in arrival order by one
    work-conserving server (the replica's GPU time): it completes when the server has done it and
    everything before it. Prefill goes first (chunked prefill schedules waiting prompts before
    decode rows), so its first token comes when its prefill is done behind earlier prompts'
    prefills only: TTFT = that prefill queue's wait + its own uncached tokens / 16k. Its cache is
    an LRU over chunk hashes (the tree's full chunks, prompt then output) with leaf-first eviction,
    `--cache-factor` (2) × its share of the distinct system prompts, in tokens. A prompt is matched
    and inserted when it arrives (requests queued behind it find it).
  - `--engine`: a replica as an engine runs its pool (`_Pool`): the chunks of the requests in
    flight (prompt and output) are pinned and the LRU evicts only the others; a request is
    admitted, first come first served, when its chunks not pinned yet fit beside the pinned ones,
    and is matched then, not on arrival (a prefix evicted while it waited is recomputed; the
    first `TOUCH_AHEAD` waiting keep theirs the most recently used, as the scheduler does). Its
    prefill queues as above; its decode is batched: `--tpot-ms` (25, the H100 router run's TPOT)
    a token whatever the batch, so a replica's throughput is the requests its pool holds at once
    over their time in flight. `--shared-gpu`: one prefill server for all replicas (several on
    one GPU, as the GPU router runs place them). `--rate` gives the arrivals per second instead
    of `--util`.
  - what a router sees: its own decisions and completions, and — `prefix` only — each replica's
    report, taken every `--digest-period` s (staggered) and delivered to every router
    `--digest-delay` s later: the chunk hashes it holds at depth ≤ route_chunks, and the work it
    holds by router (DESIGN §3 "Load": a router adds the others' share to its own exact count).
    Never the caches. `approx` is the same policy on its own decisions only (no reports: the
    approximate trees of SGLang's gateway or llm-d's estimated scorer). `shared` is `prefix` whose
    k routers mirror each other: each applies every other router's decisions and completions
    `--share-delay-ms` (10) later, as its own (loads, work lately, prefix rates, predicted chains,
    sessions), and takes from the reports only the digests (the routers that agree of issue 47
    item 3, by exchanging decisions instead of waiting for reports). `pow2` (Serve's default)
    and `ray-prefix` (one actor for all ingresses) read every replica's true queue length.
  - metrics (over the measured requests): hit_rate = cached prompt tokens / prompt tokens;
    oracle_hit_rate = the same for one pooled LRU of the whole cluster's capacity seeing every
    request (the reference a router aims at); max_mean_load = the largest, over every 10 s window
    (sliding by 1 s; the whole phase if shorter; the phases before and after a scale-up apart), of
    max over replicas ÷ mean of the work routed to each in the window (uncached prompt tokens + 4 ×
    output tokens as it turned out); max_mean_backlog = max ÷ mean of the time-averaged
    outstanding work (None with `--engine` or `--shared-gpu`); ttft_p50_s / ttft_p90_s / ttft_p99_s (`--engine`:
    the wait for the pool included); throughput_rps, output_tps: measured requests done by the
    last arrival ÷ the measured span; p99_queue = 99th percentile of the requests
    already at the chosen replica when one arrives; decision_us / decision_p50_us = mean / median
    CPU time of the routing call (choose + bookkeeping; the ingress's hashing and Ray's text
    extraction excluded; the calling thread's CPU clock, less the clock reads' own cost), with
    cpu_ref_us to say how fast the machine was; decision_wall_us = its mean wall time, which on a
    shared machine also counts the time slices other processes take in the middle of a call (a
    few ms each, on a few calls in a thousand: most of the wall mean's excess over the CPU mean).
"""

from __future__ import annotations

import argparse
import collections
import gc
import heapq
import itertools
import json
import random
import time
import timeit
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from time import thread_time
from typing import Any

import numpy as np

from chunkserve.router.events import EAGER_DEPTH
from chunkserve.router.hashing import chunk_hashes, model_seed
from chunkserve.router.index import common_prefix
from chunkserve.router.policy import PolicyConfig, PrefixPolicy, ReplicaView, Ticket

CHUNK = 64
ROUTE_CHUNKS = 128  # the default router.route_chunks; deeper than EAGER_DEPTH, a chunk is published once reused
SYSTEM_LEN, QUESTION_LEN, OUTPUT_LEN, PER_GROUP, GROUPS = 2048, 128, 256, 16, 64  # SGLang gsp defaults
GROUPS_PER_REPLICA = 16
ZIPF_ALPHA = 1.1
VOCAB = 32000
DECODE_WEIGHT = 4.0  # an output token costs a replica 4 prefill tokens of time
TOUCH_AHEAD = 8  # --engine: queued requests whose cached prefixes stay recent (the scheduler's _TOUCH_AHEAD)
PREFILL_TPS = 16000.0  # prefill tokens per second per replica
MODEL = "sim-model"
# the load test's Tenants defaults (chunkserve/cluster/loadtest/workloads.py), tenants per replica
TENANT_PROMPT, TURN_LEN, REPLY_LEN, TURNS, TENANTS_PER_REPLICA = 2048, 64, 128, 4, 4
# llm-d's precise-prefix benchmark (inference-perf shared_prefix profile)
LLMD_GROUPS, LLMD_USERS, LLMD_SYSTEM, LLMD_QUESTION, LLMD_OUTPUT = 150, 5, 6000, 1200, 1000
LLMD_REPLICAS, LLMD_KV_TOKENS, LLMD_WARMUP_RATE = 16, 307_328, 15.0
LLMD_RATES = (3.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0)
WINDOW_S, WINDOW_STEP_S = 10.0, 1.0
POLICIES = ("prefix", "shared", "approx", "pow2", "ray-prefix")
WORKLOADS = ("gsp", "zipf", "unique", "tenants")


# -- workload --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds
    chain: tuple[int, ...]  # chained hashes of every full prompt chunk; chain[:ROUTE_CHUNKS] routes
    out_chain: tuple[int, ...]  # the chunks its reply completes (a later turn's prompt resends them)
    prompt_tokens: int
    output_tokens: int
    source: tuple[int, int]  # (group or -1, question index): regenerates the tokens (ray-prefix text)
    session: int | None = None
    after: int = -1  # tenants: the session's previous turn (--closed-loop sends this one once it is done)


@dataclass(frozen=True)
class Workload:
    name: str
    replicas: int  # at the start
    groups: int
    groups_scaled: bool
    cache_tokens: int  # per replica
    oracle_hit_rate: float  # over the measured requests
    rate: float  # arrivals per second (before a scale-up)
    requests: tuple[Request, ...]
    systems: np.ndarray  # [groups, SYSTEM_LEN] (unique: [1, SYSTEM_LEN − CHUNK], the filler)
    heads: np.ndarray  # unique: [requests, CHUNK], each prompt's own first chunk; else empty
    questions: np.ndarray  # [requests, QUESTION_LEN]
    scale_at: int | None = None  # request index from which the fleet is 2 × replicas
    measure_from: int = 0  # requests before this are a warm-up: routed, not measured
    texts: tuple[np.ndarray, ...] = ()  # tenants, kept for ray-prefix: each request's prompt tokens
    active_sessions: int | None = None  # tenants: sessions in progress at once

    def tokens(self, req: Request) -> np.ndarray:
        if self.texts:
            return self.texts[req.source[1]]
        if not len(self.questions):
            raise ValueError(f"ray-prefix needs a prompt's tokens: workload {self.name!r} keeps only hashes")
        group, q = req.source
        system = self.systems[group] if group >= 0 else np.concatenate([self.heads[q], self.systems[0]])
        return np.concatenate([system, self.questions[q]])

    @property
    def final_replicas(self) -> int:
        return self.replicas * 2 if self.scale_at is not None else self.replicas

    def scale_time(self) -> float | None:
        return self.requests[self.scale_at].arrival if self.scale_at is not None else None


# a workload's requests before arrival times: (chain, out_chain, prompt, output, source, session)
_Shape = tuple[tuple[int, ...], tuple[int, ...], int, int, tuple[int, int], "int | None"]


def _gsp_like(name: str, total: int, groups: int, rng: np.random.Generator) -> tuple[list[_Shape], dict]:
    if name == "gsp":
        group_of = np.repeat(np.arange(groups), PER_GROUP)[:total]
        rng.shuffle(group_of)
    elif name == "zipf":
        p = 1.0 / np.arange(1, groups + 1) ** ZIPF_ALPHA
        group_of = rng.choice(groups, size=total, p=p / p.sum())
    else:
        group_of = np.full(total, -1)

    def tokens(*shape: int) -> np.ndarray:
        return rng.integers(0, VOCAB, shape, dtype=np.uint16)

    if name == "unique":  # a random first chunk per prompt: no two share any prefix (the rest is filler)
        systems, heads = tokens(1, SYSTEM_LEN - CHUNK), tokens(total, CHUNK)
    else:
        systems, heads = tokens(groups, SYSTEM_LEN), tokens(0, CHUNK)
    questions = tokens(total, QUESTION_LEN)
    seed_h = model_seed(MODEL)
    filler = systems[0].tolist()
    chains: dict[int, list[int]] = {}  # group -> its system prompt's chain, hashed once
    out: list[_Shape] = []
    for q, g in enumerate(group_of.tolist()):
        system = chains.get(g) if g >= 0 else chunk_hashes(heads[q].tolist() + filler, CHUNK, 1 << 30, seed_h)
        if system is None:
            system = chains[g] = chunk_hashes(systems[g].tolist(), CHUNK, 1 << 30, seed_h)
        question = chunk_hashes(questions[q].tolist(), CHUNK, 1 << 30, seed_h, after=system[-1])
        out.append((tuple(system + question), _output_ids(q), SYSTEM_LEN + QUESTION_LEN, OUTPUT_LEN, (g, q), None))
    return out, {"systems": systems, "heads": heads, "questions": questions}


class _Stream:
    """A token stream's chained chunk hashes, extended as tokens are appended (a conversation)."""

    def __init__(self, tokens: list[int] | None = None, chain: list[int] | None = None):
        self.tokens = list(tokens or [])
        self.chain = list(chain or [])

    def extend(self, more: Sequence[int]) -> None:
        self.tokens += more
        full = len(self.tokens) // CHUNK
        if full > len(self.chain):
            k = len(self.chain)
            self.chain += chunk_hashes(
                self.tokens[k * CHUNK : full * CHUNK], CHUNK, 1 << 30, MODEL, after=self.chain[-1] if k else None
            )


def _tenants(
    replicas: int,
    total: int,
    rng: np.random.Generator,
    tenants: int | None = None,
    prompt_len: int = TENANT_PROMPT,
    texts: list[np.ndarray] | None = None,
    active_sessions: int | None = None,
    afters: list[int] | None = None,
    zipf: float = ZIPF_ALPHA,
) -> tuple[list[_Shape], int]:
    """The load test's Tenants shape (see the module docstring): `tenants` (default 4 a replica)
    of `prompt_len`-token system prompts, `active_sessions` (default 4 a replica) in progress at
    once; returns the shapes and the tenants, and appends each prompt's tokens to `texts` and
    each request's previous turn (-1: a session's first) to `afters` if given; tenant k (from 0)
    starts a session with weight 1 / (k + 1) ** zipf, as the load test's `--tenant-zipf`."""
    tenants = tenants or TENANTS_PER_REPLICA * replicas
    weights = 1.0 / np.arange(1, tenants + 1) ** zipf
    weights /= weights.sum()
    systems: dict[int, _Stream] = {}

    def new_session(sid: int) -> dict:
        t = int(rng.choice(tenants, p=weights))
        if t not in systems:
            systems[t] = _Stream()
            systems[t].extend(rng.integers(0, VOCAB, prompt_len).tolist())
        base = systems[t]
        return {"id": sid, "turn": 0, "stream": _Stream(base.tokens, base.chain), "last": -1}

    active = [new_session(i) for i in range(active_sessions or TENANTS_PER_REPLICA * replicas)]
    sessions = len(active)
    out: list[_Shape] = []
    for _ in range(total):
        slot = int(rng.integers(len(active)))
        s = active[slot]
        conv: _Stream = s["stream"]
        conv.extend(rng.integers(0, VOCAB, TURN_LEN).tolist())
        prompt_tokens, chain = len(conv.tokens), tuple(conv.chain)
        if texts is not None:
            texts.append(np.array(conv.tokens, dtype=np.uint16))
        conv.extend(rng.integers(0, VOCAB, REPLY_LEN).tolist())  # the reply, resent by the next turn
        if afters is not None:
            afters.append(s["last"])
        s["last"] = len(out)
        out.append((chain, tuple(conv.chain[len(chain) :]), prompt_tokens, REPLY_LEN, (-1, len(out)), s["id"]))
        s["turn"] += 1
        if s["turn"] == TURNS:
            active[slot] = new_session(sessions)
            sessions += 1
    return out, tenants


def _llmd(total: int, rng: np.random.Generator) -> list[_Shape]:
    """llm-d's shared_prefix profile: a random (group, user) prompt per request, repeated as is."""
    seed_h = model_seed(MODEL)
    prompts: dict[tuple[int, int], tuple[int, ...]] = {}
    systems: dict[int, list[int]] = {}
    out: list[_Shape] = []
    for q in range(total):
        g, u = int(rng.integers(LLMD_GROUPS)), int(rng.integers(LLMD_USERS))
        chain = prompts.get((g, u))
        if chain is None:
            if g not in systems:
                systems[g] = rng.integers(0, VOCAB, LLMD_SYSTEM).tolist()
            toks = systems[g] + rng.integers(0, VOCAB, LLMD_QUESTION).tolist()
            chain = prompts[(g, u)] = tuple(chunk_hashes(toks, CHUNK, 1 << 30, seed_h))
        out.append((chain, _output_ids(q, LLMD_OUTPUT), LLMD_SYSTEM + LLMD_QUESTION, LLMD_OUTPUT, (g, q), None))
    return out


def build_workload(
    name: str,
    replicas: int,
    requests: int | None = None,
    seed: int = 0,
    util: float = 0.75,
    cache_factor: float = 2.0,
    scale_up: bool = False,
    *,
    tenants: int | None = None,
    tenant_prompt_len: int = TENANT_PROMPT,
    cache_tokens: int | None = None,
    keep_tokens: bool = False,
    rate: float | None = None,
    active_sessions: int | None = None,
    tenant_zipf: float = ZIPF_ALPHA,
) -> Workload:
    """A workload for `replicas` replicas (the fleet at the start; 2 × after the half with `scale_up`).
    tenants, tenant_prompt_len: the `tenants` shape's (a load test's `--tenants`,
    `--tenant-prompt-len`); cache_tokens: each replica's pool (default: from `cache_factor`);
    keep_tokens: keep `tenants`' prompt tokens (ray-prefix needs them); rate: arrivals per
    second (instead of `util`'s); active_sessions: `tenants`' sessions in progress at once;
    tenant_zipf: `tenants`' popularity exponent (a load test's `--tenant-zipf`)."""
    rng = np.random.default_rng(seed)
    arrays: dict = {"systems": np.zeros((0, 0)), "heads": np.zeros((0, 0)), "questions": np.zeros((0, 0))}
    afters: list[int] = []
    if name in ("gsp", "zipf", "unique"):
        groups = -(-requests // PER_GROUP) if requests else max(GROUPS, GROUPS_PER_REPLICA * replicas)
        total = requests or groups * PER_GROUP
        shapes, arrays = _gsp_like(name, total, groups, rng)
        distinct = groups * SYSTEM_LEN
        scaled = groups > GROUPS
    elif name == "tenants":
        total = requests or 48 * replicas
        texts: list[np.ndarray] | None = [] if keep_tokens else None
        shapes, groups = _tenants(
            replicas, total, rng, tenants, tenant_prompt_len, texts, active_sessions, afters, tenant_zipf
        )
        distinct, scaled = groups * tenant_prompt_len, True
        arrays["texts"] = tuple(texts or ())
        arrays["active_sessions"] = active_sessions or TENANTS_PER_REPLICA * replicas
    else:
        raise ValueError(f"unknown workload {name!r}")
    prompt_len = SYSTEM_LEN + QUESTION_LEN
    if cache_tokens is None:
        cache_tokens = max(int(cache_factor * distinct / replicas), 4 * (prompt_len + OUTPUT_LEN))
    scale_at = total // 2 if scale_up else None
    # Arrival rate: `util` busy at the oracle's hit rate (computed on the arrival order, which does
    # not depend on the times); after a scale-up, twice that.
    cached, works = _oracle(shapes, replicas * cache_tokens // CHUNK, scale_at)
    prompt = sum(s[2] for s in shapes)
    if rate is None:
        rate = util * replicas * PREFILL_TPS / (sum(works) / total)
    gaps = rng.exponential(1.0 / rate, size=total)
    if scale_at is not None:
        gaps[scale_at:] /= 2
    arrivals = np.cumsum(gaps).tolist()
    return Workload(
        name,
        replicas,
        groups,
        scaled,
        cache_tokens,
        cached / prompt,
        rate,
        tuple(Request(t, *shape, after=a) for t, shape, a in zip(arrivals, shapes, afters or [-1] * total)),
        scale_at=scale_at,
        **arrays,
    )


def build_llmd(rate: float, seconds: float = 60.0, seed: int = 0) -> Workload:
    """llm-d's setup at one Poisson rate: a warm-up set at 15 req/s, then `seconds` at `rate`."""
    rng = np.random.default_rng(seed)
    warm = LLMD_GROUPS * LLMD_USERS
    stage = max(1, int(rate * seconds))
    shapes = _llmd(warm + stage, rng)
    gaps = np.concatenate([rng.exponential(1 / LLMD_WARMUP_RATE, warm), rng.exponential(1 / rate, stage)])
    cached, _ = _oracle(shapes, LLMD_REPLICAS * LLMD_KV_TOKENS // CHUNK, None, measure_from=warm)
    prompt = sum(s[2] for s in shapes[warm:])
    empty = np.zeros((0, 0))
    return Workload(
        "llmd",
        LLMD_REPLICAS,
        LLMD_GROUPS,
        False,
        LLMD_KV_TOKENS,
        cached / prompt,
        rate,
        tuple(Request(t, *shape) for t, shape in zip(np.cumsum(gaps).tolist(), shapes)),
        empty,
        empty,
        empty,
        measure_from=warm,
    )


def _oracle(
    shapes: list[_Shape], capacity: int, scale_at: int | None, measure_from: int = 0
) -> tuple[int, list[float]]:
    """One pooled LRU of the fleet's capacity (doubled at a scale-up) seeing every request:
    (cached prompt tokens of the measured requests, each request's work)."""
    lru = _LRU(capacity)
    cached, works = 0, []
    for i, (chain, out, prompt, output, _, _) in enumerate(shapes):
        if i == scale_at:
            lru.capacity *= 2
        hit = lru.serve(chain, out) * CHUNK
        if i >= measure_from:
            cached += hit
        works.append(prompt - hit + DECODE_WEIGHT * output)
    return cached, works


def _output_ids(q: int, output_len: int = OUTPUT_LEN) -> tuple[int, ...]:
    """Stand-ins for a request's output chunks: unique (negative, unlike real hashes), never hit."""
    per = output_len // CHUNK + 1
    return tuple(-(q * per + k) - 1 for k in range(output_len // CHUNK))


# -- replica cache ---------------------------------------------------------------------------------


class _LRU:
    """A replica's cached chunks: LRU over chunk hashes, leaf-first eviction (a tree only evicts
    leaves), so the held set stays prefix-closed along every chain."""

    def __init__(self, capacity_chunks: int):
        self.capacity = capacity_chunks
        self.chunks: OrderedDict[int, None] = OrderedDict()
        # held hashes at depth ≤ EAGER_DEPTH, and deeper to ROUTE_CHUNKS once matched: the digest
        self.routable: set[int] = set()

    def serve(self, chain: Sequence[int], output_ids: Sequence[int]) -> int:
        """Match `chain`, then insert it and the output chunks; returns matched chunks."""
        chunks = self.chunks
        matched, routable = 0, self.routable
        for h in chain:
            if h not in chunks:
                break
            if EAGER_DEPTH <= matched < ROUTE_CHUNKS:  # a reused deep chunk is published (tree_events)
                routable.add(h)
            matched += 1
        for h in reversed(output_ids):  # deepest first: the root ends most recently used
            chunks[h] = None
            chunks.move_to_end(h)
        for k in range(len(chain) - 1, -1, -1):
            h = chain[k]
            if h in chunks:
                chunks.move_to_end(h)
            else:
                chunks[h] = None
                if k < EAGER_DEPTH:
                    routable.add(h)
        while len(chunks) > self.capacity:
            self.routable.discard(chunks.popitem(last=False)[0])
        return matched


class _Pool:
    """`--engine`: a replica's KV pool as its engine runs it. The chunks requests in flight use
    are pinned (a count each); the others form the LRU of `_LRU`, evicted oldest first; both
    within one capacity. A request is admitted (matched, its chunks pinned) only when its chunks
    not pinned yet fit beside the pinned ones, first come first served: on a busy replica the
    requests in flight hold most of the pool, and a prefix waits or is recomputed."""

    def __init__(self, capacity_chunks: int):
        self.capacity = capacity_chunks
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned held chunks, oldest first
        self.pins: dict[int, int] = {}
        self.routable: set[int] = set()  # as _LRU's: the digest

    def fits(self, chain: Sequence[int], output_ids: Sequence[int]) -> bool:
        pins = self.pins
        if not pins:  # an idle engine takes any request (one larger than its pool: the engine's error)
            return True
        new = sum(1 for h in chain if h not in pins) + sum(1 for h in output_ids if h not in pins)
        return len(pins) + new <= self.capacity

    def admit(self, chain: Sequence[int], output_ids: Sequence[int]) -> int:
        """Match `chain`, pin it and its output chunks; returns matched chunks."""
        lru, pins, routable = self.lru, self.pins, self.routable
        matched = 0
        for h in chain:
            if h not in pins and h not in lru:
                break
            if EAGER_DEPTH <= matched < ROUTE_CHUNKS:  # a reused deep chunk is published (tree_events)
                routable.add(h)
            matched += 1
        for k, h in enumerate(chain):
            if h in pins:
                pins[h] += 1
                continue
            if h in lru:
                del lru[h]
            elif k < EAGER_DEPTH:  # new
                routable.add(h)
            pins[h] = 1
        for h in output_ids:
            pins[h] = pins.get(h, 0) + 1
        self._trim()
        return matched

    def touch(self, chain: Sequence[int]) -> None:
        """A waiting request's cached prefix made the most recently used (the root last, as a
        release leaves it): the engine's scheduler does so for the head of its queue each step."""
        lru, pins = self.lru, self.pins
        run = []
        for h in chain:
            if h in pins:
                continue
            if h not in lru:
                break
            run.append(h)
        for h in reversed(run):
            lru.move_to_end(h)

    def release(self, chain: Sequence[int], output_ids: Sequence[int]) -> None:
        """The request finished: its chunks unpinned, deepest first (the root most recently used)."""
        lru, pins = self.lru, self.pins
        for h in (*reversed(output_ids), *reversed(chain)):
            c = pins[h] - 1
            if c:
                pins[h] = c
            else:
                del pins[h]
                lru[h] = None
        self._trim()

    def _trim(self) -> None:
        """Evict the least recently used unpinned chunks while the pool is over its capacity."""
        lru = self.lru
        while lru and len(lru) + len(self.pins) > self.capacity:
            self.routable.discard(lru.popitem(last=False)[0])


# -- routers: what each policy does with what a router sees ----------------------------------------


class _Fleet:
    """What the simulation shows every router: the live replicas (by index) and their true queue
    lengths (Serve's power of two and Ray's router probe them)."""

    def __init__(self, total: int, live: int):
        self.live = live
        self.outstanding = [0] * total


class _PrefixRouter:
    """Ours: chunkserve/router/policy.py, fed own decisions, completions and the replicas'
    delayed reports (digest + the work held by router)."""

    reports = True
    mirrors = False  # (_SharedRouter: the other routers' decisions, a share delay later)

    def __init__(self, ids: list[str], fleet: _Fleet, seed: int, name: int = 0):
        self.ids = ids
        self.policy = PrefixPolicy(PolicyConfig(chunk_size=CHUNK, decode_weight=DECODE_WEIGHT), ids[: fleet.live], seed)
        self.slot = {r: i for i, r in enumerate(ids)}
        self.name = name  # this router's index among the k: its share in a report is its own

    def prepare(self, wl: Workload, req: Request):
        return req.chain[:ROUTE_CHUNKS]

    def route(self, hashes, req: Request, now: float) -> tuple[int, Ticket]:
        r = self.policy.choose(hashes, req.prompt_tokens, req.output_tokens, now, req.session)[0]
        ticket = self.policy.on_routed(r, hashes, req.prompt_tokens, req.output_tokens, now, req.session)
        return self.slot[r], ticket

    def finished(self, ticket: Ticket) -> None:
        self.policy.on_finished(ticket)

    def join(self, live: int) -> None:
        self.policy.update_replicas(ReplicaView(r) for r in self.ids[:live])

    def report(self, replica: int, hashes: frozenset[int], held: list[float], as_of: float, now: float) -> None:
        """A replica's report taken at `as_of`: its digest, and the work in flight from each
        router (ours known exactly: the others' added to it)."""
        r, me = self.ids[replica], self.name
        self.policy.update_digest(r, hashes, as_of)
        self.policy.set_others(r, sum(held) - held[me])


class _SharedRouter(_PrefixRouter):
    """Ours with peers mirrored: every other router's decisions and completions arrive a share
    delay later and are booked as if its own (the policy's on_routed / on_finished), so the k
    routers' loads, work lately and predicted chains differ only by the decisions in flight
    between them; the replicas' reports give the digests only (the others' work is known
    exactly, not by report)."""

    mirrors = True

    def mirror(self, replica: int, req: Request, now: float) -> Ticket:
        chain = req.chain[:ROUTE_CHUNKS]
        return self.policy.on_routed(self.ids[replica], chain, req.prompt_tokens, req.output_tokens, now, req.session)

    def report(self, replica: int, hashes: frozenset[int], held: list[float], as_of: float, now: float) -> None:
        self.policy.update_digest(self.ids[replica], hashes, as_of)


class _ApproxRouter(_PrefixRouter):
    """The same policy on its own decisions only: no replica reports (each router's approximate
    tree, as SGLang's gateway or llm-d's estimated scorer keep)."""

    reports = False


class _Pow2Router:
    """Serve's default PowerOfTwoChoicesRequestRouter: two replicas at random, the shorter queue
    (first on ties), from the replicas' queue lengths."""

    reports = False
    mirrors = False

    def __init__(self, ids: list[str], fleet: _Fleet, seed: int, name: int = 0):
        self.fleet = fleet
        self.rng = random.Random(seed * 1000 + name)

    def prepare(self, wl: Workload, req: Request):
        return None

    def pick(self, candidates: Sequence[int]) -> int:
        q = self.fleet.outstanding
        best = candidates[0]
        for c in candidates[1:]:
            if q[c] < q[best]:
                best = c
        return best

    def route(self, _, req: Request, now: float) -> tuple[int, None]:
        n = self.fleet.live
        return self.pick(self.rng.sample(range(n), min(2, n))), None

    def finished(self, ticket: None) -> None:
        pass

    def join(self, live: int) -> None:
        pass


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
    """Ray Serve LLM's PrefixCacheAffinityRouter (one actor: every ingress shares it), reimplemented from
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

    def __init__(self, ids: list[str], fleet: _Fleet, seed: int, name: int = 0):
        super().__init__(ids, fleet, seed, name)
        self.tenants = range(fleet.live)
        self.tree = _TextTree(self.tenants)

    def join(self, live: int) -> None:
        for t in range(len(self.tenants), live):
            self.tree.chars[t] = 0
            self.tree.root.tenants.add(t)
        self.tenants = range(live)

    def prepare(self, wl: Workload, req: Request) -> str:
        return wl.tokens(req).astype(">u2").tobytes().hex()

    def route(self, text: str, req: Request, now: float) -> tuple[int, None]:
        n = len(self.tenants)
        fallback = self.rng.sample(range(n), min(2, n))
        chosen: list[int] = []
        queue = self.fleet.outstanding[:n]
        if max(queue) - min(queue) <= self.IMBALANCED_THRESHOLD:
            matched, tenants = self.tree.prefix_match(text, self.tenants)
            if matched / len(text) < self.MATCH_RATE_THRESHOLD:
                chosen = self.tree.smallest_tenants()
            else:
                chosen = tenants
        i = self.pick(chosen or fallback)
        self.tree.insert(text, i)
        return i, None


ROUTERS = {
    "prefix": _PrefixRouter,
    "shared": _SharedRouter,
    "approx": _ApproxRouter,
    "pow2": _Pow2Router,
    "ray-prefix": _RayPrefixRouter,
}


# -- the event loop --------------------------------------------------------------------------------


def _backlog_area(since: float, until: float, busy_until: float) -> float:
    """∫ max(0, busy_until − s) ds over [since, until]: a FIFO server's outstanding work."""
    if busy_until <= since:
        return 0.0
    end = min(busy_until, until)
    return ((busy_until - since) ** 2 - (busy_until - end) ** 2) / 2


def _clock_cost() -> float:
    """The part of a pair of thread_time() reads that lands between them (a system call here):
    taken off each decision's CPU time. Median of many back-to-back pairs, in seconds."""
    pairs = []
    for _ in range(2000):
        t0 = thread_time()
        pairs.append(thread_time() - t0)
    return float(np.median(pairs))


def cpu_ref_us() -> float:
    """This machine's speed at plain Python: best time of sum(range(1000)), in µs (it was
    ~25 on the shared 2-core VM these numbers were first taken on; ~8-10 is a current desktop)."""
    return round(min(timeit.repeat("sum(range(1000))", number=200, repeat=5)) / 200 * 1e6, 2)


def window_max_mean(
    times: np.ndarray, replica: np.ndarray, work: np.ndarray, live: int, since: float, until: float
) -> float:
    """The largest max ÷ mean, over replicas 0..live-1, of the work routed in a WINDOW_S window
    within [since, until] (sliding by WINDOW_STEP_S; one window if the span is shorter)."""
    order = np.argsort(times, kind="stable")
    times, replica, work = times[order], replica[order], work[order]
    starts = np.arange(since, max(since, until - WINDOW_S) + 1e-9, WINDOW_STEP_S)
    worst = 0.0
    for s in starts:
        lo, hi = np.searchsorted(times, [s, min(s + WINDOW_S, until)], side="left")
        if hi <= lo:
            continue
        per = np.bincount(replica[lo:hi], weights=work[lo:hi], minlength=live)[:live]
        mean = per.mean()
        if mean > 0:
            worst = max(worst, float(per.max() / mean))
    return worst


def simulate(
    wl: Workload,
    policy: str,
    seed: int = 0,
    digest_period: float = 1.0,
    digest_delay: float = 0.5,
    routers: int = 1,
    share_delay: float = 0.01,
    engine_tpot: float | None = None,
    shared_gpu: bool = False,
    closed_loop: bool = False,
) -> dict:
    """closed_loop: a session's turn is sent at its arrival or once the session's previous turn
    has completed, whichever is later (the load test's client); TTFT and the windows from when
    it was sent."""
    # The simulator's own heap (every replica's cache) is large and cycle-free: with the cyclic
    # GC on, its pauses would be billed to whichever routing call happens to allocate.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(
            wl, policy, seed, digest_period, digest_delay, routers, share_delay, engine_tpot, shared_gpu, closed_loop
        )
    finally:
        if gc_was_enabled:
            gc.enable()


def _simulate(
    wl: Workload,
    policy: str,
    seed: int,
    digest_period: float,
    digest_delay: float,
    k: int,
    share_delay: float,
    engine_tpot: float | None = None,
    shared_gpu: bool = False,
    closed_loop: bool = False,
) -> dict:
    started = time.perf_counter()
    engine = engine_tpot is not None
    n0, n = wl.replicas, wl.final_replicas
    ids = [f"replica-{i}" for i in range(n)]
    fleet = _Fleet(n, n0)
    cls = ROUTERS[policy]
    if cls is _RayPrefixRouter:  # one actor, whatever the ingresses
        shared = cls(ids, fleet, seed)
        rs: list[Any] = [shared] * k
    else:
        rs = [cls(ids, fleet, seed * 1000 + j, j) for j in range(k)]
    reports = cls.reports
    mirrors = cls.mirrors and k > 1
    pick_router = random.Random(seed + 17)
    caches: list[Any] = [(_Pool if engine else _LRU)(wl.cache_tokens // CHUNK) for _ in range(n)]
    waiting: list[collections.deque] = [collections.deque() for _ in range(n)]  # --engine: not admitted yet
    # the servers: one a replica, or (--shared-gpu) one for all (one GPU time-shared by the replicas)
    servers, tps = (1, PREFILL_TPS) if shared_gpu else (n, PREFILL_TPS)
    busy_until, prefill_free = [0.0] * servers, [0.0] * servers
    area, last_t = [0.0] * n, [0.0] * n
    held = [[0.0] * k for _ in range(n)]  # [replica][router] work in flight from that router
    events: list[tuple[float, int, int, Any]] = []  # (time, unique seq, kind, payload)
    seq = itertools.count()
    FINISH, SNAPSHOT, DELIVER, SCALE, SHARE, UNSHARE = 0, 1, 2, 3, 4, 5
    total = len(wl.requests)
    # each request's outcome, filled when its replica matches it (on arrival; --engine: on admission)
    matched_at, ttft_at, cost_at, finish_at, replica_at = (
        [0] * total,
        [0.0] * total,
        [0.0] * total,
        [0.0] * total,
        [0] * total,
    )
    queue_seen = [0] * total
    finished = [0]  # requests done
    sent = [q.arrival for q in wl.requests]  # when each is sent (closed_loop: maybe after its arrival)
    # the requests due, by send time; closed_loop: a turn joins once its session's previous is done
    ready = [(q.arrival, i) for i, q in enumerate(wl.requests) if not closed_loop or q.after < 0]
    heapq.heapify(ready)
    next_turn = {q.after: i for i, q in enumerate(wl.requests) if closed_loop and q.after >= 0}

    def publish(first: int, last: int, t0: float) -> None:
        for r in range(first, last):  # staggered publication
            events.append((t0 + digest_period * (r - first + 1) / (last - first), next(seq), SNAPSHOT, r))
        heapq.heapify(events)

    def start(i: int, r: int, j: int, req: Request, ticket: Any, now: float, matched_chunks: int, mirrored) -> None:
        """Request i, routed to replica r by router j, is matched now: its work joins the server."""
        matched = min(matched_chunks * CHUNK, req.prompt_tokens)
        uncached = req.prompt_tokens - matched
        cost = uncached + DECODE_WEIGHT * req.output_tokens
        s = 0 if shared_gpu else r
        if servers == n and not engine:  # (a replica's outstanding work: its own server's)
            area[r] += _backlog_area(last_t[r], now, busy_until[r])
            last_t[r] = now
        prefill_free[s] = max(now, prefill_free[s]) + uncached / tps
        if engine:  # decode rows batch: each output token a step's time, whatever the batch
            finish = prefill_free[s] + req.output_tokens * engine_tpot
        else:  # the server's work in arrival order
            finish = busy_until[s] = max(now, busy_until[s]) + cost / tps
        held[r][j] += cost - (req.prompt_tokens + DECODE_WEIGHT * req.output_tokens if engine else 0.0)
        matched_at[i], ttft_at[i], cost_at[i], finish_at[i] = matched, prefill_free[s] - sent[i], cost, finish
        heapq.heappush(events, (finish_at[i], next(seq), FINISH, (r, j, ticket, cost, req, i)))
        if mirrored is not None:  # (its SHARE pushed on arrival: the completion cannot pass the decision)
            heapq.heappush(events, (finish_at[i] + share_delay, next(seq), UNSHARE, mirrored))

    def admit(r: int, now: float) -> None:
        """--engine: replica r admits its waiting requests, first come first served, while they fit."""
        pool, queue = caches[r], waiting[r]
        for item in reversed(list(itertools.islice(queue, TOUCH_AHEAD))):  # (the head last: most recent)
            pool.touch(item[2].chain)
        while queue and pool.fits(queue[0][2].chain, queue[0][2].out_chain):
            i, j, req, ticket, mirrored = queue.popleft()
            start(i, r, j, req, ticket, now, pool.admit(req.chain, req.out_chain), mirrored)

    def handle(t: float, kind: int, payload: Any) -> None:
        if kind == FINISH:
            r, j, ticket, cost, req, i = payload
            finished[0] += 1
            if i in next_turn:  # (closed_loop) the session's next turn is sent
                nxt = next_turn.pop(i)
                heapq.heappush(ready, (max(t, wl.requests[nxt].arrival), nxt))
            fleet.outstanding[r] -= 1
            held[r][j] -= cost
            rs[j].finished(ticket)
            if engine:
                caches[r].release(req.chain, req.out_chain)
                admit(r, t)
        elif kind == SNAPSHOT:
            snapshot = (payload, frozenset(caches[payload].routable), list(held[payload]), t)
            heapq.heappush(events, (t + digest_delay, next(seq), DELIVER, snapshot))
            heapq.heappush(events, (t + digest_period, next(seq), SNAPSHOT, payload))
        elif kind == DELIVER:
            r, hashes, by_router, as_of = payload
            for router in rs:
                router.report(r, hashes, by_router, as_of, t)
        elif kind == SHARE:  # another router's decision reaches the others: booked as theirs
            src, dest, shared_req, booked = payload
            for jj, router in enumerate(rs):
                if jj != src:
                    booked[jj] = router.mirror(dest, shared_req, t)
        elif kind == UNSHARE:  # ... and its completion
            for jj, tk in payload.items():
                rs[jj].finished(tk)
        else:  # the fleet doubles: every router learns it at once; the new replicas start reporting
            fleet.live = n
            for router in dict.fromkeys(rs):
                router.join(n)
            if reports:
                publish(n0, n, t)

    if reports:
        publish(0, n0, 0.0)
    scale_t = wl.scale_time()
    if scale_t is not None:
        heapq.heappush(events, (scale_t, next(seq), SCALE, None))
    m0 = wl.measure_from
    decisions, walls = [], []
    routed = 0
    while routed < total:
        if not ready or events and events[0][0] <= ready[0][0]:  # (no ready: a turn waits for a FINISH)
            t, _, kind, payload = heapq.heappop(events)
            handle(t, kind, payload)
            continue
        now, i = heapq.heappop(ready)
        req, sent[i] = wl.requests[i], now
        routed += 1
        j = pick_router.randrange(k)
        router = rs[j]
        view = router.prepare(wl, req)
        w0, t0 = time.perf_counter(), thread_time()
        r, ticket = router.route(view, req, now)
        decisions.append(thread_time() - t0)
        walls.append(time.perf_counter() - w0)
        replica_at[i] = r
        queue_seen[i] = fleet.outstanding[r]
        fleet.outstanding[r] += 1
        mirrored: dict[int, Ticket] | None = None
        if mirrors:
            mirrored = {}  # (the other routers' tickets, filled at SHARE)
            heapq.heappush(events, (now + share_delay, next(seq), SHARE, (j, r, req, mirrored)))
        if engine:  # it waits for the pool (its whole work booked until it is matched)
            held[r][j] += req.prompt_tokens + DECODE_WEIGHT * req.output_tokens
            waiting[r].append((i, j, req, ticket, mirrored))
            admit(r, now)
        else:
            start(i, r, j, req, ticket, now, caches[r].serve(req.chain, req.out_chain), mirrored)
    if engine:  # the requests still waiting run to the end (throughput counts those done by the last arrival)
        while finished[0] < total:  # (a request waits only while another is in flight: its FINISH is due)
            t, _, kind, payload = heapq.heappop(events)
            if kind in (FINISH, SHARE, UNSHARE):
                handle(t, kind, payload)
    clock_us = _clock_cost()
    begin, horizon = min(sent[m0:]), max(sent[m0:])
    measured = wl.requests[m0:]
    t_np = np.asarray(sent[m0:])
    r_np = np.asarray(replica_at[m0:], dtype=np.int64)
    w_np = np.asarray(cost_at[m0:])
    hit, prompt = sum(matched_at[m0:]), sum(q.prompt_tokens for q in measured)
    if engine or servers != n:  # (a replica's outstanding work is not its own server's)
        backlog_ratio = None
    else:
        for r in range(n):
            area[r] += _backlog_area(last_t[r], horizon, busy_until[r])
        live_since = [0.0] * n0 + [scale_t or 0.0] * (n - n0)
        backlog = [area[r] / max(horizon - live_since[r], 1e-9) for r in range(n)]
        backlog_ratio = round(max(backlog) / (sum(backlog) / n), 4) if sum(backlog) else None
    if scale_t is None:
        load = window_max_mean(t_np, r_np, w_np, n, begin, horizon)
    else:  # the phases apart: each with its own fleet
        before = t_np < scale_t
        load = max(
            window_max_mean(t_np[before], r_np[before], w_np[before], n0, begin, scale_t),
            window_max_mean(t_np[~before], r_np[~before], w_np[~before], n, scale_t, horizon),
        )
    span = max(horizon - begin, 1e-9)
    done = np.asarray(finish_at[m0:]) <= horizon
    ttft = ttft_at[m0:]
    oracle = wl.oracle_hit_rate
    busy = float(w_np.sum()) / PREFILL_TPS
    return {
        "policy": policy,
        "workload": wl.name,
        "replicas": n0,
        "replicas_after": n if scale_t is not None else None,
        "routers": k,
        "requests": len(measured),
        "per_replica": round(len(measured) / n0, 1),
        "groups": wl.groups,
        "groups_scaled": wl.groups_scaled,
        "hit_rate": round(hit / prompt, 4),
        "oracle_hit_rate": round(oracle, 4),
        "hit_vs_oracle": round(hit / prompt / oracle, 4) if oracle else None,
        "max_mean_load": round(load, 4) if load else None,
        "max_mean_backlog": backlog_ratio,
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p90_s": round(float(np.percentile(ttft, 90)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "throughput_rps": round(float(done.sum()) / span, 3),
        "output_tps": round(float(sum(q.output_tokens for q, d in zip(measured, done) if d)) / span, 1),
        "rate": round(wl.rate, 3),
        "p99_queue": float(np.percentile(queue_seen[m0:], 99)),
        "utilisation": round(
            busy / (n0 * span if scale_t is None else n0 * (scale_t - begin) + n * (horizon - scale_t)), 4
        ),
        "decision_us": round(max(0.0, float(np.mean(decisions)) - clock_us) * 1e6, 2),
        "decision_p50_us": round(max(0.0, float(np.median(decisions)) - clock_us) * 1e6, 2),
        "decision_wall_us": round(float(np.mean(walls)) * 1e6, 2),
        "cpu_ref_us": cpu_ref_us(),
        "cache_tokens": wl.cache_tokens,
        "engine_tpot_s": engine_tpot,
        "shared_gpu": shared_gpu,
        "closed_loop": closed_loop,
        "active_sessions": wl.active_sessions,
        "digest_period_s": digest_period if reports else None,
        "digest_delay_s": digest_delay if reports else None,
        "share_delay_s": share_delay if mirrors else None,
        "seed": seed,
        "sim_s": round(time.perf_counter() - started, 2),
    }


# -- command line ----------------------------------------------------------------------------------

GRID_REPLICAS = (4, 16, 64, 256, 1024)
GRID_ROUTERS = (1, 4)
GRID_POLICIES = ("prefix", "approx", "pow2")
SHORT_PER_REPLICA = 48  # requests per replica of a short run (a scale-up: 48 before, 24 after, per replica)
RAY_MAX_REPLICAS = 64  # ray-prefix's text tree is slow: it runs the short k=1 cells up to this
DECISION_REPLICAS = 1024
DECISION_TARGET_US = 30.0


def _cell(args: tuple) -> list[dict]:
    """One grid cell: its workload built once, then every policy on it (a worker process's job)."""
    workload, n, k, scale_up, policies, seed, util, cache_factor, period, delay, share = args
    requests = SHORT_PER_REPLICA * n * (2 if scale_up else 1)
    wl = build_workload(workload, n, requests, seed, util, cache_factor, scale_up)
    return [simulate(wl, p, seed, period, delay, k, share) for p in policies]


def _llmd_cell(args: tuple) -> list[dict]:
    rate, seconds, policies, seed, period, delay = args
    wl = build_llmd(rate, seconds, seed)
    return [simulate(wl, p, seed, period, delay, 1) for p in policies]


def targets(rows: list[dict], policy: str = "prefix") -> list[dict]:
    """The issue's acceptance targets on the grid's rows of `policy` (`shared`: its k > 1 rows
    and prefix's k = 1 rows, the same policy there): one line per target, with the worst cell and
    by how much it misses (margin < 0: missed)."""
    ours = [
        r
        for r in rows
        if r["workload"] != "llmd"
        and (r["policy"] == policy or policy == "shared" and r["policy"] == "prefix" and r["routers"] == 1)
    ]
    pow2 = {(r["workload"], r["replicas"], r["routers"], r["replicas_after"]): r for r in rows if r["policy"] == "pow2"}
    out = []

    def check(name: str, cells: list[dict], value, limit: float, upper: bool) -> None:
        if not cells:
            return
        vals = [(value(r), r) for r in cells]
        worst_v, worst = (max if upper else min)(vals, key=lambda x: x[0])
        margin = (limit - worst_v) if upper else (worst_v - limit)
        out.append(
            {
                "target": name,
                "policy": policy,
                "met": margin >= 0,
                "worst": round(worst_v, 4),
                "limit": limit,
                "margin": round(margin, 4),
                "cell": {k: worst[k] for k in ("workload", "replicas", "replicas_after", "routers")},
                "cells": len(cells),
            }
        )

    for w in ("gsp", "tenants"):
        cells = [r for r in ours if r["workload"] == w]
        check(f"{w}: hit >= 0.95 x oracle", cells, lambda r: r["hit_vs_oracle"], 0.95, False)
        check(f"{w}: max/mean load <= 1.25", cells, lambda r: r["max_mean_load"], 1.25, True)
    zipf = [r for r in ours if r["workload"] == "zipf"]
    check("zipf: max/mean load <= 1.5", zipf, lambda r: r["max_mean_load"], 1.5, True)
    uniq = [r for r in ours if r["workload"] == "unique"]
    check(
        "unique: max/mean load <= 1.05 x pow2's",
        uniq,
        lambda r: (
            r["max_mean_load"]
            / pow2[(r["workload"], r["replicas"], r["routers"], r["replicas_after"])]["max_mean_load"]
        ),
        1.05,
        True,
    )
    big = [r for r in ours if r["replicas"] == DECISION_REPLICAS and r["routers"] == 1 and r["replicas_after"] is None]
    check(
        f"decision <= {DECISION_TARGET_US} us mean at {DECISION_REPLICAS}",
        big,
        lambda r: r["decision_us"],
        DECISION_TARGET_US,
        True,
    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.router.tools.simulate", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--policy", choices=POLICIES, default="prefix")
    ap.add_argument("--workload", choices=WORKLOADS, default="gsp")
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--routers", type=int, default=1, help="ingress routers (k), each seeing the others via reports")
    ap.add_argument("--scale-up", action="store_true", help="the fleet doubles half way (and the rate with it)")
    ap.add_argument("--requests", type=int, default=None, help="default: 16 per group, max(64, 16 x replicas) groups")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--util", type=float, default=0.75, help="cluster utilisation at the oracle's hit rate")
    ap.add_argument(
        "--cache-factor",
        type=float,
        default=2.0,
        help="replica cache = this x its share of the distinct system prompts",
    )
    ap.add_argument("--cache-tokens", type=int, help="each replica's pool, in tokens (instead of --cache-factor)")
    ap.add_argument("--tenants", type=int, help="tenants: how many (default 4 a replica)")
    ap.add_argument("--tenant-prompt-len", type=int, default=TENANT_PROMPT, help="tenants: each system prompt's tokens")
    ap.add_argument(
        "--tenant-zipf", type=float, default=ZIPF_ALPHA, help="tenants: tenant k's weight 1 / (k + 1) ** this"
    )
    ap.add_argument("--active-sessions", type=int, help="tenants: sessions in progress at once (default 4 a replica)")
    ap.add_argument(
        "--closed-loop",
        action="store_true",
        help="tenants: a turn is sent once its session's previous turn has completed (as the load test's client)",
    )
    ap.add_argument("--digest-period", type=float, default=1.0, help="seconds between a replica's reports")
    ap.add_argument("--digest-delay", type=float, default=0.5, help="seconds from a report's snapshot to the routers")
    ap.add_argument(
        "--share-delay-ms",
        type=float,
        default=10.0,
        help="shared: milliseconds from a router's decision (or completion) to the other routers",
    )
    ap.add_argument(
        "--engine",
        action="store_true",
        help="each replica's pool as its engine runs it: requests in flight pin their chunks, and wait until "
        "theirs fit; a request's decode takes --tpot-ms a token, batched (its prefill queues as without)",
    )
    ap.add_argument("--tpot-ms", type=float, default=25.0, help="--engine: a decode step's time")
    ap.add_argument("--rate", type=float, help="arrivals per second (instead of --util's)")
    ap.add_argument(
        "--shared-gpu", action="store_true", help="the replicas share one GPU: one server (one replica's speed) for all"
    )
    ap.add_argument("--llmd", action="store_true", help="llm-d's setup at each of --rates, every policy but ray-prefix")
    ap.add_argument("--rates", default=",".join(f"{r:g}" for r in LLMD_RATES), help="llm-d's Poisson rates, req/s")
    ap.add_argument("--llmd-seconds", type=float, default=60.0, help="each llm-d rate's measured stage")
    ap.add_argument(
        "--all",
        action="store_true",
        help=f"{WORKLOADS} x replicas {GRID_REPLICAS} x routers {GRID_ROUTERS} x (short, scale-up), "
        f"policies {GRID_POLICIES} (ray-prefix on the small k=1 short cells), then llm-d, then the targets",
    )
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for --all / --llmd")
    args = ap.parse_args(argv)
    period, delay, share = args.digest_period, args.digest_delay, args.share_delay_ms / 1e3

    def emit(rows: list[dict]) -> list[dict]:
        for row in rows:
            print(json.dumps(row), flush=True)
        return rows

    llmd_jobs = [
        (float(r), args.llmd_seconds, GRID_POLICIES, args.seed, period, delay) for r in args.rates.split(",") if r
    ]
    if args.llmd and not args.all:
        with ProcessPoolExecutor(args.jobs) as pool:
            for out in pool.map(_llmd_cell, llmd_jobs):
                emit(out)
        return
    if not args.all:
        wl = build_workload(
            args.workload,
            args.replicas,
            args.requests,
            args.seed,
            args.util,
            args.cache_factor,
            args.scale_up,
            tenants=args.tenants,
            tenant_prompt_len=args.tenant_prompt_len,
            cache_tokens=args.cache_tokens,
            keep_tokens=args.policy == "ray-prefix",
            rate=args.rate,
            active_sessions=args.active_sessions,
            tenant_zipf=args.tenant_zipf,
        )
        emit(
            [
                simulate(
                    wl,
                    args.policy,
                    args.seed,
                    period,
                    delay,
                    args.routers,
                    share,
                    args.tpot_ms / 1e3 if args.engine else None,
                    args.shared_gpu,
                    args.closed_loop,
                )
            ]
        )
        return
    cells = []
    for n in sorted(GRID_REPLICAS, reverse=True):  # the long cells first: the pool ends evenly
        for w in WORKLOADS:
            for k in GRID_ROUTERS:
                for scale_up in (False, True):
                    policies = GRID_POLICIES + (("shared",) if k > 1 else ())  # (k = 1: shared is prefix)
                    if k == 1 and not scale_up and n <= RAY_MAX_REPLICAS and w != "tenants":
                        policies += ("ray-prefix",)
                    cells.append(
                        (w, n, k, scale_up, policies, args.seed, args.util, args.cache_factor, period, delay, share)
                    )
    rows: list[dict] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for out in pool.map(_cell, cells):
            rows += emit(out)
        for out in pool.map(_llmd_cell, llmd_jobs):
            rows += emit(out)
    for policy in ("prefix", "shared"):
        for line in targets(rows, policy):
            print(json.dumps({"target": line}), flush=True)


if __name__ == "__main__":
    main()
