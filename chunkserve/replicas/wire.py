"""Every message that crosses a process, by channel: each channel's sender refuses any other
type (`check`), and each receiver dispatches on the class (`match`). The messages are NamedTuples,
cheap to build; pickled, each costs its class's reference more than a plain tuple of its fields
(chunkserve/replicas/tools/bench_wire.py measures both). Their payloads are the engine's own types.

  Serve's calls   ingress -> replica (Ray pickles them), read by the router too
                  (chunkserve/router/serve_router.py: the request's prefix hashes)
                    GenerateRequest  ──▶   ◀── GenerateOutput (streamed)
  direct stream   ingress <-> replica over TCP (chunkserve/replicas/direct_stream.py)
                    StreamOpen, StreamCancel  ──▶
                    ◀── StreamOutput, StreamEnd, StreamFull, StreamError
  engine pipe     replica <-> its engine process (chunkserve/replicas/engine_process.py)
                    StartEngine, AddRequest, AbortRequest, CompileGuide, CloseEngine  ──▶
                    ◀── EngineReady | StartFailed, then StepOutputs (one a step), GuideCompiled,
                        EngineCrashed;  EngineDied: the exception the replica raises for it
  ranks           rank 0 -> ranks 1 .. n-1 (chunkserve/replicas/parallel.py)
                    AddRequest, AbortRequest (as on the pipe), once a step

The OpenAI HTTP schemas are apart, in chunkserve/cluster/protocol.py.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, get_args

from chunkserve.replicas.engine.sequence import SamplingParams, Tenancy

if TYPE_CHECKING:
    from chunkserve.replicas.engine.llm_engine import EngineConfig, RequestOutput
    from chunkserve.router.events import Events

__all__ = [
    "ENGINE_COMMANDS",
    "ENGINE_REPLIES",
    "RANK_OPS",
    "STREAM_REPLIES",
    "STREAM_REQUESTS",
    "AbortRequest",
    "AddRequest",
    "CloseEngine",
    "CompileGuide",
    "EngineCommand",
    "EngineCrashed",
    "EngineDied",
    "EngineReady",
    "EngineReply",
    "GenerateOutput",
    "GenerateRequest",
    "GuideCompiled",
    "RankOp",
    "StartEngine",
    "StartFailed",
    "StepOutputs",
    "StreamCancel",
    "StreamEnd",
    "StreamError",
    "StreamFull",
    "StreamOpen",
    "StreamOutput",
    "StreamReply",
    "StreamRequest",
    "check",
]


class EngineDied(Exception):
    """The engine process failed or exited; the message says why (raised in the replica, and in
    the ingress for a direct stream whose replica's engine died)."""


def check(message: Any, allowed: frozenset[type], channel: str) -> None:
    """Raise TypeError unless message is one of the channel's message types (a bare tuple, above
    all: the messages were string-tagged tuples once)."""
    if type(message) not in allowed:
        names = ", ".join(sorted(t.__name__ for t in allowed))
        raise TypeError(f"{channel}: {type(message).__name__} {message!r:.100} is not one of its messages ({names})")


_TOKEN_CHAR0 = 0x10000  # GenerateRequest.prompt: token id t is chr(0x10000 + t), past the surrogates


# -- Serve's calls: ingress -> replica --------------------------------------------------------
@dataclass(frozen=True)
class GenerateRequest:
    """One choice of one prompt. A request's choices carry the same stop strings, and each call
    pickles its own copy: unpickled, a request's stop strings are the process's one copy of
    that tuple (_HeldStops), so a replica holds them once however many choices use them."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...]  # stop strings: the text ends before the first one, finish_reason "stop"
    model: str
    prefix_hashes: tuple[int, ...] = ()  # chained chunk hashes of the prompt's head, for the router
    skip_special_tokens: bool = True  # the text without special tokens' (vLLM's)
    include_stop_str_in_output: bool = False  # the text through the stop string (vLLM's)
    # its tenant, cache salt (the prefix tree it shares; prefix_hashes are seeded by it too) and
    # priority (chunkserve/cluster/tenants.py)
    tenancy: Tenancy = Tenancy()
    # the router's session hint: a hash of the tenant and the request's x-session-id header (a
    # session's requests stay on its replica while load allows); None: none
    session: int | None = None
    # the ingress process's router that sent it (chunkserve/router/direct.py ROUTER_ID): the
    # replica reports the work it holds by router; None: not sent through a prefix router's ingress
    router: str | None = None

    def __reduce__(self):
        return _received, tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def prompt(self) -> str:
        """The prompt as Ray Serve LLM's PrefixCacheAffinityRouter reads it (router.policy
        ray_prefix): its tree matches characters, so one character per token id, after the cache
        salt's, so that tenants who share no cache share no match."""
        salt = self.tenancy.cache_salt
        head = "" if salt is None else f"{len(salt)}:{salt}"  # (its length: no salt is another's head)
        return head + "".join([chr(_TOKEN_CHAR0 + t) for t in self.prompt_token_ids])


class _HeldStops:
    """The stop-string tuples of the GenerateRequests this process has unpickled and still holds:
    one copy per distinct tuple, dropped when the last request holding it is."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, ...], list] = {}  # tuple -> [the copy held, requests holding it]
        self._lock = threading.RLock()  # (unpickled on Ray's threads; a release may run inside a take's GC)

    def take(self, stop: tuple[str, ...]) -> tuple[str, ...]:
        with self._lock:
            held = self._held.setdefault(stop, [stop, 0])
            held[1] += 1
            return held[0]

    def release(self, stop: tuple[str, ...]) -> None:
        with self._lock:
            held = self._held.get(stop)
            if held is not None:
                held[1] -= 1
                if held[1] <= 0:
                    del self._held[stop]

    def __len__(self) -> int:
        return len(self._held)


HELD_STOPS = _HeldStops()


def _received(*fields) -> GenerateRequest:
    """A GenerateRequest as unpickled: its stop strings the process's held copy (HELD_STOPS)."""
    request = GenerateRequest(*fields)
    if request.stop:
        held = HELD_STOPS.take(request.stop)
        object.__setattr__(request, "stop", held)  # (frozen for its users; this is its construction)
        weakref.finalize(request, HELD_STOPS.release, held)
    return request


