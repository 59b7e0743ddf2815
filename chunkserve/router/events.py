"""Chunk-tree events: a replica's routable chunk hashes as numbered deltas (DESIGN §3).

    PrefixTree ─stored/evicted─▶ ChunkLog ─Events, a step─▶ Relay ─Events, a poll─▶ Serve's controller
      (engine process)                       (replica actor)      (record_routing_stats)  ─▶ every router:
                                                                                  PrefixIndex.apply_events

What is published: the chained hashes (chunkserve/router/hashing.py) of the tree's nodes at most
`route_chunks` deep, the set a router matches prompts against. An *epoch* names one life of that
set (a random 63-bit id, new for each engine and at each pool reset); within it *seq* numbers the
publications from 1, and the set at seq 0 is empty, so the deltas 1 .. s rebuild the set at s from
nothing. Wire format, plain builtins (Serve's controller unpickles routing stats and need not import
chunkserve):

    Events = (epoch, seq, deltas, snapshot)
      deltas:   tuple of Delta, consecutive (each first_seq is the previous last_seq + 1), the last
                ending at seq; possibly empty
      snapshot: the whole set at seq (a tuple of tier-coded hashes, below), or None
    Delta  = (first_seq, last_seq, stored, evicted)
      the net change over publications first_seq .. last_seq: tuples of hashes, disjoint, so
      applying one is O(its length) in any order. `stored` is tier-coded: h, the hash is held in
      the GPU tier as of last_seq; ~h (bitwise not: negative), in the host tier. A hash that
      changed tier (a spill, GPU -> host; a load, host -> GPU) is stored again at its new tier;
      `evicted` hashes left the tree (from either tier).

The tier (DESIGN §6 "Host tier") costs no field: a hash is in [0, 2^64), so its sign is free, and a
replica without a host tier publishes exactly what it did before. Changes are netted per hash
against its state at the last cut (absent, GPU, host): a hash stored then evicted, or spilled then
loaded back, since then is no change at all.

A follower at (epoch, s) applies the deltas after s; one of another epoch drops what it held (that
life of the tree is over) and starts from the empty set at seq 0; one whose next delta is missing
(a gap) takes the snapshot, or, without one, applies what it can and waits for the next.

Why the replica keeps a ring: Serve's controller polls each replica's record_routing_stats every
routing-stats period and hands the newest result of every replica to each router by long poll
(ray/serve/_private/deployment_state.py, long_poll.py): a router that re-polls late, or starts
late, sees only the newest report of a replica, and with one delta per report it would miss the
ones before. So each report repeats the cuts of the last `ring_s` seconds (at most `max_delta`
hashes in all): a router that missed a few reports still applies the deltas after its own seq. A
report carries a snapshot on its epoch's first reports (for `ring_s`), after a cut larger than
`max_delta` (a snapshot is then the smaller message; for `ring_s` too), and every `snapshot_s`, so
a router that fell further behind, or joined late, is exact again within `snapshot_s`. A router
cannot ask a replica for a snapshot: Serve's routing stats flow one way, from the controller.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

Delta = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (first_seq, last_seq, stored, evicted)
Events = tuple[int, int, tuple[Delta, ...], "tuple[int, ...] | None"]  # (epoch, seq, deltas, snapshot)

MAX_DELTA = 4096  # hashes in one delta (or ring) beyond which a snapshot is sent instead
RING_S = 3.0  # seconds of cuts each report repeats: a router may miss reports for this long
SNAPSHOT_S = 10.0  # a report carries a snapshot at least this often


def new_epoch() -> int:
    """A fresh epoch id: random, so a restarted engine never reuses one."""
    return int.from_bytes(os.urandom(8), "little") >> 1


OUT, GPU, HOST = 0, 1, 2  # a hash's state in a published set: absent, held in the GPU tier, in the host tier


def _note(pending: dict[int, tuple[int, int]], h: int, was: int, now: int) -> None:
    """Net one change of hash `h`, from state `was` to `now`, into `pending` (hash -> (its state
    at the last cut, its state now), for the hashes whose state differs): a hash evicted then
    stored again at its tier (or spilled then loaded back) since the last cut is no change."""
    first = pending.pop(h, None)
    if first is not None:
        was = first[0]
    if was != now:
        pending[h] = (was, now)


def _split(pending: dict[int, tuple[int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A delta's (stored, evicted) from `pending`: stored tier-coded (h: GPU, ~h: host)."""
    stored = tuple([h if now == GPU else ~h for h, (_, now) in pending.items() if now])
    return stored, tuple([h for h, (_, now) in pending.items() if not now])


