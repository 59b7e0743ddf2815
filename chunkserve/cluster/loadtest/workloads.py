"""Seeded request generators (the load test's workloads) and arrival schedules.

A workload is a list of `Spec`s: each a request's turns as pieces of content, its output
length, and its tenant / session labels. A `Piece` stands for `length` tokens of content that
every piece with the same key shares, so the sharing structure is explicit and independent of
the served model; `chunkserve.cluster.loadtest.render` turns pieces into token ids or real text.

- gsp: SGLang's generated-shared-prefix: groups of prompts, each a group's system prompt and
  a question of its own (SGLang's defaults), shuffled;
- tenants: T tenants, each with a long system prompt of its own, chosen by Zipf(s) popularity;
  a tenant's multi-turn sessions resend the whole conversation so far (system prompt, each
  earlier user turn and reply) plus a new user turn, so the shared prefix grows turn by turn.
  A turn is sent only once the session's previous turn has completed (`Spec.after`);
- prefix_repetition: vLLM's: a few prefixes, each repeated with suffixes of their own;
- random: vLLM's: nothing shared (but an optional common prefix);
- a trace (`load_trace`): JSON lines with `prompt` (text or token ids) or `messages`,
  `max_tokens`, optional `timestamp` (seconds; replayed at the recorded times) and `tenant`;
  Mooncake's and Bailian's block traces are read by `chunkserve.cluster.loadtest.traces`.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("gsp", "tenants", "prefix_repetition", "random")


@dataclass(frozen=True)
class Piece:
    key: str  # pieces with one key have one content
    length: int  # tokens


Content = tuple  # of Piece, or literal text / token ids (traces)


@dataclass(frozen=True)
class Spec:
    """One request of a workload, before it is rendered for an endpoint."""

    index: int
    turns: tuple[tuple[str, Content], ...]  # (role, content) in order; a prompt is one ("user", ...)
    max_tokens: int
    tenant: str | None = None
    session: int | None = None
    turn: int = 0
    after: int | None = None  # the request this one is sent after (its session's previous turn)
    timestamp: float | None = None  # a trace's: seconds after the trace's first request
    chat: bool | None = None  # a trace line's own form (messages: True, prompt: False); None: the endpoint's

    @property
    def prompt_len(self) -> int:
        """Tokens of its pieces (a trace's literal content counts 0: only the server knows)."""
        return sum(p.length for _, content in self.turns for p in content if isinstance(p, Piece))


@dataclass(frozen=True)
class Gsp:
    """SGLang's generated-shared-prefix dataset (bench_serving's gsp defaults)."""

    num_groups: int = 64
    prompts_per_group: int = 16
    system_prompt_len: int = 2048
    question_len: int = 128
    output_len: int = 256

    def specs(self, seed: int, num: int | None = None) -> list[Spec]:
        rng = random.Random(seed)
        specs = [
            (
                f"g{g}",
                (("user", (Piece(f"g{g}.system", self.system_prompt_len), Piece(f"g{g}.q{i}", self.question_len))),),
            )
            for g in range(self.num_groups)
            for i in range(self.prompts_per_group)
        ]
        rng.shuffle(specs)  # the groups interleaved, as SGLang sends them
        specs = _take(specs, num)
        return [Spec(i, turns, self.output_len, tenant=group) for i, (group, turns) in enumerate(specs)]


@dataclass(frozen=True)
class Tenants:
    """Multi-tenant multi-turn traffic: Zipf-popular tenants, sessions that resend their conversation."""

    num_tenants: int = 8
    prompt_len: int = 2048  # each tenant's system prompt (tool schemas, few-shot examples)
    zipf: float = 1.1  # tenant k (from 0) is chosen with weight 1 / (k + 1) ** zipf
    turns: int = 4  # user turns per session
    turn_len: int = 64  # tokens of each user turn
    output_len: int = 128  # tokens of each reply (and of the reply resent in the next turn)
    active_sessions: int = 16  # sessions in progress at once: each request continues one of them

    def specs(self, seed: int, num: int | None = None) -> list[Spec]:
        num = self.num_tenants * self.turns * 4 if num is None else num
        rng = random.Random(seed)
        weights = [1 / (k + 1) ** self.zipf for k in range(self.num_tenants)]
        sessions = 0

        def new_session() -> dict:
            nonlocal sessions
            sessions += 1
            tenant = rng.choices(range(self.num_tenants), weights)[0]
            return {
                "id": sessions - 1,
                "tenant": tenant,
                "turn": 0,
                "last": None,
                "history": [("system", (Piece(f"t{tenant}.system", self.prompt_len),))],
            }

        active = [new_session() for _ in range(min(self.active_sessions, num))]
        specs = []
        while len(specs) < num:
            slot = rng.randrange(len(active))
            s = active[slot]
            sid, turn = s["id"], s["turn"]
            s["history"].append(("user", (Piece(f"s{sid}.u{turn}", self.turn_len),)))
            specs.append(
                Spec(
                    len(specs),
                    tuple(s["history"]),
                    self.output_len,
                    tenant=f"t{s['tenant']}",
                    session=sid,
                    turn=turn,
                    after=s["last"],
                )
            )
            # the reply as the next turn resends it (the same every run: not the model's own)
            s["history"].append(("assistant", (Piece(f"s{sid}.a{turn}", self.output_len),)))
            s["turn"], s["last"] = turn + 1, len(specs) - 1
            if s["turn"] == self.turns:
                active[slot] = new_session()
        return specs


@dataclass(frozen=True)
class PrefixRepetition:
    """vLLM's prefix_repetition dataset: num_prefixes prefixes, each with suffixes of its own."""

    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128

    def specs(self, seed: int, num: int | None = None) -> list[Spec]:
        num = 1000 if num is None else num
        rng = random.Random(seed)
        order = [i % self.num_prefixes for i in range(num)]
        rng.shuffle(order)
        return [
            Spec(
                i,
                (("user", (Piece(f"p{p}", self.prefix_len), Piece(f"r{i}", self.suffix_len))),),
                self.output_len,
                tenant=f"p{p}",
            )
            for i, p in enumerate(order)
        ]


@dataclass(frozen=True)
class Random_:
    """vLLM's random dataset: input and output lengths uniform in [len (1 - r), len (1 + r)]."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # a prefix every request shares (vLLM's --random-prefix-len)

    def specs(self, seed: int, num: int | None = None) -> list[Spec]:
        num = 1000 if num is None else num
        rng = random.Random(seed)

        def around(n: int) -> int:
            return max(1, rng.randint(math.floor(n * (1 - self.range_ratio)), math.ceil(n * (1 + self.range_ratio))))

        specs = []
        for i in range(num):
            own = Piece(f"r{i}", around(self.input_len))
            pieces = (Piece("prefix", self.prefix_len), own) if self.prefix_len else (own,)
            specs.append(Spec(i, (("user", pieces),), around(self.output_len)))
        return specs


def _take(items: list, num: int | None) -> list:
    """The first num items, cycling when num is more than there are (None: all)."""
    if num is None:
        return items
    return [items[i % len(items)] for i in range(num)]


class TraceError(ValueError):
    """A trace file that cannot be read; the message names the file and line."""


def trace_rows(path: Path) -> Iterator[tuple[str, dict]]:
    """Each non-blank line of a JSON-lines trace as (its `file:line`, its object); TraceError for
    a file that cannot be read and a line that is not a JSON object."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"{path}: cannot read the trace: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON: {e}") from None
        if not isinstance(row, dict):
            raise TraceError(f"{where}: a trace line must be a JSON object, got {type(row).__name__}")
        yield where, row


def load_trace(path: str | Path, default_max_tokens: int = 128, num: int | None = None) -> list[Spec]:
    """A JSON-lines trace as specs: `prompt` (text or token ids) or `messages` (OpenAI chat
    messages with text content), `max_tokens` (else default_max_tokens), optional
    `timestamp` (seconds, any origin, non-decreasing) and `tenant`. Blank lines are skipped."""
    path = Path(path)
    specs, first_ts, last_ts = [], None, None
    for where, row in trace_rows(path):
        unknown = set(row) - {"prompt", "messages", "max_tokens", "timestamp", "tenant", "session"}
        if unknown:
            raise TraceError(f"{where}: unknown field(s) {sorted(unknown)}")
        if ("prompt" in row) == ("messages" in row):
            raise TraceError(f"{where}: give exactly one of prompt and messages")
        if "prompt" in row:
            prompt = row["prompt"]
            if isinstance(prompt, str) and prompt:
                turns = (("user", (prompt,)),)
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
            ):
                turns = (("user", (tuple(prompt),)),)
            else:
                raise TraceError(f"{where}: prompt must be non-empty text or a list of token ids")
        else:
            messages = row["messages"]
            if not (
                isinstance(messages, list)
                and messages
                and all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages
                )
            ):
                raise TraceError(f"{where}: messages must be a non-empty list of {{role, content}} with text content")
            turns = tuple((m["role"], (m["content"],)) for m in messages)
        max_tokens = row.get("max_tokens", default_max_tokens)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise TraceError(f"{where}: max_tokens must be a positive integer, got {max_tokens!r}")
        ts = row.get("timestamp")
        if specs and (ts is None) != (specs[0].timestamp is None):
            raise TraceError(f"{where}: a timestamp on some lines and not on others")
        if ts is not None:
            if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts):
                raise TraceError(f"{where}: timestamp must be a number of seconds, got {ts!r}")
            if last_ts is not None and ts < last_ts:
                raise TraceError(f"{where}: timestamps must not decrease ({ts} after {last_ts})")
            first_ts = ts if first_ts is None else first_ts
            last_ts = ts
        tenant = row.get("tenant")
        if tenant is not None and not isinstance(tenant, (str, int)):
            raise TraceError(f"{where}: tenant must be a string, got {tenant!r}")
        specs.append(
            Spec(
                len(specs),
                turns,
                max_tokens,
                tenant=None if tenant is None else str(tenant),
                timestamp=None if ts is None else ts - first_ts,
                chat="messages" in row,
            )
        )
    if not specs:
        raise TraceError(f"{path}: the trace holds no request")
    if num is not None:
        specs = specs[:num]
    return specs


# -- arrivals ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arrivals:
    """When each request is sent, as offsets from the run's start (seconds).

    rate: requests per second (inf: all at once); burstiness: the gamma shape of the gaps
    (1: Poisson; below 1 burstier, above steadier: vLLM's --burstiness); replay: a trace's own
    timestamps instead, divided by speed (2: twice as fast)."""

    rate: float = math.inf
    burstiness: float = 1.0
    replay: bool = False
    seed: int = 0
    speed: float = 1.0

    def offsets(self, specs: list[Spec]) -> list[float]:
        if self.replay:
            if any(s.timestamp is None for s in specs):
                raise ValueError("replay needs a trace with a timestamp on every line")
            if not self.speed > 0:
                raise ValueError(f"replay speed must be > 0, got {self.speed}")
            return [(s.timestamp or 0.0) / self.speed for s in specs]  # (none is None: checked above)
        return poisson_offsets(len(specs), self.rate, self.burstiness, self.seed)


def poisson_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n send times (seconds from the start) of a gamma process with mean rate `rate` (inf: all
    at 0); burstiness 1 is Poisson. The first request goes at 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out
