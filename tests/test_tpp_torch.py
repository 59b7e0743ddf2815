"""chunkserve/kernels/tpp_torch.py (the engine's CPU decode) against the row-by-row reference and the dense
oracle, on the random trees of tests/test_tpp.py, with plans bumped as rows grow."""

import pytest
import torch

from chunkserve.kernels import reference, tpp_torch
from chunkserve.kernels.reference import decode_attention_ref
from tests.test_tpp import CPU_CASES, TOL, make_case


@pytest.mark.parametrize("dtype,head_dim,groups,c,rows,seed", CPU_CASES)
def test_matches_reference_and_oracle_on_random_trees(dtype, head_dim, groups, c, rows, seed):
    q, k, v, tables, lens = make_case(seed, dtype, head_dim, groups, c, rows, device="cpu")
    tree = reference.build_tree_plan(tables, lens, c)
    got = tpp_torch.tpp_decode(q, k, v, tpp_torch.build_plan(tree, c, "cpu"), 0.3)
    ref = reference.tpp_decode_ref(q, k, v, tree, 0.3)
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    oracle = decode_attention_ref(q, k, v, tables, lens, 0.3)
    torch.testing.assert_close(got.float(), oracle.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_reserved_chunks_masked_as_rows_grow():
    # each row holds two chunks past its tail (reserved, 0 tokens): the plan rebuilt from the
    # bumped tree plan reads exactly the rows' tokens at every length
    c, d, hkv, g = 16, 32, 2, 2
    gen = torch.Generator().manual_seed(4)
    shared = [0, 1]
    tables = [shared + [2 + 3 * r, 3 + 3 * r, 4 + 3 * r] for r in range(5)]
    k, v = (torch.randn(17, hkv, c, d, generator=gen) for _ in range(2))
    q = torch.randn(5, g * hkv, d, generator=gen)
    for extra in (1, 7, 16, 17, 30):
        lens = [2 * c + extra + r % 2 for r in range(5)]
        tree = reference.build_tree_plan(tables, lens, c, reserved=True)
        plan = tpp_torch.build_plan(tree, c, "cpu")
        # the chunks holding tokens only (reserved ones left out), their tokens live
        assert plan.chunk_ids.shape == (5, -(-(max(lens) - 2 * c) // c))
        assert int(plan.live.sum()) == sum(n - 2 * c for n in lens)
        torch.testing.assert_close(tpp_torch.tpp_decode(q, k, v, plan), decode_attention_ref(q, k, v, tables, lens))


def test_fully_shared_rows_and_an_empty_batch():
    c, d = 16, 32
    k, v = (torch.randn(4, 1, c, d, generator=torch.Generator().manual_seed(s)) for s in (1, 2))
    q = torch.randn(3, 2, d)
    tables, lens = [[0, 1]] * 3, [2 * c] * 3  # nothing private
    plan = tpp_torch.build_plan(reference.build_tree_plan(tables, lens, c), c, "cpu")
    assert plan.chunk_ids.shape == (3, 0)
    torch.testing.assert_close(tpp_torch.tpp_decode(q, k, v, plan), decode_attention_ref(q, k, v, tables, lens))
    empty = tpp_torch.build_plan(reference.build_tree_plan([], [], c), c, "cpu")
    assert tpp_torch.tpp_decode(q[:0], k, v, empty).shape == (0, 2, d)
