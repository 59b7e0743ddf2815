"""The prefix tree of KV chunks (PAKV, ChunkAttention; DESIGN §3).

A node is one full chunk of `c` tokens holding computed K/V; root-to-node paths are token
prefixes, so a prefix shared by many sequences is stored once. Only full, computed chunks enter
the tree; a sequence's partial tail stays private to it (`Sequence.private`). Nodes whose
refcount drops to 0 stay as an LRU cache and are evicted leaf-first under pressure.

Each cache salt (`Sequence.tenancy.cache_salt`: a tenant's namespace, or a request's
`cache_salt`) roots a tree of its own, so sequences of different salts never share a node, never
match each other's chunks and never count them as cached; the unsalted root (`root`) is today's
shared tree. A salt's root goes once its last chunk is evicted (DESIGN §18).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from collections.abc import Sequence as Seq

from chunkserve.replicas.kv_pool import KVPool
from chunkserve.replicas.sequence import Sequence
from chunkserve.replicas.tree_events import RouteEvents
from chunkserve.router.hashing import cache_seed, chunk_hashes


class Node:
    __slots__ = ("id", "tokens", "chunk_id", "parent", "children", "ref", "last_use", "hash")

    def __init__(self, id: int, tokens: tuple[int, ...], chunk_id: int, parent: Node | None):
        self.id = id  # creation order: sorting paths of ids gives a DFS order
        self.tokens = tokens
        self.chunk_id = chunk_id
        self.parent = parent  # None once evicted (and for the root)
        self.children: dict[tuple[int, ...], Node] = {}
        self.ref = 0  # live sequences whose path runs through this node
        self.last_use = 0
        # chained chunk hash (chunkserve.router.hashing): made at insertion when routing events are
        # recorded (to route_chunks deep), else lazily for digests
        self.hash: int | None = None

    def __repr__(self):
        return f"Node(id={self.id}, chunk={self.chunk_id}, ref={self.ref}, children={len(self.children)})"


class PrefixTree:
    def __init__(self, pool: KVPool):
        self.pool = pool
        self.c = pool.chunk_size
        self.root = Node(0, (), -1, None)  # the unsalted tree's (chunk id -1: a root holds no chunk)
        self.roots: dict[str | None, Node] = {None: self.root}  # per cache salt
        self._salt_of: dict[int, str | None] = {0: None}  # a root's node id -> its salt
        self._next_id = 1
        self.num_cached = 0  # nodes with ref 0 (evictable, possibly after their children)
        # lazy min-heap of (last_use, id, node) over ref-0 leaves; stale entries skipped on pop
        self._evictable: list[tuple[int, int, Node]] = []
        self._digest_seed: int | None = None  # the seed the nodes' cached hashes were made with
        self.events: RouteEvents | None = None  # routing events (DESIGN §6): told of each store and eviction

    # -- lookups --------------------------------------------------------------------------
    def root_for(self, salt: str | None) -> Node:
        """The root of `salt`'s tree (made on first use)."""
        root = self.roots.get(salt)
        if root is None:
            root = self.roots[salt] = Node(self._next_id, (), -1, None)
            self._salt_of[root.id] = salt
            self._next_id += 1
        return root

    def match(self, token_ids: Seq[int], max_tokens: int, salt: str | None = None) -> list[Node]:
        """The longest cached path of full chunks covering at most `max_tokens` of `token_ids`,
        in `salt`'s tree."""
        node, c = self.roots.get(salt), self.c
        path: list[Node] = []
        if node is None:
            return path
        for k in range(min(max_tokens, len(token_ids)) // c):
            node = node.children.get(tuple(token_ids[k * c : (k + 1) * c]))
            if node is None:
                break
            path.append(node)
        return path

    @property
    def num_available(self) -> int:
        """Chunks a caller can obtain: free ones plus every cached (ref-0) node."""
        return self.pool.num_free + self.num_cached

    # -- refcounts ------------------------------------------------------------------------
    def acquire(self, path: Iterable[Node], now: int) -> None:
        for n in path:
            if n.ref == 0:
                self.num_cached -= 1
            n.ref += 1
            n.last_use = now

    def release(self, path: Seq[Node], now: int) -> None:
        for n in reversed(path):  # leaf first, so a parent sees its child's final state
            n.ref -= 1
            n.last_use = now
            if n.ref == 0:
                self.num_cached += 1
                if not n.children:
                    self._push_evictable(n)

    # -- growth -----------------------------------------------------------------------------
    def insert(self, parent: Node, tokens: tuple[int, ...], chunk_id: int, now: int) -> Node:
        """Add a computed full chunk under `parent` for one sequence (which then holds a ref).

        If `parent` already has an identical chunk (computed concurrently by another sequence,
        or cached), ours is a duplicate: it is freed and the existing node is shared instead.
        """
        assert len(tokens) == self.c and (parent.chunk_id < 0 or parent.ref > 0)
        existing = parent.children.get(tokens)
        if existing is not None:
            self.pool.free(chunk_id)
            self.acquire((existing,), now)
            return existing
        node = Node(self._next_id, tokens, chunk_id, parent)
        self._next_id += 1
        node.ref, node.last_use = 1, now
        parent.children[tokens] = node
        if self.events is not None:  # routing events: the one insertion point
            self.events.stored(node, parent)
        return node

    def alloc(self) -> int | None:
        """A free chunk id, evicting the least recently used cached leaf if need be."""
        if self.pool.num_free == 0 and not self._evict_one():
            return None
        return self.pool.alloc()

    # -- eviction ---------------------------------------------------------------------------
    def _push_evictable(self, node: Node) -> None:
        heapq.heappush(self._evictable, (node.last_use, node.id, node))
        if len(self._evictable) > 4 * self.num_cached + 64:  # drop stale entries now and then
            self._evictable = [e for e in self._evictable if self._is_evictable(*e)]
            heapq.heapify(self._evictable)

    @staticmethod
    def _is_evictable(last_use: int, _id: int, node: Node) -> bool:
        return node.parent is not None and node.ref == 0 and not node.children and node.last_use == last_use

    def _evict_one(self) -> bool:
        while self._evictable:
            entry = heapq.heappop(self._evictable)
            if not self._is_evictable(*entry):
                continue
            node = entry[2]
            parent = node.parent
            del parent.children[node.tokens]
            node.parent = None
            self.pool.free(node.chunk_id)
            self.num_cached -= 1
            if self.events is not None:  # routing events: the one eviction point
                self.events.evicted(node)
            if parent.chunk_id >= 0 and parent.ref == 0 and not parent.children:
                self._push_evictable(parent)
            elif parent.chunk_id < 0 and parent is not self.root and not parent.children:
                del self.roots[self._salt_of.pop(parent.id)]  # a salt's last chunk: its root goes too
            return True
        return False

    def evict_all(self) -> int:
        """Drop every cached chunk; returns how many were freed."""
        n = 0
        while self._evict_one():
            n += 1
        if self.events is not None:  # a pool reset: a new epoch of routing events
            self.events.restart()
        return n

    # -- routing digest ---------------------------------------------------------------------
    def digest(self, seed: int, max_depth: int, limit: int) -> list[int]:
        """Chained hashes (`chunkserve.router.hashing.chunk_hashes`, seeded by the served model and
        each tree's salt: `cache_seed`) of the cached paths up to `max_depth` chunks deep: level by
        level, most recently used first, so the list (and any prefix of it) holds every listed
        node's ancestors. At most `limit`."""
        self.use_hash_seed(seed)
        out: list[int] = []
        level = [(root, cache_seed(seed, salt)) for salt, root in self.roots.items()]
        depth = 0
        while level and depth < max_depth and len(out) < limit:
            below: list[tuple[Node, int]] = []
            for parent, s in level:
                for n in parent.children.values():
                    if n.hash is None:
                        after = None if parent.chunk_id < 0 else parent.hash
                        n.hash = chunk_hashes(n.tokens, self.c, 1, s, after=after)[0]
                    below.append((n, s))
            below.sort(key=lambda ns: -ns[0].last_use)
            out.extend(n.hash for n, _ in below[: limit - len(out)])
            level, depth = below, depth + 1
        return out

    def use_hash_seed(self, seed: int) -> None:
        """Nodes' hashes are `seed`'s from now on (those made with another are dropped); routing
        events fix it (their nodes' hashes are made once, at insertion)."""
        if seed != self._digest_seed:
            if self.events is not None:
                raise ValueError("the tree's hashes are its routing events' (seeded by the served model name)")
            for n in self.nodes():
                n.hash = None
            self._digest_seed = seed

    def salt_of(self, root: Node) -> str | None:
        return self._salt_of[root.id]

    # -- invariants -------------------------------------------------------------------------
    def nodes(self) -> list[Node]:
        out, stack = [], [n for root in self.roots.values() for n in root.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check(self, live: Iterable[Sequence], decode_paths: Seq[tuple[int, ...]] = ()) -> None:
        """`decode_paths`: the node-id paths of the last decode batch's rows, as scheduled."""
        # raises AssertionError naming the broken invariant of DESIGN §3
        live = list(live)
        owner: dict[int, object] = {}

        def own(cid: int, who: object) -> None:
            assert 0 <= cid < self.pool.num_chunks, f"chunk id {cid} out of range"
            assert not self.pool.is_free(cid), f"chunk {cid} used by {who} but on the free list"
            assert cid not in owner, f"chunk {cid} owned by both {owner[cid]} and {who}"
            owner[cid] = who

        refs: dict[int, int] = {}
        for s in live:
            parent = self.roots.get(s.tenancy.cache_salt) if s.nodes else None
            for i, n in enumerate(s.nodes):
                assert n.parent is parent, f"{s.request_id}: node {n.id} is not a child of its predecessor"
                assert n.tokens == tuple(s.token_ids[i * self.c : (i + 1) * self.c]), (
                    f"{s.request_id}: node {n.id} holds other tokens than the sequence"
                )
                refs[n.id] = refs.get(n.id, 0) + 1
                parent = n
            for cid in s.private:
                own(cid, s.request_id)
            assert len(s.chunk_table) * self.c >= s.num_computed, f"{s.request_id}: K/V beyond its chunks"
            assert len(s.nodes) * self.c <= s.num_computed, f"{s.request_id}: tree node not computed yet"
        for salt, root in self.roots.items():
            assert root.chunk_id < 0 and self._salt_of.get(root.id, 0) == salt, f"root of salt {salt!r} misfiled"
            assert root is self.root or root.children, f"salt {salt!r}: an empty root kept"
        cached = 0
        for n in self.nodes():
            own(n.chunk_id, f"node {n.id}")
            assert len(n.tokens) == self.c and n.parent.children.get(n.tokens) is n, f"node {n.id} misfiled"
            assert n.ref == refs.get(n.id, 0), f"node {n.id}: ref {n.ref} but {refs.get(n.id, 0)} live sequences"
            cached += n.ref == 0
        assert cached == self.num_cached, f"num_cached {self.num_cached} but {cached} ref-0 nodes"
        assert len(owner) + self.pool.num_free == self.pool.num_chunks, "chunks leaked: neither free nor owned"
        # decode batch in DFS order: each node's rows form one contiguous range
        rows: dict[int, list[int]] = {}
        for r, path in enumerate(decode_paths):
            for nid in path:
                rows.setdefault(nid, []).append(r)
        for nid, rs in rows.items():
            assert rs[-1] - rs[0] + 1 == len(rs), f"node {nid}: decode rows {rs} not contiguous"
