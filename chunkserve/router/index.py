"""One router's approximate map  prompt chain -> replicas holding a prefix of it  (DESIGN §3).

Two sources, merged per replica:
  - own decisions: the chains this router sent to a replica, by root (first chunk hash), LRU-bounded
    per replica; they bridge the gap until the replica's published set shows them.
  - the replica's published set: the chunk hashes its prefix tree holds, kept up to date by its
    chunk-tree events (chunkserve/router/events.py: numbered deltas, O(changes) each, and snapshots
    to resync from a gap or a new epoch), or replaced wholesale by a digest (`replace_digest`, the
    simulator's path). Once the set is exact as of `as_of` (a snapshot, or deltas with no gap), it
    supersedes every own record of that replica last refreshed at or before `as_of`: those are
    dropped.

Tiers: a published hash is in the replica's GPU tier or its host tier (the events' tier coding,
chunkserve/router/events.py); the index keeps each replica's host-tier hashes, a subset of its set
(`_host`). `depths` counts both tiers (what the replica will report as cached: a host chunk is
loaded back, not recomputed); `host_depths` says how much of that is in the host tier, which the
policy credits at a fraction of a GPU hit. On a tree path the GPU nodes come first, so the host
part of a held prefix is its tail.

A published set is prefix-closed along every chain (a tree node implies its ancestors), so the
depth a replica's set holds is found by binary search over the chain; a recorded chain holds exactly
its own prefixes, so the depth from own records is the longest common prefix with one of them. Both
searches rest on the hashes being chained (chunkserve/router/hashing.py): a hash names its whole prefix.

Costs: recording a prompt is O(1) dict work (the chain tuple is stored, not its hashes one by one);
published sets keep an exact hash -> replicas reverse map, updated off the request path when a
report arrives: O(1) per hash that changed (a delta's hashes; a snapshot's or digest's diff costs
O(hashes) more). Reads are O(candidates): one lookup by root serves a decision's candidates. The
LRU maps are plain dicts (re-inserted on use, so oldest first), not OrderedDicts: at the decision
rate the maps are cold in the CPU caches, and an OrderedDict's move-to-end also touches the
linked-list neighbours of the entry, each a likely miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice


def common_prefix(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two tuples or strings (C-level slice compares,
    O(log n) of them)."""
    if a == b:
        return len(a)
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def lru_overflow(lru: dict, limit: int) -> list:
    """The keys to drop from `lru`, a dict used as an LRU (entries re-inserted on use, so oldest
    first), to keep it within `limit`: the oldest beyond it and, for a limit of 64 or more, limit/16
    more. Finding the oldest scans the dict's entries from the front, past the holes re-insertions
    leave there (until the dict next resizes), so one scan serves many evictions: O(1) amortised."""
    excess = len(lru) - limit
    if excess <= 0:
        return []
    if limit >= 64:
        excess += limit >> 4
    return list(islice(lru, excess))


