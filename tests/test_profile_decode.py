"""The decode profiler's accounting (the tool itself needs a GPU: run there)."""

import pytest

from chunkserve.replicas.tools.profile_decode import kind, union_us


@pytest.mark.parametrize(
    "intervals, busy",
    [
        ([], 0.0),
        ([(0, 2), (1, 3), (5, 6)], 4.0),  # overlapping kernels count once, the gap not at all
        ([(5, 6), (0, 10)], 10.0),  # one inside another
        ([(0, 1), (1, 2)], 2.0),  # back to back
    ],
)
def test_union_counts_busy_time_once(intervals, busy):
    assert union_us(intervals) == busy


@pytest.mark.parametrize(
    "name, expected",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemm"),
        ("nvjet_tst_128x64_64x4", "gemm"),
        ("_tpp_phase2_kernel", "attention"),
        ("BatchPrefillWithPagedKVCacheKernel", "attention"),
        # FlashInfer's sm90 (FA3) prefill is a cutlass template: attention, not a GEMM
        ("void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<Params", "attention"),
        ("void cutlass::device_kernel<flashinfer::BatchPrefillKernelTraits<128>>", "attention"),
        ("_fused_rms_norm_rope", "norm_rope"),
        ("_nucleus_search", "sampler"),
        ("Memcpy DtoD (Device -> Device)", "copy"),
        ("_attend_kernel", "attention"),
        ("_merge_kernel", "attention"),
        ("index_elementwise_kernel<128, 4, gpu_index_kernel<index_put_kernel_impl", "kv_write"),
        ("_store_kv_kernel", "kv_write"),
        ("vectorized_elementwise_kernel", "other"),
    ],
)
def test_kernel_kinds(name, expected):
    assert kind(name) == expected
