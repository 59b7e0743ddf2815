"""The prefix tree's routing events: the chained hash of each node it stores or evicts, at most
`route_chunks` deep, and each such node's tier changes, into a ChunkLog (chunkserve/router/events.py;
DESIGN §3). A node deeper than `eager_depth` (EAGER_DEPTH) is published once a request reuses it
(`reused`: a match, a duplicate computed): a long shared prompt (a tenant's system prompt past
2048 tokens, a conversation's history) is routable in full, where every prompt's own tail (its
question, its reply), used once, is not published at all: the events cost what they did with
everything at most `eager_depth` deep (chunkserve/router/tools/records, bench-events).

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

from collections.abc import Iterable

from chunkserve.replicas.engine.prefix_tree import HOST, Node, PrefixTree
from chunkserve.router.events import ChunkLog, Events, PublishConfig
from chunkserve.router.hashing import cache_seed, chunk_hashes


class RouteEvents:
    """Attached to `tree` (tree.events): records from now on, starting with what it holds."""

    def __init__(self, tree: PrefixTree, seed: int, publish_config: PublishConfig):
        self.tree, self.seed = tree, seed
        cfg = publish_config
        self.max_depth, self.eager_depth, self.anchor_every = cfg.max_depth, cfg.eager_depth, cfg.anchor_every
        self.log = ChunkLog(cfg.max_delta)
        # hashes made (a child's chain needs its parent's) but not published: deeper than
        # eager_depth and not reused yet; hash -> (depth, seed)
        self._latent: dict[int, tuple[int, int]] = {}
        tree.use_hash_seed(seed)
        self._store_all()

    def stored(self, node: Node, parent: Node) -> None:
        """`node` entered the tree under `parent` (or is listed at a restart, in its tier)."""
        if parent.chunk_id < 0:  # a root: the chain starts at its salt's seed
            depth, seed, after = 1, cache_seed(self.seed, self.tree.salt_of(parent)), None
        else:
            h = parent.hash
            tag = None if h is None else self.log.held.get(h) or self._latent.get(h)
            if tag is None or tag[0] >= self.max_depth:  # below the routed depth
                return
            depth, seed, after = tag[0] + 1, tag[1], h
        h = node.hash = chunk_hashes(node.tokens, self.tree.c, 1, seed, after=after)[0]
        if depth <= self.eager_depth:
            self.log.stored(h, (depth, seed), node.tier == HOST, (depth - 1) % self.anchor_every == 0)
        else:
            self._latent[h] = (depth, seed)

    def reused(self, path: Iterable[Node]) -> None:
        """A request reuses `path` (top-down, from a root's child, or one node whose parent is
        on its own path): its latent nodes are published, each once its parent is (the set stays
        prefix-closed)."""
        latent = self._latent
        if not latent:
            return
        held = self.log.held
        for n in path:
            h = n.hash
            if h is None:  # below the routed depth: so is the rest
                return
            tag = latent.get(h)
            if tag is None:
                continue
            if n.parent is None or n.parent.hash not in held:  # (its parent latent too: not on this path)
                return
            del latent[h]
            self.log.stored(h, tag, n.tier == HOST, (tag[0] - 1) % self.anchor_every == 0)

    def evicted(self, node: Node) -> None:
        """`node` left the tree."""
        h = node.hash
        if h is not None:
            if h in self.log.held:
                self.log.evicted(h)
            else:
                self._latent.pop(h, None)

    def moved(self, node: Node) -> None:
        """`node` changed tier (now `node.tier`)."""
        if node.hash is not None and node.hash in self.log.held:
            self.log.moved(node.hash, node.tier == HOST)

    def restart(self) -> None:
        """The pool was reset: a new epoch, holding what the tree still holds (deep nodes latent
        again until reused)."""
        self.log.reset()
        self._latent.clear()
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
