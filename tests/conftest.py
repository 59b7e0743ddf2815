"""Without a GPU, Triton kernels run under the Triton interpreter. The variable is read when a
kernel is decorated, so it is set here, before any test module imports kernels.tpp.

GGUF weights the tests load are cached (replicas/model/gguf_cache.py) in a directory of the
session's, which the servers the tests start inherit, not in the user's cache."""

import atexit
import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if "CHUNKSERVE_CACHE_DIR" not in os.environ:
    os.environ["CHUNKSERVE_CACHE_DIR"] = tempfile.mkdtemp(prefix="chunkserve-test-cache-")
    atexit.register(shutil.rmtree, os.environ["CHUNKSERVE_CACHE_DIR"], ignore_errors=True)
