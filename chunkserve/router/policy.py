"""Prefix-aware replica choice: rendezvous placement, cache affinity, bounded load, hot-prefix
fan-out (DESIGN §3). Pure Python + numpy, no Ray: the Serve glue (chunkserve/router/serve_router.py) forwards
Serve's callbacks to `PrefixPolicy` and nothing else.

Per request, with chain = the prompt's chunk hashes (chunkserve/router/hashing.py), c = chunk size, and work
in prefill-token units (one output token = `decode_weight` prefill tokens of replica time):

  order   = rendezvous (highest-random-weight) order of the live replicas for chain[0]: every
            router computes the same order with no shared state, and adding or removing a replica
            moves only the prefixes whose top replica joined or left [Thaler & Ravishankar 1998].
  load    = a replica's outstanding work: this router's in-flight requests (prompt − matched +
            decode_weight × max_tokens each) plus the other routers' share as the replica last
            reported it by router (`set_others`; or a reported total beyond our own).
  bound   = (1 + ε)·mean load + one request's work — bounded loads [Mirrokni, Thorup & Zadimoghaddam
            2018], whose ⌈(1 + ε)·m/n⌉ capacity likewise allows one ball of slack; and on the work
            routed lately (decayed), max((1 + ε_w)·mean, mean + one request's work): both hold from
            the first request on, so a short run (a deploy, a scale-up) is balanced too.
  width   = 1 + how many `fanout_fill` shares of a mean replica the prefix fills beyond one request,
            by its recent work rate or its in-flight work: a hot prefix's home is order[:width].
  window  = order[:width + spare]; for a home wider than `hot_sample`, up to that many of its
            members drawn at random, plus the spares (power of d choices: the cost stays flat as
            the home grows, and no member is favoured).
  holders = unless an eligible window member holds the whole chain: up to `max_holders` more
            replicas the index says hold a prefix of it (another router's spill, an earlier
            membership), which the window cannot see.
  matched = depth × c, the tokens the index (own decisions + digests, chunkserve/router/index.py) says the
            replica holds, in either tier (the ticket's prediction of its cached_tokens);
  credited = matched with its host-tier tail at `host_hit_credit` of a GPU token (a copy back,
            not a recompute, but not free); for a hot prefix (width > 1) every window/home member
            counts as holding the best known match: that is what lets its home grow down the order.
  choice  = among candidates under both bounds (an idle replica, nothing in flight, is under the
            work bound: taking a request delays nobody) (if none: the first under them in the order's top
            row, else among a few random replicas), the best  credited − load_weight × load
            (prefill saved vs work queued), then the rendezvous rank. A prefix nobody holds (credited 0) goes
            instead to the first of its order's top row whose work routed lately is at most the
            mean (and whose load is under the bound): a rule of the order and of each router's
            sample of the same traffic, with no per-router state beyond it, so k routers place a
            new prefix alike while their samples agree, and placements stay level.
  joins   = a replica joining n existing ones starts with work lately at the fleet's mean, and the
            fleet's past work is rescaled by n / (n + joined): the total (work done) is kept,
            spread as over the larger fleet, so the old replicas' past reads as neither an excess
            (a scale-up would send every request to the newcomers) nor a debt.

Cost per decision: O(hot_sample + spare + max_holders) dict probes and chain compares; nothing is
proportional to the replica count: the order is a row of a table kept current on membership
changes (below), and the loads' sum (for the mean), the decayed totals and the per-prefix work are
kept up to date as requests come and go. At ~10^4 decisions/s beside other work, the state a
decision reads is mostly out of the CPU caches, so the layout keeps it in few objects: per-replica
numbers in arrays, a prefix's in-flight and recent work in one entry, own records also by root.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import xxhash

from chunkserve.router.index import PrefixIndex, lru_overflow

# -- rendezvous over a fixed slot space ------------------------------------------------------------
#
# A prefix's key (its first chunk hash) maps to one of SLOTS slots; a slot's order is plain
# rendezvous hashing over the replicas: weight(r, s) = fmix64(seed_r ^ slot_key_s). The table keeps
# each slot's top TOP replicas, so a decision reads one row. SLOTS is fixed (never a function of
# the replica count) so the key -> slot map survives membership changes; at 1024 replicas each
# replica owns ~64 slots, fine-grained enough that slot quantisation adds little imbalance.
# Costs: a join O(SLOTS) vectorised, a leave O(SLOTS × TOP), building from empty O(SLOTS × N)
# (seconds at 1024 replicas: the glue should do that off the event loop).

SLOTS = 1 << 16
TOP = 8
ENOUGH = 32  # a window candidate holding this many chunks of a chain ends the search for holders
_M1, _M2, _S33 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53), np.uint64(33)
_BUILD_ROWS = 1024  # slots per vectorised block when (re)computing rows: [1024, N] uint64 at a time


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finaliser, elementwise, in place (uint64 arithmetic wraps mod 2^64)."""
    t = np.empty_like(x)  # one scratch buffer: no temporaries per step
    for m in (_M1, _M2):
        np.right_shift(x, _S33, out=t)
        x ^= t
        x *= m
    np.right_shift(x, _S33, out=t)
    x ^= t
    return x


