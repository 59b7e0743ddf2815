"""chunkserve/kernels/reference.py: partial attention, tree plans, TPP decode vs the dense oracle, prefill."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chunkserve.kernels import reference as ref
from chunkserve.kernels.reference import (
    Segment,
    attn_reduce,
    build_tree_plan,
    decode_attention_ref,
    gather_kv,
    partial_attn,
    prefill_attention_ref,
    tpp_decode_ref,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# output tolerance (atol = rtol) vs an fp32 oracle; fp16/bf16 differ by the final rounding
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
head_dims = pytest.mark.parametrize("head_dim", [64, 128])
gqa = pytest.mark.parametrize("groups", [1, 4, 8])
chunk_sizes = pytest.mark.parametrize("chunk_size", [16, 64])

HKV = 2  # KV heads in every test; Hq = groups * HKV


def _close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _softmax_attn(q, k, v, scale):
    """q: [..., M, D], k/v: [..., N, D] -> [..., M, D], fp32."""
    w = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(w, dim=-1), v.float())


# ---------------------------------------------------------------------------------------------
# partial_attn / attn_reduce
# ---------------------------------------------------------------------------------------------


@dtypes
@head_dims
@gqa
def test_partial_split_merge_equals_softmax(dtype, head_dim, groups):
    g = torch.Generator().manual_seed(0)
    m_rows, n_keys = 3 * groups, 77
    q = torch.randn(HKV, m_rows, head_dim, generator=g).to(dtype)
    k = torch.randn(HKV, n_keys, head_dim, generator=g).to(dtype)
    v = torch.randn(HKV, n_keys, head_dim, generator=g).to(dtype)
    scale = 1 / math.sqrt(head_dim)
    expected = _softmax_attn(q, k, v, scale)  # both sides fp32 from the same rounded inputs
    state = None
    for a, b in [(0, 20), (20, 21), (21, 64), (64, 77)]:
        part = partial_attn(q, k[:, a:b], v[:, a:b])
        assert all(x.dtype == torch.float32 for x in part)
        state = part if state is None else attn_reduce(*state, *part)
    o, m, n = state
    torch.testing.assert_close(o / n[..., None], expected, atol=1e-5, rtol=1e-5)
    w = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    torch.testing.assert_close(m, w.amax(-1))
    # the merge is order independent
    p1, p2 = partial_attn(q, k[:, :30], v[:, :30]), partial_attn(q, k[:, 30:], v[:, 30:])
    o12, _, n12 = attn_reduce(*p1, *p2)
    o21, _, n21 = attn_reduce(*p2, *p1)
    torch.testing.assert_close(o12 / n12[..., None], o21 / n21[..., None])


def test_partial_masked_empty_rows_and_reduce_identity():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, n, 64, generator=g) for n in (5, 9, 9))
    mask = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=-1)  # row 0 attends nothing
    o, m, n = partial_attn(q, k, v, 0.125, mask=mask)
    assert not any(x.isnan().any() for x in (o, m, n))
    assert torch.isneginf(m[:, 0]).all() and (n[:, 0] == 0).all() and (o[:, 0] == 0).all()
    assert torch.isfinite(m[:, 1:]).all()
    # masked rows agree with attending only the allowed keys
    want = _softmax_attn(q[:, 3:4], k[:, :3], v[:, :3], 0.125)[:, 0]
    torch.testing.assert_close(o[:, 3] / n[:, 3, None], want)
    # an empty state is the identity of attn_reduce, on either side and on both
    full = partial_attn(q, k, v, 0.125)
    empty = partial_attn(q, k[:, :0], v[:, :0], 0.125)
    assert torch.isneginf(empty[1]).all() and (empty[2] == 0).all()
    for merged in (attn_reduce(*full, *empty), attn_reduce(*empty, *full)):
        for got, want in zip(merged, full):
            torch.testing.assert_close(got, want)
    both = attn_reduce(*empty, *empty)
    assert not any(x.isnan().any() for x in both) and torch.isneginf(both[1]).all()


# ---------------------------------------------------------------------------------------------
# build_tree_plan on hand-made trees
# ---------------------------------------------------------------------------------------------


def _seg(i, j, ids, start):
    return Segment(i, j, tuple(ids), start)


def test_plan_three_level_tree():
    # c = 4. System prompt: chunks 10, 11 (all rows). Few-shot A: 20 (rows 0-2), B: 30, 31
    # (rows 3-4).
    # User turns below A: row 0 and row 1 share 40 then diverge; row 2 alone.
    c = 4
    tables = [
        [10, 11, 20, 40, 50],
        [10, 11, 20, 40, 51, 99],  # 99: reserved next chunk, past seq_len: ignored
        [10, 11, 20, 60],
        [10, 11, 30, 31, 70],
        [10, 11, 30, 31],
    ]
    lens = [18, 20, 14, 17, 16]
    plan = build_tree_plan(tables, lens, c)
    assert plan.seq_lens == tuple(lens)
    assert plan.segments == (
        _seg(0, 5, [10, 11], 0),
        _seg(0, 3, [20], 2),
        _seg(0, 2, [40], 3),
        _seg(3, 5, [30, 31], 2),
    )
    assert plan.private_chunks == ((50,), (51,), (60,), (70,), ())
    assert plan.private_lens == ((2,), (4,), (2,), (1,), ())
    assert plan.private_positions == ((4,), (4,), (3,), (4,), ())
    assert plan.row_segments() == ((0, 1, 2), (0, 1, 2), (0, 1), (0, 3), (0, 3))


def test_plan_partial_tails_single_row_and_no_sharing():
    plan = build_tree_plan([[3, 1, 2]], [40], 16)
    assert plan.segments == () and plan.private_chunks == ((3, 1, 2),)
    assert plan.private_lens == ((16, 16, 8),)

    plan = build_tree_plan([[0, 1], [2], [3, 4, 5]], [17, 16, 33], 16)
    assert plan.segments == ()
    assert plan.private_chunks == ((0, 1), (2,), (3, 4, 5))
    assert plan.private_lens == ((16, 1), (16,), (16, 16, 1))

    empty = build_tree_plan([], [], 16)
    assert empty.segments == () and empty.private_chunks == ()


def test_plan_shared_chunk_partial_for_one_row_is_private_for_it():
    c = 8
    # chunk 7 at position 1: full for rows 0 and 1, partial for row 2 (which reads 3 tokens of it)
    plan = build_tree_plan([[5, 7, 8], [5, 7, 9], [5, 7]], [20, 17, 11], c)
    assert plan.segments == (_seg(0, 3, [5], 0), _seg(0, 2, [7], 1))
    assert plan.private_chunks == ((8,), (9,), (7,))
    assert plan.private_lens == ((4,), (1,), (3,))
    # two rows holding the same chunk, partial for both: nothing shared there
    plan = build_tree_plan([[5, 7], [5, 7]], [12, 13], c)
    assert plan.segments == (_seg(0, 2, [5], 0),)
    assert plan.private_chunks == ((7,), (7,)) and plan.private_lens == ((4,), (5,))
    # partial row in the middle of the run cuts it into two single rows: all private
    plan = build_tree_plan([[7], [7], [7]], [8, 3, 8], c)
    assert plan.segments == () and plan.private_lens == ((8,), (3,), (8,))


def test_plan_same_range_nonconsecutive_positions_are_separate_segments():
    # rows 0-1 share positions 0 and 2 but not 1 (not a tree, still a valid plan)
    plan = build_tree_plan([[1, 2, 4], [1, 3, 4]], [12, 12], 4)
    assert plan.segments == (_seg(0, 2, [1], 0), _seg(0, 2, [4], 2))
    assert plan.private_chunks == ((2,), (3,))


def test_plan_rejects_non_contiguous_and_short_tables():
    with pytest.raises(ValueError, match="non-contiguous"):
        build_tree_plan([[1, 2], [3, 4], [1, 5]], [8, 8, 8], 4)
    # a row that stops before the shared chunk also breaks its contiguity
    with pytest.raises(ValueError, match="non-contiguous"):
        build_tree_plan([[1, 2], [1], [1, 2]], [8, 4, 8], 4)
    with pytest.raises(ValueError, match="cannot hold"):
        build_tree_plan([[1, 2]], [9], 4)
    with pytest.raises(ValueError):
        build_tree_plan([[1]], [4, 4], 4)


# ---------------------------------------------------------------------------------------------
# Random prefix trees (hypothesis)
# ---------------------------------------------------------------------------------------------


@st.composite
def prefix_forests(draw, chunk_size, max_rows=40):
    """A DFS-ordered decode batch over a random prefix tree of depth >= 3.

    Returns (chunk_tables, seq_lens, num_chunks); chunk ids are a random permutation so that
    tables are not sequential. Internal nodes own 1-2 full chunks; leaves (rows) add 0-2 private
    full chunks and a partial tail; some rows end at an internal node, exactly at its end (no
    private chunk at all) or inside its last chunk (shared chunk partial for that row); some
    tables carry a reserved next chunk past seq_len.
    """
    c = chunk_size
    tables: list[list[int]] = []
    lens: list[int] = []
    counter = [0]

    def new_ids(k):
        counter[0] += k
        return list(range(counter[0] - k, counter[0]))

    def add_row(table, n):
        if n == 0:
            return
        if draw(st.integers(0, 4)) == 0:
            table = table + new_ids(1)  # reserved next chunk
        tables.append(table)
        lens.append(n)

    def grow(prefix, level):
        if len(tables) >= max_rows:
            return
        if level < 3 or (level < 5 and draw(st.booleans())):
            node = prefix + new_ids(draw(st.integers(1, 2)))
            if draw(st.integers(0, 3)) == 0:  # a row ending at (or inside the last chunk of) node
                add_row(node, len(node) * c - draw(st.sampled_from([0, 0, 1, c // 2, c - 1])))
            for _ in range(draw(st.integers(1, 3))):
                grow(node, level + 1)
        else:
            extra = draw(st.integers(0, 2))
            tail = draw(st.integers(0, c - 1))
            table = prefix + new_ids(extra + (tail > 0))
            add_row(table, (len(prefix) + extra) * c + tail)

    for _ in range(draw(st.integers(1, 2))):  # one or two roots
        grow([], 0)
    if not tables:
        tables, lens = [new_ids(1)], [1]
    perm = draw(st.permutations(range(counter[0])))
    tables = [[perm[x] for x in t] for t in tables]
    return tables, lens, counter[0]


def _check_plan_covers(plan, tables, lens, c):
    covered = {}
    for s in plan.segments:
        assert s.row_end - s.row_start >= 2 and s.chunk_ids
        for r in range(s.row_start, s.row_end):
            for off, cid in enumerate(s.chunk_ids):
                p = s.chunk_start + off
                assert tables[r][p] == cid and (p + 1) * c <= lens[r]
                assert (r, p) not in covered
                covered[(r, p)] = c
    for r, (ids, plens) in enumerate(zip(plan.private_chunks, plan.private_lens)):
        positions = [p for p in range(-(-lens[r] // c)) if (r, p) not in covered]
        assert ids == tuple(tables[r][p] for p in positions)
        assert plens == tuple(min(c, lens[r] - p * c) for p in positions)
        assert plan.private_positions[r] == tuple(positions)
    # segments of a tree nest or are disjoint
    for a in plan.segments:
        for b in plan.segments:
            ra, rb = (a.row_start, a.row_end), (b.row_start, b.row_end)
            disjoint = ra[1] <= rb[0] or rb[1] <= ra[0]
            nested = (ra[0] <= rb[0] and rb[1] <= ra[1]) or (rb[0] <= ra[0] and ra[1] <= rb[1])
            assert disjoint or nested


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), chunk_size=st.sampled_from([16, 64]))
def test_plan_properties_on_random_trees(data, chunk_size):
    tables, lens, _ = data.draw(prefix_forests(chunk_size))
    plan = build_tree_plan(tables, lens, chunk_size)
    _check_plan_covers(plan, tables, lens, chunk_size)


@dtypes
@head_dims
@gqa
@chunk_sizes
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_tpp_decode_matches_dense_on_random_trees(data, dtype, head_dim, groups, chunk_size):
    tables, lens, num_chunks = data.draw(prefix_forests(chunk_size))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    shape = (num_chunks + 2, HKV, chunk_size, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(len(tables), groups * HKV, head_dim, generator=g).to(dtype)
    plan = build_tree_plan(tables, lens, chunk_size)
    got = tpp_decode_ref(q, k_cache, v_cache, plan)
    want = decode_attention_ref(q, k_cache, v_cache, tables, lens)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, want, dtype)


def test_decode_oracle_matches_sdpa_and_scale():
    g = torch.Generator().manual_seed(2)
    c, d, groups = 16, 64, 4
    k_cache = torch.randn(10, HKV, c, d, generator=g)
    v_cache = torch.randn(10, HKV, c, d, generator=g)
    q = torch.randn(2, groups * HKV, d, generator=g)
    tables, lens = [[7, 2, 5], [3]], [40, 9]
    for scale in (None, 0.3):
        got = decode_attention_ref(q, k_cache, v_cache, tables, lens, sm_scale=scale)
        tpp = tpp_decode_ref(q, k_cache, v_cache, build_tree_plan(tables, lens, c), sm_scale=scale)
        for r in range(2):
            k = gather_kv(k_cache, tables[r], lens[r]).repeat_interleave(groups, 0)
            v = gather_kv(v_cache, tables[r], lens[r]).repeat_interleave(groups, 0)
            want = F.scaled_dot_product_attention(q[r][:, None], k, v, scale=scale)[:, 0]
            torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(tpp[r], want, atol=1e-5, rtol=1e-5)


def test_tpp_all_shared_rows_and_empty_batch():
    # every row ends exactly at a chunk boundary, so each reads only the shared segment
    g = torch.Generator().manual_seed(3)
    c, d = 16, 64
    k_cache, v_cache = (torch.randn(4, HKV, c, d, generator=g) for _ in range(2))
    tables, lens = [[1, 3]] * 3, [32] * 3
    q = torch.randn(3, HKV * 4, d, generator=g)
    plan = build_tree_plan(tables, lens, c)
    assert plan.segments == (_seg(0, 3, [1, 3], 0),) and plan.private_chunks == ((),) * 3
    torch.testing.assert_close(
        tpp_decode_ref(q, k_cache, v_cache, plan),
        decode_attention_ref(q, k_cache, v_cache, tables, lens),
        atol=1e-5,
        rtol=1e-5,
    )
    empty = tpp_decode_ref(q[:0], k_cache, v_cache, build_tree_plan([], [], c))
    assert empty.shape == (0, HKV * 4, d)


# ---------------------------------------------------------------------------------------------
# Prefill
# ---------------------------------------------------------------------------------------------


def _prefill_oracle(q, k_cache, v_cache, chunk_ids, context_len, groups):
    t = q.shape[0]
    total = context_len + t
    k = gather_kv(k_cache, chunk_ids, total).float().repeat_interleave(groups, 0)
    v = gather_kv(v_cache, chunk_ids, total).float().repeat_interleave(groups, 0)
    qpos = torch.arange(context_len, total)[:, None]
    mask = torch.arange(total)[None, :] <= qpos  # [T, total], bottom-right aligned
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)


@dtypes
@head_dims
@gqa
@chunk_sizes
@pytest.mark.parametrize("context_len,t_new", [(0, 37), (45, 1), (70, 29)])
def test_prefill_matches_sdpa(dtype, head_dim, groups, chunk_size, context_len, t_new):
    g = torch.Generator().manual_seed(context_len * 131 + t_new)
    total = context_len + t_new
    n = -(-total // chunk_size)
    num_chunks = n + 3
    chunk_ids = torch.randperm(num_chunks, generator=g)[:n].tolist()  # non-sequential order
    k_cache = torch.randn(num_chunks, HKV, chunk_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_chunks, HKV, chunk_size, head_dim, generator=g).to(dtype)
    q = torch.randn(t_new, groups * HKV, head_dim, generator=g).to(dtype)
    got = prefill_attention_ref(q, k_cache, v_cache, chunk_ids, context_len)
    assert got.dtype == dtype and got.shape == q.shape
    _close(got, _prefill_oracle(q, k_cache, v_cache, chunk_ids, context_len, groups), dtype)


def test_prefill_query_tiling(monkeypatch):
    # force many small query tiles (incl. a ragged last one) and a custom scale
    monkeypatch.setattr(ref, "_PREFILL_TILE_ELEMS", 8 * 100 * 7)
    g = torch.Generator().manual_seed(4)
    c, d, groups, context_len, t_new = 16, 64, 4, 50, 50
    k_cache, v_cache = (torch.randn(8, HKV, c, d, generator=g) for _ in range(2))
    chunk_ids = [6, 0, 3, 7, 1, 5, 2]
    q = torch.randn(t_new, groups * HKV, d, generator=g)
    got = prefill_attention_ref(q, k_cache, v_cache, chunk_ids, context_len, sm_scale=0.2)
    q_rescaled = q * (0.2 * math.sqrt(d))  # the oracle uses the default 1/sqrt(d)
    want = _prefill_oracle(q_rescaled, k_cache, v_cache, chunk_ids, context_len, groups)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the last query token is a decode step: same as the dense decode oracle
    total = context_len + t_new
    dec = decode_attention_ref(q[-1:], k_cache, v_cache, [chunk_ids], [total], sm_scale=0.2)
    torch.testing.assert_close(got[-1:], dec, atol=1e-5, rtol=1e-5)


def test_gather_kv():
    cache = torch.arange(5 * 2 * 4 * 3, dtype=torch.float32).view(5, 2, 4, 3)
    out = gather_kv(cache, [3, 1, 4], 6)
    assert out.shape == (2, 6, 3)
    torch.testing.assert_close(out[:, :4], cache[3])
    torch.testing.assert_close(out[:, 4:], cache[1][:, :2])
    assert gather_kv(cache, [], 0).shape == (2, 0, 3)
    with pytest.raises(ValueError):
        gather_kv(cache, [3], 5)