@dataclass(frozen=True)
class GenerateOutput:
    """What a replica streams back: everything new since its previous output for the request."""

    replica_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None until the last output: "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # so far
    # with SamplingParams.logprobs, per token of token_ids: (its logprob, the most likely tokens'
    # (id, logprob))
    logprobs: tuple[tuple[float, tuple[tuple[int, float], ...]], ...] | None = None
    # with SamplingParams.prompt_logprobs, in the first output: the same per prompt token (None
    # for the first)
    prompt_logprobs: tuple | None = None
    # in the first output: seconds from the replica receiving the request to this output (the
    # ingress's Server-Timing `replica`)
    first_output_s: float | None = None
    cached_tokens_host: int = 0  # of cached_tokens, those copied back from the replica's host tier


# -- the direct stream: ingress -> replica (sid: the ingress's id of the stream, unique on its connection)
class StreamOpen(NamedTuple):
    sid: int
    request: GenerateRequest


class StreamCancel(NamedTuple):
    sid: int


# -- the direct stream: replica -> ingress ---------------------------------------------------
class StreamOutput(NamedTuple):
    sid: int
    output: GenerateOutput


class StreamEnd(NamedTuple):
    sid: int


class StreamFull(NamedTuple):
    """The replica holds max_ongoing_requests already (the ingress sends the request through Serve)."""

    sid: int


class StreamError(NamedTuple):
    """The stream's generate raised: its kind as the ingress raises it again (`exception`)."""

    sid: int
    kind: str  # "refused" (a ValueError: the request's fault) | "engine_died" | "failed"
    message: str

    @staticmethod
    def of(sid: int, e: BaseException) -> StreamError:
        kind = "engine_died" if isinstance(e, EngineDied) else "refused" if isinstance(e, ValueError) else "failed"
        return StreamError(sid, kind, str(e))

    def exception(self) -> Exception:
        if self.kind == "refused":
            return ValueError(self.message)
        if self.kind == "engine_died":
            return EngineDied(self.message)
        return RuntimeError(f"the replica failed: {self.message}")


StreamRequest = StreamOpen | StreamCancel
StreamReply = StreamOutput | StreamEnd | StreamFull | StreamError
STREAM_REQUESTS: frozenset[type] = frozenset(get_args(StreamRequest))
STREAM_REPLIES: frozenset[type] = frozenset(get_args(StreamReply))


# -- the engine pipe: replica -> engine process (AddRequest and AbortRequest: to the ranks too) --
class StartEngine(NamedTuple):
    """The first message: build the engine (and warm it up)."""

    config: EngineConfig
    warm_up: bool
    route_events: tuple[str, int] | None  # (served model name, route_chunks): record the tree's routing events
    tp_rendezvous: tuple[str, int] | None  # (address, port) of the ranks' group; None: one rank


class AddRequest(NamedTuple):
    request_id: str
    prompt: list[int]
    params: SamplingParams | None
    tenancy: Tenancy | None


class AbortRequest(NamedTuple):
    request_id: str


class CompileGuide(NamedTuple):
    """Compile a guided request's grammar (off the step loop), answered by GuideCompiled(token)."""

    token: int
    guide: Any  # chunkserve.replicas.engine.guided.Guide


class CloseEngine(NamedTuple):
    pass


# -- the engine pipe: engine process -> replica ----------------------------------------------
class EngineReady(NamedTuple):
    """The engine is built (and warmed up)."""

    max_model_len: int
    vocab_size: int
    warmup: dict | None  # the warm-up's figures (chunkserve/replicas/engine/warmup.py); None: not warmed up
    stats: dict  # LLMEngine.stats()
    events: Events | None  # the tree's routing events so far (a snapshot), None when not recorded


class StartFailed(NamedTuple):
    error: str  # the engine's exception and traceback


class StepOutputs(NamedTuple):
    """One a step: every request's new outputs, the adds taken since the last (or refused, with the
    engine's ValueError text), the engine's stats, and its tree's routing events since the last
    (chunkserve/router/events.py; None when nothing changed)."""

    outputs: list[RequestOutput]
    accepted: list[str]
    rejected: list[tuple[str, str]]  # (request_id, why)
    stats: dict
    events: Events | None


class GuideCompiled(NamedTuple):
    token: int
    error: str | None  # the grammar engine's ValueError text; None: compiled


class EngineCrashed(NamedTuple):
    """The engine raised mid-run (the process then exits): the replica raises EngineDied(reason)."""

    reason: str


EngineCommand = StartEngine | AddRequest | AbortRequest | CompileGuide | CloseEngine
EngineReply = EngineReady | StartFailed | StepOutputs | GuideCompiled | EngineCrashed
ENGINE_COMMANDS: frozenset[type] = frozenset(get_args(EngineCommand))
ENGINE_REPLIES: frozenset[type] = frozenset(get_args(EngineReply))

# -- the ranks: rank 0 -> ranks 1 .. n-1, with each step ------------------------------------
RankOp = AddRequest | AbortRequest
RANK_OPS: frozenset[type] = frozenset(get_args(RankOp))
