"""A soak of the Serve application on a local Ray cluster, real HTTP: nothing leaks, outputs stay exact.

App "soak" (one LLMReplica: tiny, CPU, a small KV pool of 16-token chunks). For SOAK_S seconds
(CHUNKSERVE_SOAK_S to run longer) a seeded random mix arrives at a steady rate: valid greedy
completions and chats, streamed and not; invalid ones (bad JSON, out-of-range parameters, prompts
longer than the context); streams the client closes after a few chunks; requests the client
abandons before their first token. A steady reference stream runs meanwhile, from a process of
its own. Then, once idle, the replica's engine holds no sequence and no chunk beyond its prefix
cache, every valid request's output was the engine's own for its prompt (LLMEngine in this
process), and the RSS of the replica's processes has not grown beyond a bound.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import httpx
import psutil
import pytest
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.replicas.engine.llm_engine import LLMEngine, SamplingParams
from tests import hostile_load
from tests.serve_cluster import serve_on_local_cluster
from tests.test_serve_hostile import LEAKS, _replicas

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

SOAK_S = float(os.environ.get("CHUNKSERVE_SOAK_S", 150))  # the mix's duration (CI: 150 s)
WARM_S = min(30.0, SOAK_S / 5)  # the mix before the early RSS sample
RATE = 6.0  # requests a second, sent on schedule (open loop) ...
MAX_IN_FLIGHT = 48  # ... unless this many are unanswered
# Per replica process (the Serve actor, and its engine process), from the early sample to the
# end: allocator high-water marks and Ray's buffers settle during warm-up, so what is left is a
# few MB of noise (measured below); a leak of one chunk table or detokenizer per request
# (thousands of requests) would pass it.
RSS_GROWTH_BOUND = 64 << 20
CHUNK = 16
MAX_MODEL_LEN = 1024
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
SOAK = {
    "model": MODEL,
    "device": "cpu",
    "num_replicas": 1,
    "engine": {"kv_cache_tokens": 4096, "chunk_size": CHUNK, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 16},
}
TIMEOUT = httpx.Timeout(300.0)

SHARED = "You are a careful assistant. Answer in one short sentence, and never more than that. " * 2
PROMPTS = [SHARED + q for q in ("What is a chunk?", "Why cache prefixes?", "Name a prime.", "Say hi.")] + [
    "Once upon a time",
    "The quick brown fox",
    "1, 2, 3, 4,",
    "Q: 2+2? A:",
]
CHATS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": SHARED}, {"role": "user", "content": "What is a chunk?"}],
    [{"role": "system", "content": SHARED}, {"role": "user", "content": "Name a color."}],
    [
        {"role": "user", "content": "Count to five."},
        {"role": "assistant", "content": "1 2 3 4 5"},
        {"role": "user", "content": "Again."},
    ],
]
LENGTHS = (4, 16, 40)
STEADY_TOKENS = 300  # the reference stream's (ignore_eos): long, greedy, the same each time
VALID = ("completion", "completion-stream", "chat", "chat-stream")


def _greedy(m: int) -> dict:
    return {"model": MODEL, "max_tokens": m, "temperature": 0, "return_token_ids": True}


class Soak:
    def __init__(self, url: str, client: httpx.AsyncClient, seed: int = 27):
        self.url, self.client, self.rng = url, client, random.Random(seed)
        self.sent: Counter = Counter()  # requests by kind
        self.failures: Counter = Counter()  # by kind: anything not as expected
        self.failed: list = []  # (kind, what) of the first few
        self.outputs: dict[tuple, set[tuple[int, ...]]] = {}  # (prompt key, max_tokens) -> token ids seen
        self.texts: dict[tuple, set[str]] = {}
        self.disconnect: Counter = Counter()  # abandoned requests: before or after their response began
        self.in_flight = 0

    def fail(self, kind: str, what) -> None:
        self.failures[kind] += 1
        if len(self.failed) < 10:
            self.failed.append((kind, str(what)[:300]))

    def seen(self, key: tuple, ids: list[int], text: str) -> None:
        self.outputs.setdefault(key, set()).add(tuple(ids))
        self.texts.setdefault(key, set()).add(text)

    # -- the kinds ---------------------------------------------------------------------------
    async def generate(self, api: str, stream: bool) -> None:
        """A valid greedy request, api "completion" or "chat", whole or streamed: its output is
        kept (seen) for the exactness check."""
        kind = f"{api}-stream" if stream else api
        items = PROMPTS if api == "completion" else CHATS
        i, m = self.rng.randrange(len(items)), self.rng.choice(LENGTHS)
        if api == "completion":
            path, body, key = "/v1/completions", {"prompt": items[i], **_greedy(m)}, ("prompt", i, m)
        else:
            path, body, key = "/v1/chat/completions", {"messages": items[i], **_greedy(m)}, ("chat", i, m)
        if stream:
            ids, text = await self._stream(kind, path, body)
        else:
            r = await self.client.post(f"{self.url}{path}", json=body)
            if r.status_code != 200:
                return self.fail(kind, r.text)
            choice = r.json()["choices"][0]
            ids = choice["token_ids"]
            text = choice["text"] if api == "completion" else choice["message"]["content"] or ""
        if ids is not None:
            self.seen(key, ids, text)

    async def _stream(self, kind: str, path: str, body: dict) -> tuple[list[int] | None, str]:
        ids, text, done = [], "", False
        async with self.client.stream("POST", f"{self.url}{path}", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                self.fail(kind, (await r.aread()).decode())
                return None, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    self.fail(kind, data)
                    return None, ""
                choice = chunk["choices"][0]
                ids += choice.get("token_ids") or []
                text += choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        if not done:
            self.fail(kind, "no [DONE]")
            return None, ""
        return ids, text

    async def invalid(self) -> None:
        kind = self.rng.choice(("bad-json", "out-of-range", "oversized"))
        if kind == "bad-json":
            content = self.rng.choice((b'{"prompt": ', b'{"messages": [}', b"not json", b'{"prompt": "x",}'))
            path = self.rng.choice(("/v1/completions", "/v1/chat/completions"))
        elif kind == "out-of-range":
            bad = self.rng.choice(
                (
                    {"temperature": -1},
                    {"top_p": 1.5},
                    {"max_tokens": 0},
                    {"n": 0},
                    {"max_tokens": MAX_MODEL_LEN + 1},
                    {"presence_penalty": 3},
                )
            )
            path, content = "/v1/completions", json.dumps({"model": MODEL, "prompt": "x", **bad}).encode()
        else:  # longer than the context: as text and as token ids
            path = "/v1/completions"
            content = json.dumps(
                {
                    "model": MODEL,
                    "prompt": self.rng.choice(("ab" * MAX_MODEL_LEN, [65] * (MAX_MODEL_LEN + 8))),
                    "max_tokens": 4,
                }
            ).encode()
        self.sent[kind] += 1
        r = await self.client.post(f"{self.url}{path}", content=content, headers={"Content-Type": "application/json"})
        if (
            r.status_code != 400
            or set(r.json().get("error", {})) != {"message", "type", "param", "code"}
            or LEAKS.search(r.text)
        ):
            self.fail(kind, f"{r.status_code} {r.text}")

    async def aborted(self) -> None:
        """A long stream the client closes after a few chunks."""
        after = self.rng.randint(1, 6)
        path, body = self.rng.choice(
            (
                ("/v1/completions", {"model": MODEL, "prompt": self.rng.choice(PROMPTS)}),
                ("/v1/chat/completions", {"model": MODEL, "messages": self.rng.choice(CHATS)}),
            )
        )
        async with self.client.stream(
            "POST", f"{self.url}{path}", json={**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
        ) as r:
            if r.status_code != 200:
                return self.fail("aborted", r.status_code)
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if chunks == after:
                        break  # (leaving the block closes the connection)
            else:
                self.fail("aborted", "the stream ended before the client left")

    async def disconnected(self) -> None:
        """A request with a long prompt the client abandons after 0-150 ms: before its first token, mostly."""
        prompt = "".join(
            self.rng.choice("abcdefgh ") for _ in range(self.rng.randint(300, 700))
        )  # (+ 200: in the context)
        started = asyncio.Event()

        async def go():
            async with self.client.stream(
                "POST",
                f"{self.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": True, "stream": True},
            ) as r:
                started.set()
                async for _ in r.aiter_lines():
                    pass

        task = asyncio.create_task(go())
        await asyncio.sleep(self.rng.uniform(0, 0.15))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        self.disconnect["before first token" if not started.is_set() else "after it"] += 1

    async def one(self) -> None:
        kind = self.rng.choices(("valid", "invalid", "aborted", "disconnected"), (10, 3, 2, 2))[0]
        if kind == "valid":
            kind = self.rng.choice(VALID)
        coro = {
            "completion": lambda: self.generate("completion", False),
            "completion-stream": lambda: self.generate("completion", True),
            "chat": lambda: self.generate("chat", False),
            "chat-stream": lambda: self.generate("chat", True),
            "invalid": self.invalid,
            "aborted": self.aborted,
            "disconnected": self.disconnected,
        }[kind]()
        if kind != "invalid":
            self.sent[kind] += 1
        self.in_flight += 1
        try:
            await coro
        except Exception as e:  # noqa: BLE001 - counted
            self.fail(kind, repr(e))
        finally:
            self.in_flight -= 1


def _rss(pid: int) -> dict[str, int]:
    """RSS of a replica actor's process and of its engine process (its child)."""
    p = psutil.Process(pid)
    out = {"replica": p.memory_info().rss}
    for child in p.children(recursive=True):
        if "engine_process" in " ".join(child.cmdline()):
            out["engine"] = child.memory_info().rss
    assert set(out) == {"replica", "engine"}, out
    return out


