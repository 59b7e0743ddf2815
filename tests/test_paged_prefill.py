"""chunkserve.kernels.paged_prefill: FlashInfer's paged prefill over the chunk pool against the plain-torch
reference, span by span (GPU with flashinfer: `pytest -m gpu`)."""

import random

import pytest
import torch

from chunkserve.kernels.heads import PagedHeads
from chunkserve.kernels.reference import prefill_attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _spans(rng, c, num_chunks):
    """(table, context_len, num_new) covering the awkward cases: no context, a context ending
    on a chunk boundary and inside one, one new token, new tokens crossing several chunks, a
    long context; tables drawn from a shuffled pool (neighbours not adjacent)."""
    shapes = [
        (0, 1),
        (0, 5 * c + 3),
        (c, c),
        (2 * c + 7, 1),
        (3 * c - 1, 2 * c + 5),
        (17 * c + 9, 40),
        (rng.randrange(1, 9 * c), rng.randrange(1, 3 * c)),
    ]
    free = list(range(num_chunks))
    rng.shuffle(free)
    spans = []
    for context, new in shapes:
        used = -(-(context + new) // c)
        table = [free.pop() for _ in range(used + rng.randrange(2))]  # a reserved chunk past it, sometimes
        spans.append((table, context, new))
    return spans


def _match_the_reference(spans, q, out, k, v, scale, label):
    """Each span's rows of `out` (q's rows in span order) against the plain-torch reference."""
    start = 0
    for table, context, new in spans:
        want = prefill_attention_ref(q[start : start + new], k, v, table, context, scale)
        err = (out[start : start + new].float() - want.float()).abs().max().item()
        assert err <= TOL[out.dtype], f"{label}, span ({context}, {new}): off by {err}"
        start += new


# (FlashInfer compiles a module per dtype and head size on first use, about 90 s each on a
# fresh H200: three of them here; head size 256 is not run)
@pytest.mark.parametrize(
    "dtype, hq, hkv, d",
    [
        (torch.float16, 32, 32, 128),
        (torch.bfloat16, 32, 8, 128),
        (torch.bfloat16, 8, 2, 64),
        (torch.bfloat16, 8, 1, 64),
    ],
)
@pytest.mark.parametrize("c", [16, 64])
def test_spans_match_the_reference(dtype, hq, hkv, d, c):
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    from chunkserve.kernels.paged_prefill import FlashInferPrefill

    rng = random.Random(hq * 1000 + d + c)
    gen = torch.Generator(device="cuda").manual_seed(c)
    num_chunks = 80 * 64 // c
    k = torch.randn(num_chunks, hkv, c, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(num_chunks, hkv, c, d, generator=gen, device="cuda").to(dtype)
    scale = d**-0.5
    fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=torch.device("cuda"), sm_scale=scale)
    for step in range(2):  # the two wrappers in turn
        spans = _spans(rng, c, num_chunks)
        rows = sum(n for _, _, n in spans)
        q = torch.randn(rows, hq, d, generator=gen, device="cuda").to(dtype)
        assert fi.plan(spans) == rows
        out = fi.run(q, k, v)
        assert out.shape == q.shape and out.dtype == dtype
        _match_the_reference(spans, q, out, k, v, scale, f"step {step}")


def test_bad_plans_and_runs_are_refused():
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    from chunkserve.kernels.paged_prefill import FlashInferPrefill, usable

    assert not usable(torch.float32, 64, torch.device("cuda")) and not usable(torch.bfloat16, 64, torch.device("cpu"))
    assert not usable(torch.bfloat16, 96, torch.device("cuda"))
    fi = FlashInferPrefill(
        PagedHeads(num_q_heads=4, num_kv_heads=2, head_dim=64, chunk_size=16),
        dtype=torch.bfloat16,
        device=torch.device("cuda"),
        sm_scale=0.125,
    )
    with pytest.raises(ValueError, match="needs 3 chunks"):
        fi.plan([([0, 1], 30, 5)])
    with pytest.raises(ValueError, match="new tokens"):
        fi.plan([([0], 3, 0)])
    fi.plan([([0, 1], 20, 5)])
    k = torch.zeros(2, 2, 16, 64, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="5 query rows"):
        fi.run(torch.zeros(4, 4, 64, dtype=torch.bfloat16, device="cuda"), k, k)
    with pytest.raises(ValueError, match="16-bit"):
        FlashInferPrefill(
            PagedHeads(num_q_heads=4, num_kv_heads=2, head_dim=64, chunk_size=16),
            dtype=torch.float32,
            device=torch.device("cuda"),
            sm_scale=0.125,
        )


def test_plans_ahead_of_a_busy_device_keep_their_metadata():
    """Steps that sample nothing (a long prompt's middle pieces) are not waited for, so the host
    may plan several steps while the device still runs an earlier one: each wrapper's plan
    stages its metadata in page-locked memory the device copies in stream order, and planning
    a wrapper again before that copy has run would hand the queued step the later plan."""
    pytest.importorskip("flashinfer", reason="needs flashinfer (on the GPU box: source .gpu/activate)")
    from chunkserve.kernels.paged_prefill import FlashInferPrefill

    dtype, hq, hkv, d, c = torch.bfloat16, 32, 8, 128, 64
    rng = random.Random(5)
    gen = torch.Generator(device="cuda").manual_seed(5)
    num_chunks = 80
    k = torch.randn(num_chunks, hkv, c, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(num_chunks, hkv, c, d, generator=gen, device="cuda").to(dtype)
    scale = d**-0.5
    fi = FlashInferPrefill(PagedHeads(hq, hkv, d, c), dtype=dtype, device=torch.device("cuda"), sm_scale=scale)
    steps = [_spans(rng, c, num_chunks), _spans(rng, c, num_chunks)[:2], _spans(rng, c, num_chunks)[3:]]
    qs = [torch.randn(sum(n for _, _, n in s), hq, d, generator=gen, device="cuda").to(dtype) for s in steps]
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 31)  # the device busy for about a second: the host plans every step before it runs
    outs = []
    for spans, q in zip(steps, qs):
        fi.plan(spans)
        outs.append(fi.run(q, k, v))
    assert fi.plan_waits == 1  # the third plan reused the first's wrapper: it waited for its copy
    torch.cuda.synchronize()
    for step, (spans, q, out) in enumerate(zip(steps, qs, outs)):
        _match_the_reference(spans, q, out, k, v, scale, f"step {step}")
