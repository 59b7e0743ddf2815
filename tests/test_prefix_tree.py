"""PrefixTree + KVPool on their own: matching, sharing, dedup, LRU retention and eviction."""

import pytest
import torch

from chunkserve.replicas.engine.kv_pool import KVPool, KVShape
from chunkserve.replicas.engine.prefix_tree import PrefixTree
from chunkserve.replicas.engine.sequence import SamplingParams, Sequence, Tenancy
from chunkserve.router.hashing import cache_seed, chunk_hashes, model_seed

C = 4


def make_tree(num_chunks=8):
    pool = KVPool(
        KVShape(num_layers=1, num_kv_heads=1, chunk_size=C, head_dim=2, dtype=torch.float32), num_chunks, "cpu"
    )
    return PrefixTree(pool)


def fill(tree, seq, now=1):
    """Give `seq` computed K/V for all its tokens, inserting its full chunks as the engine does."""
    n_chunks = -(-seq.num_tokens // C)
    while seq.num_chunks < n_chunks:
        seq.private.append(tree.alloc())
    seq.num_computed = seq.num_tokens
    while seq.private and (len(seq.nodes) + 1) * C <= seq.num_computed:
        k = len(seq.nodes)
        parent = seq.nodes[-1] if seq.nodes else tree.root_for(seq.tenancy.cache_salt)
        seq.nodes.append(tree.insert(parent, tuple(seq.token_ids[k * C : (k + 1) * C]), seq.private.pop(0), now))


def seq(rid, tokens, salt=None):
    return Sequence(rid, list(tokens), SamplingParams(), 0, tenancy=Tenancy(cache_salt=salt))


def finish(tree, s, now=2):
    tree.release(s.nodes, now)
    for cid in s.private:
        tree.pool.free(cid)
    s.nodes, s.private = [], []


def test_match_share_and_dedup():
    tree = make_tree()
    a, b = seq("a", range(10)), seq("b", range(10))  # 2 full chunks + a tail of 2
    fill(tree, a)
    fill(tree, b)  # computed concurrently: its full chunks are duplicates of a's
    tree.check([a, b])
    assert [n.id for n in a.nodes] == [n.id for n in b.nodes]
    assert a.nodes[0].ref == 2 and a.private != b.private  # tails stay private
    assert tree.pool.num_free == 8 - 2 - 2
    assert tree.match(list(range(10)), 9) == a.nodes
    assert tree.match(list(range(10)), 7) == a.nodes[:1]  # capped by max_tokens
    assert tree.match([0, 1, 2, 9, 4], 5) == []


def test_retention_and_lru_eviction():
    tree = make_tree(num_chunks=4)
    a = seq("a", range(8))
    fill(tree, a)
    a_chunks = a.chunk_table
    finish(tree, a, now=2)
    b = seq("b", range(100, 108))
    fill(tree, b, now=3)
    finish(tree, b, now=4)
    tree.check([])
    assert tree.num_cached == 4 and tree.pool.num_free == 0
    # a's chunks are older: the next allocations evict a's leaf, then a's root chunk
    cid = tree.alloc()
    assert cid == a_chunks[1]
    tree.pool.free(cid)
    assert tree.match(list(range(8)), 8) and len(tree.match(list(range(8)), 8)) == 1
    assert len(tree.match(list(range(100, 108)), 8)) == 2
    assert tree.evict_all() == 3 and tree.pool.num_free == 4
    tree.check([])


def test_shared_node_is_not_evicted_while_referenced():
    tree = make_tree(num_chunks=3)
    a = seq("a", range(8))
    fill(tree, a)
    assert tree.num_available == 1
    tree.alloc()
    assert tree.alloc() is None  # a's chunks are live: nothing to evict


def test_check_catches_broken_invariants():
    tree = make_tree()
    a = seq("a", range(8))
    fill(tree, a)
    a.nodes[0].ref += 1
    with pytest.raises(AssertionError, match="ref"):
        tree.check([a])
    a.nodes[0].ref -= 1
    tree.check([a], decode_paths=[(a.nodes[0].id,), (a.nodes[0].id, a.nodes[1].id), (99,)])
    with pytest.raises(AssertionError, match="contiguous"):
        tree.check([a], decode_paths=[(a.nodes[0].id,), (99,), (a.nodes[0].id,)])
    leaked = tree.pool.alloc()
    with pytest.raises(AssertionError, match="leaked"):
        tree.check([a])
    tree.pool.free(leaked)


def test_pool_double_free_is_an_error():
    tree = make_tree()
    cid = tree.alloc()
    tree.pool.free(cid)
    with pytest.raises(RuntimeError, match="double free"):
        tree.pool.free(cid)


def test_salts_share_no_chunk_and_their_digests_differ():
    # the same tokens under no salt and two salts: three trees, no node shared, each matched only
    # under its own salt; the digest lists each tree's chain under its salt's seed, and the
    # unsalted tree's hashes are the ingress's unsalted ones (today's)
    tree = make_tree(num_chunks=12)
    tokens = range(10)
    seqs = [seq(f"s{i}", tokens, salt) for i, salt in enumerate([None, "a", "b"])]
    for s in seqs:
        fill(tree, s)
    tree.check(seqs)
    assert len({n.id for s in seqs for n in s.nodes}) == 6  # 2 chunks each, none shared
    for s in seqs:
        assert tree.match(list(tokens), 9, s.tenancy.cache_salt) == s.nodes
    assert tree.match(list(tokens), 9, "c") == []
    seed = model_seed("m")
    expected = {h for salt in (None, "a", "b") for h in chunk_hashes(list(tokens), C, 8, cache_seed(seed, salt))}
    assert set(tree.digest(seed, 8, 100)) == expected and len(expected) == 6
    assert chunk_hashes(list(tokens), C, 8, cache_seed(seed, None)) == chunk_hashes(list(tokens), C, 8, "m")
    for s in seqs:
        finish(tree, s)
    tree.check([])
    assert tree.evict_all() == 6 and set(tree.roots) == {None}  # salts' roots go with their chunks
    tree.check([])
