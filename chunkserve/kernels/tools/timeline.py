"""Per-program timelines of the TPP decode kernels on the GPU: where a step's time goes.

    python -m chunkserve.kernels.tools.timeline p1024_512 g1024_512 [--set _ROWS=1 --set _FOLD_PAIRS=False]

A case is `<p|g><n_p>_<n_s>[@b][o]`: the decode benchmark's paper grid (p: MHA, 32 heads, fp16) or
GQA grid (g: 32 query / 8 KV heads, bf16), b = 32 rows unless `@b`, and `o` for the rows' private
tokens only (the shared level dropped). `--set` changes a knob of chunkserve/kernels/tpp.py or
chunkserve/kernels/tpp_plan.py for the run.

This builds a copy of chunkserve/kernels/tpp.py (``stamped_source``) whose two attend kernels record, per
program, %globaltimer at its start, at the end of its streaming loop (before it waits for phase 1
and folds) and at its end, and the multiprocessor it ran on (%smid). It runs the case's step in a
CUDA graph after calls over rotated copies of the pools (KV from HBM, as chunkserve.kernels.tools.bench times it)
and prints, for two replays, per phase: how many programs, their end times and streaming times
(quantiles, us from the step's first program), how many ran and had started at each twelfth of
the step, and phase-2 end times grouped by what shared the program's multiprocessor.

The stamps cost registers (sm90: the MHA phase-2 kernel 111 -> 143, one program per multiprocessor
fewer), so read the shapes (waves, tails, spread), not the absolute times.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import pathlib
import sys
import tempfile
from collections.abc import Sequence

import numpy as np
import torch

from chunkserve.kernels import tpp_plan
from chunkserve.kernels.tools import bench

_TPP = pathlib.Path(__file__).parents[1] / "tpp.py"  # chunkserve/kernels/tpp.py
_STAMP = """    _sp = Stamps + ({index} * (hq // G) + kv) * 4
    tl.store(_sp, _t0)
    tl.store(_sp + 1, _t1)
    _t2 = _gtime(kv)
    tl.store(_sp + 2, _t2)
    tl.store(_sp + 3, _sm.to(tl.int64))
"""
_HELPERS = """@triton.jit
def _gtime(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _smid(x):
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1)


STAMPS = [None]  # int64 [items * Hkv * 4]: (start, streamed, end, sm) per (item, KV head)


"""
_START = "    _t0 = _gtime(kv)\n    _sm = _smid(kv)\n"
_STREAMED = "    _t1 = _gtime(kv)\n"
# (anchor in chunkserve/kernels/tpp.py, text put in its place): each anchor must occur exactly once
_EDITS = [
    ("@triton.jit\ndef _step(", _HELPERS + "@triton.jit\ndef _step("),
    ("def _attend_kernel(\n    Q,\n", "def _attend_kernel(\n    Stamps,\n    Q,\n"),
    ("def _attend_rows_kernel(\n    Q,\n", "def _attend_rows_kernel(\n    Stamps,\n    Q,\n"),
    # _attend_kernel: start, streamed (before gdc_wait), end
    (
        "    it = Items + (first + piece) * 10\n    row0 = tl.load(it + 1)\n",
        "    it = Items + (first + piece) * 10\n" + _START + "    row0 = tl.load(it + 1)\n",
    ),
    (
        "    if EARLY:  # started before the launch before completed: past this point it has\n",
        _STREAMED + "    if EARLY:  # started before the launch before completed: past this point it has\n",
    ),
    (
        """        tl.store(PartLse + part, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=live)
""",
        """        tl.store(PartLse + part, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf")), mask=live)
"""
        + _STAMP.format(index="(first + piece)"),
    ),
    # _attend_rows_kernel: the same, stamped at its first item
    (
        "    kv = tl.program_id(1)\n    hq = G * tl.num_programs(1)\n    offs_t = tl.arange(0, ROWS)\n",
        "    kv = tl.program_id(1)\n" + _START + "    hq = G * tl.num_programs(1)\n    offs_t = tl.arange(0, ROWS)\n",
    ),
    (
        "    if EARLY:  # started before phase 1 completed: past this point it has\n",
        _STREAMED + "    if EARLY:  # started before phase 1 completed: past this point it has\n",
    ),
    (
        """        o.to(Out.dtype.element_ty),
        mask=live[:, None],
    )


@triton.jit
def _merge_kernel(""",
        """        o.to(Out.dtype.element_ty),
        mask=live[:, None],
    )
"""
        + _STAMP.format(index="(first + base)")
        + """

@triton.jit
def _merge_kernel(""",
    ),
    # TppDecoder's launches: the attend kernels (kinds 0 and 1) take the stamps first
    (
        "            launch(fn, grid, args, options, (key, spec))\n",
        "            launch(fn, grid, (STAMPS[0], *args) if kind < 2 else args, options, (key, spec))\n",
    ),
]


def stamped_source(src: str) -> str:
    """chunkserve/kernels/tpp.py's source with the stamps put in; ValueError naming an anchor that is not
    there exactly once (the kernels changed under this tool: update _EDITS)."""
    for old, new in _EDITS:
        if src.count(old) != 1:
            raise ValueError(
                f"chunkserve/kernels/tpp.py has {src.count(old)} of the anchor {old.splitlines()[0]!r}, not 1"
            )
        src = src.replace(old, new)
    return src


def stamped_module():
    """A module from ``stamped_source`` (written to a file: Triton reads its kernels' source)."""
    name = "kernels_tpp_stamped"
    if name in sys.modules:
        return sys.modules[name]
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(stamped_source(_TPP.read_text()))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _q(xs: np.ndarray, f: float) -> float:
    return round(float(np.sort(xs)[min(len(xs) - 1, int(f * len(xs)))]), 1)


def summarize(stamps: np.ndarray, phases: Sequence[int]) -> dict:
    """stamps: int64 [items, Hkv, 4] (start ns, streamed ns, end ns, sm), rows of zeros for items
    no program stamped (a rows-per-program launch stamps its first item); phases[i]: item i's
    phase. Times in us from the first program's start."""
    ok = stamps[..., 0] > 0
    phase = np.broadcast_to(np.asarray(phases)[:, None], ok.shape)[ok]
    st = stamps[ok]
    t0 = st[:, 0].min()
    start, streamed, end = ((st[:, i] - t0) / 1e3 for i in range(3))
    out: dict = {"span_us": round(float(end.max()), 2)}
    at = [round(float(end.max()) * i / 12, 1) for i in range(12)]
    for p in (1, 2):
        sel = phase == p
        if not sel.any():
            continue
        s, e = start[sel], end[sel]
        out[f"phase{p}"] = dict(
            programs=int(sel.sum()),
            end=[_q(e, f) for f in (0, 0.5, 0.9, 1)],
            stream=[_q(streamed[sel] - s, f) for f in (0, 0.1, 0.5, 0.9, 1)],
            at=at,
            running=[int(((s <= t) & (t < e)).sum()) for t in at],
            started=[int((s <= t).sum()) for t in at],
        )
    # phase-2 ends by what ran on the program's multiprocessor over the step: "<phase-1>p1/<phase-2>p2"
    sm = st[:, 3]
    count = {p: {int(k): int(n) for k, n in zip(*np.unique(sm[phase == p], return_counts=True))} for p in (1, 2)}
    groups: dict[str, list[float]] = {}
    for k, e in zip(sm[phase == 2], end[phase == 2]):
        groups.setdefault(f"{count[1].get(int(k), 0)}p1/{count[2][int(k)]}p2", []).append(float(e))
    out["phase2_end_by_sm"] = {
        g: [len(v), round(min(v), 1), round(sum(v) / len(v), 1), round(max(v), 1)] for g, v in sorted(groups.items())
    }
    return out


def parse_case(name: str) -> bench.Case:
    """`<p|g><n_p>_<n_s>[@b][o]`, see the module docstring."""
    only = name.endswith("o")
    body = name[:-1] if only else name
    body, _, rows = body.partition("@")
    if body[:1] not in ("p", "g") or "_" not in body:
        raise ValueError(f"case {name!r}: want <p|g><n_p>_<n_s>[@b][o], e.g. p1024_512 or g2304_2048@128")
    n_p, n_s = map(int, body[1:].split("_"))
    b = int(rows or 32)
    hq, hkv, dtype = (32, 32, "fp16") if body[0] == "p" else (32, 8, "bf16")
    levels = bench._two_level(b, n_s, n_p - n_s)
    return bench.Case(body[0], b, hq, hkv, 128, dtype, levels[-1:] if only else levels)


def run_case(case: bench.Case, c: int, replays: int = 2) -> list[dict]:
    """The case's step, stamped: one summary per graph replay (the last call of each replay)."""
    tpp = stamped_module()
    batch = bench.make_batch(case, c)
    ks, vs = bench._rotated_pools(batch)
    plan = tpp.build_plan(
        batch.tables, batch.lens, c, "cuda", num_q_heads=case.hq, num_kv_heads=case.hkv, head_dim=case.head_dim
    )
    stamps = torch.zeros(plan.items.shape[0] * case.hkv * 4, dtype=torch.int64, device="cuda")
    tpp.STAMPS[0] = stamps
    calls = [lambda k=k, v=v: tpp.tpp_decode(batch.q, k, v, plan) for k, v in zip(ks, vs)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, warm up
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in calls:
            f()
    phases = plan.items[:, 0].tolist()
    out = []
    for _ in range(replays):
        stamps.zero_()
        graph.replay()
        torch.cuda.synchronize()
        out.append(summarize(stamps.view(len(phases), case.hkv, 4).cpu().numpy(), phases))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.kernels.tools.timeline", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("cases", nargs="+", help="e.g. p1024_512 g1024_512 g2304_2048@128 p1024_512o")
    ap.add_argument("--chunk-size", type=int, default=64, choices=[16, 32, 64, 128])
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="a chunkserve/kernels/tpp.py or tpp_plan.py knob for the run, e.g. _ROWS=1 (VALUE a Python literal)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("chunkserve.kernels.tools.timeline needs a CUDA device")
    tpp = stamped_module()
    for knob in args.set:
        key, _, value = knob.partition("=")
        # the planner's knobs are read from chunkserve/kernels/tpp_plan.py (the stamped copy plans through it)
        owner = tpp_plan if hasattr(tpp_plan, key) else tpp
        if not hasattr(owner, key):
            raise SystemExit(f"chunkserve/kernels/tpp.py and chunkserve/kernels/tpp_plan.py have no knob {key!r}")
        setattr(owner, key, ast.literal_eval(value))
    for name in args.cases:
        for i, summary in enumerate(run_case(parse_case(name), args.chunk_size)):
            print(json.dumps(dict(case=name, replay=i, set=args.set, **summary)), flush=True)


if __name__ == "__main__":
    main()
