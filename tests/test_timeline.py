"""chunkserve/kernels/tools/timeline.py: its stamped copy of kernels/tpp.py still applies, and its summary of the
stamps (the GPU run itself: `python -m chunkserve.kernels.tools.timeline`)."""

import numpy as np
import pytest

from chunkserve.kernels import tpp, tpp_plan
from chunkserve.kernels.tools import timeline


def test_the_stamps_go_into_the_current_kernels():
    src = timeline._TPP.read_text()
    out = timeline.stamped_source(src)
    # both attend kernels take the buffer and store four stamps per program, and the decoder passes
    # it to both (kinds 0 and 1: TppDecoder's launches of them)
    assert out.count("    Stamps,\n    Q,\n") == 2 and out.count("tl.store(_sp + 3, _sm.to(tl.int64))") == 2
    assert out.count("(STAMPS[0], *args) if kind < 2 else args") == 1 and out.count("_t1 = _gtime(kv)") == 2
    module = timeline.stamped_module()
    assert module.STAMPS == [None] and module.build_plan is tpp_plan.build_plan  # one planner
    tables, lens = [[0, 1, 2], [0, 1, 3]], [150, 170]
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64)
    a, b = (m.build_plan(tables, lens, 64, "cpu", **kw) for m in (tpp, module))
    assert a.items.tolist() == b.items.tolist() and a.launches == b.launches


def test_an_anchor_the_kernels_lost_is_named():
    src = timeline._TPP.read_text().replace("def _attend_rows_kernel(\n    Q,\n", "def _attend_rows_kernel(\n    QQ,\n")
    with pytest.raises(ValueError, match="_attend_rows_kernel"):
        timeline.stamped_source(src)


def test_summary_of_stamps():
    us = 1000  # ns
    t = 5_000_000
    # items: one phase-1 piece, three phase-2 pieces; 2 KV heads; (start, streamed, end, sm)
    st = np.zeros((4, 2, 4), dtype=np.int64)
    st[0, 0] = (t, t + 8 * us, t + 9 * us, 0)
    st[0, 1] = (t, t + 7 * us, t + 8 * us, 1)
    st[1, 0] = (t + 1 * us, t + 10 * us, t + 11 * us, 0)
    st[1, 1] = (t + 1 * us, t + 9 * us, t + 10 * us, 2)
    st[2, 0] = (t + 1 * us, t + 11 * us, t + 12 * us, 2)
    st[2, 1] = (t + 10 * us, t + 19 * us, t + 20 * us, 2)
    # item 3 unstamped (rows-per-program launch): ignored
    got = timeline.summarize(st, [1, 2, 2, 2])
    assert got["span_us"] == 20.0
    assert got["phase1"]["programs"] == 2 and got["phase1"]["end"] == [8.0, 9.0, 9.0, 9.0]
    p2 = got["phase2"]
    assert p2["programs"] == 4 and p2["end"] == [10.0, 12.0, 20.0, 20.0]
    assert p2["stream"] == [8.0, 8.0, 9.0, 10.0, 10.0]  # streamed - start
    assert p2["at"][:2] == [0.0, 1.7] and p2["running"][:2] == [0, 3] and p2["started"][-1] == 4
    # sm 0: one phase-1 and one phase-2 program; sm 2: three phase-2 programs
    assert got["phase2_end_by_sm"] == {"0p1/3p2": [3, 10.0, 14.0, 20.0], "1p1/1p2": [1, 11.0, 11.0, 11.0]}


def test_case_names():
    c = timeline.parse_case("g2304_2048@128")
    assert (c.batch, c.hq, c.hkv, c.dtype, c.levels) == (128, 32, 8, "bf16", ((1, 2048), (128, 256)))
    c = timeline.parse_case("p1024_512o")
    assert (c.batch, c.hkv, c.levels) == (32, 32, ((32, 512),))
    with pytest.raises(ValueError, match="want"):
        timeline.parse_case("x1024")
