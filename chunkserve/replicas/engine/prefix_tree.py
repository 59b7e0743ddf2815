"""The prefix tree of KV chunks (PAKV, ChunkAttention; DESIGN §6).

A node is one full chunk of `c` tokens holding computed K/V; root-to-node paths are token
prefixes, so a prefix shared by many sequences is stored once. Only full, computed chunks enter
the tree; a sequence's partial tail stays private to it (`Sequence.private`). Nodes whose
refcount drops to 0 stay as an LRU cache and are evicted leaf-first under pressure.

With a host tier (`HostPool`) a node lives in one of two tiers (`Node.tier`): GPU, its chunk id
the GPU pool's, or HOST, its chunk id the host pool's. The GPU pool's eviction then spills its
least recently used ref-0 node with no GPU child to the host pool: the node stays in the tree,
still matched, and a request that matches it copies it back (`load`) instead of recomputing it.
The host pool evicts its own least recently used leaf, which is the real removal (`_remove`).
On every path the GPU nodes come first, the host nodes after: a host node has no live sequence
and only host children.

A spill's copy holds up the step that evicts: its kernels may write the freed id. So while the
GPU pool runs short (fewer free chunks than `write_ahead`), the tree copies the cached GPU nodes
next in line for eviction to host chunks ahead of time (`write_ahead()`, once a step; the copies
run beside the step's forward): such a node keeps its GPU chunk and holds a host one too
(`Node.backup`), and its eviction is then a change of tier with no copy. A node loaded back
keeps the host chunk it came from as its backup. A backup is a copy, the first thing a full host
tier gives up, before any chunk held only there (a lost copy costs a copy later, a lost host leaf
a recompute): those of nodes in use (ref > 0, not evicted soon) first, then, for a spill, those
of ref-0 nodes, newest first; a write-ahead takes only free chunks and backups of nodes in use.

Each cache salt (`Sequence.tenancy.cache_salt`: a tenant's namespace, or a request's
`cache_salt`) roots a tree of its own, so sequences of different salts never share a node, never
match each other's chunks and never count them as cached; the unsalted root (`root`) is today's
shared tree. A salt's root goes once its last chunk is evicted (DESIGN §2).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from chunkserve.replicas.engine.kv_pool import HostPool, KVPool
from chunkserve.replicas.engine.sequence import Sequence
from chunkserve.router.hashing import cache_seed, chunk_hashes

if TYPE_CHECKING:
    from chunkserve.replicas.engine.tree_events import RouteEvents  # (which imports this module)

GPU, HOST = 0, 1  # Node.tier: where its chunk id points (the GPU pool, the host pool)


class Node:
    __slots__ = (
        "id",
        "tokens",
        "chunk_id",
        "parent",
        "children",
        "ref",
        "last_use",
        "hash",
        "tier",
        "gpu_children",
        "backup",
    )

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
        self.tier = GPU  # GPU or HOST: which pool chunk_id is of (a digest may carry it)
        self.gpu_children = 0  # children in the GPU tier (a ref-0 GPU node without any may spill)
        self.backup = -1  # a GPU node's host chunk holding a copy of its K/V (-1: none)

    def __repr__(self):
        tier = "host" if self.tier == HOST else "gpu"
        return f"Node(id={self.id}, {tier} chunk={self.chunk_id}, ref={self.ref}, children={len(self.children)})"


class PrefixTree:
    def __init__(self, pool: KVPool, host: HostPool | None = None, write_ahead: int = 0):
        """host: the host tier, where the GPU pool's evicted chunks go; None: evicted chunks go.
        write_ahead: with a host tier, the chunks to keep copied ahead of eviction while fewer
        than that are free (0: none; a spill then copies as it evicts)."""
        self.pool, self.host = pool, host
        self.write_ahead_chunks = write_ahead if host is not None else 0
        # GPU nodes with a backup, by node id in the order they got it (or were released): ref 0
        # (backed) and in use (held)
        self._backed: dict[int, Node] = {}
        self._held: dict[int, Node] = {}
        self._ahead_stale = True  # the eviction order's head may have changed since write_ahead
        # ids of the nodes loaded since the scheduler's step began: their copies run beside that
        # step, so no sequence holding one runs in it (Scheduler.schedule clears it)
        self.loading: set[int] = set()
        self.c = pool.chunk_size
        self.root = Node(0, (), -1, None)  # the unsalted tree's (chunk id -1: a root holds no chunk)
        self.roots: dict[str | None, Node] = {None: self.root}  # per cache salt
        self._salt_of: dict[int, str | None] = {0: None}  # a root's node id -> its salt
        self._next_id = 1
        self.num_cached = 0  # GPU nodes with ref 0 (evictable, possibly after their children)
        self.num_host = 0  # nodes in the host tier (all ref 0)
        # lazy min-heap of (last_use, id, node) over ref-0 GPU nodes without GPU children (leaves
        # but for host children); stale entries skipped on pop
        self._evictable: list[tuple[int, int, Node]] = []
        self._host_evictable: list[tuple[int, int, Node]] = []  # the same over host leaves
        self._digest_seed: int | None = None  # the seed the nodes' cached hashes were made with
        # routing events (DESIGN §3): told of each store, eviction and change of tier
        self.events: RouteEvents | None = None

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
        in `salt`'s tree: its GPU nodes, then any host nodes (`load` brings them back)."""
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
        """GPU chunks a caller can obtain: free ones plus every cached (ref-0) GPU node."""
        return self.pool.num_free + self.num_cached

    # -- refcounts ------------------------------------------------------------------------
    def acquire(self, path: Seq[Node], now: int) -> None:
        """A sequence takes `path` (matched GPU nodes, top-down; or a node computed twice)."""
        for n in path:
            assert n.tier == GPU, f"{n} is in the host tier: load it"
            if n.ref == 0:
                self.num_cached -= 1
                self._ahead_stale = True
                if n.backup >= 0:
                    self._held[n.id] = self._backed.pop(n.id)
            n.ref += 1
            n.last_use = now
        if self.events is not None:  # reused: a deep node is routable from now on
            self.events.reused(path)

    def release(self, path: Seq[Node], now: int) -> None:
        for n in reversed(path):  # leaf first, so a parent sees its child's final state
            n.ref -= 1
            n.last_use = now
            if n.ref == 0:
                self.num_cached += 1
                if n.backup >= 0:
                    self._backed[n.id] = self._held.pop(n.id)
                if not n.gpu_children:
                    self._push_evictable(n)

    def touch(self, path: Seq[Node], now: int) -> None:
        """Mark `path`'s nodes (a waiting sequence's match, made earlier; of either tier) used
        `now`, so that the chunks a queued request will match are evicted after those nobody
        waits for (the scheduler, for the head of its queue). Nodes evicted since the match go
        leaf first, so they are a suffix of `path`: the walk stops at the first."""
        for n in path:
            if n.parent is None:
                return
            if n.last_use == now:
                continue
            n.last_use = now
            if n.ref:
                continue
            if n.tier == GPU:
                if not n.gpu_children:  # its heap entry went stale with last_use: a new one
                    self._push_evictable(n)
            elif not n.children:
                self._push_host_evictable(n)

    def load(self, nodes: Seq[Node], now: int) -> int:
        """Bring host nodes back into GPU chunks for one sequence (which then holds a ref on
        each): `nodes` a run of a matched path below its GPU nodes (acquired already), top-down.
        Each takes a GPU chunk (`alloc`: its eviction may spill other nodes, whose host chunks
        may evict host leaves) and queues its copy (`HostPool.load`). Returns how many came back:
        a prefix of `nodes`, short where no GPU chunk was left or the host tier evicted a node
        meanwhile (the run is made the host's most recent first, so that takes a host tier
        holding little else)."""
        assert self.host is not None
        for n in nodes:
            n.last_use = now
            if not n.children:
                self._push_host_evictable(n)
        loaded = 0
        for n in nodes:
            cid = self.alloc()
            if cid is not None and n.parent is None:  # evicted from the host tier by that alloc
                self.pool.free(cid)
                cid = None
            if cid is None:
                break
            self.host.load(n.chunk_id, cid)
            self.loading.add(n.id)
            self.num_host -= 1
            n.backup, self._held[n.id] = n.chunk_id, n  # (its host chunk kept: a copy, its backup)
            n.tier, n.chunk_id, n.ref, n.last_use = GPU, cid, 1, now
            n.parent.gpu_children += 1
            loaded += 1
            if self.events is not None:
                self.events.moved(n)
        if loaded and self.events is not None:  # (a load is a reuse)
            self.events.reused(nodes[:loaded])
        return loaded

    # -- growth -----------------------------------------------------------------------------
    def insert(self, parent: Node, tokens: tuple[int, ...], chunk_id: int, now: int) -> Node:
        """Add a computed full chunk under `parent` for one sequence (which then holds a ref).

        If `parent` already has an identical chunk (computed concurrently by another sequence,
        or cached), ours is a duplicate: it is freed and the existing node is shared instead.
        """
        assert len(tokens) == self.c and (parent.chunk_id < 0 or parent.ref > 0)
        existing = parent.children.get(tokens)
        if existing is not None and existing.tier == HOST:  # ours is on the GPU already: its copy goes
            self.host.free(existing.chunk_id)
            self.num_host -= 1
            existing.tier, existing.chunk_id, existing.ref, existing.last_use = GPU, chunk_id, 1, now
            parent.gpu_children += 1
            if self.events is not None:
                self.events.moved(existing)
            return existing
        if existing is not None:
            self.pool.free(chunk_id)
            self.acquire((existing,), now)
            return existing
        node = Node(self._next_id, tokens, chunk_id, parent)
        self._next_id += 1
        node.ref, node.last_use = 1, now
        parent.children[tokens] = node
        parent.gpu_children += 1
        if self.events is not None:  # routing events: the one insertion point
            self.events.stored(node, parent)
        return node

    def alloc(self) -> int | None:
        """A free GPU chunk id, evicting (spilling, with a host tier) the least recently used
        cached GPU leaf if need be."""
        if self.pool.num_free == 0 and not self._evict_one():
            return None
        return self.pool.alloc()

    # -- eviction ---------------------------------------------------------------------------
    def _push_evictable(self, node: Node) -> None:
        self._ahead_stale = True
        heapq.heappush(self._evictable, (node.last_use, node.id, node))
        if len(self._evictable) > 4 * self.num_cached + 64:  # drop stale entries now and then
            self._evictable = [e for e in self._evictable if self._is_evictable(*e)]
            heapq.heapify(self._evictable)

    def _push_host_evictable(self, node: Node) -> None:
        heapq.heappush(self._host_evictable, (node.last_use, node.id, node))
        if len(self._host_evictable) > 4 * self.num_host + 64:
            self._host_evictable = [e for e in self._host_evictable if self._is_host_evictable(*e)]
            heapq.heapify(self._host_evictable)

    @staticmethod
    def _is_evictable(last_use: int, _id: int, node: Node) -> bool:
        return (
            node.parent is not None
            and node.tier == GPU
            and node.ref == 0
            and not node.gpu_children
            and node.last_use == last_use
        )

    @staticmethod
    def _is_host_evictable(last_use: int, _id: int, node: Node) -> bool:
        return node.parent is not None and node.tier == HOST and not node.children and node.last_use == last_use

    def _evict_one(self, spill: bool = True) -> bool:
        """Free one GPU chunk: the least recently used evictable GPU node's, spilled to the host
        tier where there is one (and `spill`), else removed (it has no children then)."""
        while self._evictable:
            entry = heapq.heappop(self._evictable)
            if not self._is_evictable(*entry):
                continue
            node = entry[2]
            if spill and self.host is not None:
                self._spill(node)  # (still in the tree, matched: a change of tier)
            else:
                self._remove(node)
            return True
        return False

    def _evict_host_one(self) -> bool:
        """Free one host chunk: remove the host tier's least recently used leaf."""
        while self._host_evictable:
            entry = heapq.heappop(self._host_evictable)
            if self._is_host_evictable(*entry):
                self._remove(entry[2])
                return True
        return False

    def _spill(self, node: Node) -> None:
        """A ref-0 GPU node with no GPU child into the host tier: its chunk copied (queued), its
        GPU chunk freed; the node stays, matched as before."""
        assert self.host is not None
        self._ahead_stale = True
        if node.backup >= 0:  # its copy was written ahead: no copy now
            hid = node.backup
            del self._backed[node.id]
            node.backup = -1
            self.host.spilled_ahead(node.chunk_id)
        else:
            hid = self._host_chunk(for_spill=True)
            assert hid is not None, "a full host tier has a leaf or a backup"
            self.host.spill(node.chunk_id, hid)
        self.pool.free(node.chunk_id)
        node.tier, node.chunk_id = HOST, hid
        self.num_cached -= 1
        self.num_host += 1
        if self.events is not None:  # routing events: the one spill point
            self.events.moved(node)
        if not node.children:
            self._push_host_evictable(node)
        parent = node.parent
        parent.gpu_children -= 1
        if parent.chunk_id >= 0 and parent.ref == 0 and not parent.gpu_children:
            self._push_evictable(parent)

    def _host_chunk(self, for_spill: bool) -> int | None:
        """A free host chunk id, made if need be by giving up a backup (a copy of a chunk still on
        the GPU: losing it costs a copy at that node's eviction), first the oldest of a node in
        use, then (`for_spill`) the newest of a ref-0 node, the one least likely to be evicted
        soon; and only where none is left (`for_spill`) the host tier's least recently used leaf,
        whose loss costs a recompute. None for a write-ahead that finds no free chunk or backup
        of a node in use: a copy ahead never costs a chunk held only in the host tier."""
        host = self.host
        if host.num_free == 0:
            if self._held:
                self._drop_backup(next(iter(self._held.values())))
            elif not for_spill:
                return None
            elif self._backed:
                self._drop_backup(next(reversed(self._backed.values())))
            elif not self._evict_host_one():
                return None
        return host.alloc()

    def _drop_backup(self, node: Node) -> None:
        self.host.free(node.backup)
        node.backup = -1
        del (self._held if node.ref else self._backed)[node.id]

    @property
    def num_backups(self) -> int:
        return len(self._backed) + len(self._held)

    def write_ahead(self) -> int:
        """While the GPU pool has fewer than `write_ahead_chunks` free, copy the next
        `write_ahead_chunks` GPU nodes in line for eviction that have no backup to host chunks,
        ahead of it; the engine calls it once a step, after scheduling and before the copies are
        flushed (a no-op unless the line changed). The line: the evictable leaves, least recently
        used first, each followed by the ancestors its eviction would make evictable (a finished
        prompt's chunks share its last use, so its whole chain goes before the next). A backup
        takes a free host chunk or one of a node in use's backup, nothing else (`_host_chunk`):
        with the host tier full, spills copy as they evict. Returns the copies queued."""
        want = self.write_ahead_chunks
        if not (want and self._ahead_stale) or self.pool.num_free >= want:
            return 0
        self._ahead_stale = False
        made = counted = 0
        seen, heap = [], self._evictable
        while heap and counted < want:
            entry = heapq.heappop(heap)
            if not self._is_evictable(*entry):
                continue
            seen.append(entry)
            node = entry[2]
            while True:  # the leaf, then its chain up while it would be the parent's last GPU child
                if node.backup < 0:
                    hid = self._host_chunk(for_spill=False)
                    if hid is None:
                        counted = want
                        break
                    self.host.write_ahead(node.chunk_id, hid)
                    node.backup, self._backed[node.id] = hid, node
                    made += 1
                counted += 1
                up = node.parent
                if counted >= want or up.chunk_id < 0 or up.tier != GPU or up.ref or up.gpu_children != 1:
                    break
                node = up
        for entry in seen:
            heapq.heappush(heap, entry)
        return made

    def _remove(self, node: Node) -> None:
        """Take a childless ref-0 node out of the tree and free its chunk (in its tier): the one
        place a chunk leaves the tree."""
        parent = node.parent
        del parent.children[node.tokens]
        node.parent = None
        if self.events is not None:  # routing events: the one eviction point
            self.events.evicted(node)
        if node.tier == HOST:
            self.host.free(node.chunk_id)
            self.num_host -= 1
        else:
            if node.backup >= 0:
                self._drop_backup(node)
            self.pool.free(node.chunk_id)
            self.num_cached -= 1
            parent.gpu_children -= 1
        if parent.chunk_id < 0:
            if parent is not self.root and not parent.children:
                del self.roots[self._salt_of.pop(parent.id)]  # a salt's last chunk: its root goes too
        elif parent.tier == HOST:
            if not parent.children:
                self._push_host_evictable(parent)
        elif parent.ref == 0 and not parent.gpu_children:
            self._push_evictable(parent)

    def spill_all(self) -> int:
        """Spill every cached GPU chunk to the host tier, as far as its free chunks go (none of
        its own evicted); returns how many. Benchmarks make host-tier hits with it."""
        n = 0
        while self.host is not None and self.host.num_free and self._evict_one():
            n += 1
        return n

    def evict_all(self) -> int:
        """Drop every cached chunk, of both tiers; returns how many were freed."""
        n = 0
        while self._evict_host_one():
            n += 1
        while self._evict_one(spill=False):  # (no host node is left: the GPU ones have no children)
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
        # raises AssertionError naming the broken invariant of DESIGN §6
        live = list(live)
        owner: dict[int, object] = {}  # GPU chunk id -> its node or sequence
        host_owner: dict[int, object] = {}  # host chunk id -> its node
        host = self.host

        def own(cid: int, who: object, tier: int = GPU) -> None:
            pool, owners = (self.pool, owner) if tier == GPU else (host, host_owner)
            assert pool is not None, f"{who} in the host tier, but there is none"
            assert 0 <= cid < pool.num_chunks, f"chunk id {cid} out of range"
            assert not pool.is_free(cid), f"chunk {cid} used by {who} but on the free list"
            assert cid not in owners, f"chunk {cid} owned by both {owners[cid]} and {who}"
            owners[cid] = who

        refs: dict[int, int] = {}
        for s in live:
            parent = self.roots.get(s.tenancy.cache_salt) if s.nodes else None
            for i, n in enumerate(s.nodes):
                assert n.parent is parent, f"{s.request_id}: node {n.id} is not a child of its predecessor"
                assert n.tier == GPU, f"{s.request_id}: node {n.id} is in the host tier"
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
        cached = on_host = backups = 0
        for n in list(self.roots.values()) + self.nodes():
            on_gpu = sum(ch.tier == GPU for ch in n.children.values())
            assert n.gpu_children == on_gpu, f"node {n.id}: gpu_children {n.gpu_children} but {on_gpu}"
            if n.chunk_id < 0:  # a root
                continue
            own(n.chunk_id, f"node {n.id}", n.tier)
            assert len(n.tokens) == self.c and n.parent.children.get(n.tokens) is n, f"node {n.id} misfiled"
            assert n.ref == refs.get(n.id, 0), f"node {n.id}: ref {n.ref} but {refs.get(n.id, 0)} live sequences"
            if n.tier == HOST:
                assert n.ref == 0 and not on_gpu, f"node {n.id}: in the host tier with a sequence or a GPU child"
                on_host += 1
            if n.backup >= 0:
                listed = self._held if n.ref else self._backed
                assert n.tier == GPU, f"node {n.id}: a backup but in the host tier"
                assert listed.get(n.id) is n, f"node {n.id}: a backup not on its list"
                own(n.backup, f"backup of node {n.id}", HOST)
                backups += 1
            cached += n.tier == GPU and n.ref == 0
        assert cached == self.num_cached, f"num_cached {self.num_cached} but {cached} ref-0 GPU nodes"
        assert on_host == self.num_host, f"num_host {self.num_host} but {on_host} host nodes"
        assert backups == self.num_backups, f"{self.num_backups} backups listed but {backups} kept"
        assert len(owner) + self.pool.num_free == self.pool.num_chunks, "chunks leaked: neither free nor owned"
        if host is not None:
            assert len(host_owner) + host.num_free == host.num_chunks, "host chunks leaked: neither free nor owned"
            # every copy decided is issued before a kernel can run (LLMEngine.step flushes after scheduling)
            assert not host.pending, f"{len(host.pending)} host copies decided but not issued"
        # decode batch in DFS order: each node's rows form one contiguous range
        rows: dict[int, list[int]] = {}
        for r, path in enumerate(decode_paths):
            for nid in path:
                rows.setdefault(nid, []).append(r)
        for nid, rs in rows.items():
            assert rs[-1] - rs[0] + 1 == len(rs), f"node {nid}: decode rows {rs} not contiguous"
