"""Calls to the model replicas: a choice's GenerateRequest out, its GenerateOutputs back.

Owns how a request reaches an LLMReplica and what can go wrong on the way: a direct stream to
the replica the router chose (chunkserve/replicas/direct_stream.py), else a call through Serve's
handle; the wait for the first output within the request's deadline; one retry of a replica that
failed before its first output; n choices started together and abandoned together; a client's
disconnect seen while they wait (until_gone); the replicas' model info and Serve states; and the
router's predictions taken for /metrics. What comes back is formatted by chunkserve/cluster/responses.py."""

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any

from ray import serve
from ray.exceptions import RayActorError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from chunkserve.cluster import metrics as cluster_metrics
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.errors import (
    APIError,
    deadline_exceeded,
    request_refused,
    serve_request_id,
    server_error,
    unavailable,
)
from chunkserve.replicas.direct_stream import Address, DirectStream, ReplicaFull, StreamClient, StreamLost
from chunkserve.replicas.wire import EngineDied, GenerateOutput, GenerateRequest
from chunkserve.router import direct as direct_routes

logger = logging.getLogger("ray.serve")


READY_CACHE_S = 1.0  # /ready asks Serve's controller about the model replicas at most this often


class Late(Exception):
    """No first output by the request's deadline."""


Outputs = DeploymentResponseGenerator | DirectStream  # a choice's outputs: through Serve, or direct

Started = tuple[GenerateOutput, Outputs]  # a choice's first output and the rest


async def first_output(gen: Outputs, deadline: float | None) -> GenerateOutput:
    """gen's first output; Late if it has none by `deadline` (perf_counter time). Late is "not
    done when the wait ends", never a comparison of clocks: the replica's event loop (uvloop)
    keeps a cached time, so its timers may fire a little before perf_counter reaches a deadline."""
    if deadline is None:
        return await gen.__anext__()
    first = asyncio.ensure_future(gen.__anext__())
    try:
        done, _ = await asyncio.wait((first,), timeout=max(0.0, deadline - time.perf_counter()))
    except BaseException:  # (the request itself cancelled: the client went away)
        first.cancel()
        raise
    if first in done:
        return first.result()  # (the call's own errors raised as they are)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    raise Late()


def _own_serve_request_id() -> None:
    """Give the handle calls made from this task (asyncio.gather runs each in a task with its own
    copy of the context) a Serve-internal request id of their own. Every call an HTTP request
    makes inherits that request's, and Serve's request router (ray 2.60) indexes the calls
    waiting for a replica by it: a second call with the same id, made while the first waits, is
    never given one (n choices hung), and PrefixAffinityRouter keys its load tickets by it too."""
    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))


def cancel(started: list[Started]) -> None:
    """Abort every choice in its replica (a finished one ignores it)."""
    for _, rest in started:
        rest.cancel()


def _abandon(starts: list[asyncio.Future]) -> None:
    """Cancel every choice's Replicas._start: one still waiting cancels its call itself, one
    that has started is aborted (cancel) as it ends."""

    def abort(start: asyncio.Future) -> None:
        if not start.cancelled() and start.exception() is None:
            cancel([start.result()])

    for start in starts:
        start.cancel()
        start.add_done_callback(abort)


async def until_gone(receive: Receive) -> bool:
    """True once the client has disconnected: the request's ASGI receive, its body read, gives
    http.disconnect then and nothing before (uvicorn's on the front: the connection closed;
    Serve's in a replica: the proxy's own receive forwarded, so never while the proxy's client
    waits). False (no longer watching) if receive fails."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - no disconnect known: the request goes on
        return False
    return True


async def unless_gone(work: asyncio.Future, gone: asyncio.Future) -> Any:
    """work's result, or ClientDisconnect (work cancelled) once `gone` (until_gone) says the
    client has left. A disconnect through Serve's proxy also cancels the handler's task; the
    front's uvicorn cancels nothing, so a whole response's only sign there is receive's."""
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    if not work.done() and gone.result():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ClientDisconnect()
    return await work