@pytest.fixture(scope="module")
def soak_url():
    with serve_on_local_cluster(num_nodes=1) as base:
        serve.run(build_app(SOAK), name="soak", route_prefix="/soak")
        yield f"{base}/soak"


def test_soak(soak_url):
    url = soak_url
    [pid] = _replicas("soak").values()
    llm = serve.get_deployment_handle("LLMReplica", app_name="soak")

    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=MAX_IN_FLIGHT + 8)) as client:
            soak = Soak(url, client)
            tasks, early, n, start, throttled = [], None, 0, time.monotonic(), 0
            samples = []  # (s into the mix, RSS) every 30 s after the early one: the trend
            while (now := time.monotonic()) - start < SOAK_S:
                if (early is None and now - start >= WARM_S) or (samples and now - start >= samples[-1][0] + 30):
                    samples.append((now - start, await asyncio.to_thread(_rss, pid)))
                    early = samples[0][1]
                if soak.in_flight >= MAX_IN_FLIGHT:
                    throttled += 1
                    await asyncio.sleep(0.05)
                    continue
                tasks.append(asyncio.create_task(soak.one()))
                n += 1
                await asyncio.sleep(max(0.0, start + n / RATE - time.monotonic()))
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=600)
            return soak, samples, throttled, time.monotonic() - start

    # the reference stream from a process of its own (tests/hostile_load.py: not Ray's driver)
    spawn = multiprocessing.get_context("spawn")
    with spawn.Manager() as manager, ProcessPoolExecutor(1, mp_context=spawn) as pool:
        stop = manager.Event()
        body = {"prompt": PROMPTS[0], **_greedy(STEADY_TOKENS), "ignore_eos": True, "stream": True}
        reference = pool.submit(hostile_load.steady, url, body, stop)
        try:
            soak, samples, throttled, took = asyncio.run(main())
        finally:
            stop.set()
        gaps, steady_outputs = reference.result(timeout=600)
    early = samples[0][1]
    # idle: every sequence finished or aborted, its chunks back in the pool or the prefix cache
    deadline = time.monotonic() + 60
    while (stats := llm.stats.remote().result(timeout_s=60))["running"] or stats["waiting"] or stats["kv_chunks_used"]:
        assert time.monotonic() < deadline, f"not idle: {stats}"
        time.sleep(0.5)
    late = _rss(pid)
    # the ingress's error counts (its /metrics): the 400s, and no server error (a client that
    # leaves is not one), no error chunk in a stream
    metrics = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    errors = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(("chunkserve_http_errors_total{", "chunkserve_stream_errors_total{"))
    }
    sent = sum(soak.sent.values())
    print(
        f"\nsoak: {sent} requests in {took:.0f} s ({sent / took:.1f}/s; throttled {throttled} times at "
        f"{MAX_IN_FLIGHT} in flight): {dict(sorted(soak.sent.items()))}"
    )
    print(f"failures by kind: {dict(soak.failures) or 'none'} {soak.failed}")
    print(f"abandoned: {dict(soak.disconnect)}")
    print(
        f"steady stream: {len(steady_outputs)} streams of {STEADY_TOKENS} tokens, worst gap between chunks "
        f"{max(gaps) * 1e3:.0f} ms (median {sorted(gaps)[len(gaps) // 2] * 1e3:.0f} ms over {len(gaps)})"
    )
    print(
        "engine once idle:",
        {
            k: stats[k]
            for k in (
                "running",
                "waiting",
                "kv_chunks_used",
                "kv_chunks_cached",
                "kv_chunks_free",
                "kv_chunks_total",
                "preemptions",
            )
        },
        {k: v for k, v in stats.items() if k.endswith(("requests", "tokens"))},
    )
    print("RSS (MB) during the mix:", [(round(t), {k: round(v / 2**20) for k, v in rss.items()}) for t, rss in samples])
    print(
        "RSS (MB) after warm-up -> end:",
        {k: f"{early[k] / 2**20:.0f} -> {late[k] / 2**20:.0f} ({(late[k] - early[k]) / 2**20:+.1f})" for k in early},
    )
    print(
        "error counts (/metrics):",
        {
            k.split("{", 1)[0].removeprefix("chunkserve_")
            + "{"
            + ",".join(kv for kv in k.split("{", 1)[1].rstrip("}").split(",") if kv.startswith(("status", "code")))
            + "}": v
            for k, v in errors.items()
        },
    )
    assert not soak.failures, (soak.failures, soak.failed)
    assert not [k for k in errors if 'status="5' in k or k.startswith("chunkserve_stream_errors")], errors
    assert sum(v for k, v in errors.items() if 'status="400"' in k) == sum(
        soak.sent[k] for k in ("bad-json", "out-of-range", "oversized")
    )
    assert stats["running"] == stats["waiting"] == stats["kv_chunks_used"] == 0
    assert all(soak.sent[k] > 0 for k in (*VALID, "bad-json", "out-of-range", "oversized", "aborted", "disconnected"))
    assert soak.disconnect["before first token"] > 0
    # every valid greedy output is the engine's own for its prompt
    engine = LLMEngine.from_model(SOAK["model"], device="cpu", chunk_size=CHUNK, kv_cache_tokens=4096)
    tok = engine.tokenizer
    chat_ids = {
        c: httpx.post(f"{url}/tokenize", json={"messages": CHATS[c]}, timeout=TIMEOUT).json()["tokens"]
        for c in range(len(CHATS))
    }
    for (what, i, m), seen in sorted(soak.outputs.items()):
        prompt = tok.encode(PROMPTS[i]) if what == "prompt" else chat_ids[i]
        expected = engine.generate([prompt], SamplingParams(max_tokens=m, temperature=0))[0]
        assert seen == {tuple(expected)}, (what, i, m, seen, expected)
        assert soak.texts[what, i, m] == {tok.decode(expected)}, (what, i, m, soak.texts[what, i, m])
    [steady] = engine.generate(
        [tok.encode(PROMPTS[0])], SamplingParams(max_tokens=STEADY_TOKENS, temperature=0, ignore_eos=True)
    )
    assert steady_outputs and set(steady_outputs) == {tuple(steady)}
    assert len(soak.outputs) > 10
    for k in early:
        assert late[k] - early[k] < RSS_GROWTH_BOUND, (k, early[k], late[k])
