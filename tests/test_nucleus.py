"""chunkserve.kernels.nucleus: the sort-free top-p cut keeps exactly the tokens the sort-based reference
keeps (interpreter on the CPU, small rows; the GPU with -m gpu, vocabulary-sized rows)."""

import pytest
import torch

from chunkserve.kernels.nucleus import nucleus_floor, nucleus_floor_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(seed: int, p: int, v: int) -> torch.Tensor:
    """Peaked and flat rows, bf16-rounded (many ties), some with top-k's -inf, one of zeros of
    both signs, one with a single finite token."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.tensor([8.0, 0.3, 3.0, 0.05, 1.0, 2.0, 5.0, 0.01])[torch.arange(p) % 8, None]
    x = (torch.randn(p, v, generator=gen) * scale).bfloat16().float()
    x[2 % p, : v // 3] = float("-inf")
    if p > 5:
        x[5] = 0.0
        x[5, : v // 4] = -0.0
        x[5, 3] = 1.0
        x[4, 1:] = float("-inf")
    return x


def _kept(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The tokens a cut keeps, as the sampler applies it (logits under it to -inf)."""
    return x.masked_fill(x < floor, float("-inf")) > float("-inf")


def _check(x: torch.Tensor, top_p: torch.Tensor) -> None:
    x, top_p = x.to(DEVICE), top_p.to(DEVICE)
    probs = (x - x.logsumexp(-1, keepdim=True)).exp()
    got, want = nucleus_floor(x, probs, top_p), nucleus_floor_ref(x, probs, top_p)
    assert got.shape == want.shape == (x.shape[0], 1) and got.dtype == torch.float32
    kept, kept_ref = _kept(x, got), _kept(x, want)
    assert torch.equal(kept, kept_ref)
    assert kept.any(-1).all()  # the most likely token always stays


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("p, v", [(8, 300), (3, 1), (11, 1000)])
def test_the_cut_keeps_what_the_sorted_reference_keeps(seed, p, v):
    tops = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.99, 0.6, 0.2, 0.999999, 1e-9, 0.75, 0.8], dtype=torch.float64)
    _check(_rows(seed, p, v), tops[:p, None])


def test_a_cut_through_a_run_of_ties_keeps_the_whole_run():
    # the token above the three tied at 1.0 holds 0.426 of the mass, the four down to 1.0 0.897,
    # down to 0.0 0.954: each top_p keeps the run whole or drops it
    x = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -1.0, -1.0, -3.0]] * 5)
    tops = torch.tensor([[0.2], [0.45], [0.5], [0.7], [0.95]], dtype=torch.float64)
    _check(x, tops)
    got = nucleus_floor(x.to(DEVICE), (x - x.logsumexp(-1, keepdim=True)).exp().to(DEVICE), tops.to(DEVICE))
    assert got[:, 0].tolist() == [2.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("seed", range(3))
def test_a_cut_among_the_top_k_candidates_keeps_what_the_whole_row_keeps(seed):
    # the sampler's search for top-k rows: over each row's k + 1 largest logits (below its k-th:
    # -inf), its probabilities from the whole row. Rows whose k-th value has ties past the
    # candidates (bf16-rounded, and a row of whole numbers) keep the same tokens as the whole row.
    gen = torch.Generator().manual_seed(seed)
    x = (
        (torch.randn(6, 400, generator=gen) * torch.tensor([[4.0], [0.5], [2.0], [0.1], [1.0], [3.0]]))
        .bfloat16()
        .float()
    )
    x[5] = torch.randint(0, 4, (400,), generator=gen).float()  # runs of ties a hundred long
    ks = [3, 40, 10, 60, 1, 5]
    tops = torch.tensor([[0.9], [0.6], [0.95], [0.99], [0.5], [0.999]], dtype=torch.float64)
    kth = torch.stack([torch.topk(x[i], k).values[-1] for i, k in enumerate(ks)])[:, None]
    x = x.masked_fill(x < kth, float("-inf"))
    cand = torch.topk(x, max(ks) + 1, dim=-1).values
    cand = cand.masked_fill(cand < kth, float("-inf"))
    x, cand, tops = x.to(DEVICE), cand.to(DEVICE), tops.to(DEVICE)
    lse = x.logsumexp(-1, keepdim=True)
    got = nucleus_floor(cand, (cand - lse).exp(), tops)
    want = nucleus_floor_ref(x, (x - lse).exp(), tops)
    assert torch.equal(_kept(x, got), _kept(x, want))


def test_rows_that_hold_part_of_the_mass():
    # candidates hold 0.79 of their rows' mass (the rest lies outside them): one token of 0.3 and
    # a hundred of about 0.0049 each, so top_p 0.5 cuts after some forty of the small ones. The
    # kernel leaves out tokens that cannot matter by the mass the row holds, not by 1: with 1,
    # every small token would go and the cut would fall below them all.
    small = 0.0049 - 1e-6 * torch.arange(100, dtype=torch.float64)
    probs = torch.cat([torch.tensor([0.3], dtype=torch.float64), small]).float()[None].repeat(2, 1)
    x = probs.log()
    tops = torch.tensor([[0.5], [0.7]], dtype=torch.float64)
    got = nucleus_floor(x.to(DEVICE), probs.to(DEVICE), tops.to(DEVICE)).cpu()
    want = nucleus_floor_ref(x, probs, tops)
    assert torch.equal(_kept(x, got), _kept(x, want))
    assert 30 < int(_kept(x, want)[0].sum()) < 60


@pytest.mark.parametrize("seed", range(2))
def test_many_blocks_per_program_compact_in_place(seed, monkeypatch):
    # each program's chunk many blocks long: the filter's and each pass's compaction of the
    # tokens still inside (lo, hi] to the front of its region runs over many blocks, and the
    # mass of those that leave above hi carries over to later passes
    import chunkserve.kernels.nucleus as nucleus

    monkeypatch.setattr(nucleus, "_BLOCK", 16)
    monkeypatch.setattr(nucleus, "_CHUNKS", 2)
    tops = torch.tensor([0.9, 0.5, 0.95, 0.3, 0.99, 0.6, 0.2, 0.999999], dtype=torch.float64)
    _check(_rows(seed, 8, 700), tops[:, None])


@pytest.mark.gpu
@pytest.mark.parametrize("p", [1, 64, 256])
def test_vocabulary_sized_rows_on_the_gpu(p):
    x = _rows(p, p, 128256)
    tops = torch.rand(p, 1, generator=torch.Generator().manual_seed(p), dtype=torch.float64) * 0.98 + 0.01
    _check(x, tops)


def test_bad_shapes_are_refused():
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError):
        nucleus_floor(x, x, torch.ones(2, dtype=torch.float64))