def chain_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two hash chains. A chained hash names its whole
    prefix, so a[k] == b[k] exactly when a[:k + 1] == b[:k + 1]: equality is monotone along the
    chains. One compare settles the usual cases (all shared, or none); else binary search: O(log n)
    hash compares, never the whole chains."""
    n = min(len(a), len(b))
    if not n or a[n - 1] == b[n - 1]:
        return n
    if a[0] != b[0]:
        return 0
    lo, hi = 1, n - 1  # a[lo - 1] == b[lo - 1], a[n - 1] != b[n - 1]: the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _deepest(chain: Sequence[int], known: int, held) -> int:
    """The largest d with chain[d - 1] in `held`, given chain[known - 1] is. Digests are closed
    under ancestors, so membership is monotone along the chain: binary search."""
    lo, hi = known, len(chain)
    if chain[hi - 1] in held:  # the usual case: all of it
        return hi
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if chain[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


_NO_RECORDS: dict = {}  # (never written)
_FEW = 8  # a hash's digest holders: a tuple up to this many (see PrefixIndex._digest_holders)


def _drop_holder(holders: dict, h: int, replica_id: str) -> None:
    """Take `replica_id` off the digest holders of hash `h`."""
    s = holders[h]
    if type(s) is tuple:
        if len(s) == 1:
            del holders[h]
        else:
            holders[h] = tuple([r for r in s if r != replica_id])
    else:
        s.discard(replica_id)
        if not s:
            del holders[h]


def _add_holder(holders: dict, h: int, replica_id: str) -> None:
    """Put `replica_id` among the digest holders of hash `h` (not there yet)."""
    s = holders.get(h)
    if s is None:
        holders[h] = (replica_id,)
    elif type(s) is tuple:
        holders[h] = (*s, replica_id) if len(s) < _FEW else {*s, replica_id}
    else:
        s.add(replica_id)


class PrefixIndex:
    """roots_per_replica: prefixes (roots) remembered per replica; chains_per_root: distinct chains
    kept per (replica, root); holders_per_root: most recent replicas per root `holders` offers."""

    def __init__(self, roots_per_replica: int = 4096, chains_per_root: int = 4, holders_per_root: int = 8):
        self.roots_per_replica = roots_per_replica
        self.chains_per_root = chains_per_root
        self.holders_per_root = holders_per_root
        # replica -> root -> (time last recorded, *recent chains from that root, oldest first); roots
        # least recently recorded first. One flat tuple per entry: a lookup follows few pointers.
        self._own: dict[str, dict[int, tuple]] = {}
        # root -> replica -> its entry of _own: the same records by root, least recently recorded
        # first. A lookup reads one small dict for a decision's candidates, and skips the replicas
        # without a record without touching their (cold) per-replica maps.
        self._recorded: dict[int, dict[str, tuple]] = {}
        self._digest: dict[str, set[int]] = {}  # replica -> the hashes it published (as of its last report)
        # replica -> those of its published hashes in its host tier (events' ~h); no entry while none
        self._host: dict[str, set[int]] = {}
        # replica -> [epoch, seq, exact] of its chunk-tree events applied (chunkserve/router/events.py);
        # exact: no gap since the epoch's start or the last snapshot
        self._sync: dict[str, list] = {}
        self.gaps = 0  # times a replica's events had a gap (missed reports): it waits for a snapshot
        # hash -> the replicas whose digest holds it (reverse of _digest): a tuple while few (most
        # hashes have one holder: a tuple of strings is small and the cyclic GC stops tracking it),
        # a set beyond
        self._digest_holders: dict[int, tuple[str, ...] | set[str]] = {}

    # -- writes ---------------------------------------------------------------------------------

    def record(self, replica_id: str, chain: tuple[int, ...], now: float) -> None:
        """This router just sent a prompt with chain `chain` to `replica_id`."""
        if not chain:
            return
        root = chain[0]
        own = self._own.get(replica_id)
        if own is None:
            own = self._own[replica_id] = {}
        entry = own.pop(root, None)
        if entry is None:
            entry = (now, chain)
        else:
            chains = entry[1:]
            if chain not in chains:
                chains = (*chains[max(0, len(chains) + 1 - self.chains_per_root) :], chain)  # the newest ones
            entry = (now, *chains)
        own[root] = entry  # (re-)inserted: most recent last, here and by root
        recorded = self._recorded.get(root)
        if recorded is None:
            self._recorded[root] = {replica_id: entry}
        else:
            recorded.pop(replica_id, None)
            recorded[replica_id] = entry
        if len(own) > self.roots_per_replica:
            self._forget(replica_id, own, lru_overflow(own, self.roots_per_replica))

    def replace_digest(self, replica_id: str, hashes: Iterable[int], as_of: float) -> None:
        """`replica_id` published the hashes its tree held at time `as_of` (this router's clock)."""
        self._sync.pop(replica_id, None)  # (a digest has no epoch: events start afresh)
        self._replace(replica_id, hashes)
        self._drop_own_before(replica_id, as_of)

    def apply_events(self, replica_id: str, events: tuple, as_of: float) -> bool:
        """`replica_id`'s chunk-tree events report (chunkserve/router/events.Events), taken at `as_of`
        (this router's clock). Applies the deltas after the seq this index holds, O(their
        hashes); on another epoch first drops what the replica held; on a gap takes the report's
        snapshot, or applies what it can and waits for one. Returns whether the replica's set is
        now exact (as of its report)."""
        epoch, seq, deltas, snapshot = events
        sync = self._sync.get(replica_id)
        held = self._digest.get(replica_id)
        if held is None or sync is None or sync[0] != epoch:  # a new life of the tree (or a first report)
            if held:
                self._replace(replica_id, ())
            held = self._digest[replica_id] = set()
            sync = self._sync[replica_id] = [epoch, 0, True]
        at = sync[1]
        if seq > at or snapshot is not None and not sync[2]:  # (inexact: a snapshot of its seq resyncs it too)
            i = len(deltas)
            while i and deltas[i - 1][1] > at:  # from the newest back: the deltas after `at`
                i -= 1
            if sync[2] and i < len(deltas) and deltas[i][0] == at + 1:  # no gap: deltas only
                for d in deltas[i:]:
                    self._apply_delta(replica_id, held, d, True)
            elif snapshot is not None:
                self._replace(replica_id, snapshot, coded=True)
                sync[2] = True
            else:  # a gap and no snapshot: the deltas it has (approximate) until one comes
                for d in deltas[i:]:
                    self._apply_delta(replica_id, held, d, False)
                if sync[2]:
                    self.gaps += 1
                sync[2] = False
            sync[1] = seq
        if sync[2]:
            self._drop_own_before(replica_id, as_of)
        return sync[2]

    def synced(self, replica_id: str) -> tuple[int, int, bool] | None:
        """(epoch, seq, exact) of `replica_id`'s events applied, or None."""
        sync = self._sync.get(replica_id)
        return None if sync is None else (sync[0], sync[1], sync[2])

    def published(self, replica_id: str) -> frozenset[int]:
        """The hashes `replica_id`'s reports say it holds, in either tier (a copy)."""
        return frozenset(self._digest.get(replica_id, ()))

    def published_host(self, replica_id: str) -> frozenset[int]:
        """Those of `published` its reports say are in its host tier (a copy)."""
        return frozenset(self._host.get(replica_id, ()))

    def _apply_delta(self, replica_id: str, held: set[int], delta: tuple, exact: bool) -> None:
        """One delta into `held` and the reverse map, O(its hashes). Exact (no gap before it): its
        evicted hashes are all held and its stored ones none, so the set work is two C calls and
        each hash one dict operation (most have this replica as their only holder: inline).
        After a gap, only what changes anything is applied. With tiers in play (a host-coded hash
        in the delta, or host hashes held before it), the tiers are set first, and a stored hash
        already held (a tier change) is no new holder: only the others are applied, as after a gap."""
        _, _, stored, evicted = delta
        if replica_id in self._host or stored and min(stored) < 0:
            stored, exact = self._apply_tiers(replica_id, stored, evicted), False
        holders = self._digest_holders
        if not exact:
            evicted = held.intersection(evicted)
            stored = set(stored).difference(held)
        held.difference_update(evicted)
        held.update(stored)
        pop = holders.pop
        for h in evicted:
            s = pop(h)
            if s.__class__ is not tuple or len(s) != 1:  # (shared with other replicas)
                holders[h] = s
                _drop_holder(holders, h, replica_id)
        one = (replica_id,)
        add = holders.setdefault
        for h in stored:
            if add(h, one) is not one:  # (others hold it too)
                _add_holder(holders, h, replica_id)

    def _apply_tiers(self, replica_id: str, stored: Sequence[int], evicted: Sequence[int]) -> list[int]:
        """A delta's tiers into `replica_id`'s host set; returns its stored hashes, decoded."""
        host = self._host.get(replica_id)
        if host is None:
            host = set()
        host.difference_update(evicted)
        out = []
        for x in stored:
            if x < 0:
                x = ~x
                host.add(x)
            else:
                host.discard(x)
            out.append(x)
        self._set_host(replica_id, host)
        return out

    def _set_host(self, replica_id: str, host: set[int] | None) -> None:
        if host:
            self._host[replica_id] = host
        else:
            self._host.pop(replica_id, None)

    def _replace(self, replica_id: str, hashes: Iterable[int], coded: bool = False) -> None:
        """Make `replica_id`'s published set exactly `hashes` (`coded`: an events snapshot,
        tier-coded, ~h a host-tier hash; else a digest, all on the GPU): O(hashes + changes)."""
        new = set(hashes)
        host = None
        if coded and new and min(new) < 0:
            host = {~x for x in new if x < 0}
            new = {x for x in new if x >= 0} | host
        self._set_host(replica_id, host)
        old = self._digest.get(replica_id)
        if old is None:
            old = set()
        if new != old:  # (an unchanged digest, an idle replica's: no diff)
            holders = self._digest_holders
            for h in old - new:
                _drop_holder(holders, h, replica_id)
            for h in new - old:
                _add_holder(holders, h, replica_id)
        self._digest[replica_id] = new

    def _drop_own_before(self, replica_id: str, as_of: float) -> None:
        """Drop `replica_id`'s own records last refreshed at or before `as_of`: its published set,
        exact as of then, says what it holds of them."""
        own = self._own.get(replica_id)
        if own:
            stale = []
            for root, entry in own.items():  # oldest first
                if entry[0] > as_of:
                    break
                stale.append(root)
            self._forget(replica_id, own, stale)

    def _forget(self, replica_id: str, own: dict[int, tuple], roots: Iterable[int]) -> None:
        """Drop `replica_id`'s own records of `roots` (`own`: its records)."""
        recorded = self._recorded
        for root in roots:
            del own[root]
            s = recorded[root]
            del s[replica_id]
            if not s:
                del recorded[root]

    def remove_replica(self, replica_id: str) -> None:
        own = self._own.pop(replica_id, None)
        if own:
            self._forget(replica_id, own, list(own))
        for h in self._digest.pop(replica_id, ()):
            _drop_holder(self._digest_holders, h, replica_id)
        self._host.pop(replica_id, None)
        self._sync.pop(replica_id, None)

    # -- reads ----------------------------------------------------------------------------------

    def depth(self, replica_id: str, chain: tuple[int, ...]) -> int:
        """How many leading hashes of `chain` `replica_id` is believed to hold."""
        return self.depths((replica_id,), chain)[0] if chain else 0

    def depths(self, replica_ids: Sequence[str], chain: tuple[int, ...]) -> list[int]:
        """`depth` of each of `replica_ids`, in order (one call for a decision's candidates)."""
        if not chain:
            return [0] * len(replica_ids)
        root, n, last = chain[0], len(chain), chain[-1]
        digests, digest_holders = self._digest, self._digest_holders
        recorded = self._recorded.get(root, _NO_RECORDS)
        if not recorded and root not in digest_holders:  # nobody is known to hold any of it
            return [0] * len(replica_ids)
        out = []
        at, held_by = -1, None  # the digest holders of chain[at]: one lookup for the candidates sharing `at`
        for r in replica_ids:
            best = 0
            entry = recorded.get(r)
            if entry is not None:
                for c in entry[1:]:
                    if len(c) >= n and c[n - 1] == last:  # holds all of it (chain_prefix's first test)
                        best = n
                        break
                    d = chain_prefix(chain, c)
                    if d > best:
                        best = d
            if best < n:  # its digest may hold more than our records say
                if best != at:
                    at, held_by = best, digest_holders.get(chain[best])
                if held_by and r in held_by:
                    best = _deepest(chain, best + 1, digests[r])
            out.append(best)
        return out

    def host_depths(
        self, replica_ids: Sequence[str], chain: tuple[int, ...], depths: Sequence[int]
    ) -> list[int] | None:
        """Of each replica's depth in `depths` (`depths`' answer for `replica_ids`), how many
        chunks its published set holds in the host tier: the tail of its published prefix, as the
        GPU nodes come first on a path. None when no candidate holds any of its depth in the host
        tier (the usual case, where none has a host hash at all: one dict probe each). O(log depth) set probes a candidate with some. (A chain this router
        sent the replica since its report counts in the tier the report gives: loaded by now.)"""
        hosts = self._host
        out = None
        for i, r in enumerate(replica_ids):
            host = hosts.get(r)
            d = depths[i]
            if host is None or d <= 0:
                continue
            held = self._digest[r]
            top = d if chain[d - 1] in held else _deepest(chain, 0, held)  # its published prefix
            if not top or chain[top - 1] not in host:  # its tail on the GPU: none on the host
                continue
            lo, hi = 0, top - 1  # the first host hash is in [lo, hi]: chain[hi] is one
            while lo < hi:
                mid = (lo + hi) >> 1
                if chain[mid] in host:
                    hi = mid
                else:
                    lo = mid + 1
            if out is None:
                out = [0] * len(replica_ids)
            out[i] = top - lo
        return out

    def holders(self, chain: tuple[int, ...], limit: int) -> tuple[str, ...]:
        """Replicas that may hold a prefix of the chain: the (up to holders_per_root) most recently
        sent its root whose own record of it stands, then up to `limit` whose digest holds its
        longest digest-known prefix. Unverified: read `depth` for each."""
        if not chain:
            return ()
        recent = self._recorded.get(chain[0])
        found = list(islice(reversed(recent), self.holders_per_root)) if recent else []  # most recent first
        dh = self._digest_holders
        if chain[0] in dh:
            lo = _deepest(chain, 1, dh)  # largest depth any digest holds
            n = 0
            for r in dh[chain[lo - 1]]:
                if n == limit:
                    break
                if r not in found:
                    found.append(r)
                    n += 1
        return tuple(found)

    def replicas(self) -> set[str]:
        """Replicas this index knows anything about."""
        return set(self._own) | set(self._digest)

    def own_roots(self, replica_id: str) -> int:
        return len(self._own.get(replica_id, ()))