class Replicas:
    """One ingress replica's calls to the model deployment `llm`."""

    def __init__(self, llm: DeploymentHandle, config: AppConfig):
        self.config = config
        self._llm = llm
        self._stream = llm.options(stream=True)
        # router.direct_stream: requests go to the chosen replica over connections of this replica's own
        self._direct = StreamClient() if config.router.direct_stream else None
        self._info: dict | None = None  # the replicas' max_model_len and vocab_size, fetched once
        self._states: tuple[float, dict[str, int]] = (-math.inf, {})  # (when, states)
        self._states_lock = asyncio.Lock()

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()

    async def states(self) -> dict[str, int]:
        """The model replicas' count by Serve state (STARTING, RUNNING, ...), from Serve's
        controller at most once per READY_CACHE_S (serve.status() waits on it: in a thread)."""
        async with self._states_lock:
            at, states = self._states
            if time.monotonic() - at > READY_CACHE_S:
                status = await asyncio.to_thread(serve.status)
                app_status = status.applications.get(self._llm.app_name)
                deployment = None if app_status is None else app_status.deployments.get(self._llm.deployment_name)
                states = (
                    {}
                    if deployment is None
                    else {getattr(state, "value", str(state)): n for state, n in deployment.replica_states.items() if n}
                )
                self._states = (time.monotonic(), states)
            return states

    async def model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self._llm.model_info.remote()
            except (BackPressureError, DeploymentUnavailableError) as e:
                raise unavailable(e) from None
        return self._info

    async def start_all(
        self, reqs: list[GenerateRequest], deadline: float | None, gone: asyncio.Future
    ) -> list[Started]:
        """Every choice's request started at once, each waiting for its first output (so errors
        get a status code) until `deadline` (perf_counter time, or None). The first failure is
        raised, the choices that started aborted; once `gone` (until_gone) says the client has
        left, ClientDisconnect and every choice abandoned."""
        starts = [asyncio.ensure_future(self._start(req, own_id=len(reqs) > 1, deadline=deadline)) for req in reqs]
        try:
            results = await unless_gone(asyncio.gather(*starts, return_exceptions=True), gone)
        except BaseException:
            _abandon(starts)  # the client went away while the choices waited for their first outputs
            raise
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            cancel([r for r in results if not isinstance(r, BaseException)])
            raise failed[0]
        return results

    async def _start(
        self, req: GenerateRequest, own_id: bool = False, deadline: float | None = None
    ) -> tuple[GenerateOutput, Outputs]:
        """Send the request to a replica and wait for its first output (so errors get a status code).
        own_id: the call gets a Serve request id of its own (one of n choices, see _own_serve_request_id).
        With direct streams the policy's replica gets it over this ingress's connection to it
        (_start_direct); through Serve when that cannot be (no route yet, the replica full).
        A replica that fails before the first output (nothing was sent) is retried once, through
        Serve: its router has dropped a replica whose actor died, so the retry goes to another.
        deadline (perf_counter time): past it without a first output, the call is cancelled (the
        replica aborts the sequence, or Serve drops it from its queue) and the request refused."""
        retried = False
        if self._direct is not None:
            try:
                started = await self._start_direct(req, deadline)
            except (StreamLost, EngineDied) as e:
                _log_retry(e)
                started, retried = None, True
            if started is not None:
                return started
        while True:
            if own_id or retried:  # (a retry is a new call to Serve: an id of its own too)
                _own_serve_request_id()
            gen: DeploymentResponseGenerator = self._stream.generate.remote(req)
            try:
                return await first_output(gen, deadline), gen
            except Late:
                gen.cancel()
                raise deadline_exceeded(self.config) from None
            except (BackPressureError, DeploymentUnavailableError) as e:
                raise unavailable(e) from None
            except Exception as e:
                gen.cancel()
                _raise_if_refused(e)
                if not retried and isinstance(e, (RayActorError, EngineDied)):
                    _log_retry(e)
                    retried = True
                    continue
                raise server_error(e) from None
            except BaseException:
                gen.cancel()  # the client went away while waiting
                raise

    async def _start_direct(self, req: GenerateRequest, deadline: float | None) -> Started | None:
        """The request on a direct stream to the policy's replica and its first output; None when
        it goes through Serve instead (no route: the router has not started, or the replica
        publishes no address or could not be connected to lately; or the replica is full).
        StreamLost / EngineDied: the replica failed before its first output."""
        assert self._direct is not None
        route = await direct_routes.route_direct(self._llm.app_name, self._llm.deployment_name, req)
        address = None if route is None else Address.from_tuple(route.address)
        if route is None or address is None or not self._direct.reachable(address):
            if route is not None:
                route.release()
            return None
        stream = await self._direct.open(address, req, route.release)
        try:
            return await first_output(stream, deadline), stream
        except ReplicaFull:
            return None
        except Late:
            stream.cancel()
            raise deadline_exceeded(self.config) from None
        except (StreamLost, EngineDied):
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            _raise_if_refused(e)
            raise server_error(e) from None
        except BaseException:
            stream.cancel()  # the client went away while waiting
            raise

    def predictions(self, reqs: list[GenerateRequest], firsts: list[GenerateOutput]) -> list[int | None]:
        """Each choice's cached prompt tokens as its router predicted them (None: not routed by the
        prefix policy), each counted against what its replica reported in its first output (the
        engine counts them at admission) for /metrics."""
        chunk_size, out = self.config.engine.chunk_size, []
        for req, first in zip(reqs, firsts):
            predicted = direct_routes.take_prediction(req.request_id)
            if predicted is not None:
                cluster_metrics.PREDICTIONS.observe(predicted, first.cached_tokens, chunk_size)
            out.append(predicted)
        return out


def _raise_if_refused(e: Exception) -> None:
    refused = request_refused(e)
    if refused is not None:  # the engine refused the request (the checks before should have)
        raise APIError(400, str(refused)) from None


def _log_retry(e: Exception) -> None:
    logger.warning(
        "request %s: its replica failed before its first output (%s); retrying once",
        serve_request_id(),
        type(e).__name__,
    )
