"""Chunk-tree events: a replica's routable chunk hashes as numbered deltas (DESIGN §6).

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
      snapshot: the whole set at seq (a tuple of hashes), or None
    Delta  = (first_seq, last_seq, stored, evicted)
      the net change over publications first_seq .. last_seq: tuples of hashes, disjoint, so
      applying one is O(its length) in any order

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


def _note(pending: dict[int, bool], h: int, stored: bool) -> None:
    """Net one change into `pending` (hash -> stored since the last cut, or evicted): a hash
    evicted then stored again (or the reverse) since the last cut is no change at all."""
    if pending.get(h) is (not stored):
        del pending[h]
    else:
        pending[h] = stored


def _split(pending: dict[int, bool]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple([h for h, s in pending.items() if s]), tuple([h for h, s in pending.items() if not s])


class ChunkLog:
    """The publishing end, in the engine process: the routable set and its changes since the last
    `take`, netted (a hash stored and evicted in between is no change). O(1) a change.

    held: hash -> the caller's tag for it (the tree's hook keeps (depth, seed) there)."""

    def __init__(self, max_delta: int = MAX_DELTA):
        self.max_delta = max_delta
        self.held: dict[int, Any] = {}
        self.epoch = new_epoch()
        self.seq = 0
        self._pending: dict[int, bool] = {}
        self._fresh = True  # the epoch's first publication (a snapshot) is due

    def stored(self, h: int, tag: Any = None) -> None:
        self.held[h] = tag
        _note(self._pending, h, True)

    def evicted(self, h: int) -> None:
        del self.held[h]
        _note(self._pending, h, False)

    def reset(self) -> None:
        """A new epoch from the empty set (the caller stores what its tree still holds)."""
        self.epoch, self.seq = new_epoch(), 0
        self.held.clear()
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
            out: Events = (self.epoch, seq, (), tuple(self.held))
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
        self._pending: dict[int, bool] = {}  # net change since the last cut
        self._cut_seq = 0  # the last seq a cut covers
        self._ring: deque[tuple[float, Delta]] = deque()  # (when cut, delta), oldest first
        self._ring_size = 0  # hashes in the ring's deltas
        self._snapshot_at = float("-inf")
        self._snapshot_until = float("-inf")  # snapshots in every report until then
        self._report: Events | None = None  # the last report (handed out again while nothing changes)

    def apply(self, events: Events) -> None:
        """One publication of the engine's ChunkLog. O(changes); a snapshot O(set)."""
        epoch, seq, deltas, snapshot = events
        held, pending = self.held, self._pending
        if epoch != self.epoch:  # a new engine or a reset pool: start from the epoch's empty set
            self.epoch, self._cut_seq = epoch, 0
            held.clear()
            pending.clear()
            self._ring.clear()
            self._ring_size = 0
            self._snapshot_until = float("inf")  # (set to ring_s from the next report)
        if snapshot is not None:  # the epoch's first, or an overflow: its difference is the change
            new = set(snapshot)
            for h in held - new:
                _note(pending, h, False)
            for h in new - held:
                _note(pending, h, True)
            self.held = new
        else:
            for _, _, stored, evicted in deltas:
                for h in evicted:
                    if h in held:
                        held.remove(h)
                        _note(pending, h, False)
                for h in stored:
                    if h not in held:
                        held.add(h)
                        _note(pending, h, True)
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
            snapshot = tuple(self.held)
            self._snapshot_at = now
            changed = True
        elif self._report is not None and self._report[3] is not None:
            changed = True  # (the last one carried a snapshot: this one does not)
        if changed:
            self._report = (self.epoch, self.seq, tuple(d for _, d in ring), snapshot)
        return self._report
