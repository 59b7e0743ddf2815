"""A model replica's fault under load, on a local Ray cluster, real HTTP.

App "fault": two LLMReplicas (tiny, CPU, a small KV pool, three sequences at a time each), 16
streams running, one replica SIGKILLed. The ingress retries a request that had no token yet once
on the other replica (chunkserve/cluster/replica_calls.py `Replicas._start`); a stream that has sent tokens ends with a
clean error chunk; /ready stays 200 since a replica stays up.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import ray
from ray import serve

from chunkserve.cluster.app import build_app
from chunkserve.cluster.ingress import REPLICA_HEADER
from tests.serve_cluster import serve_on_local_cluster
from tests.test_serve_hostile import LEAKS, _replicas

pytestmark = pytest.mark.slow  # Serve on a Ray cluster of its own: README's quick run leaves it out

ROOT = Path(__file__).resolve().parents[1]
MAX_SEQS = 3  # per replica: the rest of its requests wait in its engine, with no token yet
MAX_TOKENS = 240  # long enough that no running stream ends, so no waiting one starts, before the kill
MODEL = "tiny"  # the served model, which every completion and chat names (OpenAI's API requires it)
FAULT = {
    "model": MODEL,
    "device": "cpu",
    "num_replicas": 2,
    "num_cpus_per_replica": 0.5,
    # a small pool (32 chunks of 64), still enough for MAX_SEQS sequences of prompt + MAX_TOKENS
    # (6 chunks each): no preemption, so which requests have a token at the kill is known
    "engine": {"kv_cache_tokens": 2048, "max_model_len": 1024, "max_num_seqs": MAX_SEQS},
}
TIMEOUT = httpx.Timeout(300.0)


def _body(i: int, max_tokens: int = MAX_TOKENS, stream: bool = True) -> tuple[str, dict]:
    """Request i: completions for even i, chat for odd; each prompt its own (no shared prefix)."""
    text = f"request {i}: " + f"tell me about chunk {i} " * (1 + i % 3)
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    if i % 2 == 0:
        return "/v1/completions", {**body, "prompt": text}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}


class _Stream:
    """One streamed request as the client saw it."""

    def __init__(self, i: int):
        self.i = i
        self.status: int | None = None
        self.replica: str | None = None
        self.started: float | None = None  # when the response (the first token with it) came
        self.events: list[str] = []  # the SSE data payloads
        self.error: BaseException | None = None  # a client-side failure (none expected)

    async def run(self, client: httpx.AsyncClient, url: str) -> None:
        path, body = _body(self.i)
        try:
            async with client.stream("POST", f"{url}{path}", json=body) as r:
                self.status, self.replica, self.started = r.status_code, r.headers.get(REPLICA_HEADER), time.monotonic()
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: ") :])
        except Exception as e:  # noqa: BLE001 - asserted on below
            self.error = e

    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events[:-1]]


def _check_whole_stream(s: _Stream) -> None:
    """A full stream: every token, its usage, [DONE], no error."""
    assert s.error is None and s.status == 200, (s.i, s.error, s.status, s.events[-3:])
    assert s.events and s.events[-1] == "[DONE]", (s.i, s.events[-3:])
    *chunks, usage = s.chunks()
    assert all("error" not in c for c in chunks) and usage["choices"] == [], (s.i, s.events[-3:])
    assert sum(len(c["choices"][0].get("token_ids") or ()) for c in chunks) == MAX_TOKENS, s.i
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and usage["usage"]["completion_tokens"] == MAX_TOKENS


def _check_error_stream(s: _Stream) -> None:
    """A stream cut by the fault: tokens, then one clean error chunk, then [DONE]."""
    assert s.error is None and s.status == 200, (s.i, s.error, s.status)
    assert len(s.events) >= 5 and s.events[-1] == "[DONE]", (s.i, s.events[-3:])
    last = json.loads(s.events[-2])
    assert "error" in last, (s.i, "the stream ended with no error chunk", s.events[-3:])
    error = last["error"]
    assert (error["type"], error["code"]) == ("server_error", "replica_failed"), error
    assert not LEAKS.search(s.events[-2]), s.events[-2]
    tokens = sum(len(json.loads(e)["choices"][0].get("token_ids") or ()) for e in s.events[:-2])
    assert 0 < tokens < MAX_TOKENS, (s.i, tokens)


def _whole(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS and choice["finish_reason"] == "length", r.text[:500]


def _replica_stats(app: str) -> dict[str, dict]:
    """Each live replica's load (its record_routing_stats: running, waiting, kv chunks), by replica id."""
    out = {}
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith(f"SERVE_REPLICA::{app}#LLMReplica#"):
            try:
                handle = ray.get_actor(actor["name"], namespace=actor["namespace"])
                out[actor["name"].rsplit("#", 1)[1]] = ray.get(handle.record_routing_stats.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
    return out


def test_sigkill_one_of_two_replicas_under_16_streams():
    """16 streams (12, then 4 sent just before the kill) on two replicas of three running
    sequences each; SIGKILL the one with requests waiting. Its streams that had sent tokens end
    with a clean server_error chunk and [DONE]; every request that had no token yet (waiting in
    its engine, or not yet routed) completes in full on the other replica; requests sent right
    after the kill succeed; /ready, polled throughout, never says 503 (a replica is up)."""
    with serve_on_local_cluster(num_nodes=1) as base:
        serve.run(build_app(FAULT), name="fault", route_prefix="/fault")
        url = f"{base}/fault"
        replicas = _replicas("fault")
        assert len(replicas) == 2
        # the replicas run this worktree's code (the cluster inherits PYTHONPATH)
        handle = next(
            ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::fault#LLM")
        )
        where = ray.get(
            handle.__ray_call__.remote(
                lambda _: __import__("chunkserve.replicas.deployment").replicas.deployment.__file__
            )
        )
        assert Path(where).resolve().is_relative_to(ROOT), where
        t0 = time.monotonic()

        async def main():
            readies: list[tuple[float, int, str]] = []
            done = asyncio.Event()
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:

                async def poll_ready():
                    while not done.is_set():
                        r = await client.get(f"{url}/ready")
                        readies.append((time.monotonic() - t0, r.status_code, r.text))
                        await asyncio.sleep(0.2)

                poller = asyncio.create_task(poll_ready())
                streams = [_Stream(i) for i in range(16)]
                tasks = [asyncio.create_task(s.run(client, url)) for s in streams[:12]]
                deadline = time.monotonic() + 240
                while True:  # until the replica to kill has MAX_SEQS streams under way and some waiting
                    assert time.monotonic() < deadline, "the streams did not start"
                    await asyncio.sleep(0.2)
                    stats = await asyncio.to_thread(_replica_stats, "fault")
                    if len(stats) < 2:
                        continue
                    # (none may have ended yet: the victim's waiting ones would start, the race this avoids)
                    assert not any(s.events[-1:] == ["[DONE]"] for s in streams), "a stream ended before the kill"
                    victim = max(stats, key=lambda r: stats[r]["waiting"])
                    going = [s for s in streams[:12] if s.replica == victim and len(s.events) >= 3]
                    if stats[victim]["waiting"] > 0 and len(going) == MAX_SEQS == stats[victim]["running"]:
                        break
                waiting = stats[victim]["waiting"]
                tasks += [asyncio.create_task(s.run(client, url)) for s in streams[12:]]
                await asyncio.sleep(0.3)  # (they reach the ingress, some a replica)
                killed_at = time.monotonic()
                os.kill(replicas[victim], signal.SIGKILL)
                had_token = {s.i for s in streams if s.started is not None}
                # requests sent right after the kill, before Serve has noticed it
                after = [
                    asyncio.create_task(client.post(f"{url}{p}", json=b))
                    for p, b in (_body(100 + i, stream=False) for i in range(2))
                ]
                after_streams = [_Stream(200 + i) for i in range(2)]
                after += [asyncio.create_task(s.run(client, url)) for s in after_streams]
                results = await asyncio.wait_for(asyncio.gather(*tasks, *after), timeout=600)
                # /ready polled on until Serve has replaced the killed replica and both run
                deadline = time.monotonic() + 240
                while True:
                    assert time.monotonic() < deadline, "the killed replica was not replaced"
                    await asyncio.sleep(1)
                    pids = await asyncio.to_thread(_replicas, "fault")
                    if (
                        len(pids) == 2
                        and replicas[victim] not in pids.values()
                        and readies[-1][1] == 200
                        and json.loads(readies[-1][2])["model_replicas"] == {"RUNNING": 2}
                    ):
                        break
                done.set()
                await poller
                return (
                    streams,
                    victim,
                    waiting,
                    had_token,
                    killed_at,
                    results[len(tasks) : len(tasks) + 2],
                    after_streams,
                    readies,
                )

        streams, victim, waiting, had_token, killed_at, after, after_streams, readies = asyncio.run(main())
        [survivor] = set(replicas) - {victim}
        cut = [s for s in streams if s.i in had_token and s.replica == victim]
        whole = [s for s in streams if s not in cut]
        print(
            f"\nkilled replica {victim} ({waiting} requests waiting in its engine, {len(cut)} streaming) at "
            f"{killed_at - t0:.1f} s; {len(had_token)} of 16 had a token then; {len(cut)} cut, {len(whole)} "
            f"whole ({sum(s.i not in had_token for s in whole)} that had no token, "
            f"{sum(s.replica == survivor for s in whole)} on {survivor}); /ready polled {len(readies)} times: "
            f"{sorted({code for _, code, _ in readies})}"
        )
        # every one of the 16 accounted for: cut (tokens, then the error) or whole
        assert len(cut) == MAX_SEQS and len(cut) + len(whole) == 16
        for s in cut:
            _check_error_stream(s)
        for s in whole:
            _check_whole_stream(s)
        # those with no token yet (the victim's waiting ones among them) completed on the other replica
        fresh = [s for s in streams if s.i not in had_token]
        assert len(fresh) >= waiting and all(s.replica == survivor for s in fresh), [(s.i, s.replica) for s in fresh]
        for r in after:
            _whole(r)
        for s in after_streams:
            _check_whole_stream(s)
        # one replica was up throughout, until the killed one was replaced: /ready never went false
        replaced = readies[-1][0] - (killed_at - t0)
        print(
            f"replaced {replaced:.1f} s after the kill; /ready polled {len(readies)} times, "
            f"states seen: {sorted({text for _, _, text in readies})}"
        )
        assert len(readies) > 20 and all(code == 200 for _, code, _ in readies), [
            (round(t, 1), code, text) for t, code, text in readies if code != 200
        ]
        assert all(json.loads(text)["model_replicas"].get("RUNNING", 0) >= 1 for _, _, text in readies)
        # after: both replicas (the killed one's replacement) serve
        for i in range(4):
            path, body = _body(300 + i, stream=False)
            _whole(httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT))
