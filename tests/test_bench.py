"""chunkserve.kernels.tools.bench's check of issue 5's targets on a decode run's rows (the run itself needs CUDA),
and its read floor's kernels (under the Triton interpreter without CUDA)."""

import pytest
import torch

from chunkserve.kernels.tools.bench import _READ_BLOCK, read_kv, read_kv_tma, targets


def row(grid, b, n_p, n_s, ours, paged, cascade=None, bound=10.0, tc=None):
    return dict(
        grid=grid,
        b=b,
        n_p=n_p,
        n_s=n_s,
        ours_us=ours,
        fi_paged_us=paged,
        fi_cascade_us=cascade,
        fi_paged_tc_us=tc,
        bound_us=bound,
        ours_tok_per_s=b / ours * 1e6,
    )


def test_targets_name_the_rows_that_miss():
    rows = [
        row("paper", 32, 1024, 0, 100.0, 96.0),  # 1.04x paged: holds
        row("paper", 32, 2048, 0, 110.0, 100.0),  # 1.10x: misses
        row("gqa", 32, 1024, 0, 35.0, 54.0, tc=32.0),  # 0.65x paged, 1.09x its tensor-core path: misses
        row("paper", 32, 1024, 512, 70.0, 90.0, 120.0),  # 0.78x the faster path: holds
        dict(row("paper", 32, 2048, 1024, 130.0, 155.0), read_us=124.5),  # misses; limit 124 under the read floor
        row("gqa", 32, 1024, 512, 24.0, 50.0, 100.0, tc=29.0),  # 0.83x the tensor-core paged: misses
        row("paper", 32, 4096, 4096, 25.0, 200.0, 60.0, bound=15.0),  # within 26 us, 8x, 2.4x: misses 2.5x
        row("gqa", 32, 4096, 4096, 14.1, 190.0, 60.0, bound=4.0),  # bound + 10.1: misses
        row("batch", 16, 2304, 2048, 15.0, 60.0, 66.0),
        row("batch", 32, 2304, 2048, 21.0, 110.0, 90.0),  # more tokens per second: holds
        row("batch", 64, 2304, 2048, 45.0, 210.0, 140.0),  # fewer: misses
        dict(row("tree", 32, 2348, 2048, 1.0, 40.0), ours_us=None),  # not timed: not checked
    ]
    got = targets(rows)
    assert got["nothing_shared"] == dict(
        checks=3, missed=[["paper b=32 2048/0 us", 110.0, 105.0], ["gqa b=32 1024/0 us", 35.0, 33.6]]
    )
    assert got["partially_shared"]["missed"] == [
        ["paper b=32 2048/1024 us", 130.0, 124.0],
        ["gqa b=32 1024/512 us", 24.0, 23.2],
    ]
    assert got["partially_shared"]["below_read"] == [["paper b=32 2048/1024", 124.0, 124.5]]
    assert got["partially_shared"]["checks"] == 6  # the batch rows are partially shared too
    assert got["fully_shared"] == dict(
        checks=5,
        missed=[["paper b=32 4096/4096 x faster than fi_cascade", 2.4, 2.5], ["gqa b=32 4096/4096 us", 14.1, 14.0]],
    )
    assert got["batch_scaling"]["checks"] == 2
    assert [m[0] for m in got["batch_scaling"]["missed"]] == ["batch b=64 2304/2048 tok/s (b=32: 1523810)"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("programs", [1, 3])
def test_read_kv_reads_every_element_once(dtype, programs):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(21, 2, 16, 16, generator=gen).to(dtype).to(device) for _ in range(2))  # 10752 elements
    got = read_kv(k, v, programs).cpu()
    assert got.shape == (2, programs)
    per = -(-k.numel() // programs // _READ_BLOCK) * _READ_BLOCK  # each program's run, the last one cut short
    for row, x in enumerate((k, v)):
        flat = x.flatten().float().cpu()
        want = torch.stack([flat[p * per : (p + 1) * per].sum() for p in range(programs)])
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("programs, box", [(1, 16), (3, 16), (4, 32)])
def test_read_kv_tma_reads_every_row_once(dtype, programs, box):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device="cpu").manual_seed(0)
    k, v = (torch.randn(21, 2, 16, 16, generator=gen).to(dtype).to(device) for _ in range(2))  # 672 rows of 16
    got = read_kv_tma(k, v, programs, box).cpu()
    rows = k.numel() // 16
    per = -(-rows // programs // box) * box  # each program's rows, whole boxes; the last cut short
    assert got.shape == (2, -(-rows // per))
    assert per * (got.shape[1] - 1) < rows <= per * got.shape[1]
    for row, x in enumerate((k, v)):
        flat = x.reshape(rows, 16).float().cpu()
        want = torch.stack([flat[p * per : (p + 1) * per].sum() for p in range(got.shape[1])])
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("nhd", [False, True])
def test_dense_prefill_pools_hold_the_prompt_at_its_chunks(nhd):
    from chunkserve.kernels.tools.bench_dense_prefill import _pool

    gen = torch.Generator().manual_seed(3)
    k = torch.randn(21, 2, 8, generator=gen)  # 21 tokens: the last of 3 chunks of 8 is partial
    table = [5, 0, 3]
    pool = _pool(k, table, 8, 6, nhd)
    assert pool.shape == ((6, 8, 2, 8) if nhd else (6, 2, 8, 8))
    chunks = pool[torch.tensor(table)]
    tokens = (chunks if nhd else chunks.transpose(1, 2)).reshape(24, 2, 8)
    assert torch.equal(tokens[:21], k) and not tokens[21:].any()
    assert not pool[torch.tensor([1, 2, 4])].any()  # chunks the table does not name stay empty


def test_causal_flops_count_each_rows_keys():
    from chunkserve.kernels.tools.bench_dense_prefill import causal_flops

    # 3 rows after 4 keys see 5, 6 and 7 keys: 18 pairs, 4 * heads * dim FLOPs each
    assert causal_flops(4, 3, 2, 8) == 18 * 4 * 2 * 8
