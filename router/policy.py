"""Prefix-aware replica choice: rendezvous placement, cache affinity, bounded load, hot-prefix
fan-out (DESIGN §6). Pure Python + numpy, no Ray: the Serve glue (router/serve_router.py) forwards
Serve's callbacks to `PrefixPolicy` and nothing else.

Per request, with chain = the prompt's chunk hashes (router/hashing.py), c = chunk size, and work
in prefill-token units (one output token = `decode_weight` prefill tokens of replica time):

  order   = rendezvous (highest-random-weight) order of the live replicas for chain[0]: every
            router computes the same order with no shared state, and adding or removing a replica
            moves only the prefixes whose top replica joined or left [Thaler & Ravishankar 1998].
  load    = a replica's outstanding work: this router's in-flight requests (prompt − matched +
            decode_weight × max_tokens each) plus what the replica reported beyond them.
  bound   = (1 + ε)·mean load + one request's work — bounded loads [Mirrokni, Thorup & Zadimoghaddam
            2018], whose ⌈(1 + ε)·m/n⌉ capacity likewise allows one ball of slack.
  width   = 1 + how many `fanout_fill` shares of a mean replica the prefix fills beyond one request,
            by its recent work rate or its in-flight work: a hot prefix's home is order[:width].
  window  = order[:width + spare]; for a home wider than `hot_sample`, up to that many of its
            members drawn at random, plus the spares (power of d choices: the cost stays flat as
            the home grows, and no member is favoured).
  holders = unless an eligible window member holds the whole chain: up to `max_holders` more
            replicas the index says hold a prefix of it (another router's spill, an earlier
            membership), which the window cannot see.
  matched = depth × c, the tokens the index (own decisions + digests, router/index.py) says the
            replica holds; for a hot prefix (width > 1) every window/home member counts as holding
            the longest known match: that is what lets its home grow down the order.
  choice  = among candidates with load ≤ bound (if none: the first under it in the order's top
            row, else among a few random replicas), the best  matched − load_weight × load
            (prefill saved vs work queued), then the rendezvous rank. A prefix nobody holds goes
            instead where the least work went lately (decayed rate), counting half a typical
            prefix's work for each prefix placed there lately: placements even out.

Cost per decision: O(hot_sample + spare + max_holders) dict probes and chain compares; nothing is
proportional to the replica count (the order is a row of a table kept current on membership
changes, below).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from router.index import PrefixIndex

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
        self._handles: list[list[int]] = self._top.tolist()  # _top as Python lists, for cheap reads
        self._rows: dict[int, tuple[str, ...]] = {}  # slot -> top ids as a tuple (lazy cache)
        self._deep: dict[int, tuple[str, ...]] = {}  # slot -> top k > TOP, for hot prefixes
        self._live = np.zeros(0, dtype=np.int64)  # live handles

    def sample(self, rng: random.Random, k: int) -> list[str]:
        """k distinct live replicas at random, O(k) expected (handles are dense: freed ones reused)."""
        ids, out = self._ids, []
        while len(out) < min(k, len(self._handle)):
            r = ids[int(rng.random() * len(ids))]
            if r is not None and r not in out:
                out.append(r)
        return out

    def order(self, key: int, need: int) -> tuple[str, ...]:
        """The first `need` replicas (or all, if fewer live) of key's rendezvous order."""
        s = key & (SLOTS - 1)
        if need <= TOP:
            row = self._rows.get(s)
            if row is None:
                ids = self._ids
                row = self._rows[s] = tuple([ids[h] for h in self._handles[s] if h >= 0])
            return row
        row = self._deep.get(s, ())
        n = len(self._live)
        if len(row) < min(need, n):  # deeper than cached: the top k, k doubling (a hot prefix)
            k = min(n, max(need, 2 * len(row), 4 * TOP))
            w = _fmix64(self._seeds[self._live] ^ _SLOT_KEYS[s])
            top = np.argpartition(w, n - k)[n - k:] if k < n else np.arange(n)
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
            rows = hit[lo:lo + _BUILD_ROWS]
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
        self._handles = self._top.tolist()
        self._rows.clear()
        self._deep.clear()


# -- the policy ------------------------------------------------------------------------------------


