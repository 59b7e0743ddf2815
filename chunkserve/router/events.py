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
      snapshot: the whole set at seq (a tuple of tier-coded hashes, below, anchors flagged), or None
    Delta  = (first_seq, last_seq, stored, evicted, anchors_stored, anchors_evicted)
      the net change over publications first_seq .. last_seq: tuples of hashes, disjoint, so
      applying one is O(its length) in any order. `stored` is tier-coded: h, the hash is held in
      the GPU tier as of last_seq; ~h (bitwise not: negative), in the host tier (these last). A hash that
      changed tier (a spill, GPU -> host; a load, host -> GPU) is stored again at its new tier;
      `evicted` hashes left the tree (from either tier). anchors_stored / anchors_evicted: those
      of the hashes that entered / left the set that are anchors (below), plain (not tier-coded).
      A router reads a Delta of four fields (hand-built) as one whose every hash is an anchor.

Anchors: the hashes at depths 1, 1 + ANCHOR_EVERY, 1 + 2 ANCHOR_EVERY, ... of their chains (the
roots among them). A router keeps its cross-replica map (hash -> replicas) for anchors only and
each replica's whole set apart (chunkserve/router/index.py): the map is the part whose updates
touch memory shared by every replica, so a delta costs a few global dict operations (one per
ANCHOR_EVERY hashes), not one a hash. A set is prefix-closed and holds a root wherever it holds
anything, so the anchors a set holds bound who can hold any prefix. In a snapshot an anchor
carries the flag bit ANCHOR (h | ANCHOR, or ~(h | ANCHOR) in the host tier): a hash is below
2^64, so the bit is free; a non-empty snapshot with no flag (hand-built) counts every hash an anchor.

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
from dataclasses import dataclass
from typing import Any