_SLOT_KEYS = _fmix64(np.arange(SLOTS, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15))


def replica_seed(replica_id: str) -> int:
    return xxhash.xxh3_64_intdigest(replica_id.encode("utf-8"))


class Rendezvous:
    """Rendezvous order of live replicas per slot; top TOP per slot precomputed, deeper on demand."""

    def __init__(self) -> None:
        self._ids: list[str | None] = []  # handle -> replica id (None: free handle)
        self._handle: dict[str, int] = {}
        self._seeds = np.zeros(0, dtype=np.uint64)  # [handles]
        self._top = np.full((SLOTS, TOP), -1, dtype=np.int32)  # [slot, rank] -> handle, -1 empty
        self._w = np.zeros((SLOTS, TOP), dtype=np.uint64)  # [slot, rank] -> weight, descending
        self._rows: list[tuple[str, ...]] = [()] * SLOTS  # slot -> its top ids (_top as ids): one read
        self._deep: dict[int, tuple[str, ...]] = {}  # slot -> top k > TOP, for hot prefixes
        self._live = np.zeros(0, dtype=np.int64)  # live handles

    def sample(self, rng: random.Random, k: int) -> list[str]:
        """k distinct live replicas at random, O(k) expected (handles are dense: freed ones reused)."""
        ids, out = self._ids, list[str]()
        while len(out) < min(k, len(self._handle)):
            r = ids[int(rng.random() * len(ids))]
            if r is not None and r not in out:
                out.append(r)
        return out

    def order(self, key: int, need: int) -> tuple[str, ...]:
        """The first `need` replicas (or all, if fewer live) of key's rendezvous order."""
        s = key & (SLOTS - 1)
        if need <= TOP:
            return self._rows[s]
        row = self._deep.get(s, ())
        n = len(self._live)
        if len(row) < min(need, n):  # deeper than cached: the top k, k doubling (a hot prefix)
            k = min(n, max(need, 2 * len(row), 4 * TOP))
            w = _fmix64(self._seeds[self._live] ^ _SLOT_KEYS[s])
            top = np.argpartition(w, n - k)[n - k :] if k < n else np.arange(n)
            ids = self._ids
            row = self._deep[s] = tuple([ids[h] for h in self._live[top[np.argsort(w[top])[::-1]]].tolist()])
        return row

    def add(self, replica_ids: Iterable[str]) -> None:
        new = [r for r in dict.fromkeys(replica_ids) if r not in self._handle]
        if not new:
            return
        handles = []
        for r in new:
            h = self._ids.index(None) if None in self._ids else len(self._ids)
            if h == len(self._ids):
                self._ids.append(r)
            else:
                self._ids[h] = r
            self._handle[r] = h
            handles.append(h)
        seeds = np.zeros(len(self._ids), dtype=np.uint64)
        seeds[: len(self._seeds)] = self._seeds
        seeds[handles] = [replica_seed(r) for r in new]
        self._seeds = seeds
        hs = np.asarray(handles, dtype=np.int32)
        for lo in range(0, SLOTS, _BUILD_ROWS):  # merge the newcomers into each slot's top list
            rows = slice(lo, lo + _BUILD_ROWS)
            w_new = _fmix64(_SLOT_KEYS[rows, None] ^ seeds[None, hs])  # [rows, new]
            self._merge(rows, np.broadcast_to(hs, w_new.shape), w_new)
        self._changed()

    def remove(self, replica_id: str) -> None:
        h = self._handle.pop(replica_id, None)
        if h is None:
            return
        self._ids[h] = None
        hit = np.flatnonzero((self._top == h).any(axis=1))  # slots whose top list loses it
        self._top[hit], self._w[hit] = -1, 0
        live = np.fromiter(self._handle.values(), dtype=np.int64, count=len(self._handle))
        for lo in range(0, len(hit), _BUILD_ROWS):
            rows = hit[lo : lo + _BUILD_ROWS]
            w = _fmix64(_SLOT_KEYS[rows, None] ^ self._seeds[None, live])  # [rows, live]
            self._merge(rows, np.broadcast_to(live, w.shape), w)
        self._changed()

    def _merge(self, rows, cand: np.ndarray, w_cand: np.ndarray) -> None:
        """Top TOP of (current row entries ∪ candidates) by weight, descending; empties sort last."""
        hs = np.concatenate([self._top[rows], cand], axis=1)
        ws = np.concatenate([self._w[rows], w_cand], axis=1)
        ws = np.where(hs >= 0, ws, 0)
        part = np.argpartition(ws, hs.shape[1] - TOP, axis=1)[:, -TOP:]  # [rows, TOP], unordered
        srt = np.take_along_axis(part, np.argsort(np.take_along_axis(ws, part, axis=1), axis=1)[:, ::-1], axis=1)
        self._top[rows] = np.take_along_axis(hs, srt, axis=1)
        self._w[rows] = np.take_along_axis(ws, srt, axis=1)

    def _changed(self) -> None:
        self._live = np.fromiter(self._handle.values(), dtype=np.int64, count=len(self._handle))
        names = np.empty(len(self._ids) + 1, dtype=object)  # handle -> id; handle -1 (empty) -> None
        names[:-1] = self._ids
        rows = names[self._top].tolist()  # [SLOTS][TOP]: ~70 ms at 1024 replicas, like the join itself
        if len(self._live) >= TOP:  # every row full
            self._rows = list(map(tuple, rows))
        else:
            self._rows = [tuple([r for r in row if r is not None]) for row in rows]
        self._deep.clear()


