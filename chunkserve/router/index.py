"""One router's approximate map  prompt chain -> replicas holding a prefix of it  (DESIGN §3).

Two sources, merged per replica:
  - own decisions: the chains this router sent to a replica, by root (first chunk hash), LRU-bounded
    per replica; they bridge the gap until the replica's published set shows them.
  - the replica's published set: the chunk hashes its prefix tree holds, kept up to date by its
    chunk-tree events (chunkserve/router/events.py: numbered deltas, O(changes) each, and snapshots
    to resync from a gap or a new epoch), or replaced wholesale by a digest (`replace_digest`, the
    simulator's path). Once the set is exact as of `as_of` (a snapshot, or deltas with no gap), it
    supersedes every own record of that replica last refreshed at or before `as_of`: those are
    dropped, but for the roots of requests still in flight there (`pin`): a request queued in
    the replica's engine holds no chunk yet, so a report taken while it waits does not show the
    prefix it will hold once it runs (at overload, seconds later); its record stays until a
    report after the request ended.

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

Costs: recording a prompt is O(1) dict work (the chain tuple is stored, not its hashes one by one).
Published sets: each replica's own set (exact), and a reverse map hash -> replicas for *anchors*
only (chunkserve/router/events.py: the hashes at depths 1, 1 + anchor_every, ...; a digest's or a
hand-built delta's every hash), updated off the request path when a report arrives. Why anchors:
a replica's set is small and its updates touch little memory, but the reverse map is shared by every
replica and large, and each update of it is a few cache misses; a delta costs one set operation in
C over its hashes and one map operation per anchor among them (one in anchor_every). Nothing is
lost: sets are prefix-closed, so whoever holds any prefix of a chain holds its root, and whoever
holds the chain's deepest held prefix holds its deepest held anchor; `holders` takes that anchor's
holders and ranks them by their own sets within the anchor's span (O(log anchor_every) probes a
holder). A snapshot's or digest's diff costs O(hashes) more. Reads are O(candidates): one lookup by
root serves a decision's candidates. The
LRU maps are plain dicts (re-inserted on use, so oldest first), not OrderedDicts: at the decision
rate the maps are cold in the CPU caches, and an OrderedDict's move-to-end also touches the
linked-list neighbours of the entry, each a likely miss.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

from chunkserve.router.events import ANCHOR_EVERY, decode


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


def _deepest(chain: Sequence[int], known: int, held, end: int | None = None) -> int:
    """The largest d <= `end` (default: the whole chain) with chain[d - 1] in `held`, given
    chain[known - 1] is. Digests are closed under ancestors, so membership is monotone along the
    chain: binary search."""
    lo, hi = known, len(chain) if end is None else end
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
_RANKED = 8  # an anchor's holders `holders` ranks by depth at most (a hot prefix has hundreds: see holders)


def _drop_holder(holders: dict, h: int, replica_id: str) -> None:
    """Take `replica_id` off the digest holders of hash `h`."""
    s = holders[h]
    if type(s) is tuple:
        if len(s) == 1:
            del holders[h]
        else:
            holders[h] = tuple([r for r in s if r != replica_id])
    else:
        s.pop(replica_id, None)
        if not s:
            del holders[h]


def _add_holder(holders: dict, h: int, replica_id: str) -> None:
    """Put `replica_id` among the digest holders of hash `h` (not there yet)."""
    s = holders.get(h)
    if s is None:
        holders[h] = (replica_id,)
    elif type(s) is tuple:
        holders[h] = (*s, replica_id) if len(s) < _FEW else dict.fromkeys((*s, replica_id))
    else:
        s[replica_id] = None


class PrefixIndex:
    """roots_per_replica: prefixes (roots) remembered per replica; chains_per_root: distinct chains
    kept per (replica, root); holders_per_root: most recent replicas per root `holders` offers;
    anchor_every: the replicas' anchor spacing (chunkserve/router/events.ANCHOR_EVERY)."""

    def __init__(
        self,
        roots_per_replica: int = 4096,
        chains_per_root: int = 4,
        holders_per_root: int = 8,
        anchor_every: int = ANCHOR_EVERY,
    ):
        self.anchor_every = anchor_every
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
        # replica -> root -> requests in flight there with that root (`pin`): their records stay
        self._pinned: dict[str, dict[int, int]] = {}
        self._digest: dict[str, set[int]] = {}  # replica -> the hashes it published (as of its last report)
        # replica -> those of its published hashes in its host tier (events' ~h); no entry while none
        self._host: dict[str, set[int]] = {}
        # replica -> [epoch, seq, exact] of its chunk-tree events applied (chunkserve/router/events.py);
        # exact: no gap since the epoch's start or the last snapshot
        self._sync: dict[str, list] = {}
        self.gaps = 0  # times a replica's events had a gap (missed reports): it waits for a snapshot
        # anchor hash -> the replicas whose published set holds it (every hash is an anchor in a
        # digest and in a hand-built delta of four fields; chunkserve/router/events.py): a
        # tuple while few (most hashes have one holder: a tuple of strings is small and the cyclic
        # GC stops tracking it), beyond that a dict used as an ordered set (iterated in the order
        # the replicas came to hold it, as every run and every router applying the same reports
        # sees it: a set's order of strings changes with each process's string hashing)
        self._digest_holders: dict[int, tuple[str, ...] | dict[str, None]] = {}

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
            chains, last, n = entry[1:], chain[-1], len(chain)
            for c in chains:  # a chained hash names its whole prefix: equal last hashes, equal chains
                if c[-1] == last and len(c) == n:  # (`chain in chains` compares them hash by hash)
                    break
            else:
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

    def pin(self, replica_id: str, root: int) -> None:
        """A request with chain root `root` was sent to `replica_id` and has not ended: no report
        drops this router's record of that root there until `unpin`."""
        pinned = self._pinned.get(replica_id)
        if pinned is None:
            pinned = self._pinned[replica_id] = {}
        pinned[root] = pinned.get(root, 0) + 1

    def unpin(self, replica_id: str, root: int) -> None:
        """That request ended (a replica removed since has no pins left: nothing to do)."""
        pinned = self._pinned.get(replica_id)
        if pinned is None or root not in pinned:
            return
        if pinned[root] > 1:
            pinned[root] -= 1
        else:
            del pinned[root]

    def replace_digest(self, replica_id: str, hashes: Iterable[int], as_of: float) -> None:
        """`replica_id` published the hashes its tree held at time `as_of` (this router's clock)."""
        self._replace(replica_id, hashes)
        self._sync.pop(replica_id, None)  # (a digest has no epoch: events start afresh)
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
        if sync[2] and replica_id in self._own:
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
        """One delta into `held`, O(its hashes) in two C calls, and its anchors into the reverse
        map, one dict operation each. Exact (no gap before it): its evicted hashes are all held
        and its stored ones none. After a gap, only what changes anything is applied. With tiers
        in play (a host-coded hash in the delta, or host hashes held before it), the tiers are set
        first, and a stored hash already held (a tier change) is no new holder: only the others
        are applied, as after a gap. A delta of four fields (hand-built) counts every hash an anchor."""
        if len(delta) == 6:  # (its host-coded hashes come last: one test says if there are any)
            _, _, stored, evicted, a_stored, a_evicted = delta
            tiers = replica_id in self._host or stored and stored[-1] < 0
        else:
            _, _, stored, evicted = delta
            a_stored = a_evicted = None
            tiers = replica_id in self._host or stored and min(stored) < 0
        if tiers:
            stored, exact = self._apply_tiers(replica_id, stored, evicted), False
        if not exact:
            # (the anchors first: a replica is among an anchor's holders exactly when it holds it)
            if a_stored is not None:
                a_evicted = held.intersection(a_evicted)
                a_stored = set(a_stored).difference(held)
            evicted = held.intersection(evicted)
            stored = set(stored).difference(held)
        held.difference_update(evicted)
        held.update(stored)
        if a_stored is None:
            a_stored, a_evicted = stored, evicted
        holders = self._digest_holders  # (_drop_holder and _add_holder, inline: one probe a hash)
        for h in a_evicted:
            # after a gap the replica may not be listed: an anchor whose store was missed and whose
            # tier change was seen (a stored hash, listed as no anchor) entered `held` only
            s = holders.get(h)
            if s is None:
                continue
            if isinstance(s, tuple):
                if replica_id in s:
                    if len(s) > 1:
                        holders[h] = tuple([r for r in s if r != replica_id])
                    else:
                        del holders[h]
            else:
                s.pop(replica_id, None)
                if not s:
                    del holders[h]
        for h in a_stored:
            s = holders.get(h)
            if s is None:
                holders[h] = (replica_id,)
            elif isinstance(s, tuple):
                holders[h] = (*s, replica_id) if len(s) < _FEW else dict.fromkeys((*s, replica_id))
            else:
                s[replica_id] = None

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
        tier-coded, ~h a host-tier hash, anchors flagged; else a digest, all on the GPU, every
        hash an anchor): O(hashes + changes)."""
        if coded:
            new, host, anchors = decode(tuple(hashes))
        else:
            new, host = set(hashes), set()
            anchors = new
        self._set_host(replica_id, host or None)
        old = self._anchors_of(replica_id)
        if anchors != old:  # (an unchanged digest, an idle replica's: no diff)
            holders = self._digest_holders
            for h in old - anchors:
                _drop_holder(holders, h, replica_id)
            for h in anchors - old:
                _add_holder(holders, h, replica_id)
        self._digest[replica_id] = new

    def _anchors_of(self, replica_id: str) -> set[int]:
        """The anchors among `replica_id`'s published set: all of it from a digest, else those
        the reverse map lists it for (O(set) probes: a resync's or a removal's)."""
        held = self._digest.get(replica_id)
        if not held:
            return set()
        if replica_id not in self._sync:  # (a digest: every hash)
            return held
        holders = self._digest_holders
        return {h for h in held if replica_id in holders.get(h, ())}

    def _drop_own_before(self, replica_id: str, as_of: float) -> None:
        """Drop `replica_id`'s own records last refreshed at or before `as_of`: its published set,
        exact as of then, says what it holds of them (not of a pinned root's: see the module)."""
        own = self._own.get(replica_id)
        if own:
            stale, pinned = [], self._pinned.get(replica_id) or ()
            for root, entry in own.items():  # oldest first
                if entry[0] > as_of:
                    break
                if root not in pinned:
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
        self._pinned.pop(replica_id, None)
        for h in self._anchors_of(replica_id):
            _drop_holder(self._digest_holders, h, replica_id)
        self._digest.pop(replica_id, None)
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
        digests = self._digest
        rooted = self._digest_holders.get(root)  # (an anchor): no other replica's set holds any of the chain
        recorded = self._recorded.get(root, _NO_RECORDS)
        if not recorded and rooted is None:  # nobody is known to hold any of it
            return [0] * len(replica_ids)
        out = []
        for r in replica_ids:
            best = 0
            entry = recorded.get(r)
            if entry is not None:
                for c in entry[:0:-1]:  # newest first: a session's last turn is the likely deepest
                    if len(c) >= n and c[n - 1] == last:  # holds all of it (chain_prefix's first test)
                        best = n
                        break
                    if best and (len(c) <= best or c[best] != chain[best]):  # shares no more than best
                        continue
                    d = chain_prefix(chain, c)
                    if d > best:
                        best = d
            if best < n and rooted is not None and r in rooted:  # its set may hold more than our records say
                held = digests[r]
                if not best or chain[best] in held:
                    best = _deepest(chain, best + 1, held)
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
        if not hosts:  # no replica has published a host tier (the usual case)
            return None
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
        sent its root whose own record of it stands, then up to `limit` whose published set holds
        its longest published prefix: found among the holders of its deepest held anchor (the
        first _RANKED of them, when more hold it), or, where the map lists more than anchors (a
        digest's hashes), by the map alone (a fleet follows one or the other: where both mix, an
        events replica past a digest's anchor may be missed). Unverified: read `depth` for each."""
        if not chain:
            return ()
        recent = self._recorded.get(chain[0])
        found = list(islice(reversed(recent), self.holders_per_root)) if recent else []  # most recent first
        dh = self._digest_holders
        if chain[0] in dh:
            b, n = self.anchor_every, len(chain)
            lo, hi = 0, (n - 1) // b  # the deepest anchor anyone holds, chain[lo * b]: binary search
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if chain[mid * b] in dh:
                    lo = mid
                else:
                    hi = mid - 1
            at = lo * b
            if at + 1 < n and chain[at + 1] in dh:  # the map lists more than anchors (digests): search it
                held_by = dh[chain[_deepest(chain, at + 2, dh) - 1]]
            else:
                held_by = dh[chain[at]]
                if len(held_by) > 1 and at + 1 < n:  # who of them holds the most past the anchor
                    end, digests = min(n, at + b), self._digest
                    depth = {r: _deepest(chain, at + 1, digests[r], end) for r in islice(held_by, _RANKED)}
                    most = max(depth.values())
                    held_by = [r for r, d in depth.items() if d == most]
            k = 0
            for r in held_by:
                if k == limit:
                    break
                if r not in found:
                    found.append(r)
                    k += 1
        return tuple(found)

    def replicas(self) -> set[str]:
        """Replicas this index knows anything about."""
        return set(self._own) | set(self._digest)

    def own_roots(self, replica_id: str) -> int:
        return len(self._own.get(replica_id, ()))
