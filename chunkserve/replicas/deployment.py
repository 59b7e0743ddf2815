"""LLMReplica: the Serve deployment around one engine, which runs in a process of its own.

One replica = one engine process (chunkserve/replicas/engine_process.py) + this front. Every request the
replica holds is a sequence in that engine, so each step batches all of them (continuous
batching across HTTP requests). The engine process steps back to back while it has work, so
nothing this process does (Serve's plumbing, streaming, the event loop) takes the interpreter
from it:

    generate(req) ── AddRequest ──▶ pipe ──▶ engine process: adds and aborts between steps, step() ──┐
         ▲                                                                                       │
         └── per-request queue of RequestOutput ◀── on_step (StepOutputs, one a step) ◀──────────┘

A request whose caller goes away (client disconnect: Serve cancels the generator), or that a
stop string ended, is aborted in the engine, which frees its chunks. The engine's stats and its
prefix tree's routing events come with its step messages; a Relay (chunkserve/router/events.py) turns the
events into what each routing-stats poll returns for the routers.

With tensor_parallel_size n > 1 the engine process is rank 0 of n (chunkserve/replicas/parallel.py): the
replica starts ranks 1 .. n-1 as Ray actors in its placement group's other bundles (build_app
asks for n bundles, one GPU each, on one node), and its engine process, a TPEngine, drives them
through every step.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve import metrics
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from chunkserve.replicas.direct_stream import StreamServer
from chunkserve.replicas.engine.distributed import free_port, init_group
from chunkserve.replicas.engine.llm_engine import EngineConfig, RequestOutput
from chunkserve.replicas.engine_process import EngineProcess
from chunkserve.replicas.model import IncrementalDetokenizer, Tokenizer, load_tokenizer
from chunkserve.replicas.parallel import TPWorker, rank_device, worker_config
from chunkserve.replicas.wire import EngineDied, GenerateOutput, GenerateRequest, StepOutputs
from chunkserve.router.events import Relay


class _HeldByRouter:
    """The requests this replica holds, summed by the router that sent them (GenerateRequest.router;
    None: a router-less caller): [requests, prompt tokens, cached prompt tokens, max_tokens]. A
    router turns the others' sums into work in its own units and adds it to its exact count of its
    own (chunkserve/router/serve_router.py, DESIGN §3 "Load"). Cached tokens count once the engine
    reports them (its first output)."""

    def __init__(self) -> None:
        self._sums: dict[str | None, list[int]] = {}

    def hold(self, router: str | None, prompt_tokens: int, max_tokens: int) -> list:
        """Count a request in; returns its handle: [router, cached tokens counted]."""
        sums = self._sums.setdefault(router, [0, 0, 0, 0])
        sums[0] += 1
        sums[1] += prompt_tokens
        sums[3] += max_tokens
        return [router, 0, prompt_tokens, max_tokens]

    def cached(self, handle: list, cached_tokens: int) -> None:
        if handle[1] != cached_tokens:
            self._sums[handle[0]][2] += cached_tokens - handle[1]
            handle[1] = cached_tokens

    def release(self, handle: list) -> None:
        router, cached, prompt, max_tokens = handle
        sums = self._sums[router]
        sums[0] -= 1
        sums[1] -= prompt
        sums[2] -= cached
        sums[3] -= max_tokens
        if not sums[0]:
            del self._sums[router]

    def snapshot(self) -> dict[str | None, list[int]]:
        return {r: list(v) for r, v in self._sums.items()}


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Stream:
    """The event-loop side of one request in the engine."""

    accepted: asyncio.Future  # set when the engine applied the add: None, or its ValueError
    outputs: asyncio.Queue[RequestOutput | EngineDied]  # one per step; EngineDied if the engine process dies
    # while generate waits out its stream interval: resolved by then, or as soon as the last
    # output (or EngineDied) is queued, so that a stream's end is never held back
    gather: asyncio.Future | None = None
    ended: bool = False  # the last output (or EngineDied) is queued: nothing to wait for

    def put(self, out: RequestOutput | EngineDied) -> None:
        self.outputs.put_nowait(out)
        if isinstance(out, EngineDied) or out.finished:
            self.ended = True
            if self.gather is not None:
                _resolve(self.gather)


@dataclass(frozen=True)
class ReplicaOptions:
    """How a replica serves its engine, besides the engine's own config (build_app fills it from
    the AppConfig).

    served_model_name: seeds the routing events' hashes as the ingress seeds prompt hashes
    (chunkserve/router/hashing.py); None: the engine's model. route_chunks: the leading chunks of a
    prompt the router hashes. cpus_per_rank: each tensor-parallel rank's actor's CPUs (its bundle's).
    warm_up: compile the kernels before the replica reports ready. stream_interval_ms: a stream's
    outputs after its first are sent at most this often, the steps between gathered into one
    (each send is a Ray message, and one more at the ingress to the proxy: per token, the ingress
    and proxy bound the stack's tokens per second); 0: one a step. direct_streams: take
    ingresses' direct streams (chunkserve/replicas/direct_stream.py) while the replica holds
    fewer requests than this (its max_ongoing_requests); None: none."""

    served_model_name: str | None = None
    route_chunks: int = 128
    cpus_per_rank: float = 1
    warm_up: bool = False
    stream_interval_ms: float = 0
    direct_streams: int | None = None


@serve.deployment
class LLMReplica:
    TP_PING_TIMEOUT_S = 20.0  # a tensor-parallel rank that does not answer a health check ping in this is dead

    def __init__(self, engine_config: EngineConfig, options: ReplicaOptions = ReplicaOptions()):
        self._stream_interval_s = options.stream_interval_ms / 1000
        self._tp_ranks: list = []  # ranks 1 .. n-1 (Ray actors) of a tensor-parallel replica
        rendezvous, check = None, None
        if engine_config.tp_size > 1:
            engine_config, self._tp_ranks, rendezvous, check = _start_tp_ranks(engine_config, options.cpus_per_rank)
        # the router's view of this replica's tree: routing events, hashes seeded by the served model
        # name as the ingress hashes prompts (chunkserve/router/hashing.py), taken between steps.
        # Built and warmed up (kernels compiled) before the replica reports ready: Serve waits for __init__.
        self.core = EngineProcess(
            engine_config,
            warm_up=options.warm_up,
            route_events=(options.served_model_name or engine_config.model, options.route_chunks),
            tp_rendezvous=rendezvous,
            while_waiting=check,
        )
        info = self.core.info
        self.warmup_stats = info.warmup
        self._model_info = {"max_model_len": info.max_model_len, "vocab_size": info.vocab_size}
        self.tokenizer = load_tokenizer(engine_config.model)  # detokenizes the streams here (the engine's own)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._streams: dict[str, _Stream] = {}
        self._held = _HeldByRouter()  # what each router's requests here amount to (routing stats)
        self._stats = info.stats  # as of the engine's last step; read by stats / routing stats
        self._relay = Relay()  # the tree's routing events, as each routing-stats poll reports them
        if info.events is not None:
            self._relay.apply(info.events)
        self._metrics = _Metrics(self._stats)
        loop = asyncio.get_running_loop()
        self.core.start_receiving(loop, self._on_step, self._on_death)
        self._direct: StreamServer | None = None
        self._slots: _Slots | None = None
        if options.direct_streams is not None:
            # Serve counts only its own calls against max_ongoing_requests: with direct streams
            # the replica bounds the requests in its engine itself, from both paths; Serve's calls
            # past it wait here in order, a direct one past it goes through Serve instead
            self._slots = slots = _Slots(options.direct_streams)
            self._direct = StreamServer(ray.util.get_node_ip_address(), self._generate_direct, slots.free)
            loop.create_task(self._direct.start())

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """Stream one request: each output holds what is new since the previous one."""
        entered = time.perf_counter()
        self._raise_if_dead()
        rid = request.request_id
        stops = _Stops(request.stop, request.params.min_tokens, request.include_stop_str_in_output)
        text = _TextStream(self.tokenizer, request.prompt_token_ids, stops, request.skip_special_tokens)
        if request.params.guided is not None:
            # compiled in the engine process off its step loop (seconds for a large schema and
            # vocabulary): its add then finds it cached (a ValueError for a bad guide reaches the caller)
            await self.core.compile(request.params.guided)
        if self._slots is not None:
            await self._slots.take()  # (direct streams beside Serve's calls: one bound for both)
        stream = self._streams[rid] = _Stream(asyncio.get_running_loop().create_future(), asyncio.Queue())
        held = self._held.hold(request.router, len(request.prompt_token_ids), request.params.max_tokens)
        arrival = time.perf_counter()
        first_token_at = None
        engine_done = False
        sent_at = None  # when the last output went (the first goes at once)
        try:
            self.core.add(rid, list(request.prompt_token_ids), request.params, request.tenancy)
            await stream.accepted  # the engine's ValueError for a bad request surfaces here
            while not engine_done:
                batch = [await stream.outputs.get()]
                if sent_at is not None and not isinstance(batch[-1], EngineDied) and not batch[-1].finished:
                    wait = sent_at + self._stream_interval_s - time.perf_counter()
                    if wait > 0 and not stream.ended:  # gather the steps until the interval is up, or the end comes
                        await self._gather(stream, wait)
                while not stream.outputs.empty():  # steps that came meanwhile: sent as one
                    batch.append(stream.outputs.get_nowait())
                if isinstance(batch[-1], EngineDied):
                    raise batch[-1]
                if first_token_at is None:
                    first_token_at = time.perf_counter()
                    self._metrics.time_to_first_token.observe(first_token_at - arrival)
                out = _take(text, batch)
                engine_done = out.engine_done
                if out.reason is not None and out.output_tokens > 1:
                    self._metrics.time_per_output_token.observe(
                        (time.perf_counter() - first_token_at) / (out.output_tokens - 1)
                    )
                last = batch[-1]
                self._held.cached(held, last.cached_tokens)
                yield GenerateOutput(
                    self.replica_id,
                    out.text,
                    out.token_ids,
                    out.reason,
                    last.prompt_tokens,
                    last.cached_tokens,
                    out.output_tokens,
                    out.logprobs,
                    out.prompt_logprobs,
                    first_output_s=None if sent_at is not None else first_token_at - entered,
                    cached_tokens_host=last.cached_tokens_host,
                )
                sent_at = time.perf_counter()
                if out.stopped:
                    return  # a stop string ended it; the engine still runs it until the abort below
        finally:
            del self._streams[rid]
            self._held.release(held)
            if self._slots is not None:
                self._slots.release()
            if not engine_done and self.core.error is None:  # cancelled, failed, or stopped by a stop string
                try:
                    self.core.abort(rid)
                except EngineDied:  # (it died meanwhile: nothing left to abort)
                    pass

    @staticmethod
    async def _gather(stream: _Stream, wait: float) -> None:
        loop = asyncio.get_running_loop()
        stream.gather = done = loop.create_future()
        timer = loop.call_later(wait, _resolve, done)
        try:
            await done
        finally:
            timer.cancel()
            stream.gather = None

    def _generate_direct(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """generate for a request an ingress sent on a direct stream (chunkserve/replicas/direct_stream.py)."""
        self._metrics.count_direct()
        return self.generate(request)

    # -- the engine's messages (on the event loop) ------------------------------------------
    def _on_step(self, step: StepOutputs) -> None:
        outputs, accepted, rejected, stats, events = step
        for rid in accepted:
            stream = self._streams.get(rid)
            if stream is not None and not stream.accepted.done():  # (None: the caller left meanwhile)
                stream.accepted.set_result(None)
        for rid, message in rejected:
            stream = self._streams.get(rid)
            if stream is not None and not stream.accepted.done():
                stream.accepted.set_exception(ValueError(message))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:  # None: aborted while the step ran
                stream.put(out)
        self._stats = stats
        self._metrics.update(stats)
        if events is not None:
            self._relay.apply(events)

    def _on_death(self, reason: str) -> None:
        died = EngineDied(f"the engine failed: {reason}")
        for stream in self._streams.values():
            if not stream.accepted.done():
                stream.accepted.set_exception(died)
            stream.put(died)

    def _raise_if_dead(self) -> None:
        if self.core.error is not None:  # (set by the receiver thread: why the engine process is gone)
            raise EngineDied(f"the engine is not running: {self.core.error}")

    # -- Serve hooks and introspection ------------------------------------------------------
    async def check_health(self) -> None:
        self._raise_if_dead()  # a failing check makes Serve replace the replica (and its engine process)
        # a rank that died leaves rank 0 waiting in a collective, its engine process still "running"
        if self._tp_ranks:
            await asyncio.wait_for(
                asyncio.gather(*(rank.ping.remote() for rank in self._tp_ranks)), timeout=self.TP_PING_TIMEOUT_S
            )

    async def record_routing_stats(self) -> dict:
        """What Serve's controller collects from this replica for the routers (chunkserve/router/serve_router.py),
        and the ingress's /metrics from every replica (chunkserve/cluster/metrics.py reads `metrics`): the
        controller polls this each routing-stats period, the ingress when it is scraped."""
        s = self._stats
        return {
            "running": s["running"],
            "waiting": s["waiting"],
            "kv_chunks_used": s["kv_chunks_used"],
            "kv_chunks_total": s["kv_chunks_total"],
            # the tree's routing events since the last polls (chunkserve/router/events.py), as of now
            "events": self._relay.report(time.monotonic()),
            "as_of": time.time(),
            "held_by_router": self._held.snapshot(),
            "metrics": self._metrics.snapshot(s),
            **({"stream_address": self._direct.address.as_tuple()} if self._direct is not None else {}),
        }

    async def stats(self) -> dict[str, int]:
        """engine.stats() as of the engine's last step."""
        return dict(self._stats)

    async def model_info(self) -> dict:
        """What the ingress validates requests against."""
        return dict(self._model_info)

    def __del__(self) -> None:
        direct = getattr(self, "_direct", None)
        if direct is not None:
            direct.close()
        core = getattr(self, "core", None)
        if core is not None:
            core.close()


@ray.remote(max_concurrency=2)  # type: ignore[call-overload]  # (Ray's stubs lack actor options) ping answers while serve runs
class _TPRank:
    """Rank r > 0 of a replica's tensor-parallel group: a TPWorker in its own process, stepping
    with rank 0 (the replica's engine process) over the group (replicas/parallel.py), not through Ray calls."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.worker: TPWorker | None = None
        self.started = threading.Event()  # serve waits for start: both are called at once
        self.stopped: str | None = None  # why start or serve returned, once one has

    def start(self, addr: str, port: int) -> None:
        """Join the group, then build the engine (with every other rank: the pool size is agreed)."""
        try:
            init_group(self.config.tp_rank, self.config.tp_size, addr, port, rank_device(self.config))
            self.worker = TPWorker(self.config)
        except BaseException as e:
            self.stopped = f"{type(e).__name__}: {e}"
            raise
        finally:
            self.started.set()

    def serve(self) -> None:
        self.started.wait()
        if self.worker is None:
            raise RuntimeError(f"tensor-parallel rank {self.config.tp_rank} did not start: {self.stopped}")
        try:
            self.worker.serve()
            self.stopped = "rank 0 closed the group"
        except BaseException as e:
            self.stopped = f"{type(e).__name__}: {e}"
            raise

    def ping(self) -> None:
        """The replica's health check: this rank's process is alive and still stepping."""
        if self.stopped is not None:
            raise RuntimeError(f"tensor-parallel rank {self.config.tp_rank} stopped: {self.stopped}")


def _start_tp_ranks(
    config: EngineConfig, cpus_per_rank: float
) -> tuple[EngineConfig, list, tuple[str, int], Callable[[], None]]:
    """Start ranks 1 .. n-1 in the replica's placement group, joining rank 0's rendezvous and
    then stepping with it (warmup included: rank 0's engine process steps as soon as it is built).
    -> (rank 0's config, the ranks' actors, the rendezvous, a check that raises a rank's failure)."""
    group = ray.util.get_current_placement_group()
    if group is None or len(group.bundle_specs) < config.tp_size:
        raise ValueError(
            f"tensor_parallel_size={config.tp_size} needs a placement group of that many bundles "
            "(chunkserve.cluster.app.build_app asks Serve for one)"
        )
    if config.device not in ("cpu", "cuda"):
        raise ValueError(f"tensor_parallel_size > 1 takes device cpu or cuda (a GPU per rank), got {config.device!r}")
    config = worker_config(config, 0)
    addr = ray.util.get_node_ip_address()
    port = free_port(addr)
    ranks = [
        _TPRank.options(
            num_cpus=cpus_per_rank,
            num_gpus=1 if config.device == "cuda" else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r),
        ).remote(worker_config(config, r))
        for r in range(1, config.tp_size)
    ]
    refs = [rank.start.remote(addr, port) for rank in ranks] + [rank.serve.remote() for rank in ranks]

    def check() -> None:  # while rank 0's engine process starts: a rank that failed raises here
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ray.get(done)  # (a start that returned is fine; a serve that returned this early raised)

    return config, ranks, (addr, port), check


class _Slots:
    """At most `limit` requests in the engine; the rest wait for a slot in arrival order."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    def free(self) -> bool:
        return self.used < self.limit and not self._waiting

    async def take(self) -> None:
        if self.free():
            self.used += 1
            return
        slot = asyncio.get_running_loop().create_future()
        self._waiting.append(slot)
        try:
            await slot  # (release hands its slot over: used stays)
        except asyncio.CancelledError:
            if slot.done() and not slot.cancelled():
                self.release()  # handed over just as the caller left
            elif slot in self._waiting:  # (a release meanwhile may have dropped it, cancelled)
                self._waiting.remove(slot)
            raise

    def release(self) -> None:
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                slot.set_result(None)
                return
        self.used -= 1


@dataclass(frozen=True)
class _Taken:
    """What one yield sends of a batch of a request's step outputs (see _take)."""

    text: str
    token_ids: tuple[int, ...]
    reason: str | None
    output_tokens: int  # completion tokens so far, the last one sent included
    stopped: bool  # a stop string ended the text
    engine_done: bool  # the engine finished the request (no abort needed): the batch's last output did
    logprobs: tuple | None = None  # per token of token_ids, if the request asked (RequestOutput.logprobs)
    prompt_logprobs: tuple | None = None  # in the first output, if the request asked


def _take(text: _TextStream, batch: list[RequestOutput]) -> _Taken:
    """Push a batch of step outputs (oldest first) through the request's text stream, token by
    token: a stop string ends the text, and the tokens after the one that completed it are
    neither sent nor counted, as in vLLM, even when several steps arrive at once."""
    ids: list[int] = []
    pieces: list[str] = []
    logprobs: list | None = None
    prompt = next((tuple(o.prompt_logprobs) for o in batch if o.prompt_logprobs is not None), None)
    for out in batch:
        new = out.new_token_ids
        if out.logprobs is not None:
            logprobs = logprobs or []
        for j in range(max(1, len(new))):  # an output with no tokens may still end the request
            piece, stopped = text.push(tuple(new[j : j + 1]), final=out.finished and j >= len(new) - 1)
            pieces.append(piece)
            ids += new[j : j + 1]
            if out.logprobs is not None:
                logprobs += out.logprobs[j : j + 1]
            if stopped:
                unsent = len(new) - j - 1
                return _Taken(
                    "".join(pieces),
                    tuple(ids),
                    "stop",
                    out.output_tokens - unsent,
                    True,
                    batch[-1].finished,
                    _tuple(logprobs),
                    prompt,
                )
        if out.finished:
            return _Taken(
                "".join(pieces), tuple(ids), out.finish_reason, out.output_tokens, False, True, _tuple(logprobs), prompt
            )
    last = batch[-1]
    return _Taken("".join(pieces), tuple(ids), None, last.output_tokens, False, False, _tuple(logprobs), prompt)


def _tuple(logprobs: list | None) -> tuple | None:
    return None if logprobs is None else tuple(logprobs)


@dataclass(frozen=True)
class _Stops:
    """A request's stop strings and how they end its text: looked for from the min_tokens-th
    token on; include: the text ends after the stop string instead of before it (vLLM's
    include_stop_str_in_output)."""

    strings: tuple[str, ...] = ()
    min_tokens: int = 0
    include: bool = False


class _TextStream:
    """One request's output text: incremental detokenization and stop strings.

    Text that could still be the start of a stop string is held back (longest stop - 1 chars);
    on a stop string the text ends right before it (after it: stops.include). Stop strings are
    looked for from the stops.min_tokens-th token on (vLLM: text before it is not searched
    again). vLLM's skip_special_tokens=False renders special tokens' text.

    Only the text not yet sent is kept: a stop string found now ends in the new text, so it
    begins in the held-back part at the earliest, and each token's search covers, per stop
    string, its length and the new text, never the text before (bounded by the ingress's
    max_stop_chars).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_ids: tuple[int, ...],
        stops: _Stops = _Stops(),
        skip_special_tokens: bool = True,
    ):
        stop = stops.strings
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer and this model has none")
        self._detok = (
            None if tokenizer is None else IncrementalDetokenizer(tokenizer, list(prompt_ids), skip_special_tokens)
        )
        self._stop, self._include_stop = stop, stops.include
        self._min_tokens, self._tokens = stops.min_tokens, 0
        self._hold = max(map(len, stop), default=1) - 1
        self._text = ""  # not yet sent: at most _hold chars between pushes

    def push(self, token_ids: tuple[int, ...], final: bool) -> tuple[str, bool]:
        """-> (text to send now, whether a stop string ended the text)."""
        if self._detok is None:
            return "", False
        checked = len(self._text)
        self._text += "".join(self._detok.push(t) for t in token_ids)
        self._tokens += len(token_ids)
        if final:
            self._text += self._detok.flush()
        stopped = self._tokens >= self._min_tokens and self._cut_at_stop(checked)
        end = len(self._text) if final or stopped else max(0, len(self._text) - self._hold)
        new, self._text = self._text[:end], self._text[end:]
        return new, stopped

    def _cut_at_stop(self, checked: int) -> bool:
        # A stop string found now ends in the new text (after `checked`), so it starts after
        # checked - len(stop), inside what was held back (_hold >= len(stop) - 1 chars).
        text = self._text
        hits = [(i, len(s)) for s in self._stop if (i := text.find(s, max(0, checked - len(s) + 1))) >= 0]
        if not hits:
            return False
        start, length = min(hits)  # (of stop strings found at one place, the shortest)
        self._text = text[: start + length if self._include_stop else start]
        return True


class _Metrics:
    """chunkserve_* metrics of one replica, kept twice: through ray.serve.metrics (Ray's export,
    which adds deployment/replica/application tags) and as plain numbers (`snapshot`) that the
    ingress's /metrics aggregates over every replica (chunkserve/cluster/metrics.py), since Ray's metrics
    cannot be read back in-process. Both see every update, so they agree."""

    _COUNTERS = {
        "prompt_tokens": "prompt tokens of finished requests (aborted ones once admitted)",
        "cached_prompt_tokens": "prompt tokens served from the prefix tree",
        "cached_prompt_tokens_host": "of those, prompt tokens copied back from the host tier",
        "host_spills": "KV chunks copied from the GPU pool to the host tier as it evicted them",
        "host_write_ahead": "KV chunks copied from the GPU pool to the host tier ahead of their eviction",
        "host_spills_ahead": "KV chunks evicted to the host tier with no copy (written ahead, or loaded from there)",
        "host_loads": "KV chunks copied from the host tier back to the GPU pool",
        "host_copy_bytes": "bytes those copies moved",
        "host_copy_ms": "milliseconds those copies took",
        "generated_tokens": "tokens generated",
        "finished_requests": "requests the engine finished (aborted ones included)",
    }
    _GAUGES = {
        "running": ("running_requests", "sequences in the running batch"),
        "waiting": ("waiting_requests", "sequences waiting for admission"),
        "kv_chunks_used": ("kv_chunks_used", "KV chunks held by live sequences"),
        "kv_chunks_total": ("kv_chunks_total", "KV chunks in the pool"),
        "host_chunks_used": ("host_chunks_used", "KV chunks in the host tier"),
        "host_chunks_total": ("host_chunks_total", "KV chunks the host tier holds (0: none)"),
    }
    LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)

    def __init__(self, stats: dict[str, int]):
        self._last = {k: stats[k] for k in self._COUNTERS}
        self._counters = {k: metrics.Counter(f"chunkserve_{k}", description=d) for k, d in self._COUNTERS.items()}
        self._gauges = {k: metrics.Gauge(f"chunkserve_{name}", description=d) for k, (name, d) in self._GAUGES.items()}
        self.time_to_first_token = _Histogram(
            "chunkserve_time_to_first_token_seconds", "arrival at the replica to first token", self.LATENCY_BUCKETS
        )
        self.time_per_output_token = _Histogram(
            "chunkserve_time_per_output_token_seconds", "decode time per token after the first", self.LATENCY_BUCKETS
        )
        self._direct = metrics.Counter("chunkserve_direct_requests", description="requests taken on direct streams")
        self._direct_requests = 0
        self.update(stats)

    def count_direct(self) -> None:
        self._direct.inc()
        self._direct_requests += 1

    def update(self, stats: dict[str, int]) -> None:
        for k, counter in self._counters.items():
            if stats[k] > self._last[k]:
                counter.inc(stats[k] - self._last[k])
                self._last[k] = stats[k]
        for k, gauge in self._gauges.items():
            gauge.set(stats[k])

    def snapshot(self, stats: dict[str, int]) -> dict:
        """Plain numbers (picklable, no Ray types): the engine's counters since it started (warmup
        excluded), the gauges as of its last step, and both histograms' buckets."""
        return {
            "counters": {**{k: stats[k] for k in self._COUNTERS}, "direct_requests": self._direct_requests},
            "gauges": {name: stats[k] for k, (name, _) in self._GAUGES.items()},
            "histograms": {h.name: h.snapshot() for h in (self.time_to_first_token, self.time_per_output_token)},
        }


class _Histogram:
    """A ray.serve.metrics Histogram and the same observations counted here (per bucket, with the
    sum and count), so their exact buckets can be summed over replicas."""

    def __init__(self, name: str, description: str, bounds: tuple[float, ...]):
        self.name, self.bounds = name, bounds
        self._ray = metrics.Histogram(name, description=description, boundaries=list(bounds))
        self._counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is (bounds[-1], +inf)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._ray.observe(value)
        self._counts[bisect.bisect_left(self.bounds, value)] += 1  # le semantics: a value on a bound is in its bucket
        self._sum += value

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self._counts), "sum": self._sum}
