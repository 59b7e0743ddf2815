"""One router's approximate map  prompt chain -> replicas holding a prefix of it  (DESIGN §6).

Two sources, merged per replica:
  - own decisions: the chains this router sent to a replica, by root (first chunk hash), LRU-bounded
    per replica; they bridge the gap until the replica's next digest shows them.
  - digests: the set of chunk hashes a replica's prefix tree holds, published periodically and
    replaced wholesale, so evictions are learned. A digest snapshot taken at `as_of` supersedes
    every own record of that replica last refreshed at or before `as_of`: those are dropped.

A digest is prefix-closed along every chain (a tree node implies its ancestors), so the depth a
replica's digest holds is found by binary search over the chain; a recorded chain holds exactly its
own prefixes, so the depth from own records is the longest common prefix with one of them.

Costs: recording a prompt is O(1) dict work (the chain tuple is stored, not its hashes one by one);
digests keep an exact hash -> replicas reverse map, rebuilt off the request path when one arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


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


def _deepest(chain: Sequence[int], known: int, held) -> int:
    """The largest d with chain[d - 1] in `held`, given chain[known - 1] is. Digests are closed
    under ancestors, so membership is monotone along the chain: binary search."""
    lo, hi = known, len(chain)
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if chain[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixIndex:
    """roots_per_replica: prefixes (roots) remembered per replica; chains_per_root: distinct chains
    kept per (replica, root); holders_per_root: replicas remembered per root; roots: roots tracked."""

    def __init__(self, roots_per_replica: int = 4096, chains_per_root: int = 4, holders_per_root: int = 8,
                 roots: int = 1 << 16):
        self.roots_per_replica = roots_per_replica
        self.chains_per_root = chains_per_root
        self.holders_per_root = holders_per_root
        self.max_roots = roots
        # replica -> root -> (time last recorded, recent chains from that root); oldest first
        self._own: dict[str, OrderedDict[int, tuple[float, list[tuple[int, ...]]]]] = {}
        self._roots: OrderedDict[int, OrderedDict[str, None]] = OrderedDict()  # root -> recent replicas
        self._digest: dict[str, frozenset[int]] = {}  # replica -> its latest published hashes
        self._digest_holders: dict[int, set[str]] = {}  # hash -> replicas, reverse of _digest

    # -- writes ---------------------------------------------------------------------------------

    def record(self, replica_id: str, chain: tuple[int, ...], now: float) -> None:
        """This router just sent a prompt with chain `chain` to `replica_id`."""
        if not chain:
            return
        root = chain[0]
        holders = self._roots.get(root)
        if holders is None:
            holders = self._roots[root] = OrderedDict()
            if len(self._roots) > self.max_roots:
                self._roots.popitem(last=False)
        else:
            self._roots.move_to_end(root)
        holders[replica_id] = None
        holders.move_to_end(replica_id)
        if len(holders) > self.holders_per_root:
            holders.popitem(last=False)
        own = self._own.get(replica_id)
        if own is None:
            own = self._own[replica_id] = OrderedDict()
        entry = own.pop(root, None)
        if entry is None:
            chains = [chain]
        else:
            chains = entry[1]
            if chain not in chains:
                chains.append(chain)
                if len(chains) > self.chains_per_root:
                    del chains[0]
        own[root] = (now, chains)
        if len(own) > self.roots_per_replica:
            own.popitem(last=False)

    def replace_digest(self, replica_id: str, hashes: Iterable[int], as_of: float) -> None:
        """`replica_id` published the hashes its tree held at time `as_of` (this router's clock)."""
        new = frozenset(hashes)
        old = self._digest.get(replica_id, frozenset())
        holders = self._digest_holders
        for h in old - new:
            s = holders[h]
            s.discard(replica_id)
            if not s:
                del holders[h]
        for h in new - old:
            s = holders.get(h)
            if s is None:
                holders[h] = {replica_id}
            else:
                s.add(replica_id)
        self._digest[replica_id] = new
        own = self._own.get(replica_id)
        while own and next(iter(own.values()))[0] <= as_of:
            own.popitem(last=False)

    def remove_replica(self, replica_id: str) -> None:
        self._own.pop(replica_id, None)
        for holders in self._roots.values():
            holders.pop(replica_id, None)
        for h in self._digest.pop(replica_id, ()):
            s = self._digest_holders[h]
            s.discard(replica_id)
            if not s:
                del self._digest_holders[h]

    # -- reads ----------------------------------------------------------------------------------

    def depth(self, replica_id: str, chain: tuple[int, ...]) -> int:
        """How many leading hashes of `chain` `replica_id` is believed to hold."""
        if not chain:
            return 0
        best = 0
        own = self._own.get(replica_id)
        entry = own.get(chain[0]) if own else None
        if entry is not None:
            for c in entry[1]:
                d = common_prefix(chain, c)
                if d > best:
                    best = d
        digest = self._digest.get(replica_id)
        if best < len(chain) and digest and chain[best] in digest:  # it holds more than our records say
            best = _deepest(chain, best + 1, digest)
        return best

    def holders(self, chain: tuple[int, ...], limit: int) -> tuple[str, ...]:
        """Replicas that may hold a prefix of the chain: the ones most recently sent its root,
        then up to `limit` whose digest holds its longest digest-known prefix. Unverified: read
        `depth` for each."""
        if not chain:
            return ()
        found = list(self._roots.get(chain[0], ()))[::-1]  # most recent first
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
        return set(self._own) | set(self._digest) | {r for s in self._roots.values() for r in s}

    def own_roots(self, replica_id: str) -> int:
        return len(self._own.get(replica_id, ()))