# -- the policy ------------------------------------------------------------------------------------

_SCORE, _ID = itemgetter(0, 1), itemgetter(3)  # of choose's candidate tuples


class DecayClock:
    """The time scale of sums that halve every `half_life` seconds: they are stored multiplied by
    scale(now) = 2^((now − t0)/half_life) (t0: a reference time), so an add is one multiply and every
    read at one `now` shares one power. Sums sharing a clock (`Decaying(clock)`) share that power:
    one computation per `now`. Before the scale could overflow, t0 moves to `now` and every sum on
    the clock is rescaled (a rebase). Times must not decrease."""

    def __init__(self, half_life: float):
        self.half_life = half_life
        self._t0 = 0.0
        self._at, self._scale = 0.0, 1.0  # the last `now` and scale(now)
        self._sums: list[Decaying] = []  # rescaled on a rebase

    def scale(self, now: float) -> float:
        if now != self._at:
            e = (now - self._t0) / self.half_life
            if e > 64:  # rebase at t0 = now: every sum has decayed by 2^-e (to 0.0 if e is huge)
                f = 2.0**-e
                for s in self._sums:
                    s._rescale(f)
                self._t0, e = now, 0.0
            self._at, self._scale = now, 2.0**e
        return self._scale


class Decaying:
    """Sums per key that halve every `half_life` seconds (or on a shared DecayClock's), and their
    total; at most `max_keys` keys (least recently added dropped first, a batch at a time:
    `lru_overflow`). Stored scaled by the clock's scale: see DecayClock. Times must not decrease."""

    def __init__(self, half_life: float | DecayClock, max_keys: int | None = None):
        self.clock = half_life if isinstance(half_life, DecayClock) else DecayClock(half_life)
        self.clock._sums.append(self)
        self.max_keys = max_keys
        self._v: dict = {}  # key -> scaled sum; with max_keys: least recently added first
        self._total = 0.0  # scaled

    def get(self, key, now: float) -> float:
        scale = self.clock.scale(now)  # first: it may rebase
        return self._v.get(key, 0.0) / scale

    def total(self, now: float) -> float:
        scale = self.clock.scale(now)
        return self._total / scale

    def stored(self, now: float) -> tuple[dict, float, float]:
        """(sums, total, scale) as stored: at `now` a key's sum is sums.get(key, 0.0) / scale and the
        total is total / scale. For reading many keys at one `now`; `sums` is the live store: read
        it, never write it."""
        scale = self.clock.scale(now)
        return self._v, self._total, scale

    def add(self, key, amount: float, now: float) -> None:
        scaled = amount * self.clock.scale(now)
        v, limit = self._v, self.max_keys
        if limit is None:
            v[key] = v.get(key, 0.0) + scaled
        else:
            v[key] = v.pop(key, 0.0) + scaled  # re-inserted: most recently added last
        self._total += scaled
        if limit is not None and len(v) > limit:
            for k in lru_overflow(v, limit):
                self.drop(k)

    def drop(self, key) -> None:
        self._total = max(0.0, self._total - self._v.pop(key, 0.0))

    def _rescale(self, f: float) -> None:
        v = self._v
        for k in v:
            v[k] *= f
        self._total *= f


