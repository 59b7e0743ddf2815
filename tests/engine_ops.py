"""Random add/step/abort sequences on an engine, as the hypothesis tests draw them
(tests/test_engine.py, tests/test_host_tier.py): `engine.check()` after every step and abort,
then run to the end; every request added finishes or is aborted."""

from __future__ import annotations

from collections.abc import Callable

import hypothesis.strategies as st

from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from chunkserve.replicas.engine.sequence import Tenancy

SALTS = [None, "a", "b"]  # no salt and two tenants' namespaces: the same prompts in separate trees


def ops(max_length: int, bases: int, max_size: int) -> st.SearchStrategy:
    """("add", length, base, max_tokens, salt) | ("step", n) | ("abort", which)."""
    return st.lists(
        st.one_of(
            st.tuples(
                st.just("add"),
                st.integers(1, max_length),
                st.integers(0, bases - 1),
                st.integers(1, 12),
                st.integers(0, 2),
            ),
            st.tuples(st.just("step"), st.integers(1, 4)),
            st.tuples(st.just("abort"), st.integers(0, 50)),
        ),
        min_size=1,
        max_size=max_size,
    )


def drive(engine: LLMEngine, drawn: list[tuple], prompt: Callable[[int, int], list[int]]) -> None:
    """Run the drawn ops; `prompt(base, length)` makes an add's prompt."""
    live: list[str] = []
    added = 0

    def step() -> None:
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        engine.check()

    for op in drawn:
        if op[0] == "add":
            _, length, base, max_tokens, salt = op
            rid = f"q{added}"
            added += 1
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(rid, prompt(base, length), params, Tenancy(cache_salt=SALTS[salt]))
            live.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        elif live:
            assert engine.abort(live.pop(op[1] % len(live)))
            engine.check()
    while engine.has_unfinished():
        step()
    assert not live