class Decaying:
    """Sums per key that halve every `half_life` seconds, and their total; at most `max_keys` keys
    (least recently added dropped first). Times must not decrease.

    Stored scaled by 2^((t − t0)/half_life) (t0: a reference time), so an add is one multiply and
    reading every key at one `now` shares one power; rebased before the scale could overflow."""

    def __init__(self, half_life: float, max_keys: int | None = None):
        self.half_life = half_life
        self.max_keys = max_keys
        self._v: OrderedDict[object, float] = OrderedDict()  # key -> scaled sum
        self._total = 0.0  # scaled
        self._t0 = 0.0
        self._at, self._scale = 0.0, 1.0  # the last `now` and 2^((now − t0)/half_life)

    def _scale_at(self, now: float) -> float:
        if now != self._at:
            e = (now - self._t0) / self.half_life
            if e > 64:  # rebase at t0 = now: every sum has decayed by 2^-e (to 0.0 if e is huge)
                f = 2.0 ** -e
                for k in self._v:
                    self._v[k] *= f
                self._total *= f
                self._t0, e = now, 0.0
            self._at, self._scale = now, 2.0 ** e
        return self._scale

    def get(self, key, now: float) -> float:
        scale = self._scale_at(now)  # first: it may rebase the stored sums
        return self._v.get(key, 0.0) / scale

    def total(self, now: float) -> float:
        scale = self._scale_at(now)
        return self._total / scale

    def add(self, key, amount: float, now: float) -> None:
        scaled = amount * self._scale_at(now)
        self._v[key] = self._v.pop(key, 0.0) + scaled  # re-inserted: most recently added last
        self._total += scaled
        if self.max_keys is not None and len(self._v) > self.max_keys:
            self.drop(next(iter(self._v)))

    def drop(self, key) -> None:
        self._total = max(0.0, self._total - self._v.pop(key, 0.0))


@dataclass(frozen=True)
class PolicyConfig:
    chunk_size: int = 64  # tokens per hashed chunk: the replicas' tree chunk size
    decode_weight: float = 4.0  # replica time of one output token, in prefill tokens
    epsilon: float = 0.25  # bounded load: load ≤ (1 + ε)·mean + one request's work
    load_weight: float = 0.25  # score = matched tokens − load_weight × load
    fanout_fill: float = 0.25  # a prefix gets a home member per this fraction of a mean replica it fills
    half_life_s: float = 10.0  # of the routed-work rates (per replica, per prefix) and placements
    spare: int = 2  # rendezvous candidates scored beyond the prefix's home set
    hot_sample: int = 3  # members sampled from a home set wider than this
    max_holders: int = 2  # replicas the index says hold the prefix, scored besides the window
    index_roots: int = 4096  # per replica: LRU bound of the router's own decision memory, in prefixes
    prefix_entries: int = 1 << 16  # prefixes whose rate is tracked (LRU)


@dataclass(frozen=True)
class ReplicaView:
    """What the glue knows of a replica: its id and, when it has one, a load report (prefill-token
    units, all routers' traffic included)."""
    replica_id: str
    load: float | None = None


@dataclass(frozen=True)
class Ticket:
    """One routed request's bookkeeping, handed back to `on_finished`."""
    replica_id: str
    key: int | None  # the prefix's first chunk hash (None: prompt shorter than a chunk)
    cost: float  # the work it added to the replica's load


