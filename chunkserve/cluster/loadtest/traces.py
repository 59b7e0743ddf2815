"""Block traces (Mooncake's, Alibaba Bailian's) as workload specs, and a trace's time window.

A block trace is JSON lines of a request's lengths and its prompt's blocks, not its text:

- mooncake (kvcache-ai/Mooncake, FAST25-release/traces): `timestamp` (ms since the trace's
  start), `input_length`, `output_length`, `hash_ids` (ids of the prompt's 512-token blocks; two
  prompts with the same first k ids share their first k blocks; the last block may be partial);
- bailian (alibaba-edu/qwen-bailian-usagetraces-anon): the same four, `timestamp` in seconds
  and blocks of 16 tokens, plus `chat_id`, `parent_chat_id` (-1 for a conversation's first
  request), `turn` and `type`. A follow-up row is the whole request as served (history
  included), so it is sent as recorded, at its time, without waiting for its parent.

Each hash id becomes one `Piece` (key `block<id>`, the block size long; the last one as long as
`input_length` leaves), so a hash id is the same run of tokens in every prompt that has it: the
renderer gives one content per key, a shorter piece the prefix of the full block. max_tokens is
`output_length`; timestamps become seconds from the trace's first request (lines may come in
any order: they are sent in time order). A bailian row keeps its conversation as labels: its
session is the chat id its `parent_chat_id` links lead back to, its turn the row's `turn`.

`load` reads either kind or the plain JSON-lines trace (`workloads.load_trace`), keeps a time
window (`select`: seconds of the trace, re-based so the window's first request goes at 0), drops
prompts over a length, and says what it kept (`info`, merged into each run's report).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from chunkserve.cluster.loadtest.workloads import Piece, Spec, TraceError, load_trace, trace_rows

FORMATS = ("auto", "jsonl", "mooncake", "bailian")
BLOCK_SIZE = {"mooncake": 512, "bailian": 16}  # tokens a hash id stands for, by the trace's own use
_SECONDS = {"mooncake": 1e-3, "bailian": 1.0}  # a timestamp's unit
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")
_FIELDS = {
    "mooncake": frozenset(_REQUIRED),
    "bailian": frozenset((*_REQUIRED, "chat_id", "parent_chat_id", "turn", "type")),
}


def detect_format(path: str | Path) -> str:
    """The format of a trace file from its first line: an object with `hash_ids` and
    `input_length` is a block trace (bailian where it has a `chat_id`), else plain jsonl."""
    try:
        with open(path) as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace: {e}") from None
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return "jsonl"  # (load_trace names the line)
    if isinstance(row, dict) and "hash_ids" in row and "input_length" in row:
        return "bailian" if "chat_id" in row else "mooncake"
    return "jsonl"


def _int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def load_block_trace(path: str | Path, fmt: str, block_size: int | None = None) -> list[Spec]:
    """Every line of a mooncake or bailian trace as a spec, in time order, timestamps in seconds
    from the earliest. block_size: tokens per hash id (default the format's: 512, 16)."""
    if fmt not in BLOCK_SIZE:
        raise ValueError(f"block trace formats are {sorted(BLOCK_SIZE)}, got {fmt!r}")
    size = BLOCK_SIZE[fmt] if block_size is None else block_size
    if not (_int(size) and size >= 1):
        raise ValueError(f"block size must be a positive integer, got {size!r}")
    path = Path(path)
    rows: list[tuple[float, tuple[Piece, ...], int, dict]] = []
    for where, row in trace_rows(path):
        missing = [k for k in _REQUIRED if k not in row]
        if fmt == "bailian":
            missing += [k for k in ("chat_id", "parent_chat_id") if k not in row]
        if missing:
            raise TraceError(f"{where}: missing field(s) {missing} (a {fmt} line has {sorted(_FIELDS[fmt])})")
        unknown = set(row) - _FIELDS[fmt]
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {sorted(unknown)} for a {fmt} trace")
        ts = row["timestamp"]
        if not (isinstance(ts, (int, float)) and not isinstance(ts, bool) and math.isfinite(ts) and ts >= 0):
            unit = "ms" if fmt == "mooncake" else "s"
            raise TraceError(f"{where}: timestamp must be a number >= 0 ({unit}), got {ts!r}")
        length, out, ids = row["input_length"], row["output_length"], row["hash_ids"]
        if not (_int(length) and length >= 1):
            raise TraceError(f"{where}: input_length must be a positive integer, got {length!r}")
        if not (_int(out) and out >= 1):
            raise TraceError(f"{where}: output_length must be a positive integer, got {out!r}")
        if not (isinstance(ids, list) and ids and all(_int(h) and h >= 0 for h in ids)):
            raise TraceError(f"{where}: hash_ids must be a non-empty list of non-negative integers, got {ids!r:.80}")
        need = -(-length // size)  # blocks input_length fills
        if len(ids) != need:
            more = "more" if len(ids) > need else "fewer"
            raise TraceError(
                f"{where}: {len(ids)} hash_ids is {more} blocks than input_length {length} needs "
                f"({need} of {size} tokens; the block size is --trace-block-size: Mooncake's 512, Bailian's 16)"
            )
        last = length - (need - 1) * size
        pieces = tuple(Piece(f"block{h}", size) for h in ids[:-1]) + (Piece(f"block{ids[-1]}", last),)
        labels = {}
        if fmt == "bailian":
            for k in ("chat_id", "parent_chat_id"):
                if not _int(row[k]):
                    raise TraceError(f"{where}: {k} must be an integer, got {row[k]!r}")
            turn = row.get("turn", 0)
            if not (_int(turn) and turn >= 0):
                raise TraceError(f"{where}: turn must be a non-negative integer, got {turn!r}")
            labels = {"chat_id": row["chat_id"], "parent": row["parent_chat_id"], "turn": turn}
        rows.append((ts * _SECONDS[fmt], pieces, out, labels))
    if not rows:
        raise TraceError(f"{path}: the trace holds no request")
    rows.sort(key=lambda r: r[0])  # (stable: lines of one time keep their order)
    roots = _sessions([r[3] for r in rows]) if fmt == "bailian" else {}
    t0 = rows[0][0]
    return [
        Spec(
            i,
            (("user", pieces),),
            out,
            session=roots.get(labels.get("chat_id")),
            turn=labels.get("turn", 0),
            timestamp=ts - t0,
        )
        for i, (ts, pieces, out, labels) in enumerate(rows)
    ]


def _sessions(labels: list[dict]) -> dict[int, int]:
    """Each chat id's conversation: the chat id its parent links lead back to (a parent the
    file lacks stands for the conversation's start)."""
    parent = {lab["chat_id"]: lab["parent"] for lab in labels}
    root: dict[int, int] = {}
    for chat in parent:
        c, seen = chat, {chat}
        while parent.get(c, -1) != -1 and parent[c] not in seen:  # (a missing parent has none: the walk ends there)
            c = parent[c]
            seen.add(c)
        root[chat] = c
    return root


def parse_window(text: str) -> tuple[float, float]:
    """'START:END' seconds of the trace (either side may be empty: from the start, to the end)."""
    start, sep, end = text.partition(":")
    try:
        lo = float(start) if start.strip() else 0.0
        hi = float(end) if end.strip() else math.inf
    except ValueError:
        lo = hi = math.nan
    if not sep or not (0 <= lo < hi):
        raise ValueError(f"a trace window is START:END seconds with 0 <= START < END, got {text!r}")
    return lo, hi


def select(
    specs: list[Spec],
    window: tuple[float, float] | None = None,
    max_input_len: int | None = None,
    num: int | None = None,
) -> tuple[list[Spec], int]:
    """The specs whose timestamp is in [start, end), less those of more than max_input_len
    prompt tokens, the first num of them, renumbered, timestamps re-based so the first is at 0.
    Returns them and how many max_input_len dropped."""
    if window is not None:
        if any(s.timestamp is None for s in specs):
            raise TraceError("a trace window needs a timestamp on every line")
        lo, hi = window
        specs = [s for s in specs if s.timestamp is not None and lo <= s.timestamp < hi]
    dropped = 0
    if max_input_len is not None:
        kept = [s for s in specs if s.prompt_len <= max_input_len]
        dropped, specs = len(specs) - len(kept), kept
    if num is not None:
        specs = specs[:num]
    t0 = specs[0].timestamp if specs else None
    return [
        replace(s, index=i, timestamp=None if s.timestamp is None or t0 is None else s.timestamp - t0)
        for i, s in enumerate(specs)
    ], dropped


def load(
    path: str | Path,
    fmt: str = "auto",
    *,
    block_size: int | None = None,
    default_max_tokens: int = 128,
    window: tuple[float, float] | None = None,
    max_input_len: int | None = None,
    num: int | None = None,
) -> tuple[list[Spec], dict]:
    """A trace file of any format as specs (see the module's docstring), and what was read, for
    the report: its format, block size, lines, window and the prompts max_input_len dropped."""
    if fmt not in FORMATS:
        raise ValueError(f"trace formats are {FORMATS}, got {fmt!r}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "jsonl":
        if block_size is not None:
            raise TraceError(f"{path}: a block size is for mooncake and bailian traces; this is a plain one")
        if max_input_len is not None:
            raise TraceError(f"{path}: --max-input-len needs token lengths (a mooncake or bailian trace)")
        specs = load_trace(path, default_max_tokens)
    else:
        specs = load_block_trace(path, fmt, block_size)
    total = len(specs)
    specs, dropped = select(specs, window, max_input_len, num)
    if not specs:
        raise TraceError(f"{path}: no request of its {total} is left in the window and under --max-input-len")
    info = {
        "trace_format": fmt,
        "trace_block_size": None if fmt == "jsonl" else BLOCK_SIZE[fmt] if block_size is None else block_size,
        "trace_requests": total,
        "trace_window": None if window is None else [window[0], None if math.isinf(window[1]) else window[1]],
        "trace_dropped_over_max_input_len": dropped,
    }
    return specs, info
