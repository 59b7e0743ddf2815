"""This process's prefix routers, for the ingress's direct streams (chunkserve/replicas/direct_stream.py),
and what they predicted for each request.

Serve builds each handle's request router (chunkserve/router/serve_router.py, a module it pickles by value,
so its globals are a copy) and runs it on an event loop of its own; the router registers itself
here, by (application, deployment), with that loop, and the ingress asks it for a replica through
`route_direct`, on the router's loop.

Predictions: when a router routes a request (Serve's `on_request_routed`, or `route_direct`) it
records here, by the request's id, the prompt tokens it counted as cached on the replica it went
to (`policy.Ticket.matched`); the ingress takes the record once the request's first output has
come, which is after the routing: Serve calls on_request_routed before it hands the call's result
back, and route_direct returns after it. A retry routes again, and its record replaces the first.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class DirectRoute:
    """A replica chosen for a request sent to it directly (not through Serve)."""

    replica_id: str
    address: Any  # the replica's routing stats' `stream_address`
    release: Callable[[], None]  # the request is over: its work leaves the load (any thread, once)


class _Router(Protocol):
    def route_direct(self, request: Any) -> DirectRoute | None: ...


# This process's routers' name on the wire (GenerateRequest.router): a replica reports the work it
# holds by it, so each router adds the other routers' share to its own exact count (DESIGN §3).
ROUTER_ID = uuid.uuid4().hex[:16]

_ROUTERS: weakref.WeakValueDictionary[tuple[str, str], Any] = weakref.WeakValueDictionary()
_LOOPS: dict[tuple[str, str], asyncio.AbstractEventLoop] = {}


def register(app_name: str, deployment_name: str, router: _Router, loop: asyncio.AbstractEventLoop) -> None:
    """router (which runs on loop) chooses for that deployment's direct streams from now on."""
    _ROUTERS[(app_name, deployment_name)] = router
    _LOOPS[(app_name, deployment_name)] = loop


async def route_direct(app_name: str, deployment_name: str, request: Any) -> DirectRoute | None:
    """The replica the deployment's router chooses for `request` (a GenerateRequest), on the
    router's loop; None when there is no router yet (it starts with the first call through
    Serve), its loop is gone, or it has no route (see PrefixAffinityRouter.route_direct)."""
    key = (app_name, deployment_name)
    router, loop = _ROUTERS.get(key), _LOOPS.get(key)
    if router is None or loop is None or loop.is_closed():
        return None
    if loop is asyncio.get_running_loop():
        return router.route_direct(request)

    async def on_router_loop() -> DirectRoute | None:
        return router.route_direct(request)

    # shielded: a cancel would reach the router's task too late to stop its choice, only its result
    chosen = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_router_loop(), loop))
    try:
        return await asyncio.shield(chosen)
    except asyncio.CancelledError:  # (the client went): the route chosen meanwhile is released
        chosen.add_done_callback(_release_chosen)
        raise


def peer_stats() -> dict[str, list[int]]:
    """Per deployment ("app/deployment") of this process's routers that share decisions
    (chunkserve/router/peers.py): [routers it sends to, decisions of others booked, ever]."""
    out = {}
    for (app, name), router in list(_ROUTERS.items()):
        stats = getattr(router, "peer_stats", None)
        if stats is not None and (s := stats()) is not None:
            out[f"{app}/{name}"] = s
    return out


def _release_chosen(chosen: Any) -> None:
    if not chosen.cancelled() and chosen.exception() is None and chosen.result() is not None:
        chosen.result().release()


# request id -> predicted cached prompt tokens; records the ingress never takes (a request that
# failed first) go oldest first beyond PREDICTIONS_KEPT
PREDICTIONS_KEPT = 1 << 16
_predictions: OrderedDict[str, int] = OrderedDict()
_predictions_lock = threading.Lock()  # (routers write on their loops' threads, the ingress reads on its own)


def predict(request_id: str, cached_tokens: int) -> None:
    """A router routed `request_id` counting `cached_tokens` of its prompt as cached there."""
    with _predictions_lock:
        _predictions[request_id] = cached_tokens
        _predictions.move_to_end(request_id)
        if len(_predictions) > PREDICTIONS_KEPT:
            _predictions.popitem(last=False)


def take_prediction(request_id: str) -> int | None:
    """The prediction recorded for `request_id` (then forgotten); None when no prefix router routed it."""
    with _predictions_lock:
        return _predictions.pop(request_id, None)
