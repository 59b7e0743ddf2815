"""Block traces in the load test (Mooncake's and Bailian's JSON lines): hash ids as shared blocks
of tokens or text, timestamps as send times (speed, window), malformed lines named by file and
line, and the command line replaying one against a recording server on loopback (real HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading

import httpx
import pytest

from chunkserve.cluster.loadtest import traces
from chunkserve.cluster.loadtest import workloads as wl
from chunkserve.cluster.loadtest.cli import main
from chunkserve.cluster.loadtest.render import Renderer


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _row(ts, length, out, ids, **more) -> dict:
    return {"timestamp": ts, "input_length": length, "output_length": out, "hash_ids": ids, **more}


def _common(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class _Server:
    """A loopback HTTP server in a thread: /tokenize and /detokenize one token a character
    (its code), anything else a streamed completion of the body's max_tokens, usage counting the
    prompt; every request body is kept."""

    def __init__(self):
        self.bodies: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        assert self.ready.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _answer(self, path: str, body: dict) -> tuple[str, bytes]:
        if path == "/v1/models":
            return "application/json", json.dumps({"object": "list", "data": [{"id": "stub-model"}]}).encode()
        if path == "/tokenize":
            return "application/json", json.dumps({"tokens": [ord(c) for c in body["prompt"]]}).encode()
        if path == "/detokenize":
            return "application/json", json.dumps({"prompt": "".join(map(chr, body["tokens"]))}).encode()
        n, prompt = body.get("max_tokens", 1), body.get("prompt", "")
        chunk = json.dumps({"id": "x", "choices": [{"index": 0, "text": "a", "finish_reason": None}]})
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        usage_chunk = json.dumps({"id": "x", "choices": [], "usage": usage})
        sse = [f"data: {chunk}\n\n"] * n + [f"data: {usage_chunk}\n\n", "data: [DONE]\n\n"]
        return "text/event-stream", "".join(sse).encode()

    def _run(self):
        async def handle(reader, writer):
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")
                    path = lines[0].split(" ")[1]
                    length = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length:")), 0)
                    body = json.loads(await reader.readexactly(length) or b"{}")
                    self.bodies.append((path, body))
                    kind, out = self._answer(path, body)
                    writer.write(
                        f"HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {len(out)}\r\n"
                        "x-chunkserve-replica: rec\r\n\r\n".encode()
                        + out
                    )
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        async def start():
            self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]
            self.ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.close()


def test_the_format_is_told_by_the_first_line(tmp_path):
    assert traces.detect_format(_write(tmp_path / "m.jsonl", [_row(0, 5, 1, [7])])) == "mooncake"
    bailian = _row(61.1, 5, 1, [7], chat_id=1, parent_chat_id=-1, turn=1, type="text")
    assert traces.detect_format(_write(tmp_path / "b.jsonl", ["", bailian])) == "bailian"
    assert traces.detect_format(_write(tmp_path / "j.jsonl", [{"prompt": "hi"}])) == "jsonl"


def test_hash_ids_become_blocks_of_tokens_shared_exactly_as_far_as_the_ids(tmp_path):
    f = _write(
        tmp_path / "m.jsonl",
        [_row(0, 12, 3, [1, 2, 3]), _row(5, 11, 4, [1, 2, 9]), _row(9, 8, 2, [9, 3]), _row(9, 3, 1, [1])],
    )
    specs = traces.load_block_trace(f, "mooncake", block_size=4)
    assert [[p.length for _, c in s.turns for p in c] for s in specs] == [[4, 4, 4], [4, 4, 3], [4, 4], [3]]
    assert [s.max_tokens for s in specs] == [3, 4, 2, 1]
    assert [s.timestamp for s in specs] == pytest.approx([0.0, 0.005, 0.009, 0.009])  # ms -> s
    a, b, c, d = (Renderer("tokens", seed=1).request(s).prompt for s in specs)
    assert [len(p) for p in (a, b, c, d)] == [12, 11, 8, 3]
    assert _common(a, b) == 8  # two blocks shared, the third differs
    assert b[8:] == c[:3]  # block 9 cut short: the first tokens of block 9
    assert c[4:] == a[8:]  # block 3: the same tokens wherever it stands
    assert d == a[:3]
    # seeded: the same ids again, other ids under another seed (the same sharing)
    again = [Renderer("tokens", seed=1).request(s).prompt for s in reversed(specs)]
    assert again == [d, c, b, a]
    other = [Renderer("tokens", seed=2).request(s).prompt for s in specs]
    assert other[0] != a and _common(other[0], other[1]) == 8


def test_text_prompts_keep_the_blocks_a_cut_block_a_prefix(tmp_path, server):
    f = _write(tmp_path / "m.jsonl", [_row(0, 12, 3, [1, 2, 3]), _row(5, 11, 4, [1, 2, 9]), _row(9, 8, 2, [9, 3])])
    specs = traces.load_block_trace(f, "mooncake", block_size=4)
    r = Renderer("text", seed=0)

    async def prepare():
        async with httpx.AsyncClient() as client:
            await r.prepare(client, server.url, specs, {})

    asyncio.run(prepare())
    a, b, c = (r.request(s).prompt for s in specs)
    assert [len(p) for p in (a, b, c)] == [12, 11, 8]  # one character a token here
    assert a[:8] == b[:8] and a[8:11] != b[8:] and b[8:] == c[:3] and c[4:] == a[8:]


def test_timestamps_become_send_times_with_window_speed_and_length_cap(tmp_path):
    lengths = [8, 40, 8, 12, 8, 8]
    rows = [
        _row(ts, n, 2, list(range(10 * i, 10 * i + -(-n // 4))))
        for i, (ts, n) in enumerate(zip([0, 1000, 2500, 4000, 4200, 7000], lengths))
    ]
    f = _write(tmp_path / "m.jsonl", rows)
    specs, info = traces.load(f, block_size=4)
    assert [s.timestamp for s in specs] == pytest.approx([0.0, 1.0, 2.5, 4.0, 4.2, 7.0])
    assert wl.Arrivals(replay=True, speed=2.0).offsets(specs) == pytest.approx([0.0, 0.5, 1.25, 2.0, 2.1, 3.5])
    assert info == {
        "trace_format": "mooncake",
        "trace_block_size": 4,
        "trace_requests": 6,
        "trace_window": None,
        "trace_dropped_over_max_input_len": 0,
    }
    # a window of the trace's seconds, re-based: its first request goes at 0
    specs, info = traces.load(f, block_size=4, window=traces.parse_window("1:4.2"), max_input_len=32)
    assert [s.timestamp for s in specs] == pytest.approx([0.0, 1.5])  # 1.0 (40 tokens) dropped; 4.2 is past the end
    assert [s.index for s in specs] == [0, 1] and [s.prompt_len for s in specs] == [8, 12]
    assert wl.Arrivals(replay=True, speed=0.5).offsets(specs) == pytest.approx([0.0, 3.0])
    assert info["trace_window"] == [1.0, 4.2] and info["trace_dropped_over_max_input_len"] == 1
    specs, info = traces.load(f, block_size=4, window=traces.parse_window("4:"), num=2)
    assert [s.timestamp for s in specs] == pytest.approx([0.0, 0.2]) and info["trace_window"] == [4.0, None]
    assert traces.parse_window(":2.5") == (0.0, 2.5)
    for bad in ("3:1", "x:2", "5", "-1:2"):
        with pytest.raises(ValueError, match="START:END"):
            traces.parse_window(bad)
    with pytest.raises(wl.TraceError, match="no request of its 6 is left"):
        traces.load(f, block_size=4, window=(100.0, 200.0))


def test_lines_out_of_time_order_are_sent_in_time_order(tmp_path):
    f = _write(tmp_path / "m.jsonl", [_row(300, 4, 1, [1]), _row(100, 4, 2, [2]), _row(100, 4, 3, [3])])
    specs = traces.load_block_trace(f, "mooncake", block_size=4)
    assert [s.max_tokens for s in specs] == [2, 3, 1] and [s.timestamp for s in specs] == pytest.approx([0.0, 0.0, 0.2])


def test_bailian_rows_keep_their_conversations_as_labels(tmp_path):
    def row(chat, parent, ts, turn):
        return _row(ts, 20, 5, [chat * 10, chat * 10 + 1], chat_id=chat, parent_chat_id=parent, turn=turn, type="text")

    f = _write(
        tmp_path / "b.jsonl",
        [
            row(159, -1, 61.114, 1),
            row(200, -1, 61.5, 1),
            row(160, 159, 62.5, 2),
            row(161, 160, 70.0, 3),
            row(300, 999, 71.0, 4),
        ],
    )
    specs, info = traces.load(f)
    assert info["trace_format"] == "bailian" and info["trace_block_size"] == 16
    assert [s.timestamp for s in specs] == pytest.approx([0.0, 0.386, 1.386, 8.886, 9.886])  # seconds
    assert [(s.session, s.turn) for s in specs] == [(159, 1), (200, 1), (159, 2), (159, 3), (999, 4)]
    assert all(s.after is None for s in specs)  # open loop: each at its own time
    assert [[p.length for _, c in s.turns for p in c] for s in specs] == [[16, 4]] * 5


GOOD = _row(0, 6, 2, [1, 2])


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "m.jsonl:2: not JSON"),
        (
            json.dumps({"timestamp": 1, "input_length": 4, "output_length": 2}),
            "m.jsonl:2: missing field(s) ['hash_ids']",
        ),
        (json.dumps(_row(1, 8, 2, [1, "2"])), "m.jsonl:2: hash_ids must be a non-empty list of non-negative integers"),
        (json.dumps(_row(1, 8, 2, [1, 2.5])), "m.jsonl:2: hash_ids must be"),
        (json.dumps(_row(1, 8, 2, [1, -2])), "m.jsonl:2: hash_ids must be"),
        (json.dumps(_row(1, 8, 2, [])), "m.jsonl:2: hash_ids must be"),
        (json.dumps(_row(1, 4, 2, [1, 2])), "m.jsonl:2: 2 hash_ids is more blocks than input_length 4 needs (1 of 4"),
        (json.dumps(_row(1, 9, 2, [1, 2])), "m.jsonl:2: 2 hash_ids is fewer blocks than input_length 9 needs (3 of 4"),
        (json.dumps(_row(1, 4, -1, [1])), "m.jsonl:2: output_length must be a positive integer, got -1"),
        (json.dumps(_row(1, 4, 0, [1])), "m.jsonl:2: output_length must be a positive integer, got 0"),
        (json.dumps(_row(1, 0, 1, [1])), "m.jsonl:2: input_length must be a positive integer"),
        (json.dumps(_row(-5, 4, 1, [1])), "m.jsonl:2: timestamp must be a number >= 0 (ms), got -5"),
        (json.dumps(_row("soon", 4, 1, [1])), "m.jsonl:2: timestamp must be a number"),
        (json.dumps(_row(1, 4, 1, [1], session_id="s")), "m.jsonl:2: unknown field(s) ['session_id']"),
        ("[1, 2]", "m.jsonl:2: a trace line must be a JSON object"),
    ],
)
def test_a_malformed_block_trace_line_is_named(tmp_path, line, message, capsys):
    f = _write(tmp_path / "m.jsonl", [GOOD, line])
    with pytest.raises(wl.TraceError, match=re.escape(message)):
        traces.load(f, block_size=4)
    with pytest.raises(SystemExit) as e:
        main(["--dataset", f, "--trace-block-size", "4", "--url", "http://127.0.0.1:1"])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_bailian_line_without_its_chat_is_named(tmp_path):
    good = _row(1.5, 20, 5, [1, 2], chat_id=1, parent_chat_id=-1, turn=1, type="text")
    f = _write(tmp_path / "b.jsonl", [good, _row(2.0, 20, 5, [1, 2], chat_id=2, turn=2)])
    with pytest.raises(wl.TraceError, match=r"b.jsonl:2: missing field\(s\) \['parent_chat_id'\]"):
        traces.load(f)
    f = _write(tmp_path / "b.jsonl", [good, {**good, "chat_id": "two"}])
    with pytest.raises(wl.TraceError, match="b.jsonl:2: chat_id must be an integer"):
        traces.load(f)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replay-speed", "2"], "--replay-speed paces --replay"),
        (["--replay-speed", "0"], "must be > 0"),
        (["--max-input-len", "100"], "--max-input-len read a trace: give --dataset"),
        (["--trace-window", "5:2"], "0 <= START < END"),
        (["--trace-format", "bailian"], "--trace-format read a trace"),
    ],
)
def test_bad_trace_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_plain_trace_takes_no_length_cap(tmp_path, capsys):
    f = _write(tmp_path / "t.jsonl", [{"prompt": "hello"}])
    with pytest.raises(SystemExit) as e:
        main(["--dataset", f, "--max-input-len", "8", "--url", "http://127.0.0.1:1"])
    assert e.value.code == 2 and "--max-input-len needs token lengths" in capsys.readouterr().err


def test_the_command_exits_2_on_a_bad_trace(tmp_path):
    good = _row(0, 600, 2, [1, 2])  # 2 blocks of Mooncake's 512 hold 600 tokens
    f = _write(tmp_path / "m.jsonl", [good])
    bad = _write(tmp_path / "bad.jsonl", [good, _row(1, 600, 2, [1, 2, 3])])
    p = subprocess.run(
        [sys.executable, "-m", "chunkserve.cluster.loadtest", "--dataset", bad, "--url", "http://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert f"{bad}:2: 3 hash_ids is more blocks than input_length 600 needs (2 of 512 tokens" in p.stderr
    assert traces.load(f)[1]["trace_block_size"] == 512


def test_the_command_replays_a_block_trace_against_a_server(tmp_path, server):
    rows = [
        _row(0, 10, 3, [1, 2, 3]),
        _row(200, 12, 2, [1, 2, 4]),
        _row(450, 40, 2, list(range(100, 110))),  # over --max-input-len: dropped
        _row(500, 7, 4, [1, 5]),
        _row(900, 12, 1, [6, 2, 3]),
    ]
    f, out = _write(tmp_path / "m.jsonl", rows), tmp_path / "r.jsonl"
    argv = ["--url", server.url, "--dataset", f, "--trace-block-size", "4", "--max-input-len", "32"]
    argv += ["--replay", "--replay-speed", "10", "--prompt-format", "tokens", "--model", "stub"]
    assert main([*argv, "--no-progress", "--save-result", str(out)]) == 0
    (report,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["trace_format"] == "mooncake" and report["trace_requests"] == 5
    assert report["trace_dropped_over_max_input_len"] == 1 and report["replay_speed"] == 10
    assert [r["scheduled"] for r in report["records"]] == pytest.approx(
        [0.0, 0.02, 0.05, 0.09]
    )  # the trace's ms / 1000 / 10
    assert report["input_lens"] == [10, 12, 7, 12] and report["output_lens"] == [3, 2, 4, 1]
    sent = sorted((b for path, b in server.bodies if path == "/v1/completions"), key=lambda b: len(b["prompt"]))
    assert {b["model"] for b in sent} == {"stub"}  # --model's
    by_len = {(len(b["prompt"]), b["max_tokens"]): b["prompt"] for b in sent}
    a, b, c, d = by_len[10, 3], by_len[12, 2], by_len[7, 4], by_len[12, 1]
    assert _common(a, b) == 8 and _common(a, c) == 4 and a[8:] == d[8:10] and b[4:8] == d[4:8]


def test_the_load_test_names_the_served_model_or_says_why_it_cannot(tmp_path, server):
    # OpenAI's API requires `model`: without --model the run asks /v1/models for it, and one that
    # cannot ask stops there, saying so (rather than sending requests every server refuses)
    f = _write(tmp_path / "m.jsonl", [_row(0, 10, 3, [1, 2, 3]), _row(100, 12, 2, [1, 2, 4])])
    argv = ["--dataset", f, "--trace-block-size", "4", "--prompt-format", "tokens", "--no-progress"]
    assert main(["--url", server.url, *argv]) == 0
    assert [b["model"] for path, b in server.bodies if path == "/v1/completions"] == ["stub-model"] * 2
    with pytest.raises(SystemExit) as e:
        main(["--url", "http://127.0.0.1:1", *argv])
    assert "cannot learn the served model's name from http://127.0.0.1:1/v1/models" in str(e.value.code)
    assert "pass --model" in str(e.value.code)
