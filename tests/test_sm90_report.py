"""chunkserve/kernels/tools/sm90_report.py: the attend kernel compiled for sm90 on the CPU (no GPU needed).

Guards what the H200 measurements rest on: K and V at least double-buffered wherever the launch
config asks for three pipeline stages (a load in the streaming loop that the next block's
addresses wait on makes Triton single-buffer them), and two or more programs per multiprocessor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_every_tile_double_buffers_kv_and_fits_two_programs_per_sm():
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run(
        [sys.executable, "-m", "chunkserve.kernels.tools.sm90_report"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    phase1 = {"mha_phase1", "mha_phase1_alone", "gqa_phase1"}
    assert {r["tile"] for r in rows} == phase1 | {"mha_phase2", "gqa_phase2"}
    assert {r["tile"] for r in rows if r["tma"]} == phase1  # phase 1 by TMA too
    for r in rows:
        if r["live"] < r["block_m"]:  # phase-2 tiles: build_plan's lean_phase2 rests on this estimate
            assert r["planned_shared_bytes"] == r["shared_bytes"], r
        assert r["shared_bytes"] > 0 and 0 < r["registers"] <= 255, r
        assert r["kv_buffers"] >= (2 if r["num_stages"] >= 3 else 1), r
        assert r["programs_per_sm"] >= 2, r