class DecayingArray(Decaying):
    """Decaying sums for keys 0..n-1 (a replica's position), held in an array of floats: reading or
    adding one touches no per-key object (a dict's float values are scattered over the heap, each
    read a likely cache miss). `stored` gives the array: a key's sum is sums[key] / scale."""

    def __init__(self, half_life: float | DecayClock):
        super().__init__(half_life)
        self._v = array("d")  # type: ignore[assignment]

    def resize(self, n: int) -> None:
        """Keys 0..n-1 valid; new ones start at 0."""
        if n > len(self._v):
            self._v.extend([0.0] * (n - len(self._v)))

    def get(self, key: int, now: float) -> float:
        scale = self.clock.scale(now)
        return self._v[key] / scale

    def join(self, keys: Sequence[int], among: int, past: float = 1.0) -> None:
        """Keys `keys` (at 0) join `among` existing ones: each existing sum × f^past, with f =
        among / (among + joined), and the newcomers start at the existing ones' new mean. With
        past = 1 the total is kept, spread as over the larger set; a larger `past` also forgets
        that much more of it. Scale-free: all stored sums share one scale."""
        if among <= 0 or not keys:
            return
        v, f = self._v, (among / (among + len(keys))) ** past
        for k in range(len(v)):
            v[k] *= f
        self._total *= f
        mean = self._total / among
        self._total += mean * len(keys)
        for k in keys:
            v[k] = mean

    def add(self, key: int, amount: float, now: float) -> None:
        scaled = amount * self.clock.scale(now)
        self._v[key] += scaled
        self._total += scaled

    def drop(self, key: int) -> None:
        self._total = max(0.0, self._total - self._v[key])
        self._v[key] = 0.0

    def _rescale(self, f: float) -> None:
        v = self._v
        for k in range(len(v)):
            v[k] *= f
        self._total *= f


class PrefixWork:
    """Per prefix key: this router's in-flight work for it, and the work routed for it lately
    (halving every half-life, stored scaled: see DecayClock), in one entry, so a decision reads one
    map. At most `max_keys` prefixes: the least recently routed go first (a batch at a time:
    `lru_overflow`), in-flight work and all (by then their requests are long done)."""

    def __init__(self, clock: DecayClock, max_keys: int):
        self.clock = clock
        clock._sums.append(self)
        self.max_keys = max_keys
        self._v: dict[int, tuple[float, float]] = {}  # key -> (in-flight, scaled recent); oldest first

    def get(self, key: int, now: float) -> tuple[float, float]:
        """(in-flight work, recent work) of a prefix."""
        scale = self.clock.scale(now)  # first: it may rebase
        load, scaled = self._v.get(key, _NO_WORK)
        return load, scaled / scale

    def routed(self, key: int, cost: float, now: float) -> None:
        scale, v = self.clock.scale(now), self._v
        load, scaled = v.pop(key, _NO_WORK)
        v[key] = (load + cost, scaled + cost * scale)  # re-inserted: most recent last
        if len(v) > self.max_keys:
            for k in lru_overflow(v, self.max_keys):
                del v[k]

    def finished(self, key: int, cost: float) -> None:
        entry = self._v.get(key)
        if entry is not None:
            left = entry[0] - cost
            self._v[key] = (left if left > 1e-6 else 0.0, entry[1])

    def _rescale(self, f: float) -> None:
        v = self._v
        for k, (load, scaled) in v.items():
            v[k] = (load, scaled * f)


_NO_WORK = (0.0, 0.0)


def _bound(mean: float, epsilon: float, request_work: float) -> float:
    """A replica is eligible while its load (or work lately) is at most this: (1 + ε)·mean, but
    never less than mean + one request's work, so that from the first request on, a replica at or
    under the mean (one always is) can take one more; with load high the margin is ε·mean alone,
    not ε·mean plus a request (which in a short run, mean a few requests, is most of the slack)."""
    wide = mean + request_work
    tight = (1.0 + epsilon) * mean
    return tight if tight > wide else wide


@dataclass(frozen=True)
class PolicyConfig:
    chunk_size: int = 64  # tokens per hashed chunk: the replicas' tree chunk size
    decode_weight: float = 4.0  # replica time of one output token, in prefill tokens
    epsilon: float = 0.5  # bounded load: load ≤ (1 + ε)·mean + one request's work
    work_epsilon: float = 0.2  # bounded work: work routed lately ≤ (1 + this)·mean + one request's
    load_weight: float = 0.25  # score = matched tokens − load_weight × load
    fanout_fill: float = 1.0  # a prefix gets a home member per this fraction of a mean replica it fills
    half_life_s: float = 10.0  # of the routed-work rates (per replica, per prefix) and placements
    # at a join of j replicas to n, the work routed lately is rescaled by (n / (n + j))^join_past
    # and the newcomers start at the mean: 1 keeps the work done; more forgets more of the past,
    # whose ε-share would otherwise let the replicas holding the prefixes (the old ones, which
    # affinity prefers) take ε × the past beyond the mean of the work after the join
    join_past: float = 3.0
    spare: int = 2  # rendezvous candidates scored beyond the prefix's home set
    hot_sample: int = 3  # members sampled from a home set wider than this
    max_holders: int = 2  # replicas the index says hold the prefix, scored besides the window
    # a chunk in a replica's host tier scores this fraction of one in its GPU tier: ≈ 1 − (its copy
    # back) / (its recompute) (DESIGN §3 "Tiers"); 0 scores a host hit as a miss
    host_hit_credit: float = 0.8
    index_roots: int = 4096  # per replica: LRU bound of the router's own decision memory, in prefixes
    prefix_entries: int = 1 << 16  # prefixes whose in-flight and recent work is tracked (LRU)
    session_entries: int = 1 << 16  # sessions (x-session-id) whose last replica is kept (LRU)