class PrefixPolicy:
    """One router's state and decisions. Not thread-safe: call from the router's event loop."""

    def __init__(self, config: PolicyConfig = PolicyConfig(), replicas: Iterable[str] = (), seed: int = 0):
        self.config = config
        self.index = PrefixIndex(config.index_roots)
        self._hrw = Rendezvous()
        self._own: dict[str, float] = {}  # replica -> this router's in-flight work on it
        self._external: dict[str, float] = {}  # replica -> reported load beyond our own
        self._total = 0.0  # Σ own + external
        self._prefix_load: dict[int, float] = {}  # prefix key -> this router's in-flight work for it
        self._rate = Decaying(config.half_life_s)  # replica -> work routed lately
        self._placed = Decaying(config.half_life_s)  # replica -> prefixes placed on it lately
        self._prefix_rate = Decaying(config.half_life_s, config.prefix_entries)  # prefix key -> work
        self._rng = random.Random(seed)  # only for prompts with no full chunk, and wide homes
        self._last: tuple[tuple[int, ...], list] = ((), [])  # choose's chain and candidates
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
        for r in [r for r in self._own if r not in live]:
            self.remove_replica(r)
        added = [v.replica_id for v in views if v.replica_id not in self._own]
        for r in added:
            self._own[r] = 0.0
            self._external[r] = 0.0
        self._hrw.add(added)
        for v in views:
            if v.load is not None:
                self._set_external(v.replica_id, v.load)

    def remove_replica(self, replica_id: str) -> None:
        """A replica died or was scaled down: it leaves every order, the index and the load sums."""
        if replica_id not in self._own:
            return
        self._total -= self._own.pop(replica_id) + self._external.pop(replica_id)
        self._rate.drop(replica_id)
        self._placed.drop(replica_id)
        self._hrw.remove(replica_id)
        self.index.remove_replica(replica_id)

    def update_digest(self, replica_id: str, hashes: Iterable[int], as_of: float,
                      load: float | None = None) -> None:
        """A replica published the chunk hashes its tree held at `as_of` (and its load then)."""
        if replica_id not in self._own:
            return
        self.index.replace_digest(replica_id, hashes, as_of)
        if load is not None:
            self._set_external(replica_id, load)

    def _set_external(self, replica_id: str, load: float) -> None:
        ext = max(0.0, load - self._own[replica_id])
        self._total += ext - self._external[replica_id]
        self._external[replica_id] = ext

    def load(self, replica_id: str) -> float:
        return self._own[replica_id] + self._external[replica_id]

    def bound(self, request_work: float) -> float:
        """Loads above this are not chosen while a replica under it can be."""
        n = len(self._own)
        return (1.0 + self.config.epsilon) * self._total / n + request_work if n else 0.0

    def request_work(self, num_prompt_tokens: int, max_tokens: int, matched_tokens: int = 0) -> float:
        return num_prompt_tokens - matched_tokens + self.config.decode_weight * max_tokens

    # -- decisions ----------------------------------------------------------------------------

    def width(self, key: int, request_work: float, now: float) -> int:
        """Home-set size of a prefix: one replica, plus one per `fanout_fill` of a mean replica
        that its recent work rate — or its in-flight work — fills beyond one request. A share
        smaller than one request's work (an idle or just-started cluster) counts as one request,
        so a single request never widens a home."""
        n, fill = len(self._own), self.config.fanout_fill
        load = self._prefix_load.get(key, 0.0)
        rate = self._prefix_rate.get(key, now)
        if load <= request_work and rate <= request_work:  # the common case: one request's worth
            return 1
        by_rate = max(0.0, rate - request_work) / max(fill * self._rate.total(now) / n, request_work)
        by_load = max(0.0, load - request_work) / max(fill * self._total / n, request_work)
        return 1 + int(max(by_rate, by_load))

    def choose(self, prefix_hashes: Sequence[int], num_prompt_tokens: int, max_tokens: int,
               now: float) -> tuple[str, ...]:
        """Replica ids, best first: the choice, then the other scored candidates by preference."""
        chain = tuple(prefix_hashes)
        own, ext, cfg, index = self._own, self._external, self.config, self.index
        n = len(own)
        if n == 0:
            return ()
        miss = num_prompt_tokens + cfg.decode_weight * max_tokens  # its work if nothing is cached
        bound = (1.0 + cfg.epsilon) * self._total / n + miss
        if not chain:  # nothing to be affine to: power of two choices on load
            return tuple(sorted(self._hrw.sample(self._rng, 2), key=lambda r: own[r] + ext[r]))
        key = chain[0]
        width = self.width(key, miss, now)
        order = self._hrw.order(key, width + cfg.spare)
        home = order[:width]
        if width <= cfg.hot_sample:
            window = order[: width + cfg.spare]
        else:  # power of d choices inside a wide home (in rendezvous order), then the spares
            rnd, m = self._rng.random, len(home)
            window = (*(home[i] for i in sorted({int(rnd() * m) for _ in range(cfg.hot_sample)})),
                      *order[width: width + cfg.spare])
        cands = []  # (load, depth, counts as holder when hot, id), in rank order
        deepest = full = 0  # full: some eligible candidate holds all of the chain
        for r in window:
            load, d = own[r] + ext[r], index.depth(r, chain)
            if d > deepest:
                deepest = d
            if d == len(chain) and load <= bound:
                full = True
            cands.append((load, d, True, r))
        if not full:  # replicas the window misses: another router's spill, an earlier membership
            seen, extra = set(window), cfg.max_holders
            for r in index.holders(chain, extra):
                if extra and r in own and r not in seen:
                    seen.add(r)
                    extra -= 1
                    cands.append((own[r] + ext[r], index.depth(r, chain), r in home, r))
            if min(cands)[0] > bound:  # all over the bound: one under it, next in order if possible
                r = self._under(bound, (r for r in self._hrw.order(key, TOP) if r not in seen))
                cands.append((own[r] + ext[r], index.depth(r, chain), r in home, r))
            deepest = max(d for _, d, _, _ in cands)
        c, lw, hot = cfg.chunk_size, cfg.load_weight, width > 1
        if deepest:  # warm: tokens held − load penalty; for a hot prefix its window counts as holding
            scored = [(load <= bound, (deepest if hot and h else d) * c - lw * load, -rank, r)
                      for rank, (load, d, h, r) in enumerate(cands)]
        else:  # nobody holds it: where the least work went lately, counting what prefixes placed
            # there lately will still bring (half a typical prefix's work each): long-run balance
            rate, placed = self._rate, self._placed
            per = 0.5 * rate.total(now) / max(placed.total(now), 1.0)
            scored = [(load <= bound, -(rate.get(r, now) + per * placed.get(r, now)), -rank, r)
                      for rank, (load, _, _, r) in enumerate(cands)]
        scored.sort(reverse=True)
        self._last = (chain, cands)  # on_routed reads the chosen one's depth from here
        return tuple(r for *_, r in scored)

    def _under(self, bound: float, preferred: Iterable[str]) -> str:
        """A replica with load ≤ bound: the first of `preferred`, else the least loaded of a few
        random ones, else (rarely) the least loaded of all. One exists: the least loaded is at or
        below the mean."""
        load = lambda r: self._own[r] + self._external[r]  # noqa: E731
        for r in preferred:
            if load(r) <= bound:
                return r
        best = min(self._hrw.sample(self._rng, 8), key=load)
        return best if load(best) <= bound else min(self._own, key=load)

    def on_routed(self, replica_id: str, prefix_hashes: Sequence[int], num_prompt_tokens: int,
                  max_tokens: int, now: float) -> Ticket:
        """The request went to `replica_id` (Serve may pick another than `choose`'s first)."""
        chain = tuple(prefix_hashes)
        depth = -1
        if self._last[0] is chain:
            for _, d, _, r in self._last[1]:
                if r == replica_id:
                    depth = d
                    break
        if depth < 0:
            depth = self.index.depth(replica_id, chain)
        cost = self.request_work(num_prompt_tokens, max_tokens, min(depth * self.config.chunk_size, num_prompt_tokens))
        key = chain[0] if chain else None
        if replica_id in self._own:
            self._own[replica_id] += cost
            self._total += cost
            self._rate.add(replica_id, cost, now)
        if key is not None:
            if depth == 0:  # it held none of it: a placement
                self._placed.add(replica_id, 1.0, now)
            self._prefix_load[key] = self._prefix_load.get(key, 0.0) + cost
            self._prefix_rate.add(key, cost, now)
            self.index.record(replica_id, chain, now)
        return Ticket(replica_id, key, cost)

    def on_finished(self, ticket: Ticket) -> None:
        """The request's response ended (or failed): its work leaves the loads."""
        r = ticket.replica_id
        if r in self._own:
            self._own[r] -= ticket.cost
            self._total -= ticket.cost
        if ticket.key is not None:
            left = self._prefix_load.get(ticket.key, 0.0) - ticket.cost
            if left > 1e-6:
                self._prefix_load[ticket.key] = left
            else:
                self._prefix_load.pop(ticket.key, None)
