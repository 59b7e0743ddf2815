"""Tenants (DESIGN §2): whose request it is, whom its cached prompts are shared with, its limits.

    Authorization: Bearer <key> ──sha256──▶ Tenant ──▶ cache salt (its namespace ∪ cache_salt)
                                                   ├─▶ rate limits: 429 + Retry-After
                                                   └─▶ per-tenant counts (/metrics)

A key names one tenant (`AppConfig.tenants`; `api_key`, or no key at all, is the `default`
tenant, shared). The tenant's cache policy and the request's `cache_salt` (vLLM's) make the cache
salt that seeds the prompt's chunk hashes here and picks its prefix tree in the engine
(`chunkserve.replicas.engine.sequence.Tenancy`), so requests of different salts never share a cached
chunk, at the router or on a replica: a private tenant's prompts cannot be timed by anyone else.
What is not protected: tenants that share (`shared`, or one group) see each other's cached
prefixes by design; the load (how busy a replica is) shows in everyone's latency.
"""

from __future__ import annotations

import collections
import hashlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass

import xxhash

from chunkserve.cluster.config import DEFAULT_TENANT, AppConfig, TenantOptions


@dataclass(frozen=True)
class Tenant:
    name: str
    namespace: str | None  # cache namespace: None shared, "tenant:<name>" private, "group:<name>"
    priority: int = 0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


DEFAULT = Tenant(DEFAULT_TENANT, None)


def cache_salt(tenant: Tenant, request_salt: str | None) -> str | None:
    """The salt a request's chunks are hashed and cached under: None (today's shared cache) for a
    shared tenant's unsalted request; else its namespace and its own salt, encoded so that no two
    (namespace, salt) pairs give one string."""
    if tenant.namespace is None and request_salt is None:
        return None
    return json.dumps([tenant.namespace, request_salt], ensure_ascii=False)


SESSION_HEADER = "x-session-id"  # a multi-turn session's id (Ray's consistent-hash router and load generators send it)


def session_key(tenant: Tenant, session_id: str | None) -> int | None:
    """The router's session hint (chunkserve.router.policy.PrefixPolicy.choose): the tenant and
    its client's session id hashed together, so two tenants' equal ids are two sessions; None
    without one."""
    if not session_id:
        return None
    return xxhash.xxh3_64_intdigest(f"{tenant.name}\0{session_id}".encode("utf-8", "surrogatepass"))


