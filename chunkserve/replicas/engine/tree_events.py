"""The prefix tree's routing events: the chained hash of each node it stores or evicts, at most
`route_chunks` deep, and each such node's tier changes, into a ChunkLog (chunkserve/router/events.py;
DESIGN §3).

The tree calls `stored` at its one insertion point, `evicted` at its one eviction point, and
`moved` where a node changes tier (a spill to the host tier, a load or a recompute back to the GPU)
(PrefixTree.events). A node's hash is made once, when it is stored, from its parent's (kept on
the node, `Node.hash`), and the log keeps each held hash's (depth, seed), so a change costs one
xxh3 call and O(1) dict work: events cost O(changes), never a walk of the tree. The nodes at
depths 1, 1 + anchor_every, ... are published as anchors (chunkserve/router/events.py). The hashes are
the ingress's (chunkserve/router/hashing.chunk_hashes, seeded by the served model and each tree's
cache salt), so the router matches prompts against them directly.
"""

from __future__ import annotations

from chunkserve.replicas.engine.prefix_tree import HOST, Node, PrefixTree
from chunkserve.router.events import ANCHOR_EVERY, MAX_DELTA, ChunkLog, Events
from chunkserve.router.hashing import cache_seed, chunk_hashes


class RouteEvents:
    """Attached to `tree` (tree.events): records from now on, starting with what it holds."""

    def __init__(
        self, tree: PrefixTree, seed: int, max_depth: int, max_delta: int = MAX_DELTA, anchor_every: int = ANCHOR_EVERY
    ):
        self.tree, self.seed, self.max_depth, self.anchor_every = tree, seed, max_depth, anchor_every
        self.log = ChunkLog(max_delta)
        tree.use_hash_seed(seed)
        self._store_all()

    def stored(self, node: Node, parent: Node) -> None:
        """`node` entered the tree under `parent` (or is listed at a restart, in its tier)."""
        if parent.chunk_id < 0:  # a root: the chain starts at its salt's seed
            depth, seed, after = 1, cache_seed(self.seed, self.tree.salt_of(parent)), None
        else:
            tag = self.log.held.get(parent.hash) if parent.hash is not None else None
            if tag is None or tag[0] >= self.max_depth:  # below the routed depth
                return
            depth, seed, after = tag[0] + 1, tag[1], parent.hash
        h = node.hash = chunk_hashes(node.tokens, self.tree.c, 1, seed, after=after)[0]
        self.log.stored(h, (depth, seed), node.tier == HOST, (depth - 1) % self.anchor_every == 0)

    def evicted(self, node: Node) -> None:
        """`node` left the tree."""
        if node.hash is not None and node.hash in self.log.held:
            self.log.evicted(node.hash)

    def moved(self, node: Node) -> None:
        """`node` changed tier (now `node.tier`)."""
        if node.hash is not None and node.hash in self.log.held:
            self.log.moved(node.hash, node.tier == HOST)

    def restart(self) -> None:
        """The pool was reset: a new epoch, holding what the tree still holds."""
        self.log.reset()
        self._store_all()

    def take(self) -> Events | None:
        """The changes since the last take (chunkserve/router/events.ChunkLog.take)."""
        return self.log.take()

    def _store_all(self) -> None:
        level = [(root, n) for root in self.tree.roots.values() for n in root.children.values()]
        for _ in range(self.max_depth):  # parents before children
            if not level:
                break
            for parent, n in level:
                self.stored(n, parent)
            level = [(n, child) for _, n in level for child in n.children.values()]
