"""chunkserve.kernels.block_union: the block scores (Triton, under the interpreter on the CPU) against the
reference, the selection rules, the sparse reference's semantics against dense prefill over a
compacted cache, FlashInfer over the page lists (GPU), and the engine with sparse prefill."""

import dataclasses
import random

import pytest
import torch

from chunkserve.kernels import block_union
from chunkserve.kernels.block_union import (
    BlockUnion,
    block_keys,
    budget_blocks,
    budget_list_len,
    budget_lists,
    budget_pages,
    chunk_mask,
    normalised,
    select_blocks,
    subgroup_size,
)
from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.reference import block_scores_ref, prefill_attention_ref, sparse_prefill_ref
from chunkserve.replicas.engine.llm_engine import LLMEngine
from chunkserve.replicas.engine.sequence import SamplingParams

CUDA = torch.cuda.is_available()


def _cache(num_chunks, hkv, c, d, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    k = torch.randn(num_chunks, hkv, c, d, generator=g).to(device=device, dtype=dtype)
    v = torch.randn(num_chunks, hkv, c, d, generator=g).to(device=device, dtype=dtype)
    return k, v


@pytest.mark.parametrize(
    "t, hq, hkv, sub, d, block, nb",
    [
        (1, 4, 4, 1, 16, 16, 1),
        (37, 8, 2, 2, 32, 16, 5),
        (64, 4, 1, 4, 16, 32, 70),
        (50, 2, 2, 1, 64, 32, 17),
        (100, 8, 2, 4, 16, 16, 66),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spread, fold", [(1.0, "max"), (0.5, "sum"), (0.0, "max")])
def test_block_agg_matches_the_reference(t, hq, hkv, sub, d, block, nb, dtype, spread, fold):
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator(device="cpu").manual_seed(t + nb)
    q = (torch.randn(t, hq, d, generator=g) * 2).to(device=device, dtype=dtype)
    a, b = torch.randn(2, nb, hkv, d, generator=g) * 2
    bounds = torch.cat([a.maximum(b), a.minimum(b)], dim=-1).to(device)  # [max | min] per block
    got = block_union.block_agg(q, bounds, block, sub, None, spread, fold)
    scores = block_scores_ref(block_union.bound_queries(q, spread), bounds.to(dtype), block, d**-0.5)
    assert scores.shape == (hq, -(-t // block), nb)
    torch.testing.assert_close(scores.sum(-1), torch.ones_like(scores[..., 0]))
    want = normalised(scores, sub, fold)
    assert got.shape == (hq // sub, nb)
    atol = (2e-2 if dtype == torch.float16 else 1e-5) * (sub * -(-t // block) if fold == "sum" else 1)
    torch.testing.assert_close(got, want, atol=atol, rtol=1e-2)
    if fold == "max":  # every list holds some (head, query block)'s best (1 up to the GPU's division)
        torch.testing.assert_close(got.amax(1), torch.ones_like(got[:, 0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "t, hq, hkv, sub, block, span_qb, limits",
    [
        (64, 4, 2, 2, 16, 1, [3, 4, 5, 6]),  # spans of one query block, each seeing one more block
        (100, 8, 2, 4, 16, 2, [9, 9, 11, 11, 13, 13, 15]),  # spans of two, the last short
        (37, 2, 1, 1, 32, 1, [1, 2]),
    ],
)
@pytest.mark.parametrize("fold", ["max", "sum"])
def test_block_agg_of_spans_matches_the_reference(t, hq, hkv, sub, block, span_qb, limits, fold):
    """Each query block scores only the blocks its span sees, and folds into its span's lists."""
    device = "cuda" if CUDA else "cpu"
    d, nb = 32, max(limits)
    g = torch.Generator(device="cpu").manual_seed(t)
    q = (torch.randn(t, hq, d, generator=g) * 2).to(device)
    a, b = torch.randn(2, nb, hkv, d, generator=g) * 2
    bounds = torch.cat([a.maximum(b), a.minimum(b)], dim=-1).to(device)
    lim = torch.tensor(limits, dtype=torch.int32, device=device)
    got = block_union.block_agg(q, bounds, block, sub, None, 0.5, fold, lim, span_qb)
    scores = block_scores_ref(block_union.bound_queries(q, 0.5), bounds, block, d**-0.5, limits)
    for i, n in enumerate(limits):  # nothing past a query block's limit; its blocks sum to 1
        assert (scores[:, i, n:] == 0).all()
        torch.testing.assert_close(scores[:, i].sum(-1), torch.ones(hq, device=device))
    want = normalised(scores, sub, fold, span_qb)
    spans, e = -(-len(limits) // span_qb), hq // sub
    assert got.shape == want.shape == (spans * e, nb)
    torch.testing.assert_close(got, want, atol=1e-5 * sub * span_qb, rtol=1e-2)  # (a GPU's float32 dot: TF32)
    for j in range(spans):  # span j's lists: zero past what its query blocks see
        seen = max(limits[j * span_qb : (j + 1) * span_qb])
        assert (got[j * e : (j + 1) * e, seen:] == 0).all()
    with pytest.raises(ValueError, match="one per query block"):
        block_union.block_agg(q, bounds, block, sub, None, 0.5, fold, lim[1:], span_qb)


@pytest.mark.parametrize("stride", [2, 4])
def test_a_stride_scores_every_strideth_row_as_all_rows_would_alike(stride):
    """Rows alike within each run of `stride` score as all of them: the stride drops the rows a
    block's mean would count alike, from each query block's first (a short last one too)."""
    g = torch.Generator().manual_seed(stride)
    q = torch.randn(152 // stride, 4, 32, generator=g).repeat_interleave(stride, 0)  # 2 blocks and 24 rows
    a, b = torch.randn(2, 12, 2, 32, generator=g)
    bounds = torch.cat([a.maximum(b), a.minimum(b)], -1)
    cfg = BlockUnion(block=64, budget=0.2, window=1)
    every = block_union.block_scores(q, bounds, cfg, 2, 32**-0.5, [10, 11, 12])
    strided = block_union.block_scores(q, bounds, dataclasses.replace(cfg, stride=stride), 2, 32**-0.5, [10, 11, 12])
    torch.testing.assert_close(strided, every)
    q[1::stride] += 1.0  # rows the stride skips
    again = block_union.block_scores(q, bounds, dataclasses.replace(cfg, stride=stride), 2, 32**-0.5, [10, 11, 12])
    assert torch.equal(again, strided)
    with pytest.raises(ValueError, match="stride"):
        BlockUnion(block=32, stride=4)  # 8 rows a block
    with pytest.raises(ValueError, match="stride"):
        BlockUnion(stride=3)


@pytest.mark.parametrize("stride, span", [(1, None), (4, None), (2, 1), (4, "auto")])
def test_block_scores_gpu_is_block_scores(stride, span):
    """The engine's Triton scores (strided rows, packed heads, spans) are the plain-torch ones."""
    device = "cuda" if CUDA else "cpu"
    cfg = BlockUnion(block=64, budget=0.2, window=1, span=span, stride=stride)
    context, new, c = 2560, 200, 64  # 'auto': spans of 128 rows, the last short
    limits = block_union.query_limits(context, new, c, cfg)
    g = torch.Generator().manual_seed(stride)
    q = torch.randn(new, 8, 32, generator=g)
    a, b = torch.randn(2, max(limits), 2, 32, generator=g)
    bounds = torch.cat([a.maximum(b), a.minimum(b)], -1)
    want = block_union.block_scores(q, bounds, cfg, 4, 32**-0.5, limits, context)
    lim = torch.tensor(limits, dtype=torch.int32, device=device)
    got = block_union.block_scores_gpu(q.to(device), bounds.to(device), cfg, 4, 32**-0.5, lim, context)
    spans = len(block_union.piece_spans(context, new, cfg.span_rows(context)))
    assert got.shape == want.shape == (spans * 2, max(limits)) and (spans > 1 or span is None)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4 * 4 * len(limits), rtol=1e-2)


def test_agg_heads_share_a_list_within_agg_rows():
    assert [block_union.agg_heads(sub, 64) for sub in (1, 2, 3, 4, 8)] == [1, 2, 1, 2, 2]
    assert [block_union.agg_heads(4, block) for block in (16, 32, 128, 256)] == [4, 4, 1, 1]


def test_block_agg_refuses_bad_shapes():
    with pytest.raises(ValueError, match="powers of two"):
        block_union.block_agg(torch.zeros(4, 4, 24), torch.zeros(3, 2, 48), 16, 1)
    with pytest.raises(ValueError, match="do not fit"):
        block_union.block_agg(torch.zeros(4, 4, 32), torch.zeros(3, 3, 64), 16, 1)
    with pytest.raises(ValueError, match="do not fit"):
        block_union.block_agg(torch.zeros(4, 4, 32), torch.zeros(3, 2, 64), 16, 4)  # groups of 2
    with pytest.raises(ValueError, match="do not fit"):
        block_union.block_agg(torch.zeros(4, 4, 32), torch.zeros(3, 2, 32), 16, 1)  # not [max | min]


@pytest.mark.parametrize(
    "e, hkv, free, bc, spans", [(8, 8, 5, 2, 1), (4, 2, 1, 4, 3), (32, 32, 37, 1, 1), (2, 1, 0, 2, 2), (4, 2, 6, 2, 4)]
)
def test_write_pages_is_budget_pages(e, hkv, free, bc, spans):
    """Each row writes its own count of its blocks' pages at its own offset, nothing else."""
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(free)
    r = spans * e
    table = torch.randperm(500, generator=g)[:200].to(device)
    blocks = torch.stack([torch.randperm(200 // bc, generator=g)[:free] for _ in range(r)]).to(device)
    counts = [max(0, free - i % 3) if spans > 1 else free for i in range(r)]
    per = 3 + free * bc + 2  # each row's list: 3 pages, its chosen ones, 2 more
    ids = torch.full((r * per,), -7, dtype=torch.int32, device=device)
    dst = torch.arange(r, device=device) * per + 3
    block_union.write_pages(ids, dst, torch.tensor(counts, dtype=torch.int32, device=device), blocks, table, bc, hkv, e)
    want = block_union.budget_pages(blocks, table, bc, hkv, e)
    for i, n in enumerate(counts):
        row = ids[i * per : (i + 1) * per]
        assert torch.equal(row[3 : 3 + n * bc], want[i, : n * bc])
        assert (row[:3] == -7).all() and (row[3 + n * bc :] == -7).all()


def test_block_keys_bound_their_chunks_bounds():
    bounds = torch.randn(10, 2, 8)  # [max | min] of 4 dims, per chunk and KV head
    table = torch.tensor([7, 2, 9, 0, 5])
    got = block_keys(bounds, table, 2)  # blocks: (7, 2), (9, 0), (5,)

    def pair(a, b):
        return torch.cat([torch.maximum(a[..., :4], b[..., :4]), torch.minimum(a[..., 4:], b[..., 4:])], -1)

    want = torch.stack([pair(bounds[7], bounds[2]), pair(bounds[9], bounds[0]), bounds[5]])
    assert torch.equal(got, want)
    layers = torch.randn(3, 10, 2, 8)
    torch.testing.assert_close(block_keys(layers, table, 2)[2], block_keys(layers[2], table, 2))
    torch.testing.assert_close(block_keys(layers, table[:4], 2)[0], block_keys(layers[0], table[:4], 2))


@pytest.mark.parametrize(
    "k, bc, dtype",
    [
        (1, 2, torch.float32),
        (9, 2, torch.float32),
        (130, 2, torch.float16),
        (64, 4, torch.bfloat16),
        (5, 1, torch.float32),
    ],
)
def test_block_keys_kernel_is_block_keys(k, bc, dtype):
    device = "cuda" if CUDA else "cpu"
    g = torch.Generator().manual_seed(k)
    bounds = torch.randn(200, 2, 32, generator=g).to(device=device, dtype=dtype)  # (the pool's: K's dtype)
    table = torch.randperm(200, generator=g)[:k].to(device)
    got = block_union.block_keys_gpu(bounds, table, bc, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, block_keys(bounds, table, bc))  # maxima and minima: exact


@pytest.mark.parametrize("triton", [True, False])
@pytest.mark.parametrize("c, d, dtype", [(16, 16, torch.bfloat16), (64, 32, torch.bfloat16), (16, 32, torch.float32)])
def test_bound_chunks_are_each_chunks_max_and_min(c, d, dtype, triton):
    """bound_chunks through the kernel (chunk_key_bounds) and the reference: every layer's, or one
    layer's slice of the pool, the other chunks and layers untouched."""
    device = "cuda" if CUDA else "cpu"
    kv = torch.randn(3, 2, 40, 2, c, d, generator=torch.Generator().manual_seed(c)).to(device=device, dtype=dtype)
    bounds = torch.full((3, 40, 2, 2 * d), -9.0, device=device, dtype=dtype)
    chunks = torch.tensor([7, 0, 39, 12], device=device)
    block_union.bound_chunks(kv[1:2, 0], chunks, bounds[1:2], triton)  # one layer's (Attention._bound_own)
    assert torch.equal(bounds[1, chunks], block_union.chunk_key_bounds_ref(kv[1, 0, chunks]))
    assert (bounds[[0, 2]] == -9).all()
    block_union.bound_chunks(kv[:, 0], chunks, bounds, triton)
    want = block_union.chunk_key_bounds_ref(kv[:, 0, chunks])
    assert torch.equal(bounds[:, chunks], want)
    assert torch.equal(want[..., :d], kv[:, 0, chunks].amax(3)) and torch.equal(want[..., d:], kv[:, 0, chunks].amin(3))
    others = [i for i in range(40) if i not in (7, 0, 39, 12)]
    assert (bounds[:, others] == -9).all()
    before = bounds.clone()
    block_union.bound_chunks(kv[:, 0], chunks[:0], bounds, triton)  # nothing filled: nothing changes
    assert torch.equal(bounds, before)


def test_bound_scores_bound_every_key_of_the_block():
    """A bounded query's dot product with a block's bounds is at least q . k for each of its keys,
    and equal to it for a block of one key."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(6, 2, 64, 16, generator=g)  # 6 chunks, 2 KV heads, 64 slots, D 16
    q = torch.randn(5, 2, 16, generator=g)  # 5 rows, one query head per KV head
    bounds = block_keys(block_union.chunk_key_bounds_ref(keys), torch.arange(6), 3)  # [2, 2, 32]
    ub = torch.einsum("thd,bhd->thb", block_union.bound_queries(q), bounds)
    exact = torch.einsum("thd,bhnd->thbn", q, keys.view(2, 3, 2, 64, 16).transpose(1, 2).reshape(2, 2, 192, 16))
    assert (ub[..., None] >= exact - 1e-5).all()
    one = block_union.chunk_key_bounds_ref(keys[:1, :, :1])  # a block of one key: the bound is q . k
    torch.testing.assert_close(
        torch.einsum("thd,bhd->thb", block_union.bound_queries(q), one),
        torch.einsum("thd,bhd->thb", q, keys[:1, :, 0]),
    )


@pytest.mark.parametrize("spread", [0.0, 0.5, 1.0])
def test_spread_scores_the_box_center_and_part_of_its_radius(spread):
    """bound_queries(q, spread) . [max | min] = q . center + spread |q| . radius of the block's
    box: spread 1 is the bound above, 0 the center; the config takes [0, 1] and folds a budget's
    scores by their sum, alpha's by their max."""
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(2, 3, 2, 16, generator=g)
    hi, lo = a.maximum(b), a.minimum(b)
    q = torch.randn(5, 2, 16, generator=g)
    got = torch.einsum("thd,bhd->thb", block_union.bound_queries(q, spread), torch.cat([hi, lo], -1))
    want = torch.einsum("thd,bhd->thb", q, (hi + lo) / 2) + spread * torch.einsum(
        "thd,bhd->thb", q.abs(), (hi - lo) / 2
    )
    torch.testing.assert_close(got, want)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="spread"):
            BlockUnion(spread=bad)
    assert BlockUnion().fold == "max" and BlockUnion(budget=0.1).fold == "sum"


def test_subgroup_size():
    assert subgroup_size(32, 8, 4) == 4
    assert subgroup_size(32, 32, 4) == 1
    assert subgroup_size(28, 4, 4) == 1  # a group of 7
    assert subgroup_size(24, 4, 4) == 3  # a group of 6: the largest divisor up to 4
    assert subgroup_size(64, 8, 16) == 8


def test_selection_keeps_alpha_of_the_best_unions_and_adds_sink_and_window():
    cfg = BlockUnion(alpha=0.5, sink=1, window=1, subgroup=2)
    nb = 8
    scores = torch.full((4, 2, nb), 0.01)  # Hq 4 = Hkv 1 x 2 sub-groups of 2
    scores[:, :, 0] = 1.0  # every (head, query block)'s best: the first block
    scores[0, 0, 3] = 0.9  # head 0, query block 0: block 3
    scores[0, 0, 4] = 0.5  # exactly alpha x the best: kept
    scores[0, 0, 5] = 0.44  # under it
    scores[1, 1, 2] = 0.8  # head 1 (same sub-group), query block 1: block 2
    scores[1, 1, 5] = 0.3  # under alpha x its own best
    scores[3, 0, 6] = 0.7  # head 3: the second sub-group
    keep = select_blocks(normalised(scores, 2), cfg)
    assert keep.shape == (2, nb)
    assert keep[0].nonzero().flatten().tolist() == [0, 2, 3, 4, 7]  # sink 0, window 7
    assert keep[1].nonzero().flatten().tolist() == [0, 6, 7]
    # flat scores (every block the best): everything kept
    assert select_blocks(normalised(torch.full((4, 1, nb), 1 / nb), 2), cfg).all()
    assert select_blocks(normalised(scores, 2), BlockUnion(alpha=0.0)).all()


def test_budget_keeps_a_fixed_share_the_best_by_normalised_score():
    cfg = BlockUnion(budget=0.2, sink=1, window=2, subgroup=2)
    nb = 10
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 3, nb, generator=g)  # Hq 4, 3 query blocks: 2 lists of 2 heads
    agg = normalised(scores, 2)
    assert agg.shape == (2, nb)
    torch.testing.assert_close(agg[1], (scores[2:] / scores[2:].amax(-1, keepdim=True)).amax(0).amax(0))
    blocks = budget_blocks(agg, cfg)  # 5 kept: sink, window 2, and the 2 (0.2 x 10) best of blocks 1..7
    assert blocks.shape == (2, 2)
    for e in range(2):  # (blocks tie at 1.0, each some (head, query block)'s best)
        best = sorted((agg[e, b].item() for b in range(1, 8)), reverse=True)[:2]
        assert sorted((agg[e, b].item() for b in blocks[e]), reverse=True) == best
        assert len(set(blocks[e].tolist())) == 2 and all(1 <= b < 8 for b in blocks[e])
    keep = select_blocks(agg, cfg)
    assert (keep.sum(1) == 5).all() and keep[:, 0].all() and keep[:, 8:].all()
    # the share counts apart from the sink and window: a budget under their share still picks
    # ceil(budget x blocks) by score; past the blocks between them, all of those
    assert budget_blocks(agg, BlockUnion(budget=0.1, sink=1, window=2)).shape == (2, 1)
    assert budget_blocks(agg, BlockUnion(budget=0.5, sink=1, window=2)).shape == (2, 5)
    assert budget_blocks(agg, BlockUnion(budget=0.8, sink=1, window=2)).shape == (2, 7)
    assert select_blocks(agg, BlockUnion(budget=0.75, window=1)).all()


def test_spans_choose_among_the_blocks_before_them():
    """A piece's spans: each sees the blocks before it (its piece's earlier ones too), keeps its
    own sink and window, and a budget's share of its own blocks."""
    cfg = BlockUnion(block=32, budget=0.2, sink=1, window=2, span=2, subgroup=2)
    c = 16
    assert block_union.piece_spans(40 * c, 150, 64) == [(640, 64), (704, 64), (768, 22)]
    assert block_union.piece_spans(40 * c, 150, None) == [(640, 150)]
    assert block_union.query_limits(40 * c, 150, c, cfg) == [20, 20, 22, 22, 24]
    assert block_union.query_limits(40 * c + 5, 40, c, cfg) == [20, 20]  # the partial chunk is the span's own
    scores = torch.rand(4, 5, 24, generator=torch.Generator().manual_seed(1))
    scores[..., 20:] *= 0.0  # (what block_scores_ref gives past each query block's limit)
    agg = normalised(scores, 2, "sum", 2)
    assert agg.shape == (6, 24)  # 3 spans x 2 lists
    torch.testing.assert_close(agg[2], (scores[:2, 2:4] / scores[:2, 2:4].amax(-1, keepdim=True)).sum((0, 1)))
    limits = [20, 20, 22, 22, 24, 24]
    keep = select_blocks(agg, cfg, limits)
    for r, n in enumerate(limits):
        kept = keep[r].nonzero().flatten().tolist()
        assert len(kept) == 1 + 2 + block_union.budget_free(cfg, n) and kept[0] == 0 and kept[-2:] == [n - 2, n - 1]
        assert not keep[r, n:].any()
    blocks = budget_blocks(agg, cfg, limits)
    assert blocks.shape == (6, block_union.budget_free(cfg, 24))
    exclude = block_union.budget_exclude(cfg, torch.tensor(limits)[:, None], 24)  # (a step's, once)
    assert torch.equal(budget_blocks(agg, cfg, None, exclude), blocks)
    for r, n in enumerate(limits):  # a row's first budget_free(n) picks: its best between sink and window
        mine = blocks[r, : block_union.budget_free(cfg, n)].tolist()
        best = agg[r, 1 : n - 2].topk(len(mine)).indices + 1
        assert sorted(mine) == sorted(best.tolist())
    assert cfg.span_rows(640) == 64 and BlockUnion(span=None).span_rows(640) is None
    with pytest.raises(ValueError, match="span must be >= 1"):
        BlockUnion(block=32, span=0)
    with pytest.raises(ValueError, match="set a budget"):
        BlockUnion(span="auto")


def test_auto_spans_are_at_most_a_quarter_of_the_context_they_choose():
    """'auto' spans: per piece the most blocks (a power of two) whose rows are at most a quarter
    of budget x context_len, one block at least; the whole piece once that is longer than it."""
    cfg = BlockUnion(block=64, budget=0.1, window=1, span="auto")
    assert [cfg.span_rows(n) for n in (1024, 4096, 5120, 6656, 16384, 65536, 262144)] == [
        64,
        64,
        128,
        128,
        256,
        1024,
        4096,
    ]
    for context in (6656, 65536):
        rows = cfg.span_rows(context)
        assert 4 * rows <= cfg.budget * context < 8 * rows
    assert block_union.piece_spans(262144, 2048, cfg.span_rows(262144)) == [(262144, 2048)]
    assert block_union.span_blocks(cfg, 32, 65536) == 16 and block_union.span_blocks(cfg, 16, 6656) == 2
    assert block_union.span_blocks(cfg, 32, 262144) == 32
    assert block_union.query_limits(6656, 256, 64, cfg) == [104, 104, 106, 106]
    with pytest.raises(ValueError, match="context_len"):
        block_union.block_scores(torch.zeros(64, 2, 16), torch.zeros(4, 1, 32), cfg, 2)


@pytest.mark.parametrize("context, new, budget", [(40 * 16, 50, 0.3), (37 * 16 + 5, 16, 0.5), (64 * 16, 1, 1.0)])
def test_budget_lists_are_the_masked_pages(context, new, budget):
    """The page ids a step plans for a budget piece, with the chosen blocks written in, are the
    masked pages (chunk * Hkv + head, list by list) of the same selection: what the reference
    attends."""
    cfg = BlockUnion(block=32, budget=budget, sink=1, window=2, subgroup=2)
    c, hkv, e = 16, 2, 4
    total = context + new
    used = -(-total // c)
    table = random.Random(context).sample(range(200), used)
    k0, bc = context // c, 2
    nb = -(-k0 // bc)
    scores = torch.rand(8, 3, nb, generator=torch.Generator().manual_seed(new))
    blocks = budget_blocks(normalised(scores, 2), cfg)
    pages, per, chosen = budget_lists(table, context, total, c, cfg, hkv, e)
    assert per == budget_list_len(cfg, context, total, c) and len(pages) == e * per
    planned = torch.tensor(pages, dtype=torch.int32).view(e, per)
    planned[:, chosen] = budget_pages(blocks, torch.tensor(table), bc, hkv)
    mask = chunk_mask(select_blocks(normalised(scores, 2), cfg), bc, k0, used)
    page = torch.tensor(table)[None, :] * hkv + (torch.arange(e) // (e // hkv))[:, None]
    for i in range(e):  # the same pages; the chosen blocks' in any order, each block's chunks in order
        assert sorted(planned[i].tolist()) == sorted(page[i][mask[i]].tolist())
        assert planned[i, : chosen.start].tolist() == page[i, : chosen.start].tolist()
        assert planned[i, chosen.stop :].tolist() == page[i, -(per - chosen.stop) :].tolist()


@pytest.mark.parametrize(
    "context, new, span", [(40 * 16, 150, 2), (37 * 16 + 5, 100, 1), (24 * 16, 64, None), (40 * 16, 150, "auto")]
)
def test_budget_piece_is_each_spans_masked_pages(context, new, span):
    """A piece's planned lists with each span's chosen blocks written at their offsets are, span
    by span, the masked pages of select_blocks on the same scores: what the reference attends."""
    cfg = BlockUnion(block=32, budget=0.3, sink=1, window=2, subgroup=2, span=span)
    c, hkv, e, bc = 16, 2, 4, 2
    total = context + new
    table = random.Random(context).sample(range(300), -(-total // c))
    parts = block_union.piece_spans(context, new, cfg.span_rows(context))
    assert len(parts) > 1 or span is None
    limits = block_union.query_limits(context, new, c, cfg)
    scores = torch.rand(8, len(limits), max(limits), generator=torch.Generator().manual_seed(new))
    for i, n in enumerate(limits):
        scores[:, i, n:] = 0.0
    agg = normalised(scores, 2, "sum", block_union.span_blocks(cfg, len(limits), context))
    pages, planned, dst, counts, row_limits = block_union.budget_piece(table, context, new, c, cfg, hkv, e)
    assert [p[0] for p in planned] == [n for _, n in parts] and len(dst) == len(parts) * e
    assert sum(sum(p[1]) for p in planned) == len(pages)
    ids = torch.tensor(pages, dtype=torch.int32)
    chosen = block_union.budget_pages(budget_blocks(agg, cfg, row_limits), torch.tensor(table), bc, hkv, e)
    for r, (o, n) in enumerate(zip(dst, counts)):
        ids[o : o + n * bc] = chosen[r, : n * bc]
    keep = select_blocks(agg, cfg, row_limits)
    start = 0
    for j, ((ctx, rows), (_, per, tail)) in enumerate(zip(parts, planned)):
        used = -(-(ctx + rows) // c)
        assert tail == ctx + rows - (used - 1) * c
        mask = chunk_mask(keep[j * e : (j + 1) * e], bc, ctx // c, used)
        page = torch.tensor(table[:used])[None, :] * hkv + (torch.arange(e) // (e // hkv))[:, None]
        for i in range(e):
            mine = ids[start : start + per[i]]
            assert sorted(mine.tolist()) == sorted(page[i][mask[i]].tolist())
            assert mine[-(used - ctx // c) :].tolist() == page[i, ctx // c : used].tolist()  # own chunks last
            start += per[i]


def test_sparse_queries_go_list_major_per_planned_piece_and_back():
    """What FlashInfer's sparse run reads: each planned piece's rows list-major ([E * n, sub, D]);
    a piece's spans regrouped in one copy are the same as span by span, and the inverse puts
    every output row back."""
    from chunkserve.kernels.paged_prefill import from_lists, planned_runs, to_lists

    e, hq, d = 4, 8, 16
    planned = [64, 64, 64, 22, 30, 5, 5]  # a piece of 3 spans of 64 and one of 22; one of 30; two of 5
    assert planned_runs(planned, [214, 30, 10]) == [(64, 3, 22), (30, 1, 0), (5, 2, 0)]
    with pytest.raises(ValueError, match="sparse plan"):
        planned_runs(planned, [214, 40])  # a q that ends inside a planned piece
    with pytest.raises(ValueError, match="sparse plan"):
        planned_runs([22, 64], [86])  # a shorter run before a longer one: not one piece's spans
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(n, hq, d, generator=g) for n in (214, 30, 10)]
    runs = planned_runs(planned, [214, 30, 10])
    got = to_lists(qs, runs, e)
    rows, want = [q[i] for q in qs for i in range(q.shape[0])], []
    start = 0
    for n in planned:  # span by span, as each planned piece alone
        piece = torch.stack(rows[start : start + n])
        want.append(piece.reshape(n, e, hq // e, d).transpose(0, 1).reshape(-1, hq // e, d))
        start += n
    assert torch.equal(got, torch.cat(want))
    outs = [torch.zeros_like(q) for q in qs]
    from_lists(got, outs, runs, e)
    assert all(torch.equal(o, q) for o, q in zip(outs, qs))


def test_chunk_mask_marks_kept_blocks_and_the_own_chunks():
    keep = torch.tensor([[True, False, True], [False, False, False]])
    mask = chunk_mask(keep, 2, 5, 8)  # 5 context chunks in blocks (0,1) (2,3) (4); 3 own chunks
    assert mask.tolist() == [[1, 1, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]]


def test_config_is_checked():
    for bad in (
        dict(block=48),
        dict(block=8),
        dict(alpha=1.5),
        dict(sink=-1),
        dict(subgroup=0),
        dict(budget=0.0),
        dict(budget=1.5),
        dict(budget=0.5, window=0),
    ):
        with pytest.raises(ValueError):
            BlockUnion(**bad)
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        BlockUnion(block=32).check_chunk_size(64)
    cfg = BlockUnion(min_context=100, block=32, sink=1, window=2)
    assert not cfg.applies(99, 16)  # short context
    assert not cfg.applies(100, 16) and not cfg.applies(111, 16)  # 3 blocks: sink and window keep them all
    assert cfg.applies(112, 16)  # 7 chunks: 4 blocks
    assert cfg.first_sparse_context(16) == 112
    for cfg, c in (
        (BlockUnion(min_context=0, block=128, sink=1, window=4), 64),
        (BlockUnion(min_context=5000), 16),
        (BlockUnion(min_context=100, block=32, sink=0, window=1), 32),
    ):
        first = cfg.first_sparse_context(c)  # where applies turns on, and stays
        assert not cfg.applies(first - 1, c) and all(cfg.applies(first + i, c) for i in range(0, 400, 7))


def _random_mask(rng, e, used, context_chunks):
    mask = torch.ones(e, used, dtype=torch.bool)
    for i in range(e):
        for k in range(context_chunks):
            mask[i, k] = rng.random() < 0.4
    return mask


@pytest.mark.parametrize("hq, hkv, sub", [(4, 4, 1), (8, 2, 2), (8, 2, 4), (8, 1, 4)])
@pytest.mark.parametrize("context, new", [(0, 9), (48, 16), (53, 20), (100, 1), (64, 40)])
def test_sparse_reference_is_dense_prefill_over_the_compacted_lists(hq, hkv, sub, context, new):
    """What FlashInfer runs: per entry, a cache of one KV head whose table is the entry's marked
    chunks, causal from the end; equals the sparse reference on the true positions."""
    c, d = 16, 16
    rng = random.Random(context * 100 + new + hq)
    k_cache, v_cache = _cache(32, hkv, c, d, seed=hq + hkv)
    total = context + new
    used = -(-total // c)
    table = rng.sample(range(32), used)
    e = hkv * (hq // hkv // sub)
    mask = _random_mask(rng, e, used, context // c)
    q = torch.randn(new, hq, d, generator=torch.Generator().manual_seed(new))
    got = sparse_prefill_ref(q, k_cache, v_cache, table, context, mask)
    for i in range(e):
        kv = i // (e // hkv)
        chosen = [table[k] for k in range(used) if mask[i, k]]
        dropped = used - len(chosen)
        heads = slice(i * sub, (i + 1) * sub)
        want = prefill_attention_ref(
            q[:, heads], k_cache[:, kv : kv + 1], v_cache[:, kv : kv + 1], chosen, context - dropped * c
        )
        torch.testing.assert_close(got[:, heads], want, atol=1e-5, rtol=1e-5)
    everything = torch.ones(e, used, dtype=torch.bool)
    torch.testing.assert_close(
        sparse_prefill_ref(q, k_cache, v_cache, table, context, everything),
        prefill_attention_ref(q, k_cache, v_cache, table, context),
        atol=1e-5,
        rtol=1e-5,
    )


def test_sparse_reference_refuses_a_mask_that_does_not_fit():
    k_cache, v_cache = _cache(8, 2, 16, 16)
    with pytest.raises(ValueError, match="does not fit"):
        sparse_prefill_ref(torch.zeros(4, 4, 16), k_cache, v_cache, [0, 1], 20, torch.ones(2, 3, dtype=torch.bool))


# -- the engine ------------------------------------------------------------------------------

SPARSE = dict(min_context=64, block=32, window=1)


def _prompts():
    rng = random.Random(3)
    shared = [rng.randrange(256) for _ in range(300)]
    return [shared + [rng.randrange(256) for _ in range(n)] for n in (5, 40)] + [
        [rng.randrange(256) for _ in range(230)]
    ]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("span", [None, 1])
def test_engine_with_everything_kept_gives_the_dense_tokens(async_scheduling, span):
    prompts, params = _prompts(), SamplingParams(max_tokens=24, temperature=0)
    dense = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, max_num_batched_tokens=64).generate(
        prompts, params
    )
    engine = LLMEngine.from_model(
        "tiny",
        device="cpu",
        chunk_size=16,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
        sparse_prefill=dict(SPARSE, alpha=0.0, span=span),
    )
    assert engine.generate(prompts, params) == dense
    stats = engine.stats()
    assert stats["sparse_pages_dense"] > 0 and stats["sparse_pages_read"] == stats["sparse_pages_dense"]


@pytest.mark.parametrize("span", [None, 1])
def test_engine_with_a_whole_budget_gives_the_dense_tokens(span):
    prompts, params = _prompts(), SamplingParams(max_tokens=24, temperature=0)
    dense = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, max_num_batched_tokens=64).generate(
        prompts, params
    )
    engine = LLMEngine.from_model(
        "tiny",
        device="cpu",
        chunk_size=16,
        max_num_batched_tokens=64,
        sparse_prefill=dict(SPARSE, budget=1.0, span=span),
    )
    assert engine.generate(prompts, params) == dense


@pytest.mark.parametrize("sparse", [dict(alpha=1.0), dict(budget=0.3), dict(budget=0.3, span=1, dense_tail=0)])
def test_engine_sparse_prefill_reads_fewer_pages_and_keeps_exact_key_bounds(sparse):
    prompts, params = _prompts(), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    engine = LLMEngine.from_model(
        "tiny", device="cpu", chunk_size=16, max_num_batched_tokens=64, sparse_prefill=dict(SPARSE, **sparse)
    )
    outs = engine.generate(prompts, params)
    assert all(len(o) == 40 for o in outs)
    stats = engine.stats()
    assert 0 < stats["sparse_pages_read"] < stats["sparse_pages_dense"]
    # every full chunk the tree holds (prompts' and generated tokens') has its key bounds
    pool, c, full = engine.pool, 16, []
    stack = list(engine.tree.root.children.values())
    while stack:
        node = stack.pop()
        stack += node.children.values()
        if len(node.tokens) == c:
            full.append(node.chunk_id)
    assert len(full) > 30
    keys = pool.kv[:, 0, full]
    assert torch.equal(pool.key_bounds[:, full], torch.cat([keys.amax(3), keys.amin(3)], -1))
    # a later prompt over the cached prefix reads the bounds its first prefill left
    again = engine.generate([prompts[0][:290] + [1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert len(again[0]) == 2 and engine.stats()["sparse_pages_read"] > stats["sparse_pages_read"]


def test_engine_sparse_prefill_is_the_reference_on_its_own_selection():
    """One sparse piece through the engine's layer: the same as sparse_prefill_ref on the mask
    the selection rules give from the reference scores."""
    from chunkserve.replicas.engine.attention import PrefillSpan

    engine = LLMEngine.from_model(
        "tiny", device="cpu", chunk_size=16, sparse_prefill=dict(SPARSE, alpha=0.6, span=None)
    )
    engine.generate([list(range(400))], SamplingParams(max_tokens=1))  # fills the pool and its bounds
    attention, pool = engine.attention, engine.pool
    seq_table = [n.chunk_id for n in _path(engine.tree, 24)]
    context, new = 320, 64
    q = torch.randn(new, 4, 64, generator=torch.Generator().manual_seed(0)) * 30  # peaked scores
    out = torch.zeros_like(q)
    k0 = context // 16
    keys = block_keys(pool.key_bounds, torch.tensor(seq_table[:k0]), 2)  # [L, NB, Hkv, 2D]
    torch.testing.assert_close(keys[1], block_keys(pool.key_bounds[1], torch.tensor(seq_table[:k0]), 2))
    span = PrefillSpan(0, new, context, tuple(seq_table), torch.tensor(seq_table))
    attention.sparse_prefill(1, q, out, [span])
    cfg = engine.config.sparse_prefill
    keep = select_blocks(block_union.block_scores(q, keys[1], cfg, 2, 64**-0.5), cfg)
    mask = chunk_mask(keep, 2, k0, 24)
    assert not mask.all()
    want = sparse_prefill_ref(q, pool.k(1), pool.v(1), seq_table, context, mask, 64**-0.5)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("span", [1, "auto"])
def test_engine_spans_are_the_reference_each_on_its_own_selection(span):
    """A piece in spans through the engine's layer: each span the sparse reference on the mask
    the selection rules give it from the reference scores, its piece's earlier chunks among the
    blocks it chooses from (their key bounds made in the layer, from the K just written)."""
    from chunkserve.replicas.engine.attention import PrefillSpan

    sparse = dict(SPARSE, budget=0.25, span=span)
    engine = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, sparse_prefill=sparse)
    engine.generate([list(range(400))], SamplingParams(max_tokens=1))  # fills the pool
    attention, pool = engine.attention, engine.pool
    seq_table = [n.chunk_id for n in _path(engine.tree, 24)]
    context, new = 256, 120
    own = torch.tensor(seq_table[16:22])  # the chunks before the last span's first token
    pool.key_bounds[1, own] = 0.0  # the piece's chunks: bounded in the layer, not before
    q = torch.randn(new, 4, 64, generator=torch.Generator().manual_seed(0)) * 30  # peaked scores
    out = torch.zeros_like(q)
    span = PrefillSpan(0, new, context, tuple(seq_table), torch.tensor(seq_table))
    attention.sparse_prefill(1, q, out, [span])
    keys = pool.kv[1, 0, own]
    assert torch.equal(pool.key_bounds[1, own], torch.cat([keys.amax(2), keys.amin(2)], -1))
    cfg = engine.config.sparse_prefill
    parts = block_union.piece_spans(context, new, cfg.span_rows(context))
    assert len(parts) == 4
    blocks = block_keys(pool.key_bounds[1], torch.tensor(seq_table[: parts[-1][0] // 16]), 2)
    limits = block_union.query_limits(context, new, 16, cfg)
    agg = block_union.block_scores(q, blocks, cfg, 2, 64**-0.5, limits, context)
    limits = [block_union.context_blocks(ctx, 16, 32) for ctx, _ in parts for _ in range(2)]
    keep = select_blocks(agg, cfg, limits)
    for j, (ctx, n) in enumerate(parts):
        used = -(-(ctx + n) // 16)
        mask = chunk_mask(keep[2 * j : 2 * j + 2], 2, ctx // 16, used)
        assert not mask.all()
        r = slice(ctx - context, ctx - context + n)
        want = sparse_prefill_ref(q[r], pool.k(1), pool.v(1), seq_table, ctx, mask, 64**-0.5)
        torch.testing.assert_close(out[r], want)


@pytest.mark.parametrize("tail", [24, 0])
def test_the_prompts_last_tokens_attend_densely(monkeypatch, tail):
    # the prompt's last piece: its last dense_tail tokens a dense span of their own, their
    # attention exactly dense; the rest of it, and the pieces before, sparse
    from chunkserve.replicas.engine.attention import StepAttention

    seen = []
    attend = StepAttention.attend

    def spy(self, layer, q, out=None):
        out = attend(self, layer, q, out)
        if layer == 1 and self.prefills:
            seen.append((self.prefills, q.clone(), out.clone()))
        return out

    monkeypatch.setattr(StepAttention, "attend", spy)
    sparse = dict(SPARSE, alpha=1.0, dense_tail=tail)
    engine = LLMEngine.from_model("tiny", device="cpu", chunk_size=16, max_num_batched_tokens=64, sparse_prefill=sparse)
    prompt = [random.Random(5).randrange(256) for _ in range(300)]
    assert len(engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0))[0]) == 3
    kinds = [[(s.sparse, s.context_len, s.num_new) for s in spans] for spans, _, _ in seen]
    # (a piece after 64 tokens runs dense: its 2 blocks are the sink and the window)
    assert kinds[:-1] == [[(False, 0, 64)], [(False, 64, 64)], [(True, 128, 64)], [(True, 192, 64)]]
    if not tail:
        assert kinds[-1] == [(True, 256, 44)]
        return
    assert kinds[-1] == [(True, 256, 20), (False, 276, 24)]
    spans, q, out = seen[-1]
    rows = slice(spans[1].start, spans[1].start + 24)
    want = prefill_attention_ref(q[rows], engine.pool.k(1), engine.pool.v(1), spans[1].chunk_ids, 276, 64**-0.5)
    torch.testing.assert_close(out[rows], want)
    # the tail's pages count as read, by every layer's page lists
    stats = engine.stats()
    assert 0 < stats["sparse_pages_read"] < stats["sparse_pages_dense"]


def _path(tree, n):
    node, path = tree.root, []
    while len(path) < n:
        node = next(iter(node.children.values()))
        path.append(node)
    return path


def test_engine_refuses_a_block_that_is_not_a_chunk_multiple():
    with pytest.raises(ValueError, match="multiple of the chunk size"):
        LLMEngine.from_model("tiny", chunk_size=64, sparse_prefill=dict(block=32))


# -- FlashInfer over the page lists (GPU) -----------------------------------------------------


@pytest.mark.parametrize(
    "dtype, hq, hkv, sub, d",
    [(torch.bfloat16, 32, 8, 4, 128), (torch.bfloat16, 32, 32, 1, 128), (torch.bfloat16, 8, 2, 2, 64)],
)
@pytest.mark.parametrize("c", [16, 64])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_flashinfer_runs_the_page_lists_as_the_reference(dtype, hq, hkv, sub, d, c):
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    from chunkserve.kernels.paged_prefill import FlashInferPrefill, SparsePiece

    rng = random.Random(c + hq)
    k_cache, v_cache = _cache(256, hkv, c, d, dtype, "cuda", seed=c)
    fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=torch.device("cuda"), sm_scale=d**-0.5)
    pieces, spans = [], []
    for context, new in [(40 * c, 3 * c + 5), (17 * c + 9, 40), (9 * c, 1)]:
        total = context + new
        used = -(-total // c)
        table = rng.sample(range(256), used)
        e = hkv * (hq // hkv // sub)
        mask = _random_mask(rng, e, used, context // c).cuda()
        q = torch.randn(new, hq, d, device="cuda").to(dtype)
        pieces.append(SparsePiece(q, mask, torch.tensor(table, device="cuda"), total))
        spans.append((table, context))
    for _ in range(2):  # planned again, same wrapper
        outs = fi.run_sparse(pieces, k_cache, v_cache)
    for p, (table, context), o in zip(pieces, spans, outs):
        want = sparse_prefill_ref(p.q, k_cache, v_cache, table, context, p.mask)
        torch.testing.assert_close(o, want, atol={torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype], rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("hq, hkv, c", [(32, 8, 64), (8, 2, 16)])
def test_flashinfer_runs_budget_lists_rewritten_in_place(hq, hkv, c):
    """A budget's lists planned once; each 'layer' writes other chosen pages into them and runs:
    every run is the reference on its own selection (FlashInfer reads the page ids in place)."""
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    from chunkserve.kernels.paged_prefill import FlashInferPrefill

    d, dtype, dev = (128 if hq == 32 else 64), torch.bfloat16, torch.device("cuda")
    cfg = BlockUnion(block=2 * c, budget=0.3, sink=1, window=2)
    sub = subgroup_size(hq, hkv, cfg.subgroup)
    e = hq // sub
    k_cache, v_cache = _cache(300, hkv, c, d, dtype, "cuda", seed=c)
    fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=dev, sm_scale=d**-0.5)
    rng = random.Random(hq)
    spans = []
    for context, new in [(60 * c, 2 * c + 3), (33 * c + 7, 20)]:
        total = context + new
        table = rng.sample(range(300), -(-total // c))
        spans.append((table, context, total))
    pages, planned, places = [], [], []
    for table, context, total in spans:
        lists, per, chosen = budget_lists(table, context, total, c, cfg, hkv, e)
        places.append((len(pages), per, chosen))
        pages += lists
        planned.append((total - context, [per] * e, total - (len(table) - 1) * c))
    ids = torch.tensor(pages, dtype=torch.int32, device=dev)
    fi.plan_sparse(ids, planned)
    for layer in range(2):
        qs, masks = [], []
        for (table, context, total), (o, per, chosen) in zip(spans, places):
            k0 = context // c
            nb = -(-k0 // 2)
            scores = torch.rand(hq, 2, nb, generator=torch.Generator().manual_seed(layer * 7 + k0)).to(dev)
            blocks = budget_blocks(normalised(scores, sub), cfg)
            dst = torch.arange(e, device=dev) * per + o + chosen.start
            counts = torch.full((e,), blocks.shape[1], dtype=torch.int32, device=dev)
            block_union.write_pages(ids, dst, counts, blocks, torch.tensor(table, device=dev), 2, hkv, e)
            masks.append(chunk_mask(select_blocks(normalised(scores, sub), cfg), 2, k0, len(table)))
            qs.append(torch.randn(total - context, hq, d, device=dev).to(dtype))
        outs = fi.run_planned_sparse(qs, k_cache, v_cache)
        for (table, context, _), q, mask, out in zip(spans, qs, masks, outs):
            assert not mask.all()
            want = sparse_prefill_ref(q, k_cache, v_cache, table, context, mask)
            torch.testing.assert_close(out, want, atol=3e-2, rtol=0)


@pytest.mark.parametrize("span", [None, 1])
def test_engine_sparse_prefill_through_the_triton_kernels(span):
    """The triton backend (under the interpreter on the CPU; float32 on a GPU, which FlashInfer
    does not take: the reference attends): key bounds, block bounds and scores from the Triton
    kernels (spans': their pieces' own chunks bounded in each layer); with every block kept,
    the dense tokens; the pool's key bounds exact."""
    device = "cuda" if CUDA else "cpu"
    prompts, params = _prompts()[:2], SamplingParams(max_tokens=6, temperature=0)
    dense = LLMEngine.from_model(
        "tiny", device=device, dtype="float32", chunk_size=16, max_num_batched_tokens=128, attention_backend="torch"
    ).generate(prompts, params)
    engine = LLMEngine.from_model(
        "tiny",
        device=device,
        dtype="float32",
        chunk_size=16,
        max_num_batched_tokens=128,
        attention_backend="triton",
        sparse_prefill=dict(SPARSE, alpha=0.0, span=span),
    )
    assert engine.generate(prompts, params) == dense
    stats = engine.stats()
    assert stats["sparse_pages_dense"] > 0 and stats["sparse_pages_read"] == stats["sparse_pages_dense"]
    full = [n.chunk_id for n in _path(engine.tree, 18)]
    keys = engine.pool.kv[:, 0, full]
    assert torch.equal(engine.pool.key_bounds[:, full], torch.cat([keys.amax(3), keys.amin(3)], -1))


@pytest.mark.parametrize("seed", range(8))
def test_a_block_with_one_matching_key_is_chosen_by_the_budget(seed):
    """Among 16 blocks of 128 random keys, one key of block 9 matches the piece's queries (a
    planted fact): its bound lifts block 9 above the others in every list, and the budget's 2
    choices of the 13 between sink and window hold it."""
    g = torch.Generator().manual_seed(seed)
    hkv, c, d, nb, bc = 2, 64, 32, 16, 2
    keys = torch.randn(nb * bc, hkv, c, d, generator=g)  # [chunks, Hkv, c, D]
    fact = torch.randn(hkv, d, generator=g)
    keys[9 * bc + 1, :, 17] = 3 * fact  # one slot of block 9, each KV head
    q = fact.repeat_interleave(2, 0)[None] + 0.3 * torch.randn(64, 2 * hkv, d, generator=g)  # [T, Hq 4, D]
    cfg = BlockUnion(budget=0.1, sink=1, window=2, block=bc * c, subgroup=2)
    bounds = block_keys(block_union.chunk_key_bounds_ref(keys), torch.arange(nb * bc), bc)
    agg = block_union.block_scores(q, bounds, cfg, 2, d**-0.5)
    assert (budget_blocks(agg, cfg) == 9).any(1).all()


def test_a_spec_reads_none_and_auto_and_names_what_it_refuses():
    cfg = BlockUnion.from_spec("budget=0.1,block=64,window=1,span=auto,stride=4,dense_tail=64", 1024)
    assert cfg == BlockUnion(min_context=1024, budget=0.1, block=64, window=1, span="auto", stride=4, dense_tail=64)
    assert BlockUnion.from_spec("budget=0.1,span=none", 0).span is None
    with pytest.raises(ValueError, match="unknown sparse field 'bogus'"):
        BlockUnion.from_spec("bogus=1", 0)
    with pytest.raises(ValueError, match="unknown sparse field 'min_context'"):
        BlockUnion.from_spec("min_context=0", 0)
    with pytest.raises(ValueError, match="sparse block takes a number, got 'big'"):
        BlockUnion.from_spec("block=big", 0)
    with pytest.raises(ValueError, match="set a budget"):
        BlockUnion.from_spec("span=auto", 0)
