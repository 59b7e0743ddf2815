"""The engine in a process of its own (chunkserve/replicas/engine_process.py), driven as the replica drives it."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

from chunkserve.replicas.engine.guided import Guide
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.engine_process import EngineProcess
from chunkserve.replicas.wire import EngineDied, StepOutputs
from chunkserve.router.events import Relay
from chunkserve.router.hashing import chunk_hashes

CONFIG = EngineConfig(model="tiny", device="cpu", kv_cache_tokens=8192, max_num_seqs=16)
PROMPTS = [[1, 2, 3, 4, 5] * 20 + [i] for i in range(6)]
PARAMS = SamplingParams(max_tokens=12, temperature=0)


class Front:
    """What LLMReplica does with its EngineProcess, minus Serve."""

    def __init__(self, core: EngineProcess, loop: asyncio.AbstractEventLoop):
        self.core, self.tokens, self.done = core, {}, {}
        self.accepted, self.rejected, self.stats, self.death = set(), {}, None, None
        self.relay = Relay()  # the tree's routing events, followed as the replica does
        if core.info.events is not None:
            self.relay.apply(core.info.events)
        self.finished = asyncio.Event()
        core.start_receiving(loop, self.on_step, self.on_death)

    def on_step(self, step: StepOutputs):
        outputs, accepted, rejected, stats, events = step
        self.accepted |= set(accepted)
        self.rejected |= dict(rejected)
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.done[out.request_id] = out.finish_reason
        self.stats = stats
        if events is not None:
            self.relay.apply(events)
        self.finished.set()

    def on_death(self, reason):
        self.death = reason
        self.finished.set()

    async def until(self, cond, timeout=120):
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            self.finished.clear()
            try:
                await asyncio.wait_for(self.finished.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


def test_tokens_equal_the_engines_and_bad_input_is_refused():
    want = LLMEngine(CONFIG).generate(PROMPTS, PARAMS)
    core = EngineProcess(CONFIG, route_events=("tiny", 32))
    assert core.info.max_model_len == 4096 and core.info.vocab_size == 512 and core.info.warmup is None

    async def go():
        front = Front(core, asyncio.get_running_loop())
        core.add("r0", PROMPTS[0], PARAMS)
        await front.until(lambda: "r0" in front.done)  # (its prefix then cached for the others)
        for i, p in enumerate(PROMPTS[1:], 1):
            core.add(f"r{i}", p, PARAMS)
        core.add("bad", [1, 99999], PARAMS)  # a token past the vocabulary: the engine's ValueError
        await front.until(lambda: len(front.done) == len(PROMPTS) and "bad" in front.rejected)
        return front

    front = asyncio.run(go())
    try:
        assert [front.tokens[f"r{i}"] for i in range(len(PROMPTS))] == want
        assert front.accepted == {f"r{i}" for i in range(len(PROMPTS))}
        assert "token ids must be integers in [0, 512)" in front.rejected["bad"]
        assert front.stats["finished_requests"] == len(PROMPTS) and front.stats["running"] == 0
        assert front.stats["cached_prompt_tokens"] == 5 * 64  # the others found r0's full chunk cached
        # the routing events followed: the one full chunk the prompts share, hashed as the ingress does
        assert front.relay.held == {chunk_hashes(PROMPTS[0], 64, 32, "tiny")[0]}
    finally:
        core.close()
    assert core._proc.poll() is not None  # close ends the process


def test_aborts_and_guides_compile_in_the_engine_process():
    core = EngineProcess(CONFIG)

    async def go():
        front = Front(core, asyncio.get_running_loop())
        core.add("long", PROMPTS[0], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        await front.until(lambda: len(front.tokens.get("long", [])) >= 3)
        core.abort("long")
        await front.until(lambda: front.stats["running"] == 0 and front.stats["kv_chunks_used"] == 0)
        with pytest.raises(ValueError, match="schema"):
            await core.compile(Guide("json", "{not a schema"))
        guide = Guide(
            "json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
        )
        await core.compile(guide)
        core.add("g", PROMPTS[1], SamplingParams(max_tokens=40, temperature=0, guided=guide))
        await front.until(lambda: "g" in front.done)
        return front

    try:
        front = asyncio.run(go())
    finally:
        core.close()
    assert "long" not in front.done and len(front.tokens["long"]) < 3000
    assert front.done["g"] in ("stop", "length")


def test_a_killed_engine_process_is_reported_and_refuses_more():
    core = EngineProcess(CONFIG)

    async def go():
        front = Front(core, asyncio.get_running_loop())
        core.add("r", PROMPTS[0], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        await front.until(lambda: front.tokens.get("r"))
        os.kill(core._proc.pid, signal.SIGKILL)
        await front.until(lambda: front.death is not None)
        return front

    front = asyncio.run(go())
    assert "exited" in front.death and core.error == front.death
    with pytest.raises(EngineDied):
        core.add("more", PROMPTS[1], PARAMS)
    core.close()


def test_a_bad_config_fails_the_start_with_the_engines_error():
    with pytest.raises(EngineDied, match="chunk_size|preset|model"):
        EngineProcess(EngineConfig(model="no-such-model", device="cpu"))


def test_the_engine_process_ends_when_its_pipe_closes():
    core = EngineProcess(CONFIG)
    core._conn.close()  # as when the replica's process dies (besides PR_SET_PDEATHSIG)
    deadline = time.monotonic() + 30
    while core._proc.poll() is None:
        assert time.monotonic() < deadline, "the engine process outlived its pipe"
        time.sleep(0.1)


def test_the_grammar_engine_is_built_before_ready():
    """xgrammar and the vocabulary's token info are built while the engine process starts: built
    at the first guided request, they held the interpreter lock from the running steps."""
    core = EngineProcess(CONFIG)
    try:
        maps = Path(f"/proc/{core._proc.pid}/maps").read_text()  # (the libraries the process has loaded)
        assert "xgrammar" in maps
    finally:
        core.close()


def test_a_string_tagged_tuple_is_refused_at_both_ends_of_the_pipe():
    """The pipe carries only chunkserve/replicas/wire.py's messages: the replica's side refuses to
    send a bare tuple (the messages' old form), and an engine process that receives one anyway
    stops and says what it got, which the replica reports as the engine's death."""
    core = EngineProcess(CONFIG)

    async def go():
        front = Front(core, asyncio.get_running_loop())
        with pytest.raises(TypeError, match=r"the engine pipe: tuple \('abort', 'r'\) is not one of its messages"):
            core._send(("abort", "r"))  # type: ignore[arg-type]
        core.add("r", PROMPTS[0], PARAMS)  # (the pipe still works)
        await front.until(lambda: "r" in front.done)
        core._conn.send_bytes(pickle.dumps(("abort", "r")))  # past the check
        await front.until(lambda: front.death is not None)
        return front

    try:
        front = asyncio.run(go())
    finally:
        core.close()
    assert "TypeError: the engine process got tuple ('abort', 'r'), not a command" in front.death