def tier_coded(held: set[int] | dict[int, Any], host: set[int]) -> tuple[int, ...]:
    """A snapshot of `held` (hashes; `host`: those of them in the host tier), tier-coded."""
    if not host:
        return tuple(held)
    return tuple([~h if h in host else h for h in held])


def decode(coded: tuple[int, ...] | list[int]) -> tuple[set[int], set[int]]:
    """(every hash, the host tier's) of a tier-coded snapshot."""
    host = {~x for x in coded if x < 0}
    if not host:
        return set(coded), host
    return {x for x in coded if x >= 0} | host, host


class ChunkLog:
    """The publishing end, in the engine process: the routable set, each hash's tier, and their
    changes since the last `take`, netted (a hash stored and evicted in between, or spilled and
    loaded back, is no change). O(1) a change.

    held: hash -> the caller's tag for it (the tree's hook keeps (depth, seed) there); host: the
    held hashes in the host tier."""

    def __init__(self, max_delta: int = MAX_DELTA):
        self.max_delta = max_delta
        self.held: dict[int, Any] = {}
        self.host: set[int] = set()
        self.epoch = new_epoch()
        self.seq = 0
        self._pending: dict[int, tuple[int, int]] = {}
        self._fresh = True  # the epoch's first publication (a snapshot) is due

    def stored(self, h: int, tag: Any = None, host: bool = False) -> None:
        """`h` entered the set (in the host tier if `host`: a restart listing a spilled node)."""
        self.held[h] = tag
        if host:
            self.host.add(h)
        _note(self._pending, h, OUT, HOST if host else GPU)

    def evicted(self, h: int) -> None:
        del self.held[h]
        host = self.host
        if h in host:
            host.remove(h)
            _note(self._pending, h, HOST, OUT)
        else:
            _note(self._pending, h, GPU, OUT)

    def moved(self, h: int, host: bool) -> None:
        """Held `h` changed tier: spilled to the host tier (`host`), or loaded back to the GPU."""
        if host:
            self.host.add(h)
            _note(self._pending, h, GPU, HOST)
        else:
            self.host.remove(h)
            _note(self._pending, h, HOST, GPU)

    def reset(self) -> None:
        """A new epoch from the empty set (the caller stores what its tree still holds)."""
        self.epoch, self.seq = new_epoch(), 0
        self.held.clear()
        self.host.clear()
        self._pending.clear()
        self._fresh = True

    def take(self) -> Events | None:
        """The changes since the last take as the next publication, or None if there were none.
        An epoch's first publication, and one of more than max_delta changes, is a snapshot."""
        pending = self._pending
        if not pending and not self._fresh:
            return None
        self.seq += 1
        seq = self.seq
        if self._fresh or len(pending) > self.max_delta:
            out: Events = (self.epoch, seq, (), tier_coded(self.held, self.host))
        else:
            out = (self.epoch, seq, ((seq, seq, *_split(pending)),), None)
        pending.clear()
        self._fresh = False
        return out