# (first_seq, last_seq, stored, evicted, anchors_stored, anchors_evicted)
Delta = tuple[int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
Events = tuple[int, int, tuple[Delta, ...], "tuple[int, ...] | None"]  # (epoch, seq, deltas, snapshot)

MAX_DELTA = 4096  # hashes in one delta (or ring) beyond which a snapshot is sent instead
RING_S = 3.0  # seconds of cuts each report repeats: a router may miss reports for this long
SNAPSHOT_S = 10.0  # a report carries a snapshot at least this often
# depths 1, 1 + this, ... are anchors (module docstring); a router must use the same. Within
# EAGER_DEPTH (below) the roots alone: each anchor changed costs a router one map update (~2 us on a
# loaded 2-core VM, bench_events), and a denser spacing only sharpens `holders` where more than
# _RANKED replicas hold a prefix's deepest anchor (chunkserve/router/index.py)
ANCHOR_EVERY = 32
# hashes deeper than this are published once a request reuses them, not when stored
# (chunkserve/replicas/engine/tree_events.py): the depth every prompt's own chunks may reach
EAGER_DEPTH = 32
ANCHOR = 1 << 64  # a snapshot's flag on an anchor's hash


@dataclass(frozen=True)
class PublishConfig:
    """What a replica's tree publishes for routing (chunkserve/replicas/engine/tree_events.py)."""

    max_depth: int  # router.route_chunks: no deeper chunk is published
    eager_depth: int = EAGER_DEPTH  # published when stored; deeper, once reused
    anchor_every: int = ANCHOR_EVERY
    max_delta: int = MAX_DELTA


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
    """A delta's (stored, evicted) from `pending`: stored tier-coded (h: GPU, ~h: host), the
    GPU tier's first (so its last tells a router whether any is host-coded)."""
    stored = (
        *[h for h, (_, now) in pending.items() if now == GPU],
        *[~h for h, (_, now) in pending.items() if now == HOST],
    )
    return stored, tuple([h for h, (_, now) in pending.items() if not now])


def _cut(pending: dict[int, tuple[int, int]], anchors: dict[int, tuple[int, int]]) -> tuple:
    """(stored, evicted, anchors_stored, anchors_evicted) of a Delta from the netted changes of
    every hash (`pending`) and of the anchors (`anchors`, states OUT / GPU)."""
    return (
        *_split(pending),
        tuple([h for h, (_, now) in anchors.items() if now]),
        tuple([h for h, (_, now) in anchors.items() if not now]),
    )


def tier_coded(held: set[int] | dict[int, Any], host: set[int], anchors: set[int]) -> tuple[int, ...]:
    """A snapshot of `held` (hashes; `host`: those of them in the host tier; `anchors`: those of
    them that are anchors), tier-coded, anchors flagged."""
    a = ANCHOR
    if not host:  # (the usual case: set operations in C, then the few anchors)
        rest = held.keys() - anchors if isinstance(held, dict) else held - anchors
        return (*rest, *[h | a for h in anchors])
    return tuple([(~(h | a) if h in host else h | a) if h in anchors else (~h if h in host else h) for h in held])


def decode(coded: tuple[int, ...] | list[int]) -> tuple[set[int], set[int], set[int]]:
    """(every hash, the host tier's, the anchors) of a tier-coded snapshot (an unflagged one: every
    hash is an anchor)."""
    a = ANCHOR
    host, anchors, held = set(), set(), set()
    for x in coded:
        if x < 0:
            x = ~x
            if x >= a:
                x ^= a
                anchors.add(x)
            host.add(x)
        elif x >= a:
            x ^= a
            anchors.add(x)
        held.add(x)
    if not anchors:
        anchors = set(held)
    return held, host, anchors


class ChunkLog:
    """The publishing end, in the engine process: the routable set, each hash's tier, and their
    changes since the last `take`, netted (a hash stored and evicted in between, or spilled and
    loaded back, is no change). O(1) a change.

    held: hash -> the caller's tag for it (the tree's hook keeps (depth, seed) there); host: the
    held hashes in the host tier; anchors: the held hashes that are anchors."""

    def __init__(self, max_delta: int = MAX_DELTA):
        self.max_delta = max_delta
        self.held: dict[int, Any] = {}
        self.host: set[int] = set()
        self.anchors: set[int] = set()
        self.epoch = new_epoch()
        self.seq = 0
        self._pending: dict[int, tuple[int, int]] = {}
        self._anchors: dict[int, tuple[int, int]] = {}  # the anchors' net changes (OUT / GPU)
        self._fresh = True  # the epoch's first publication (a snapshot) is due

    def stored(self, h: int, tag: Any = None, host: bool = False, anchor: bool = True) -> None:
        """`h` entered the set (in the host tier if `host`: a restart listing a spilled node);
        `anchor`: it is an anchor (the tree's hook says by depth; by default every hash is)."""
        self.held[h] = tag
        if host:
            self.host.add(h)
        if anchor:
            self.anchors.add(h)
            _note(self._anchors, h, OUT, GPU)
        _note(self._pending, h, OUT, HOST if host else GPU)

    def evicted(self, h: int) -> None:
        del self.held[h]
        if h in self.anchors:
            self.anchors.remove(h)
            _note(self._anchors, h, GPU, OUT)
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
        self.anchors.clear()
        self._pending.clear()
        self._anchors.clear()
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
            out: Events = (self.epoch, seq, (), tier_coded(self.held, self.host, self.anchors))
        else:
            out = (self.epoch, seq, ((seq, seq, *_cut(pending, self._anchors)),), None)
        pending.clear()
        self._anchors.clear()
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
        self.anchors: set[int] = set()  # the held hashes that are anchors
        self._pending: dict[int, tuple[int, int]] = {}  # net change since the last cut
        self._anchors: dict[int, tuple[int, int]] = {}  # the anchors' (OUT / GPU)
        self._cut_seq = 0  # the last seq a cut covers
        self._ring: deque[tuple[float, Delta]] = deque()  # (when cut, delta), oldest first
        self._ring_size = 0  # hashes in the ring's deltas
        self._snapshot_at = float("-inf")
        self._snapshot_until = float("-inf")  # snapshots in every report until then
        self._report: Events | None = None  # the last report (handed out again while nothing changes)

    def apply(self, events: Events) -> None:
        """One publication of the engine's ChunkLog. O(changes); a snapshot O(set)."""
        epoch, seq, deltas, snapshot = events
        held, host, pending, anchors = self.held, self.host, self._pending, self.anchors
        if epoch != self.epoch:  # a new engine or a reset pool: start from the epoch's empty set
            self.epoch, self._cut_seq = epoch, 0
            held.clear()
            host.clear()
            anchors.clear()
            pending.clear()
            self._anchors.clear()
            self._ring.clear()
            self._ring_size = 0
            self._snapshot_until = float("inf")  # (set to ring_s from the next report)
        if snapshot is not None:  # the epoch's first, or an overflow: its difference is the change
            new, new_host, new_anchors = decode(snapshot)
            for h in held - new:
                _note(pending, h, HOST if h in host else GPU, OUT)
            for h in new - held:
                _note(pending, h, OUT, HOST if h in new_host else GPU)
            for h in (host ^ new_host) & held & new:  # held before and after, in the other tier
                _note(pending, h, HOST if h in host else GPU, HOST if h in new_host else GPU)
            for h in anchors - new_anchors:
                _note(self._anchors, h, GPU, OUT)
            for h in new_anchors - anchors:
                _note(self._anchors, h, OUT, GPU)
            self.held, self.host, self.anchors = new, new_host, new_anchors
        else:
            for _, _, stored, evicted, anchors_stored, anchors_evicted in deltas:
                for h in anchors_evicted:
                    if h in anchors:
                        anchors.remove(h)
                        _note(self._anchors, h, GPU, OUT)
                for h in anchors_stored:
                    if h not in anchors:
                        anchors.add(h)
                        _note(self._anchors, h, OUT, GPU)
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
            delta: Delta = (self._cut_seq + 1, self.seq, *_cut(pending, self._anchors))
            pending.clear()
            self._anchors.clear()
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
            _, (_, _, stored, evicted, _, _) = ring.popleft()
            self._ring_size -= len(stored) + len(evicted)
            changed = True
        if self._snapshot_until == float("inf"):  # a new epoch: snapshots for ring_s from now
            self._snapshot_until = now + self.ring_s
        snapshot = None
        if now < self._snapshot_until or now - self._snapshot_at >= self.snapshot_s:
            snapshot = tier_coded(self.held, self.host, self.anchors)
            self._snapshot_at = now
            changed = True
        elif self._report is not None and self._report[3] is not None:
            changed = True  # (the last one carried a snapshot: this one does not)
        if changed:
            self._report = (self.epoch, self.seq, tuple(d for _, d in ring), snapshot)
        return self._report
