"""The wire messages' cost per message: `python -m chunkserve.replicas.tools.bench_wire [--rows 32]` prints
one JSON line per message (the engine pipe's StepOutputs of a decode step of --rows requests, the
direct stream's StreamOutput of one token, the pipe's AddRequest): microseconds to build, check
(wire.check) and pickle it, and to unpickle it, with the same for a plain tuple of a tag and the
same fields (the messages' form before the wire types) beside, and the bytes of each.

Each figure is the least of --rounds interleaved rounds (the two forms alternate, so a busy
machine slows both alike). CPU only.
"""

from __future__ import annotations

import argparse
import json
import pickle
import timeit
from collections.abc import Callable

from chunkserve.replicas.engine.llm_engine import RequestOutput
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.wire import (
    ENGINE_COMMANDS,
    ENGINE_REPLIES,
    STREAM_REPLIES,
    AddRequest,
    GenerateOutput,
    StepOutputs,
    StreamOutput,
    check,
)

P = pickle.HIGHEST_PROTOCOL


def _cases(rows: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """message -> (the wire type built and checked, the tagged tuple built)."""
    outputs = [RequestOutput(f"req-{i:08x}", [1000 + i], False, None, 500, 256, 10) for i in range(rows)]
    stats = {"steps": 1234, "running": rows, "waiting": 0, "free_chunks": 100}
    out = GenerateOutput("replica-0", " the", (1234,), None, 500, 256, 11)
    prompt, params = list(range(2000)), SamplingParams(max_tokens=128)

    def step() -> object:
        m = StepOutputs(outputs, [], [], stats, None)
        check(m, ENGINE_REPLIES, "the engine pipe")
        return m

    def frame() -> object:
        m = StreamOutput(17, out)
        check(m, STREAM_REPLIES, "the direct stream")
        return m

    def add() -> object:
        m = AddRequest("req-1", prompt, params, None)
        check(m, ENGINE_COMMANDS, "the engine pipe")
        return m

    return {
        f"StepOutputs ({rows} rows)": (step, lambda: ("step", outputs, [], [], stats, None)),
        "StreamOutput (1 token)": (frame, lambda: ("out", 17, out)),
        "AddRequest (2000-token prompt)": (add, lambda: ("add", "req-1", prompt, params, None)),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m chunkserve.replicas.tools.bench_wire", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=32, help="requests in the step message")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--number", type=int, default=2000, help="messages timed per round")
    args = ap.parse_args(argv)
    for name, makers in _cases(args.rows).items():
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):
            for form, make in zip(("wire", "tuple"), makers):
                data = pickle.dumps(make(), P)
                for what, fn in (("dumps", lambda: pickle.dumps(make(), P)), ("loads", lambda: pickle.loads(data))):
                    t = timeit.timeit(fn, number=args.number) / args.number
                    best[form, what] = min(best.get((form, what), t), t)
        row: dict[str, object] = {"bench": "wire", "message": name}
        for form, make in zip(("wire", "tuple"), makers):
            row[f"{form}_bytes"] = len(pickle.dumps(make(), P))
            row[f"{form}_dumps_us"] = round(best[form, "dumps"] * 1e6, 2)  # (build and check included)
            row[f"{form}_loads_us"] = round(best[form, "loads"] * 1e6, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
