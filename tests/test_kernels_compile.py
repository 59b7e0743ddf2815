"""The Triton kernels of chunkserve/kernels/norm_rope.py and block_union_triton.py compiled for an
H100/H200 (sm90) on the CPU, down to the cubin: the interpreter that runs them in CI never calls the compiler, so a kernel
that only fails to compile would otherwise first fail on a GPU machine. Each compile runs in a
subprocess without TRITON_INTERPRET (conftest sets it for this process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from chunkserve.kernels import block_union_triton, norm_rope

module, name, types, consts = json.loads(sys.argv[1])
fn = getattr({"norm_rope": norm_rope, "block_union_triton": block_union_triton}[module], name)
names = fn.arg_names
signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
print(len(kernel.asm["cubin"]))
"""

_BF16 = {n: "*bf16" for n in ("X", "R", "W", "Y", "H", "Q", "K", "V", "Cos", "Sin", "OQ", "OK", "KC", "VC")}
_IDX = {"Chunk": "*i64", "Offset": "*i64", "eps": "fp32"}

# block_union's pointers (the engine's dtypes: bf16 keys and bounds, fp32 scores, int32 page ids)
_BU = {
    "Q": "*bf16",
    "Bounds": "*bf16",
    "Scratch": "*fp32",
    "Agg": "*fp32",
    "AggBits": "*i32",
    "Limits": "*i32",
    "qk_scale": "fp32",
    "spread": "fp32",
    "Ids": "*i32",
    "Dst": "*i64",
    "Counts": "*i32",
    "Blocks": "*i64",
    "Table": "*i64",
    "Out": "*bf16",
    "KPool": "*bf16",
    "Chunks": "*i64",
}

CASES = [
    ("norm_rope", "_rmsnorm_kernel", {"HAS_RES": True, "BLOCK": 4096}),
    ("norm_rope", "_rmsnorm_kernel", {"HAS_RES": False, "BLOCK": 1024}),
    # llama3-8b's heads; one KV head (a rank of 8 under tensor parallelism), where the compiler
    # takes an argument equal to 1 as a constant
    ("norm_rope", "_rope_kernel", {"HEAD": 128, "HALF": 64, "BLOCK": 64, "HB": 8, "STORE": False}),
    ("norm_rope", "_rope_kernel", {"HEAD": 128, "HALF": 64, "BLOCK": 64, "HB": 1, "HKV": 1, "STORE": False}),
    ("norm_rope", "_rope_kernel", {"HEAD": 128, "HALF": 64, "BLOCK": 64, "HB": 8, "STORE": True}),  # rope_store
    ("norm_rope", "_store_kv_kernel", {"D": 128, "BLOCK_H": 8, "BLOCK_D": 128}),
    ("norm_rope", "_store_kv_kernel", {"D": 64, "BLOCK_H": 1, "BLOCK_D": 64, "HKV": 1}),
    ("norm_rope", "_silu_mul_kernel", {"BLOCK": 1024, "LIBDEVICE": True}),
    # llama3-8b's heads, BlockUnion's defaults (blocks of 128 tokens: 2 chunks of 64)
    (
        "block_union_triton",
        "agg_kernel",
        {"G": 4, "SUB": 4, "HP": 1, "D": 128, "BLOCK_Q": 128, "BLOCK_N": 64, "FOLD_SUM": True},
    ),
    (
        "block_union_triton",
        "agg_kernel",
        {"G": 4, "SUB": 4, "HP": 2, "D": 128, "BLOCK_Q": 64, "BLOCK_N": 16, "FOLD_SUM": False},
    ),
    ("block_union_triton", "pages_kernel", {"E": 8, "GROUPS": 1, "HKV": 8, "BC": 2, "FREE_P": 64}),
    ("block_union_triton", "block_keys_kernel", {"BC": 2, "D": 128, "BLOCK_N": 64}),
    ("block_union_triton", "chunk_bounds_kernel", {"C": 64, "D": 128, "ROWS": 32}),
]


@pytest.mark.parametrize("module,name,consts", CASES, ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(CASES)])
def test_kernel_compiles_for_sm90(module, name, consts):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    types = {**_BF16, **_IDX} if module == "norm_rope" else _BU
    arg = json.dumps([module, name, types, consts])
    out = subprocess.run([sys.executable, "-c", _SCRIPT, arg], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 0  # a cubin's bytes
