"""Without a GPU, Triton kernels run under the Triton interpreter. The variable is read when a
kernel is decorated, so it is set here, before any test module imports chunkserve.kernels.tpp.

GGUF weights the tests load are cached (chunkserve/replicas/model/gguf_cache.py) in a directory of the
session's, which the servers the tests start inherit, not in the user's cache.

After each GPU test the memory its engines left cached in torch's allocator goes back to the
driver: with every GPU test in one process (`pytest -m gpu`), later tests' Triton launches and
cuBLAS calls ran out of memory on an H200, where each passed in a process of its own."""

import atexit
import gc
import os
import shutil
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "CHUNKSERVE_CACHE_DIR" not in os.environ:
    os.environ["CHUNKSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="chunkserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CHUNKSERVE_CACHE_DIR"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _release_gpu_memory(request):
    yield
    if torch.cuda.is_available() and ({"gpu", "gpu2", "gpu4"} & {m.name for m in request.node.iter_markers()}):
        gc.collect()  # (whatever of the test's engines only a reference cycle still holds)
        torch.cuda.empty_cache()