class Relay:
    """The replica actor's end: follows its engine's publications (in order, over the pipe) and
    answers each routing-stats poll with the Events a router needs (module docstring)."""

    def __init__(self, max_delta: int = MAX_DELTA, ring_s: float = RING_S, snapshot_s: float = SNAPSHOT_S):
        self.max_delta, self.ring_s, self.snapshot_s = max_delta, ring_s, snapshot_s
        self.epoch: int | None = None
        self.seq = 0
        self.held: set[int] = set()
        self.host: set[int] = set()  # the held hashes in the host tier
        self._pending: dict[int, tuple[int, int]] = {}  # net change since the last cut
        self._cut_seq = 0  # the last seq a cut covers
        self._ring: deque[tuple[float, Delta]] = deque()  # (when cut, delta), oldest first
        self._ring_size = 0  # hashes in the ring's deltas
        self._snapshot_at = float("-inf")
        self._snapshot_until = float("-inf")  # snapshots in every report until then
        self._report: Events | None = None  # the last report (handed out again while nothing changes)

    def apply(self, events: Events) -> None:
        """One publication of the engine's ChunkLog. O(changes); a snapshot O(set)."""
        epoch, seq, deltas, snapshot = events
        held, host, pending = self.held, self.host, self._pending
        if epoch != self.epoch:  # a new engine or a reset pool: start from the epoch's empty set
            self.epoch, self._cut_seq = epoch, 0
            held.clear()
            host.clear()
            pending.clear()
            self._ring.clear()
            self._ring_size = 0
            self._snapshot_until = float("inf")  # (set to ring_s from the next report)
        if snapshot is not None:  # the epoch's first, or an overflow: its difference is the change
            new, new_host = decode(snapshot)
            for h in held - new:
                _note(pending, h, HOST if h in host else GPU, OUT)
            for h in new - held:
                _note(pending, h, OUT, HOST if h in new_host else GPU)
            for h in (host ^ new_host) & held & new:  # held before and after, in the other tier
                _note(pending, h, HOST if h in host else GPU, HOST if h in new_host else GPU)
            self.held, self.host = new, new_host
        else:
            for _, _, stored, evicted in deltas:
                for h in evicted:
                    if h in held:
                        held.remove(h)
                        if h in host:
                            host.remove(h)
                            _note(pending, h, HOST, OUT)
                        else:
                            _note(pending, h, GPU, OUT)
                for x in stored:
                    if x >= 0:  # now in the GPU tier
                        if x not in held:
                            held.add(x)
                            _note(pending, x, OUT, GPU)
                        elif x in host:
                            host.remove(x)
                            _note(pending, x, HOST, GPU)
                    else:  # now in the host tier
                        h = ~x
                        if h not in held:
                            held.add(h)
                            host.add(h)
                            _note(pending, h, OUT, HOST)
                        elif h not in host:
                            host.add(h)
                            _note(pending, h, GPU, HOST)
        self.seq = seq

    def report(self, now: float) -> Events | None:
        """What a routing-stats poll returns (`now`: a monotonic clock). None before the engine's
        first publication."""
        if self.epoch is None:
            return None
        changed = self._report is None
        ring = self._ring
        if self.seq > self._cut_seq:  # cut the changes since the last report into the ring
            pending = self._pending
            n = len(pending)
            delta: Delta = (self._cut_seq + 1, self.seq, *_split(pending))
            pending.clear()
            self._cut_seq = self.seq
            if n > self.max_delta:  # larger than a snapshot could be: the ring restarts after it
                ring.clear()
                self._ring_size = 0
                self._snapshot_until = now + self.ring_s
            else:
                ring.append((now, delta))
                self._ring_size += n
            changed = True
        while ring and (ring[0][0] < now - self.ring_s or self._ring_size > self.max_delta):
            _, (_, _, stored, evicted) = ring.popleft()
            self._ring_size -= len(stored) + len(evicted)
            changed = True
        if self._snapshot_until == float("inf"):  # a new epoch: snapshots for ring_s from now
            self._snapshot_until = now + self.ring_s
        snapshot = None
        if now < self._snapshot_until or now - self._snapshot_at >= self.snapshot_s:
            snapshot = tier_coded(self.held, self.host)
            self._snapshot_at = now
            changed = True
        elif self._report is not None and self._report[3] is not None:
            changed = True  # (the last one carried a snapshot: this one does not)
        if changed:
            self._report = (self.epoch, self.seq, tuple(d for _, d in ring), snapshot)
        return self._report
