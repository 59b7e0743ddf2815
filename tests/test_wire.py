"""The wire types (chunkserve/replicas/wire.py): every channel's messages pickle as themselves, each
channel's check refuses a string-tagged tuple and another channel's messages, and the stream's
errors come back as the exceptions they were. (Each channel's ends: tests/test_engine_process.py,
test_direct_stream.py, test_parallel.py.)"""

from __future__ import annotations

import json
import pickle

import pytest

from chunkserve.replicas import wire
from chunkserve.replicas.engine.llm_engine import EngineConfig, RequestOutput
from chunkserve.replicas.engine.sequence import SamplingParams
from chunkserve.replicas.wire import (
    ENGINE_COMMANDS,
    ENGINE_REPLIES,
    RANK_OPS,
    STREAM_REPLIES,
    STREAM_REQUESTS,
    EngineDied,
    GenerateOutput,
    GenerateRequest,
    check,
)

REQUEST = GenerateRequest("r", (1, 2, 3), SamplingParams(max_tokens=3), (), "m")
OUTPUT = GenerateOutput("replica", "hi", (7,), None, 3, 0, 1)
MESSAGES = [
    wire.StreamOpen(1, REQUEST),
    wire.StreamCancel(1),
    wire.StreamOutput(1, OUTPUT),
    wire.StreamEnd(1),
    wire.StreamFull(1),
    wire.StreamError(1, "refused", "too long"),
    wire.StartEngine(EngineConfig(model="tiny", device="cpu"), False, ("m", 32), None),
    wire.AddRequest("r", [1, 2, 3], SamplingParams(max_tokens=3), None),
    wire.AbortRequest("r"),
    wire.CompileGuide(0, None),
    wire.CloseEngine(),
    wire.EngineReady(4096, 512, None, {"steps": 0}, None),
    wire.StartFailed("ValueError: no model"),
    wire.StepOutputs([RequestOutput("r", [7], True, "length", 3, 0, 1)], ["r"], [("q", "too long")], {}, None),
    wire.GuideCompiled(0, None),
    wire.EngineCrashed("RuntimeError: boom"),
]
CHANNELS = {
    "stream requests": STREAM_REQUESTS,
    "stream replies": STREAM_REPLIES,
    "engine commands": ENGINE_COMMANDS,
    "engine replies": ENGINE_REPLIES,
    "rank ops": RANK_OPS,
}


def test_every_message_pickles_as_itself_and_belongs_to_a_channel():
    for m in MESSAGES:
        back = pickle.loads(pickle.dumps(m, pickle.HIGHEST_PROTOCOL))
        assert type(back) is type(m) and back == m
    kinds = {type(m) for m in MESSAGES}
    assert kinds == set().union(*CHANNELS.values())  # (every type above is some channel's, and each is tested)


def test_each_channel_refuses_tagged_tuples_and_other_channels_messages():
    for name, allowed in CHANNELS.items():
        for m in MESSAGES:
            if type(m) in allowed:
                check(m, allowed, name)
            else:
                with pytest.raises(TypeError, match=f"{name}: {type(m).__name__}"):
                    check(m, allowed, name)
        with pytest.raises(TypeError, match=rf"{name}: tuple \('abort', 'r'\) is not one of its messages"):
            check(("abort", "r"), allowed, name)
        with pytest.raises(TypeError):
            check(tuple(wire.AbortRequest("r")), allowed, name)  # (the fields without the type: refused too)


def test_a_streams_error_is_raised_again_as_it_was():
    for raised, kind, back in (
        (ValueError("too long"), "refused", ValueError),
        (EngineDied("killed"), "engine_died", EngineDied),
        (KeyError("x"), "failed", RuntimeError),
    ):
        error = wire.StreamError.of(3, raised)
        assert error.kind == kind and type(error.exception()) is back and error.sid == 3


def test_bench_wire_prints_a_line_per_message(capsys):
    from chunkserve.replicas.tools import bench_wire

    bench_wire.main(["--rows", "2", "--rounds", "1", "--number", "3"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["message"] for r in rows] == [
        "StepOutputs (2 rows)",
        "StreamOutput (1 token)",
        "AddRequest (2000-token prompt)",
    ]
    assert all(r["wire_dumps_us"] > 0 and r["tuple_loads_us"] > 0 and r["wire_bytes"] > 0 for r in rows)


def test_prompt_for_rays_prefix_router_is_a_character_per_token_behind_the_salt():
    from chunkserve.replicas.engine.sequence import Tenancy

    ids = (0, 1, 128255)
    plain = GenerateRequest("r", ids, SamplingParams(max_tokens=3), (), "m").prompt
    assert len(plain) == 3 and [ord(c) - 0x10000 for c in plain] == list(ids)
    a = GenerateRequest("r", ids, SamplingParams(max_tokens=3), (), "m", tenancy=Tenancy(cache_salt="a")).prompt
    b = GenerateRequest("r", ids, SamplingParams(max_tokens=3), (), "m", tenancy=Tenancy(cache_salt="ab")).prompt
    assert a.endswith(plain) and b.endswith(plain) and not a.startswith(b[:3]) and a != b
    assert not a.startswith(plain[:1])  # a salted prompt never matches an unsalted one's head
