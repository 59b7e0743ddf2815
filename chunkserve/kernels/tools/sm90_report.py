"""What the attend kernel of chunkserve/kernels/tpp.py compiles to on sm90, without a GPU.

    python -m chunkserve.kernels.tools.sm90_report        # one JSON line per query tile the plans launch

For each tile (the launch config ``tpp_plan._launch_config`` picks for it) Triton compiles the kernel
for sm90 on this machine's CPU; we report its shared memory, the registers ptxas gives it, how
many K and V buffers Triton's pipeliner allocated, and how many programs of it fit on one
multiprocessor. That is how we found the chunk-id load inside the streaming loop leaving K and
V single-buffered (a load the next block's addresses wait on). Run it without
TRITON_INTERPRET=1: under the interpreter ``triton.jit`` kernels cannot be compiled.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from chunkserve.kernels import tpp, tpp_plan

# H100 / H200 per multiprocessor: shared memory usable by programs, registers, warps
_SMEM_BYTES = 227 << 10
_REGISTERS = 64 << 10
_WARPS = 64
_INT_ARGS = {"first", "stride_qb", "stride_qh", "stride_kc", "stride_kh", "stride_ob", "stride_oh"}
_DTYPES = {"fp16": ("*fp16", tl.float16), "bf16": ("*bf16", tl.bfloat16), "fp32": ("*fp32", tl.float32)}

# (name, dtype, head_dim, G, chunk size, BLOCK_M, live query vectors): the tiles of the bench
# grid; phase-1 tiles compiled with K/V by TMA where tpp._TMA (as on the H200) and without
TILES = [
    ("mha_phase1", "fp16", 128, 1, 64, 32, 32),
    ("mha_phase1_alone", "fp16", 128, 1, 64, 64, 64),  # nothing private: tpp_plan._P1_ALONE_M
    ("mha_phase2", "fp16", 128, 1, 64, 16, 1),
    ("gqa_phase1", "bf16", 128, 4, 64, 64, 64),
    ("gqa_phase2", "bf16", 128, 4, 64, 16, 4),
]


def report(dtype: str, head_dim: int, g: int, c: int, block_m: int, live: int, tma: bool) -> dict:
    """Compile one attend tile for sm90 and describe it (see the module docstring)."""
    ptr, dot_t = _DTYPES[dtype]
    elem = 4 if dtype == "fp32" else 2
    cfg = tpp_plan._launch_config(head_dim, block_m, elem, live)
    const = dict(
        G=g,
        C=c,
        D=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        DOT_T=dot_t,
        DOT_PREC="ieee" if dtype == "fp32" else "tf32",
        LAUNCH_NEXT=True,
        EARLY=True,
        TMA=tma,
        TAIL=live != block_m,  # phase 2 (live < block_m) folds, as tpp_decode launches it
        FOLD_P=triton.next_power_of_2(tpp_plan._FOLD_MAX) if tpp._FOLD_VEC_MIN and live < block_m else 1,
        FOLD_VEC_MIN=tpp._FOLD_VEC_MIN,
    )
    if not tma:
        const.update(Kd=None, Vd=None)
    params = list(inspect.signature(tpp._attend_kernel.fn).parameters)
    sig = {}
    for p in params:
        if p in const:
            sig[p] = "constexpr"
        elif p in ("Kd", "Vd"):  # as the JIT types a TensorDescriptor of [BLOCK_N, D] boxes
            sig[p] = f"tensordesc<{dtype}[{cfg['BLOCK_N']}, {head_dim}]>"
        elif p == "qk_scale":
            sig[p] = "fp32"
        elif p in _INT_ARGS:
            sig[p] = "i32"
        elif p in ("Q", "K", "V", "Out"):
            sig[p] = ptr
        elif p in ("PartO", "PartLse"):
            sig[p] = "*fp32"
        else:
            sig[p] = "*i32"
    # as the JIT specialises them at run time: pointers 16-byte aligned, strides multiples of 16
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, p in enumerate(params)
        if sig[p].startswith("*") or p.startswith("stride")
    }
    src = ASTSource(
        fn=tpp._attend_kernel, signature=sig, constexprs={(params.index(k),): v for k, v in const.items()}, attrs=attrs
    )
    kernel = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    )
    shared = kernel.metadata.shared
    registers = _registers(kernel.asm["ptx"])
    # K and V tiles in shared memory: memdesc<N x BLOCK_N x D>, N buffers each
    tile = rf"memdesc<(\d+)x{cfg['BLOCK_N']}x{head_dim}x"
    buffers = [int(n) for n in re.findall(tile, kernel.asm["ttgir"])]
    threads = 32 * cfg["num_warps"]
    fit = min(
        _SMEM_BYTES // max(1, shared + 1024),  # + the driver's 1 KB per program
        _REGISTERS // (threads * _round_up(registers, 8)),
        _WARPS // cfg["num_warps"],
    )
    return dict(
        dtype=dtype,
        head_dim=head_dim,
        g=g,
        c=c,
        block_m=block_m,
        live=live,
        tma=tma,
        **cfg,
        shared_bytes=shared,
        planned_shared_bytes=tpp_plan._shared_bytes(head_dim, block_m, elem, cfg),  # what build_plan assumes
        registers=registers,
        kv_buffers=min(buffers) if buffers else 0,
        programs_per_sm=fit,
    )


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _registers(ptx: str) -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", path, "-o", os.path.join(tmp, "k.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    found = re.search(r"Used (\d+) registers", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"no register count in ptxas output: {(out.stdout + out.stderr)[-300:]}")
    return int(found.group(1))


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: the interpreter cannot compile kernels")
    for name, dtype, head_dim, g, c, block_m, live in TILES:
        for tma in sorted({False, tpp._TMA and live == block_m}):  # phase-1 tiles by TMA
            print(json.dumps(dict(tile=name, **report(dtype, head_dim, g, c, block_m, live, tma))), flush=True)


if __name__ == "__main__":
    main()
