"""chunkserve.kernels.philox: the NumPy Philox4x32-10 against Random123's known answers, and the Triton
kernel's uniforms against the NumPy reference, bit for bit (interpreter on the CPU; the GPU with
-m gpu)."""

import numpy as np
import pytest
import torch

from chunkserve.kernels import philox

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA the kernel runs in the interpreter (conftest)

# Random123's kat_vectors, philox4x32 10: counter (4 words), key (2 words) -> output (4 words)
KAT = [
    ("00000000 00000000 00000000 00000000", "00000000 00000000", "6627e8d5 e169c58d bc57ac4c 9b00dbd8"),
    ("ffffffff ffffffff ffffffff ffffffff", "ffffffff ffffffff", "408f276d 41c83b0e a20bc7c6 6d5451fd"),
    ("243f6a88 85a308d3 13198a2e 03707344", "a4093822 299f31d0", "d16cfe09 94fdcceb 5001e420 24126ea1"),
]


def _hex(words: str) -> np.ndarray:
    return np.array([int(w, 16) for w in words.split()], dtype=np.uint32)


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_reference_gives_random123s_known_answers(ctr, key, want):
    assert philox.philox4x32_ref(_hex(ctr), _hex(key)).tolist() == _hex(want).tolist()


KEYS = [0, -1, 7, 2**62 + 5, -(2**63), 123456789]
COUNTERS = [0, 1, 2**32 + 3, -1, 5, 2**40]


@pytest.mark.parametrize("n", [1, 1000, 1024, 2500])
def test_kernel_matches_the_reference(n):
    keys, counters = torch.tensor(KEYS), torch.tensor(COUNTERS)
    got = philox._uniform_triton(keys.to(DEVICE), counters.to(DEVICE), n)
    want = philox.uniform_ref(keys, counters, n)
    assert got.dtype == torch.float32 and got.shape == (len(KEYS), n)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000, 128256])
def test_uniform_runs_the_kernel_on_the_gpu(n):
    keys, counters = torch.tensor(KEYS), torch.tensor(COUNTERS)
    got = philox.uniform(keys.cuda(), counters.cuda(), n)
    assert got.is_cuda and torch.equal(got.cpu(), philox.uniform_ref(keys, counters, n))


def test_uniforms_lie_in_the_open_interval_and_differ_by_key_and_counter():
    u = philox.uniform(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 20000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert (u[0] == u[1]).float().mean() < 0.01  # unrelated streams, not shifted copies
    # the extremes, words whose kept bits are all ones or all zeros, stay inside (0, 1) in float32
    m = philox._MANTISSA
    assert (
        0 < np.float32(np.float32(0.5) * np.float32(2.0**-m))
        and np.float32(np.float32(2**m - 0.5) * np.float32(2.0**-m)) < 1
    )


@pytest.mark.parametrize(
    "keys, counters, n",
    [
        (torch.tensor([1, 2]), torch.tensor([0]), 4),  # shapes differ
        (torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 4),
        (torch.tensor([1]), torch.tensor([0]), 0),
    ],
)
def test_bad_arguments_are_refused(keys, counters, n):
    with pytest.raises(ValueError):
        philox.uniform(keys, counters, n)
