"""The ingress's calls to a replica and what the replica streams back: the wire types between
chunkserve/cluster/ingress.py and chunkserve/replicas/deployment.py (pickled by Ray), read by the router too
(chunkserve/router/serve_router.py: the request's prefix hashes); and EngineDied, what a replica whose
engine process is gone raises, on every path. The OpenAI HTTP schemas are apart, in
chunkserve/cluster/protocol.py.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from dataclasses import dataclass

from chunkserve.replicas.engine.sequence import SamplingParams, Tenancy

__all__ = ["EngineDied", "GenerateOutput", "GenerateRequest"]


class EngineDied(Exception):
    """The engine process failed or exited; the message says why (raised in the replica, and in
    the ingress for a direct stream whose replica's engine died)."""


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