def _sha256(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _tenant(options: TenantOptions) -> Tenant:
    cache = options.cache
    namespace = None if cache == "shared" else f"tenant:{options.name}" if cache == "private" else cache
    return Tenant(options.name, namespace, options.priority, options.requests_per_minute, options.tokens_per_minute)


class Unauthorized(Exception):
    """No key, or a key of no tenant (the ingress answers 401)."""


class RateLimited(Exception):
    """A tenant over its limit (the ingress answers 429 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


BURST_S = 10.0  # a bucket holds this many seconds' worth: a burst of a minute's limit at once would swamp


class _Bucket:
    """A token bucket: `per_minute` a minute, holding at most BURST_S seconds' worth (at least
    one); it may go into debt (tokens are charged when known), and a request is refused while it
    holds less than `need`."""

    def __init__(self, per_minute: float):
        self.rate = per_minute / 60
        self.capacity = max(1.0, self.rate * BURST_S)
        self.level, self.at = self.capacity, time.monotonic()

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, need: float, now: float) -> float:
        """Seconds until it holds `need` (0: now)."""
        self._refill(now)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, n: float, now: float) -> None:
        self._refill(now)
        self.level -= n


class Tenants:
    """The ingress's tenants: keys, limits and counts (one per ingress replica process)."""

    def __init__(self, config: AppConfig):
        self._by_key: dict[str, Tenant] = {}  # sha256 hex of a key -> its tenant
        default_key = config.resolve_api_key()
        self.open = default_key is None and not config.tenants  # no key needed: every request `default`'s
        if default_key is not None:
            self._by_key[_sha256(default_key)] = DEFAULT
        for options in config.tenants:
            tenant = _tenant(options)
            hashes = [_sha256(k.get_secret_value()) for k in options.api_keys] + list(options.api_key_sha256)
            if options.api_key_env is not None:
                key = os.environ.get(options.api_key_env)
                if not key:
                    raise ValueError(
                        f"tenant {options.name!r}: api_key_env={options.api_key_env!r} but that environment "
                        "variable is not set"
                    )
                hashes.append(_sha256(key))
            for h in hashes:
                if h in self._by_key and self._by_key[h] is not tenant:
                    raise ValueError(f"tenant {options.name!r}: one of its keys is also {self._by_key[h].name!r}'s")
                self._by_key[h] = tenant
        # each ingress replica holds its share of every limit (the replicas do not talk)
        self._share = 1 / config.ingress.num_replicas
        self._lock = threading.Lock()
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self.counts = TenantCounts()

    def authorize(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization: Bearer <key>` header; Unauthorized if none."""
        if self.open:
            return DEFAULT
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("missing API key: send `Authorization: Bearer <key>`")
        # (looked up by the key's SHA-256: the lookup's time tells nothing of the keys held)
        tenant = self._by_key.get(_sha256(token.strip()))
        if tenant is None:
            raise Unauthorized("incorrect API key")
        return tenant

    def _bucket(self, tenant: Tenant, kind: str, per_minute: int) -> _Bucket:
        bucket = self._buckets.get((tenant.name, kind))
        if bucket is None:
            bucket = self._buckets[tenant.name, kind] = _Bucket(per_minute * self._share)
        return bucket

    def admit(self, tenant: Tenant) -> None:
        """Take one request from the tenant's limits; RateLimited (nothing taken) when it is over
        one: its requests a minute, or its tokens a minute spent (in debt)."""
        now = time.monotonic()
        with self._lock:
            waits = []
            if tenant.requests_per_minute is not None:
                wait = self._bucket(tenant, "requests", tenant.requests_per_minute).wait_s(1, now)
                waits.append((wait, f"{tenant.requests_per_minute} requests per minute"))
            if tenant.tokens_per_minute is not None:
                wait = self._bucket(tenant, "tokens", tenant.tokens_per_minute).wait_s(1e-9, now)
                waits.append((wait, f"{tenant.tokens_per_minute} tokens per minute"))
            wait, limit = max(waits, default=(0.0, ""))
            if wait > 0:
                raise RateLimited(f"rate limit reached for tenant {tenant.name!r}: {limit}; retry later", wait)
            if tenant.requests_per_minute is not None:
                self._bucket(tenant, "requests", tenant.requests_per_minute).take(1, now)

    def take_prompt(self, tenant: Tenant, tokens: int) -> None:
        """Charge a request's prompt tokens as it is sent; RateLimited (nothing taken) when the
        tenant's tokens a minute are spent. Checked and taken at once, so concurrent requests
        cannot all pass before the first is charged."""
        if tenant.tokens_per_minute is None:
            return
        now = time.monotonic()
        with self._lock:
            bucket = self._bucket(tenant, "tokens", tenant.tokens_per_minute)
            wait = bucket.wait_s(1e-9, now)
            if wait > 0:
                raise RateLimited(
                    f"rate limit reached for tenant {tenant.name!r}: {tenant.tokens_per_minute} tokens per minute; "
                    "retry later",
                    wait,
                )
            bucket.take(tokens, now)

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Count `tokens` against the tenant's tokens a minute (it may go into debt)."""
        if tenant.tokens_per_minute is not None and tokens > 0:
            with self._lock:
                self._bucket(tenant, "tokens", tenant.tokens_per_minute).take(tokens, time.monotonic())


def retry_after(seconds: float) -> str:
    """Retry-After's whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


class TenantCounts:
    """Per-tenant counts of this ingress replica, for /metrics (chunkserve/cluster/metrics.py):
    requests answered, rejected (by OpenAI error code), prompt / cached prompt / generated tokens."""

    FIELDS = ("requests", "prompt_tokens", "cached_prompt_tokens", "generated_tokens")

    def __init__(self):
        self._lock = threading.Lock()
        self.totals: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.rejected: collections.Counter[tuple[str, str]] = collections.Counter()

    def served(self, tenant: str, prompt: int, cached: int, generated: int) -> None:
        with self._lock:
            self.totals[tenant].update(
                requests=1, prompt_tokens=prompt, cached_prompt_tokens=cached, generated_tokens=generated
            )

    def reject(self, tenant: str, code: str) -> None:
        with self._lock:
            self.rejected[tenant, code] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "totals": [[t, *(c[f] for f in self.FIELDS)] for t, c in self.totals.items()],
                "rejected": [[t, code, n] for (t, code), n in self.rejected.items()],
            }