@dataclass(frozen=True)
class ReplicaView:
    """What the glue knows of a replica: its id and, when it has one, a load report (prefill-token
    units): `load`, all routers' traffic included, or `others`, the work it holds from the other
    routers only (a replica that reports by router: this router's own share it knows exactly)."""

    replica_id: str
    load: float | None = None
    others: float | None = None


class Ticket(NamedTuple):
    """One routed request's bookkeeping, handed back to `on_finished` (a tuple: cheap to make)."""

    replica_id: str
    key: int | None  # the prefix's first chunk hash (None: prompt shorter than a chunk)
    cost: float  # the work it added to the replica's load
    matched: int  # prompt tokens counted as cached there: the prediction of the replica's cached_tokens


_new_ticket = tuple.__new__  # _new_ticket(Ticket, fields): Ticket(*fields), without its Python-level __new__


class PrefixPolicy:
    """One router's state and decisions. Not thread-safe: call from the router's event loop."""

    def __init__(self, config: PolicyConfig = PolicyConfig(), replicas: Iterable[str] = (), seed: int = 0):
        self.config = config
        self.index = PrefixIndex(config.index_roots)
        self._hrw = Rendezvous()
        # Per-replica numbers live in arrays indexed by the replica's position (a dense index, freed
        # ones reused): a decision reads them for each candidate, and an array keeps them together
        # where a dict's float values would each be a separate heap object, likely a cache miss.
        self._pos: dict[str, int] = {}  # replica -> its position; in joining order
        self._free: list[int] = []  # positions of departed replicas
        self._own = array("d")  # [position] this router's in-flight work on it
        self._external = array("d")  # [position] reported load beyond our own
        self._load = array("d")  # [position] own + external, kept in step: one read per candidate
        self._total = 0.0  # Σ own + external
        clock = DecayClock(config.half_life_s)  # one scale computation per `now` for the three sums
        self._rate = DecayingArray(clock)  # [position] work routed lately
        self._prefix = PrefixWork(clock, config.prefix_entries)  # prefix key -> in-flight, recent work
        self._rng = random.Random(seed)  # only for prompts with no full chunk, and wide homes
        self._last: tuple[tuple[int, ...], list] = ((), [])  # choose's chain and candidates
        self._sessions: OrderedDict[int, str] = OrderedDict()  # session key -> its last replica (LRU)
        self.update_replicas(ReplicaView(r) for r in replicas)

    # -- membership and load ------------------------------------------------------------------

    def swap_rendezvous(self, table: Rendezvous) -> None:
        """Adopt a rendezvous table built elsewhere (a thread: building one for ~1000 replicas takes
        seconds). The caller then calls `update_replicas` so members and table agree."""
        self._hrw = table

    def update_replicas(self, views: Iterable[ReplicaView]) -> None:
        """Make the live set exactly `views`; apply the load reports they carry."""
        views = list(views)
        live = {v.replica_id for v in views}
        for r in [r for r in self._pos if r not in live]:
            self.remove_replica(r)
        added = [v.replica_id for v in views if v.replica_id not in self._pos]
        for r in added:  # (a reused position was zeroed when its replica left)
            if self._free:
                self._pos[r] = self._free.pop()
            else:
                self._pos[r] = len(self._own)
                for a in (self._own, self._external, self._load):
                    a.append(0.0)
        self._rate.resize(len(self._own))
        self._rate.join([self._pos[r] for r in added], len(self._pos) - len(added), self.config.join_past)
        self._hrw.add(added)
        for v in views:
            if v.others is not None:
                self.set_others(v.replica_id, v.others)
            elif v.load is not None:
                self._set_external(v.replica_id, v.load)

    def remove_replica(self, replica_id: str) -> None:
        """A replica died or was scaled down: it leaves every order, the index and the load sums."""
        p = self._pos.pop(replica_id, None)
        if p is None:
            return
        self._total -= self._own[p] + self._external[p]
        self._own[p] = self._external[p] = self._load[p] = 0.0
        self._rate.drop(p)
        self._free.append(p)
        self._hrw.remove(replica_id)
        self.index.remove_replica(replica_id)

    def update_digest(self, replica_id: str, hashes: Iterable[int], as_of: float, load: float | None = None) -> None:
        """A replica published the chunk hashes its tree held at `as_of` (and its load then)."""
        if replica_id not in self._pos:
            return
        self.index.replace_digest(replica_id, hashes, as_of)
        if load is not None:
            self._set_external(replica_id, load)

    def _set_external(self, replica_id: str, load: float) -> None:
        p = self._pos[replica_id]
        ext = max(0.0, load - self._own[p])
        self._total += ext - self._external[p]
        self._external[p] = ext
        self._load[p] = self._own[p] + ext

    def set_others(self, replica_id: str, work: float) -> None:
        """The replica reported the work it holds from the other routers (by router: see
        DESIGN §3 "Load"): that is its load beyond this router's own in-flight work, exactly, until
        the next report. (`_set_external` instead guesses it from a total that includes our own
        requests as of the report, wrong by whatever we sent or saw finish since.)"""
        p = self._pos.get(replica_id)
        if p is None:
            return
        ext = work if work > 0.0 else 0.0
        self._total += ext - self._external[p]
        self._external[p] = ext
        self._load[p] = self._own[p] + ext

    def has_replica(self, replica_id: str) -> bool:
        return replica_id in self._pos

    def load(self, replica_id: str) -> float:
        return self._load[self._pos[replica_id]]

    def bound(self, request_work: float) -> float:
        """Loads above this are not chosen while a replica under it can be."""
        n = len(self._pos)
        return (1.0 + self.config.epsilon) * self._total / n + request_work if n else 0.0

    def work_bound(self, request_work: float, now: float) -> float:
        """Work routed lately (`work_lately`) above this is not chosen while a replica under it can be."""
        n = len(self._pos)
        return _bound(self._rate.total(now) / n, self.config.work_epsilon, request_work) if n else 0.0

    def work_lately(self, replica_id: str, now: float) -> float:
        """The work this router sent the replica lately (halving every half_life_s)."""
        return self._rate.get(self._pos[replica_id], now)

    def request_work(self, num_prompt_tokens: int, max_tokens: int, matched_tokens: int = 0) -> float:
        return num_prompt_tokens - matched_tokens + self.config.decode_weight * max_tokens

    # -- decisions ----------------------------------------------------------------------------

    def width(self, key: int, request_work: float, now: float) -> int:
        """Home-set size of a prefix: one replica, plus one per `fanout_fill` of a mean replica
        that its recent work rate — or its in-flight work — fills beyond one request. A share
        smaller than one request's work (an idle or just-started cluster) counts as one request,
        so a single request never widens a home."""
        load, rate = self._prefix.get(key, now)
        if load <= request_work and rate <= request_work:  # the common case: one request's worth
            return 1
        n, fill = len(self._pos), self.config.fanout_fill
        # by_x = max(0, x − request_work) / max(fill × the mean replica's x, request_work)
        by_rate = by_load = 0.0
        if rate > request_work:
            share = fill * self._rate.total(now) / n
            by_rate = (rate - request_work) / (request_work if request_work > share else share)
        if load > request_work:
            share = fill * self._total / n
            by_load = (load - request_work) / (request_work if request_work > share else share)
        return 1 + int(by_load if by_load > by_rate else by_rate)

    def choose(
        self,
        prefix_hashes: Sequence[int],
        num_prompt_tokens: int,
        max_tokens: int,
        now: float,
        session: int | None = None,
    ) -> tuple[str, ...]:
        """Replica ids, best first: the choice, then the other scored candidates by preference.
        session: a session's key (the ingress's hash of its tenant and `x-session-id`): its last
        replica goes first while its load is under the bound, whatever the prefix prefers (a
        multi-turn session's history may lie past the hashed chunks)."""
        ranked = self._choose(prefix_hashes, num_prompt_tokens, max_tokens, now)
        if session is None:
            return ranked
        last = self._sessions.get(session)
        p = None if last is None or (ranked and ranked[0] == last) else self._pos.get(last)
        if p is None:
            return ranked
        cfg, n = self.config, len(self._pos)
        miss = num_prompt_tokens + cfg.decode_weight * max_tokens
        rate, rt, rs = self._rate.stored(now)
        if (
            self._load[p] > (1.0 + cfg.epsilon) * self._total / n + miss
            or self._load[p] > 0.0
            and rate[p] > _bound(rt / n, cfg.work_epsilon, miss * rs)
        ):
            return ranked  # load forbids: the session moves with the prefix's choice
        return (last, *(r for r in ranked if r != last))

    def _choose(
        self, prefix_hashes: Sequence[int], num_prompt_tokens: int, max_tokens: int, now: float
    ) -> tuple[str, ...]:
        chain = tuple(prefix_hashes)
        cfg, index = self.config, self.index
        n = len(self._pos)
        if n == 0:
            return ()
        miss = num_prompt_tokens + cfg.decode_weight * max_tokens  # its work if nothing is cached
        bound = (1.0 + cfg.epsilon) * self._total / n + miss
        rate, rt, rs = self._rate.stored(now)  # the work bound, on work routed lately: compared scaled
        rbound = _bound(rt / n, cfg.work_epsilon, miss * rs)
        if not chain:  # nothing to be affine to: power of two choices on load
            return tuple(sorted(self._hrw.sample(self._rng, 2), key=self.load))
        key = chain[0]
        width = self.width(key, miss, now)
        order = self._hrw.order(key, width + cfg.spare)  # home = order[:width]
        if width <= cfg.hot_sample:
            window = order[: width + cfg.spare]
        else:  # power of d choices inside a wide home (in rendezvous order), then the spares
            rnd, m, picks, window = self._rng.random, min(width, len(order)), set(), []
            for _ in range(cfg.hot_sample):
                picks.add(int(rnd() * m))
            for i in sorted(picks):
                window.append(order[i])
            window += order[width : width + cfg.spare]
        # The hot path is written for CPython 3.11: loops rather than comprehensions (each of those
        # is a function call there), few calls, and the per-candidate data in few objects.
        pos, loads, c, lw = self._pos, self._load, cfg.chunk_size, cfg.load_weight
        wloads, oks, whole, depths = [], [], len(chain), None  # the window's loads, eligibility, depths
        for r in window:
            p = pos[r]
            load = loads[p]
            wloads.append(load)
            oks.append(load <= bound and (rate[p] <= rbound or load <= 0.0))
        # all of the chain, or the first ENOUGH chunks of a longer one: past them a chain runs into
        # the prompt's own tail, which no replica holds, and the holders a window misses (a
        # conversation's replica) are left to the session hint
        enough = whole if whole < ENOUGH else ENOUGH
        if width > 1:  # a hot prefix: its members' own depths matter only through its deepest match
            # (and the chosen one's, for on_routed). Probe the likely choice first (the least loaded:
            # eligible if any is): if it holds all of the chain (or ENOUGH of it: below), nobody
            # holds more that matters here, and the others' depths can stay unknown (-1).
            i = wloads.index(min(wloads))
            d = index.depth(window[i], chain)
            if d >= enough and oks[i] and self._credited(window[i : i + 1], chain, [d])[0] == d:
                depths = [-1] * len(window)
                depths[i] = d
        if depths is None:
            depths = index.depths(window, chain)
        # cands: (eligible: under both bounds, score, depth, id), in rank order. Warm (someone holds
        # a prefix of the chain): score = tokens held (tier-credited) − load penalty, where a hot
        # prefix's window members count as holding its best known match.
        gains = self._credited(window, chain, depths)
        deepest, cands = max(gains), []
        full = False  # an eligible candidate holds `enough` of the chain (on the GPU, unless credit is 1)
        if deepest:
            held = deepest * c if width > 1 else 0  # (0: each counts its own depth)
            for r, d, g, load, ok in zip(window, depths, gains, wloads, oks):
                if ok and g >= enough:
                    full = True
                cands.append((ok, (held or g * c) - lw * load, d, r))
        if not full:  # replicas the window misses: another router's spill, an earlier membership
            more, extra, holds = [], cfg.max_holders, None  # holds: which count as holding when hot
            holders = index.holders(chain, extra)
            fits = True in oks  # an eligible candidate so far
            seen = set(window) if holders or not fits else ()
            for r in holders:
                if not extra:
                    break
                if r in pos and r not in seen:
                    seen.add(r)
                    extra -= 1
                    more.append(r)
            more_oks = [loads[pos[r]] <= bound and (rate[pos[r]] <= rbound or loads[pos[r]] <= 0.0) for r in more]
            if not fits and True not in more_oks:
                # all over a bound: one under both, next in order if possible
                more.append(self._under(bound, rbound, (r for r in self._hrw.order(key, TOP) if r not in seen), now))
                more_oks.append(True)
            if more:  # the candidates grow: score them all again (the deepest match may too)
                home, more_depths = order[:width], index.depths(more, chain)
                window, depths = (*window, *more), depths + more_depths
                gains = gains + self._credited(more, chain, more_depths)
                wloads = wloads + [loads[pos[r]] for r in more]
                oks = oks + more_oks
                holds = [True] * (len(window) - len(more)) + [r in home for r in more]
                deepest, hot = max(gains), width > 1
                cands = [
                    (ok, (deepest if hot and h else g) * c - lw * load, d, r)
                    for r, d, g, load, h, ok in zip(window, depths, gains, wloads, holds, oks)
                ]
        if not deepest:  # nobody holds it: placed on the first replica in its rendezvous order whose
            # work routed lately is at most the mean (or that is idle), load under the bound. Every router
            # computes the same order and sees a like sample of the same traffic, so k routers place
            # alike with no state of each other's; consistent hashing with bounded loads [Mirrokni
            # et al.] keeps the placements level
            mean = rt / n
            cands, chosen = [], None
            for r in self._hrw.order(key, TOP) if width <= cfg.hot_sample else window:
                p = pos[r]
                load = loads[p]
                if chosen is None and load <= bound and (rate[p] <= mean or load <= 0.0):
                    chosen = r
                cands.append((r == chosen, -rate[p], 0, r))
            if chosen is not None:  # the chosen one first, the others by least work lately
                cands.sort(key=_SCORE, reverse=True)
                self._last = (chain, cands)
                return tuple(map(_ID, cands))
        cands.sort(key=_SCORE, reverse=True)  # stable: ties stay in rank order
        self._last = (chain, cands)  # on_routed reads the chosen one's depth from here
        return tuple(map(_ID, cands))

    # -- tier credit (DESIGN §3 "Tiers"): the one place the score sees a replica's host tier --------
    def _credited(self, replicas: Sequence[str], chain: tuple[int, ...], depths: list[int]) -> list:
        """Each replica's depth (chunks of the chain it holds, in either tier) with the part in its
        host tier counted at `host_hit_credit` of a GPU chunk: a host chunk is copied back, not
        recomputed, but the copy is not free. `depths` itself where no candidate holds any of the
        chain in its host tier (the usual case). Credit 0 counts a host hit as a miss: a replica
        holding the chain only in its host tier scores, and is placed, as one holding nothing."""
        host = self.index.host_depths(replicas, chain, depths)
        if host is None:
            return depths
        k = 1.0 - self.config.host_hit_credit
        return [d - k * h for d, h in zip(depths, host)]

    def _under(self, bound: float, rbound: float, preferred: Iterable[str], now: float) -> str:
        """A replica under both bounds (load ≤ bound, scaled work lately ≤ rbound): the first of
        `preferred`, else the best of a few random ones, else (rarely) the least loaded of all."""
        loads, pos = self._load, self._pos
        rate, _, _ = self._rate.stored(now)
        for r in preferred:
            p = pos[r]
            if loads[p] <= bound and (rate[p] <= rbound or loads[p] <= 0.0):
                return r
        sample = self._hrw.sample(self._rng, 8)
        for r in sample:
            p = pos[r]
            if loads[p] <= bound and (rate[p] <= rbound or loads[p] <= 0.0):
                return r
        return min(self._pos, key=self.load)

    def on_routed(
        self,
        replica_id: str,
        prefix_hashes: Sequence[int],
        num_prompt_tokens: int,
        max_tokens: int,
        now: float,
        session: int | None = None,
        matched: int | None = None,
    ) -> Ticket:
        """The request went to `replica_id` (Serve may pick another than `choose`'s first); a
        session's next request prefers it. matched: another router's decision (peers.PeerBook),
        the prompt tokens it counted as cached there, so that every router books the same work;
        None: this router's own, from its index."""
        if session is not None:
            sessions = self._sessions
            sessions[session] = replica_id
            sessions.move_to_end(session)
            if len(sessions) > self.config.session_entries:
                sessions.popitem(last=False)
        chain, cfg = tuple(prefix_hashes), self.config
        depth = -1 if matched is None else 0
        last_chain, cands = self._last
        if matched is None and last_chain is chain:
            for cand in cands:  # best first: usually the first
                if cand[3] == replica_id:
                    depth = cand[2]
                    break
        if depth < 0:
            depth = self.index.depth(replica_id, chain)
        # the engine never matches the chunk holding the prompt's last token (its logits give the
        # first output): at most (prompt − 1) // c chunks count as cached, as the replica reports
        c = cfg.chunk_size
        if matched is None:
            matched = min(depth * c, (num_prompt_tokens - 1) // c * c) if depth else 0
        cost = num_prompt_tokens - matched + cfg.decode_weight * max_tokens  # (request_work's)
        key = chain[0] if chain else None
        p = self._pos.get(replica_id)
        if p is not None:
            own = self._own
            own[p] += cost
            self._load[p] = own[p] + self._external[p]
            self._total += cost
            self._rate.add(p, cost, now)
        if key is not None:
            self._prefix.routed(key, cost, now)
            self.index.record(replica_id, chain, now)
            self.index.pin(replica_id, key)  # (until on_finished: its record outlives reports meanwhile)
        return _new_ticket(Ticket, (replica_id, key, cost, matched))

    def on_finished(self, ticket: Ticket) -> None:
        """The request's response ended (or failed): its work leaves the loads."""
        p = self._pos.get(ticket.replica_id)
        if p is not None:
            own = self._own
            own[p] -= ticket.cost
            self._load[p] = own[p] + self._external[p]
            self._total -= ticket.cost
        if ticket.key is not None:
            self._prefix.finished(ticket.key, ticket.cost)
            self.index.unpin(ticket.replica_id, ticket.key)
