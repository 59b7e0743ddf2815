"""The ingress's errors: OpenAI's error body, what a failure tells the client, and the app's handlers.

APIError is an HTTP error answered with {"error": {"message", "type", "param", "code"}} (and
counted by code, chunkserve/cluster/metrics.py); its subclasses NotFoundError, RateLimitError and
ServerError set the type. server_error logs a failure with the request's
Serve id and tells the client only that id; unavailable and deadline_exceeded are the 503s of an
overloaded model. install() makes FastAPI answer every error in that body: an unknown route, an
unexpected exception, a client gone (499, logged as no error)."""

import logging
import math
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray.exceptions import RayActorError, RayError, RayTaskError, TaskCancelledError
from ray.serve import context as serve_context
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from chunkserve.cluster import metrics as cluster_metrics
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.protocol import ErrorDetail, ErrorResponse
from chunkserve.replicas.direct_stream import StreamLost
from chunkserve.replicas.wire import EngineDied

logger = logging.getLogger("ray.serve")


def client_left(e: Exception) -> bool:
    """Whether e is a client's disconnect, not a server error: Serve cancels the request's
    receive when its client disconnects (a stream the client closed: Starlette's disconnect
    listener raises TaskCancelledError), and Starlette raises ClientDisconnect where the client
    left before its body was read."""
    return isinstance(e, (TaskCancelledError, ClientDisconnect))


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body; the body's type is the class's (OpenAI's
    own for a 404 of an unknown model, as for a 401: invalid_request_error)."""

    error_type = "invalid_request_error"

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.detail = ErrorDetail(
            message=_text(message), type=self.error_type, param=None if param is None else _text(param), code=code
        )

    def response(self) -> JSONResponse:
        cluster_metrics.HTTP.error(self.status, self.detail.code or self.detail.type)  # (every error body: here)
        return JSONResponse(
            ErrorResponse(error=self.detail).model_dump(), status_code=self.status, headers=self.headers
        )


class NotFoundError(APIError):
    """An unknown route's 404."""

    error_type = "not_found_error"


class RateLimitError(APIError):
    """A tenant over its rate (429)."""

    error_type = "rate_limit_error"


class ServerError(APIError):
    """The server's failure or overload (5xx)."""

    error_type = "server_error"


def _text(s: str) -> str:
    """s with any lone surrogate (a key or value echoed from a body) escaped: JSON-encodable."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def serve_request_id() -> str:
    """Serve's id of the HTTP request being answered: its `x-request-id` header, and Serve's log lines'."""
    return serve_context._get_serve_request_context().request_id or str(uuid.uuid4())


def server_error(e: BaseException, request_id: str | None = None) -> ServerError:
    """e logged here with the request's id; the client's error names that id and nothing else of
    e (a replica's death carries actor ids, pids, node addresses and Ray's advice)."""
    rid = request_id or serve_request_id()
    replica = isinstance(e, (RayActorError, RayTaskError, EngineDied, StreamLost))
    logger.error("request %s failed (%s)", rid, "a model replica failed" if replica else "internal error", exc_info=e)
    if replica:
        return ServerError(
            500, f"the model replica serving this request failed; retry it (request id {rid})", code="replica_failed"
        )
    return ServerError(500, f"internal server error (request id {rid})", code="internal_error")


def request_refused(e: Exception) -> ValueError | None:
    """The ValueError with which a replica refused a request (RayTaskError wraps what a replica raised), if so."""
    cause = e.cause if isinstance(e, RayTaskError) else e
    return cause if isinstance(cause, ValueError) and not isinstance(cause, RayError) else None


def unavailable(e: Exception) -> ServerError:
    retry_after = getattr(e, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return ServerError(503, f"the model is overloaded, retry later ({e})", code="overloaded", headers=headers)


def deadline_exceeded(config: AppConfig) -> ServerError:
    """A request with no first output within config.request_deadline_s."""
    return ServerError(
        503,
        f"the request got no output within its deadline of {config.request_deadline_s:g} s "
        "(request_deadline_s): the model is overloaded, retry later",
        code="deadline_exceeded",
        headers={"Retry-After": str(max(1, math.ceil(config.retry_after_s)))},
    )


def install(app: FastAPI) -> None:
    """Every error `app` answers in OpenAI's body, and every response counted by endpoint and
    status (chunkserve_http_responses_total; a client gone: 499)."""
    app.add_middleware(cluster_metrics.CountResponses, status_of=lambda e: 499 if client_left(e) else 500)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)


async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    # an unknown route (404) or method (405): OpenAI's error body rather than FastAPI's {"detail"}
    error = NotFoundError if e.status_code == 404 else APIError
    return error(e.status_code, str(e.detail), headers=getattr(e, "headers", None)).response()


async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    # (Starlette re-raises after answering, so Serve logs the traceback as well)
    if client_left(e):  # no server error, and no one to answer (once a logged 500 each time)
        logger.info("request %s: the client disconnected", serve_request_id())
        return JSONResponse(
            ErrorResponse(
                error=ErrorDetail(
                    message="the client disconnected", type="invalid_request_error", code="client_disconnected"
                )
            ).model_dump(),
            status_code=499,
        )
    return server_error(e).response()
