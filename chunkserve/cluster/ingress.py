"""OpenAIIngress: the HTTP front of the application (FastAPI inside a Serve deployment).

    POST /v1/completions, POST /v1/chat/completions (stream: true -> SSE), GET /v1/models, GET /health,
    GET /ready, GET /metrics, POST /tokenize, POST /detokenize; GET /docs, /redoc, /openapi.json
    (as AppConfig.openapi_docs says)

It checks the key, parses and validates the body, tokenizes (chat through the model's chat
template), and checks the context length, so bad input is answered here and never reaches a
replica. It then streams GenerateOutputs from one LLMReplica (on a direct stream to the replica
the router chose, or through Serve's handle) and formats them as OpenAI responses.
Errors use OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import dataclasses
import hmac
import inspect
import json
import logging
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.exceptions import RayActorError, RayError, RayTaskError, TaskCancelledError
from ray.serve import context as serve_context
from ray.serve._private.utils import generate_request_id
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive

from chunkserve.cluster import metrics as cluster_metrics
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.front import HTTPFront
from chunkserve.cluster.logprobs import TokenTexts, chat_logprobs, completion_logprobs, text_length
from chunkserve.cluster.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from chunkserve.cluster.metrics import CountResponses, MetricsText
from chunkserve.cluster.protocol import (
    MAX_PROMPTS,
    ChatChoice,
    ChatChoiceMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
    template_tools,
)
from chunkserve.cluster.reasoning import ReasoningSplit, think_tags
from chunkserve.cluster.tenants import (
    SESSION_HEADER,
    RateLimited,
    Tenant,
    Tenants,
    Unauthorized,
    cache_salt,
    retry_after,
    session_key,
)
from chunkserve.cluster.tool_calls import ToolOutput
from chunkserve.replicas.direct_stream import Address, DirectStream, ReplicaFull, StreamClient, StreamLost
from chunkserve.replicas.engine.guided import load_grammar_engine
from chunkserve.replicas.engine.sequence import Tenancy
from chunkserve.replicas.model import load_tokenizer
from chunkserve.replicas.model.tokenizer import PLAIN_TEXT_ROLES
from chunkserve.replicas.wire import EngineDied, GenerateOutput, GenerateRequest
from chunkserve.router import direct as direct_routes
from chunkserve.router.hashing import cache_seed, chunk_hashes

logger = logging.getLogger("ray.serve")

FRONT_DRAIN_S = 15.0  # a stopping replica's front finishes its open requests this long at most
REPLICA_HEADER = "x-chunkserve-replica"  # which LLMReplica served the request
TIMING_HEADER = "server-timing"  # where the time to first output went (_server_timing)
# per choice, the prompt tokens the prefix router predicted as cached on the replica it chose
# (usage.prompt_tokens_details.cached_tokens: what the replica found)
PREDICTED_HEADER = "x-chunkserve-predicted-cached-tokens"

# FastAPI's own /docs, /redoc and /openapi.json answer anyone; the deployment serves them itself,
# as its config's `openapi_docs` says (OpenAIIngress.openapi), which is not known yet here
app = FastAPI(
    title="chunkserve",
    summary="OpenAI-compatible LLM serving for prompts sharing long prefixes",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
)


def _client_left(e: Exception) -> bool:
    """Whether e is a client's disconnect, not a server error: Serve cancels the request's
    receive when its client disconnects (a stream the client closed: Starlette's disconnect
    listener raises TaskCancelledError), and Starlette raises ClientDisconnect where the client
    left before its body was read."""
    return isinstance(e, (TaskCancelledError, ClientDisconnect))


# chunkserve_http_responses_total: every response, by endpoint and status (a client gone: 499)
app.add_middleware(CountResponses, status_of=lambda e: 499 if _client_left(e) else 500)


class APIError(Exception):
    """An HTTP error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.headers = status, headers
        self.detail = ErrorDetail(
            message=_text(message), type=type, param=None if param is None else _text(param), code=code
        )

    def response(self) -> JSONResponse:
        cluster_metrics.HTTP.error(self.status, self.detail.code or self.detail.type)  # (every error body: here)
        return JSONResponse(
            ErrorResponse(error=self.detail).model_dump(), status_code=self.status, headers=self.headers
        )


def _text(s: str) -> str:
    """s with any lone surrogate (a key or value echoed from a body) escaped: JSON-encodable."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


@app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return e.response()


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    # an unknown route (404) or method (405): OpenAI's error body rather than FastAPI's {"detail"}
    return APIError(
        e.status_code,
        str(e.detail),
        type="not_found_error" if e.status_code == 404 else "invalid_request_error",
        headers=getattr(e, "headers", None),
    ).response()


@app.exception_handler(Exception)
async def _internal_error(_: Request, e: Exception) -> JSONResponse:
    # (Starlette re-raises after answering, so Serve logs the traceback as well)
    if _client_left(e):  # no server error, and no one to answer (once a logged 500 each time)
        logger.info("request %s: the client disconnected", _request_id())
        return JSONResponse(
            ErrorResponse(
                error=ErrorDetail(
                    message="the client disconnected", type="invalid_request_error", code="client_disconnected"
                )
            ).model_dump(),
            status_code=499,
        )
    return _server_error(e).response()


def _request_id() -> str:
    """Serve's id of the HTTP request being answered: its `x-request-id` header, and Serve's log lines'."""
    return serve_context._get_serve_request_context().request_id or str(uuid.uuid4())


def _proxy_port() -> int:
    """The port of Serve's HTTP proxies (http_options.port), from Serve's controller."""
    return serve_context._get_global_client().http_config.port


def _server_error(e: BaseException, request_id: str | None = None) -> APIError:
    """e logged here with the request's id; the client's error names that id and nothing else of
    e (a replica's death carries actor ids, pids, node addresses and Ray's advice)."""
    rid = request_id or _request_id()
    replica = isinstance(e, (RayActorError, RayTaskError, EngineDied, StreamLost))
    logger.error("request %s failed (%s)", rid, "a model replica failed" if replica else "internal error", exc_info=e)
    if replica:
        return APIError(
            500,
            f"the model replica serving this request failed; retry it (request id {rid})",
            type="server_error",
            code="replica_failed",
        )
    return APIError(500, f"internal server error (request id {rid})", type="server_error", code="internal_error")


def _request_refused(e: Exception) -> ValueError | None:
    """The ValueError with which a replica refused a request (RayTaskError wraps what a replica raised), if so."""
    cause = e.cause if isinstance(e, RayTaskError) else e
    return cause if isinstance(cause, ValueError) and not isinstance(cause, RayError) else None


# Module-level helpers come before the deployment class: @serve.ingress freezes a pickled copy of
# the FastAPI app (routes = our methods) when the class is decorated, and that copy sees only the
# module globals defined by then.


# The event loop also drives every open stream, so no request may hold it. Bodies (bytes) and text
# (characters) past _OFF_LOOP_SIZE are parsed, validated, tokenized and detokenized in worker
# threads, and grammars always are; a thread helps only while the call in it releases the
# interpreter lock. Measured on a 2-core CPU as the longest pause of a 5 ms ticker thread meanwhile:
# tokenizers' encode_batch, which Tokenizer.encode uses for long text, 2 M characters of tiny's in
# 1.3 s with pauses <= 45 ms (encode: one 1.3 s pause); xgrammar's schema parsing, a 270-object
# chain in 2.1 s with pauses <= 8 ms. JSON parsing and pydantic validation hold it: a 9.9 MB text
# body 0.1 s. So what could take longer is refused before any of it runs: text too long for any
# prompt the context takes (_check_chars), schemas nested too deep (protocol.MAX_SCHEMA_DEPTH).
_OFF_LOOP_SIZE = 16 << 10
READY_CACHE_S = 1.0  # /ready asks Serve's controller about the model replicas at most this often
GUIDE_DEADLINE_S = 10.0  # a structured output whose grammar takes longer than this to parse is refused


def _check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (FastAPI's rule: application/json, application/*+json,
    or no Content-Type at all, which is read as JSON)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.partition(";")[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise APIError(
        415,
        f"Content-Type {media or declared!r} is not supported: send the body as JSON with "
        "`Content-Type: application/json`",
        code="unsupported_media_type",
    )


# `\uD800`-`\uDFFF` escapes: the only way a strictly decoded UTF-8 body yields a surrogate
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    """The request body as `model`, or an APIError 400 saying what is wrong with it."""
    try:
        text = body.decode("utf-8")  # strict: JSON text is UTF-8 (RFC 8259), encoded surrogates refused
    except UnicodeDecodeError as e:
        raise APIError(
            400, f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})", code="invalid_utf8"
        ) from None
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested too deep
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(text):  # a pair is one character once parsed; a lone half is not text
        where = _lone_surrogate(data)
        if where is not None:
            raise APIError(
                400,
                f"`{'.'.join(map(str, where)) or 'body'}` holds a lone UTF-16 surrogate (an "
                "unpaired \\uD800-\\uDFFF escape): strings must be Unicode text",
                param=str(where[0]) if where else None,
                code="invalid_unicode",
            )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        where = lambda err: ".".join(map(str, err["loc"])) or "body"  # noqa: E731
        message = "; ".join(f"{where(err)}: {err['msg']}" for err in errors)
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None
        raise APIError(400, message, param=param) from None


def _lone_surrogate(data: Any) -> list | None:
    """The path (keys and indices) to a string (or key) of parsed JSON holding a surrogate, or None."""
    stack: list[tuple[list, Any]] = [([], data)]  # (not recursive: the body may nest deep)
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    return path + [k]
                stack.append((path + [k], v))
        elif isinstance(value, list):
            stack += [(path + [i], v) for i, v in enumerate(value)]
    return None


async def _off_loop_if(big: bool, fn, *args):
    """fn(*args), in a worker thread when `big` (see _OFF_LOOP_SIZE)."""
    return await asyncio.to_thread(fn, *args) if big else fn(*args)


def _check_stop(stop: tuple[str, ...], config: AppConfig) -> None:
    """400 naming the limit when a request's stop strings are more, or longer in all, than the
    config allows (AppConfig.max_stop_strings, max_stop_chars)."""
    if len(stop) > config.max_stop_strings:
        raise APIError(
            400,
            f"{len(stop)} stop strings are more than this server takes: at most "
            f"{config.max_stop_strings} (max_stop_strings)",
            param="stop",
        )
    chars = sum(map(len, stop))
    if chars > config.max_stop_chars:
        raise APIError(
            400,
            f"stop strings of {chars} characters in all are longer than this server takes: at most "
            f"{config.max_stop_chars} characters over all of a request's stop strings (max_stop_chars)",
            param="stop",
        )


def _check_logprob_entries(
    body: CompletionRequest | ChatCompletionRequest, prompts: list[list[int]], limits: list[int], most: int
) -> None:
    """400 naming the limit when the response could carry more logprob entries than `most`
    (AppConfig.max_logprob_entries): per choice, k + 1 for each token it asks to generate
    (limits: each prompt's max_tokens; a request that sets none, whose output runs to the end of
    the context, is not refused for it: OpenAI's clients often leave it out, and its entries
    come as its tokens are made) and, with echo and logprobs, for each prompt token."""
    k, k_prompt = body.top_logprobs_wanted, body.prompt_logprobs_wanted
    if k is None and k_prompt is None:
        return
    asked = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if asked is None:
        limits = [0] * len(limits)
    entries = body.n * sum(
        (0 if k is None else (k + 1) * most_tokens) + (0 if k_prompt is None else (k_prompt + 1) * len(prompt))
        for prompt, most_tokens in zip(prompts, limits)
    )
    if entries > most:
        echoed = "" if k_prompt is None else " and each echoed prompt token"
        raise APIError(
            400,
            f"this request could return {entries} logprob entries, more than this server sends in one "
            f"response: at most {most} (max_logprob_entries). Per choice ({len(prompts)} prompt(s) x "
            f"n={body.n}), each token's and its {k if k is not None else k_prompt} most likely tokens', "
            f"for each of up to max_tokens={max(limits)} generated tokens{echoed}; lower max_tokens, n, "
            "the logprobs asked for or the prompts sent at once",
            param="top_logprobs" if isinstance(body, ChatCompletionRequest) and body.top_logprobs else "logprobs",
        )


class _Late(Exception):
    """No first output by the request's deadline."""


Outputs = DeploymentResponseGenerator | DirectStream  # a choice's outputs: through Serve, or direct


async def _first_output(gen: Outputs, deadline: float | None) -> GenerateOutput:
    """gen's first output; _Late if it has none by `deadline` (perf_counter time). Late is "not
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
    raise _Late()


def _unavailable(e: Exception) -> APIError:
    retry_after = getattr(e, "retry_after_s", None)
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return APIError(
        503, f"the model is overloaded, retry later ({e})", type="server_error", code="overloaded", headers=headers
    )


class _CompletionFormat:
    """GenerateOutputs -> /v1/completions bodies: stream chunks, the usage chunk, the whole
    response. Choice c is the c-th generate request's output: prompt c // n's choice c % n."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        n: int,
        token_ids: bool,
        texts: TokenTexts,
        echo: list[str] | None = None,
        echo_hidden: list[frozenset[int]] | None = None,
        hidden_ids: frozenset[int] = frozenset(),
    ):
        self.id, self.model, self.prompts, self.n = request_id, model, prompts, n
        self.token_ids, self.texts = token_ids, texts
        self.echo = echo  # per prompt, its text, sent before each of its choices' (completions' echo), or None
        # text_offset counts no characters for these: per echoed prompt, the positions of tokens its
        # echo does not show (a BOS the tokenizer added); generated ids whose text is skipped
        self.echo_hidden = echo_hidden or [frozenset()] * len(prompts)
        self.hidden_ids = hidden_ids
        self.created = int(time.time())
        self.offsets: dict[int, int] = {}  # per choice: characters of its tokens' texts sent (logprobs' text_offset)

    def _with_prompt(self, outs: list[GenerateOutput], index: int) -> tuple[list[int], list]:
        """Choice index's tokens and logprob entries (from its outputs outs), after its prompt's
        when that is echoed with its logprobs (the first output carries them)."""
        ids, entries = _tokens_and_logprobs(outs)
        if self.echo is not None and outs[0].prompt_logprobs is not None:
            return self.prompts[index // self.n] + ids, list(outs[0].prompt_logprobs) + entries
        return ids, entries

    def _hidden(self, ids: list[int], index: int, echoed: bool) -> set[int]:
        """Positions of ids (choice index's, after its prompt's if echoed) whose text is not in the choice's text."""
        prompt = len(self.prompts[index // self.n]) if echoed else 0
        return set(self.echo_hidden[index // self.n] if echoed else ()) | {
            i for i in range(prompt, len(ids)) if ids[i] in self.hidden_ids
        }

    def chunk(self, out: GenerateOutput, index: int) -> CompletionResponse:
        first = self.echo is not None and index not in self.offsets  # (the echo goes first)
        logprobs, length = None, 0
        if out.logprobs is not None:
            echoed = first and out.prompt_logprobs is not None
            ids, entries = self._with_prompt([out], index) if first else _tokens_and_logprobs([out])
            hidden = self._hidden(ids, index, echoed)
            logprobs = completion_logprobs(ids, entries, self.texts, self.offsets.get(index, 0), hidden)
            length = text_length(logprobs, hidden)
        self.offsets[index] = self.offsets.get(index, 0) + length
        choice = CompletionChoice(
            index=index,
            text=self.echo[index // self.n] + out.text if first else out.text,
            finish_reason=out.finish_reason,
            logprobs=logprobs,
            token_ids=list(out.token_ids) if self.token_ids else None,
        )
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _whole_logprobs(self, outs: list[GenerateOutput], index: int) -> CompletionLogprobs:
        ids, entries = self._with_prompt(outs, index)
        echoed = self.echo is not None and outs[0].prompt_logprobs is not None
        return completion_logprobs(ids, entries, self.texts, hidden=self._hidden(ids, index, echoed))

    def usage(self, lasts: list[GenerateOutput]) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=[], usage=Usage.of(lasts, self.n)
        )

    def whole(self, choices: list[list[GenerateOutput]]) -> CompletionResponse:
        echo = self.echo or [""] * len(self.prompts)
        body = [
            CompletionChoice(
                index=i,
                text=echo[i // self.n] + "".join(o.text for o in outs),
                finish_reason=outs[-1].finish_reason,
                token_ids=[t for o in outs for t in o.token_ids] if self.token_ids else None,
                prompt_token_ids=self.prompts[i // self.n] if self.token_ids else None,
                logprobs=None if outs[0].logprobs is None else self._whole_logprobs(outs, i),
            )
            for i, outs in enumerate(choices)
        ]
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=body,
            usage=Usage.of([outs[-1] for outs in choices], self.n),
        )


class _ChatFormat(_CompletionFormat):
    """GenerateOutputs -> /v1/chat/completions bodies; each choice's first chunk's delta carries the
    role. Under a reasoning parser (chunkserve/cluster/reasoning.py) each choice's thinking is split from its
    content (not for a guided request: its guide holds the whole output); under a tool choice
    (chunkserve/cluster/tool_calls.py) the content goes through a ToolOutput."""

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt: list[int],
        n: int,
        token_ids: bool,
        texts: TokenTexts,
        tool_choice: Any = "none",
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        super().__init__(request_id, model, [prompt], n, token_ids, texts)
        self.sent_role: set[int] = set()  # choices whose role went out
        self.tool_choice, self.tool_call_parser = tool_choice, tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.streams: dict[int, tuple[ReasoningSplit | None, ToolOutput | None]] = {}  # per choice, streamed

    def _new(self) -> tuple[ReasoningSplit | None, ToolOutput | None]:
        """A choice's reasoning split and tool output (None: not asked for)."""
        return (
            None if self.reasoning_parser is None else ReasoningSplit(self.reasoning_parser),
            ToolOutput.of(self.tool_choice, self.tool_call_parser),
        )

    def chunk(self, out: GenerateOutput, index: int) -> ChatCompletionChunk | None:
        if index not in self.streams:
            self.streams[index] = self._new()
        split, tools = self.streams[index]
        finish = out.finish_reason
        reasoning, text = ("", out.text) if split is None else split.step(out.text, final=finish is not None)
        if tools is not None:
            delta, finish = tools.step(text, finish)
        elif text or (finish is None and split is None):
            delta = {"content": text}
        else:
            delta = {}
        if reasoning:
            delta = {"reasoning_content": reasoning, **delta}
        if index not in self.sent_role:
            delta = {"role": "assistant", **({} if "tool_calls" in delta else {"content": ""}), **delta}
            self.sent_role.add(index)
        elif not delta and finish is None and not self.token_ids and out.logprobs is None:
            return None  # text held back (it may begin a tag or a tool call): nothing to send yet
        choice = ChatStreamChoice(
            index=index,
            delta=delta,
            finish_reason=finish,
            token_ids=list(out.token_ids) if self.token_ids else None,
            logprobs=None if out.logprobs is None else chat_logprobs(out.token_ids, out.logprobs, self.texts),
        )
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage(self, lasts: list[GenerateOutput]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=Usage.of(lasts, self.n)
        )

    def whole(self, choices: list[list[GenerateOutput]]) -> ChatCompletionResponse:
        body = []
        for i, outs in enumerate(choices):
            text, finish = "".join(o.text for o in outs), outs[-1].finish_reason
            split, tools = self._new()
            reasoning, text = (None, text) if split is None else split.whole(text)
            content, calls, finish = (text, [], finish) if tools is None else tools.whole(text, finish)
            if reasoning is not None and content == "":
                content = None  # (all thinking)
            message = ChatChoiceMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
            body.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=finish,
                    token_ids=[t for o in outs for t in o.token_ids] if self.token_ids else None,
                    logprobs=None
                    if outs[0].logprobs is None
                    else chat_logprobs(*_tokens_and_logprobs(outs), self.texts),
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=body,
            usage=Usage.of([outs[-1] for outs in choices], self.n),
            prompt_token_ids=self.prompts[0] if self.token_ids else None,
        )


def _tokens_and_logprobs(outs: list[GenerateOutput]) -> tuple[list[int], list]:
    """A choice's tokens and their logprob entries, over all its outputs."""
    return [t for o in outs for t in o.token_ids], [e for o in outs for e in (o.logprobs or ())]


def _exclude(token_ids: bool, usage: bool) -> dict:
    """Fields left out of a body: token ids unless asked for (an extension), `usage` in stream
    chunks unless include_usage (OpenAI then sends `usage: null` in every chunk)."""
    exclude: dict = {} if usage else {"usage": True}
    if not token_ids:
        exclude |= {"prompt_token_ids": True, "choices": {"__all__": {"token_ids", "prompt_token_ids"}}}
    return exclude


Started = tuple[GenerateOutput, Outputs]  # a choice's first output and the rest


def _own_serve_request_id() -> None:
    """Give the handle calls made from this task (asyncio.gather runs each in a task with its own
    copy of the context) a Serve-internal request id of their own. Every call an HTTP request
    makes inherits that request's, and Serve's request router (ray 2.60) indexes the calls
    waiting for a replica by it: a second call with the same id, made while the first waits, is
    never given one (n choices hung), and PrefixAffinityRouter keys its load tickets by it too."""
    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=generate_request_id()))


def _cancel(started: list[Started]) -> None:
    """Abort every choice in its replica (a finished one ignores it)."""
    for _, rest in started:
        rest.cancel()


Ended = Callable[[list[GenerateOutput]], None]  # a response's end: each choice's last output


def _nothing(lasts: list[GenerateOutput]) -> None:
    pass


def _weight(out: GenerateOutput) -> int:
    """About how many values formatting `out` writes (against _OFF_LOOP_SIZE): its text's
    characters and token ids, and each logprob entry's token and its most likely tokens."""
    weight = len(out.text) + len(out.token_ids)
    for entries in (out.logprobs, out.prompt_logprobs):
        if entries and entries[-1] is not None:  # (a prompt's first entry is None)
            weight += len(entries) * (2 + len(entries[-1][1]))
    return weight


def _whole_body(fmt: _CompletionFormat, choices: list[list[GenerateOutput]], headers: dict[str, str]) -> Response:
    # pydantic's own JSON (its Rust serializer: a 4.7 MB body of logprobs in 43 ms, where
    # model_dump and json.dumps took 380, the interpreter held throughout)
    body = fmt.whole(choices).model_dump_json(exclude=_exclude(fmt.token_ids, usage=True))
    return Response(body, media_type="application/json", headers=headers)


def _event(fmt: _CompletionFormat, out: GenerateOutput, index: int, exclude: dict) -> str | None:
    """A choice's output as a `data:` event; None: nothing to send yet (_ChatFormat.chunk)."""
    chunk = fmt.chunk(out, index)
    return None if chunk is None else f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def _abandon(starts: list[asyncio.Future]) -> None:
    """Cancel every choice's _start: one still waiting cancels its call itself, one that has
    started is aborted (_cancel) as it ends."""

    def abort(start: asyncio.Future) -> None:
        if not start.cancelled() and start.exception() is None:
            _cancel([start.result()])

    for start in starts:
        start.cancel()
        start.add_done_callback(abort)


async def _until_gone(receive: Receive) -> bool:
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


async def _unless_gone(work: asyncio.Future, gone: asyncio.Future) -> Any:
    """work's result, or ClientDisconnect (work cancelled) once `gone` (_until_gone) says the
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


async def _whole(
    started: list[Started],
    fmt: _CompletionFormat,
    headers: dict[str, str],
    gone: asyncio.Future,
    ended: Ended = _nothing,
) -> Response:
    async def outputs(first: GenerateOutput, rest: Outputs) -> list[GenerateOutput]:
        return [first] + [out async for out in rest]

    try:
        gathered = asyncio.gather(*(outputs(first, rest) for first, rest in started))
        choices = await _unless_gone(gathered, gone)
    except Exception as e:
        _cancel(started)  # the client went away, or a replica failed: the replicas abort the requests
        if isinstance(e, ClientDisconnect):
            raise
        raise _server_error(e) from None
    except BaseException:
        _cancel(started)  # the handler cancelled (the client went away through Serve's proxy)
        raise
    ended([outs[-1] for outs in choices])
    # a large body (an echo's logprobs: up to max_logprob_entries) is formatted in a thread, off
    # the event loop that drives every open stream
    big = sum(_weight(out) for outs in choices for out in outs) > _OFF_LOOP_SIZE
    return await _off_loop_if(big, _whole_body, fmt, list(choices), headers)


def _server_timing(prepare_s: float, first_output_s: float, replica_s: float) -> str:
    """The W3C Server-Timing header of a response, in ms: where its time to first output went.
    prepare: the endpoint's own work before the request left for a replica (body, tokenizing,
    checks); first-output: from then to the first output back here (Serve's routing and the two
    hops included), of which replica: the replica's, from receiving the request to its first
    output (its engine's queue, prefill and the pipe). For n > 1 choices, the slowest's."""
    return (
        f"prepare;dur={prepare_s * 1e3:.2f}, first-output;dur={first_output_s * 1e3:.2f}, "
        f"replica;dur={replica_s * 1e3:.2f}"
    )


def _sse(
    started: list[Started],
    fmt: _CompletionFormat,
    include_usage: bool,
    headers: dict[str, str],
    ended: Ended = _nothing,
) -> StreamingResponse:
    """Server-sent events: `data: {chunk}` per output (a choice's, with its index, as they come),
    the usage chunk if asked, then `data: [DONE]`. As in vLLM, an output that carries tokens is
    sent even when it adds no text (a special token, half a character: its text is ""), so a
    client sees each token arrive; only an output with neither tokens nor text (nothing
    happened) is dropped, unless it ends its choice."""
    exclude = _exclude(fmt.token_ids, include_usage)
    request_id = _request_id()
    lasts = [first for first, _ in started]
    closed = False

    def close(done: bool) -> None:  # once, from the stream's end or the response's, whichever is first
        nonlocal closed
        if closed:
            return
        closed = True
        if not done:
            _cancel(started)  # the client disconnected (or a replica failed): abort in the engines
        ended(lasts)  # (what it generated, also when cut short)

    async def events() -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, rest: Outputs) -> None:  # choice i's outputs, then None
            try:
                async for out in rest:
                    await queue.put((i, out))
                await queue.put((i, None))
            except Exception as e:  # noqa: BLE001 - reported in the stream below
                await queue.put((i, e))

        pumps: list[asyncio.Task] = []
        done = False
        try:
            for i, first in enumerate(lasts):  # (a first output may carry an echo's logprobs: a thread's)
                event = await _off_loop_if(_weight(first) > _OFF_LOOP_SIZE, _event, fmt, first, i, exclude)
                if event is not None:
                    yield event
            pumps = [asyncio.create_task(pump(i, rest)) for i, (_, rest) in enumerate(started)]
            running = len(pumps)
            while running:
                i, out = await queue.get()
                if out is None:
                    running -= 1
                    continue
                if isinstance(out, Exception):
                    raise out
                lasts[i] = out
                if out.text or out.token_ids or out.finish_reason is not None:
                    event = await _off_loop_if(_weight(out) > _OFF_LOOP_SIZE, _event, fmt, out, i, exclude)
                    if event is not None:
                        yield event
            done = True
        except Exception as e:  # a replica failed mid-stream: the status is sent, so say it in the stream
            error = _server_error(e, request_id).detail
            cluster_metrics.HTTP.stream_error(error.code or error.type)
            yield f"data: {ErrorResponse(error=error).model_dump_json()}\n\n"
            yield "data: [DONE]\n\n"  # the stream still ends as every stream does (vLLM's too)
            return
        finally:
            for task in pumps:
                task.cancel()
            close(done)
        if include_usage:
            yield f"data: {fmt.usage(lasts).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"

    return _Stream(events(), lambda: close(False), media_type="text/event-stream", headers=headers)


class _Stream(StreamingResponse):
    """A StreamingResponse that calls `closed` when it ends, however: a client that left before
    the body began (its http.response.start failed) leaves the generator unstarted, and an
    unstarted generator's `finally` never runs, so its requests would generate on unaborted and
    uncharged. `closed` must be idempotent (the generator's own end calls it too)."""

    def __init__(self, content: AsyncIterator[str], closed: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._closed = closed

    async def __call__(self, scope: Any, receive: Receive, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._closed()


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, llm: DeploymentHandle, config: AppConfig):
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = load_tokenizer(config.model)  # None: the model takes token ids only
        if self.tokenizer is not None:  # (structured outputs need one: their grammars parse here)
            load_grammar_engine()
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' token texts
        self.tenants = Tenants(config)  # keys -> tenants, their limits and counts
        self._metrics_key = None if config.metrics_api_key is None else config.metrics_api_key.get_secret_value()
        # special tokens' text typed in a text prompt or a user's or tool's message is text (not
        # their ids: a user could forge the template's role markers), unless the operator allows it
        self._split_special_tokens = not config.allow_special_tokens_in_prompt
        # grammars parse on threads of their own, two at a time: a burst of schemas queues there,
        # not in front of the tokenizing in asyncio's default pool
        self._grammars = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunkserve-grammar")
        self._llm = llm
        self._stream = llm.options(stream=True)
        # router.direct_stream: requests go to the chosen replica over connections of this replica's own
        self._direct = StreamClient() if config.router.direct_stream else None
        self._info: dict | None = None  # the replicas' max_model_len and vocab_size, fetched once
        self._created = int(time.time())
        self._states: tuple[float, dict[str, int]] = (-math.inf, {})  # (when, _replica_states)
        self._states_lock = asyncio.Lock()
        ctx = serve.get_replica_context()
        self._metrics = MetricsText(
            self.model_name,
            llm.app_name,
            (llm.deployment_name, ctx.deployment),
            ctx.replica_id.unique_id,
            lambda: (ctx.deployment, self.record_http()),
        )
        # ingress.http_port: this replica answers HTTP on that port itself too, skipping Serve's
        # proxy (chunkserve/cluster/front.py); a port another program holds fails the deployment here
        opts = config.ingress
        if opts.http_port is not None and opts.http_port == _proxy_port():
            # (Serve's proxy binds its port with SO_REUSEPORT too: both would take connections)
            raise ValueError(
                f"ingress.http_port {opts.http_port} is Serve's own http_options.port: give one of them another port"
            )
        self._front = (
            None if opts.http_port is None else HTTPFront(opts.http_host, opts.http_port, opts.header_timeout_s)
        )
        if self._front is not None:
            self._front.start(lambda: self.app, ctx.app_name)

    def check_health(self) -> None:
        """Serve's periodic health check: a front that stopped by itself fails it (Serve then
        replaces the replica)."""
        failed = self._front.failed() if self._front is not None else None
        if failed is not None:
            raise RuntimeError(f"the ingress's HTTP front on port {self._front.port} stopped: {failed!r}")

    async def __del__(self) -> None:
        """Serve's shutdown of the replica: the front stops taking connections and finishes the
        open ones (within FRONT_DRAIN_S), then Serve's own shutdown of the app."""
        if getattr(self, "_front", None) is not None:
            await self._front.stop(FRONT_DRAIN_S)
        if getattr(self, "_direct", None) is not None:
            self._direct.close()
        parent = getattr(super(), "__del__", None)  # Serve's ingress wrapper's (the app's lifespan)
        if parent is not None:
            await parent()

    # -- endpoints --------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        """Liveness: the ingress answers (whether or not a model replica does)."""
        return Response(status_code=200)

    @app.get("/ready")
    async def ready(self) -> JSONResponse:
        """Readiness: 200 while at least one model replica is running (Serve marks a replica
        RUNNING once its constructor, warmup included, has returned); else 503 saying what the
        replicas are doing. Like /health it needs no API key (probes carry none)."""
        states = await self._replica_states()
        if states.get("RUNNING", 0) > 0:
            return JSONResponse({"ready": True, "model_replicas": states})
        doing = ", ".join(f"{n} {state.lower()}" for state, n in states.items()) or "none deployed"
        raise APIError(
            503,
            f"not ready: no model replica is running and warmed up (model replicas: {doing})",
            type="server_error",
            code="not_ready",
        )

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text: every replica's chunkserve_* metrics (chunkserve/cluster/metrics.py). As vLLM's
        /metrics, it needs no API key (it tells no request's content), unless metrics_api_key is
        set: its per-tenant series tell each tenant's volumes and hit rates."""
        if self._metrics_key is not None:
            _, _, token = request.headers.get("authorization", "").partition(" ")
            if not hmac.compare_digest(token.strip().encode(), self._metrics_key.encode()):
                raise APIError(
                    401,
                    "/metrics needs the metrics key (metrics_api_key): send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return Response(await self._metrics.text(), media_type=METRICS_CONTENT_TYPE)

    # -- API docs (AppConfig.openapi_docs: off, behind the API key, or open) ----------------------
    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        """The OpenAPI schema of these routes (FastAPI's, with the route prefix as its server)."""
        root = self._docs_root(request)
        schema = self.app.openapi()
        if root:
            schema = {**schema, "servers": [{"url": root}]}
        return JSONResponse(schema)

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(self, request: Request) -> HTMLResponse:
        """Swagger UI of the schema (its script and styles from FastAPI's default CDN)."""
        root = self._docs_root(request)
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title="chunkserve - Swagger UI")

    @app.get("/redoc", include_in_schema=False)
    async def redoc(self, request: Request) -> HTMLResponse:
        """ReDoc of the schema."""
        root = self._docs_root(request)
        return get_redoc_html(openapi_url=f"{root}/openapi.json", title="chunkserve - ReDoc")

    def _docs_root(self, request: Request) -> str:
        """The path the app is served under (Serve's route prefix; "" on the front), once
        openapi_docs lets the request see the docs: 404 when off, the key's 401 when behind it."""
        mode = self.config.openapi_docs
        if mode == "off":
            raise StarletteHTTPException(404)  # (as any unknown path)
        if mode == "key":
            self._authorize(request)
        return request.scope.get("root_path", "").rstrip("/")

    @app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        self._authorize(request)
        info = await self._model_info()
        card = ModelCard(
            id=self.model_name, created=self._created, root=self.config.model, max_model_len=info["max_model_len"]
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        entered = time.perf_counter()
        tenant = self._authorize(request)
        return await self._as_tenant(tenant, self._completions(request, tenant, entered))

    async def _completions(self, request: Request, tenant: Tenant, entered: float) -> Response:
        body = await self._parse(request, CompletionRequest)
        self._check_model(body.model)
        _check_stop(body.stop_strings, self.config)
        if len(body.prompts) * body.n > MAX_PROMPTS:
            raise APIError(
                400,
                f"{len(body.prompts)} prompts x n={body.n} choices exceed {MAX_PROMPTS} completions in one request",
                param="prompt",
            )
        prompts = await self._completion_prompts(body)
        await self._check_logit_bias(body)
        await self._check_guide(body)
        limits = [await self._check_length(p, body.max_tokens, param="max_tokens") for p in prompts]
        session = session_key(tenant, request.headers.get(SESSION_HEADER))
        rid, reqs = self._generate_request("cmpl", prompts, limits, body, tenant, session=session)
        echo = [self._echo_text(sent, ids) for sent, ids in zip(body.prompts, prompts)] if body.echo else None
        tok = self.tokenizer
        fmt = _CompletionFormat(
            rid,
            self.model_name,
            prompts,
            body.n,
            body.return_token_ids,
            self.token_texts,
            echo,
            [self._echo_hidden(sent, ids) for sent, ids in zip(body.prompts, prompts)],
            tok.special_ids if tok is not None and body.skip_special_tokens else frozenset(),
        )
        return await self._respond(request, reqs, fmt, body.stream, body.include_usage, entered, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        entered = time.perf_counter()
        tenant = self._authorize(request)
        return await self._as_tenant(tenant, self._chat_completions(request, tenant, entered))

    async def _chat_completions(self, request: Request, tenant: Tenant, entered: float) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        _check_stop(body.stop_strings, self.config)
        if body.effective_tool_choice == "auto" and self.config.tool_call_parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) needs the server\'s tool_call_parser '
                'set; send tool_choice "required", a named function or "none"',
                param="tool_choice",
            )
        prompt = await self._chat_prompt_off_loop(body)
        await self._check_logit_bias(body)
        await self._check_guide(body)
        max_tokens = await self._check_length(
            prompt,
            body.requested_max_tokens,
            param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        )
        # a guided request under a reasoning parser thinks freely first, where the tags are tokens
        think = think_tags(self.tokenizer, self.config.reasoning_parser, body.guide is not None)
        session = session_key(tenant, request.headers.get(SESSION_HEADER))
        rid, reqs = self._generate_request("chatcmpl", [prompt], [max_tokens], body, tenant, think, session)
        fmt = _ChatFormat(
            rid,
            self.model_name,
            prompt,
            body.n,
            body.return_token_ids,
            self.token_texts,
            body.effective_tool_choice,
            self.config.tool_call_parser,
            None if body.guide is not None and think is None else self.config.reasoning_parser,
        )
        return await self._respond(request, reqs, fmt, body.stream, body.include_usage, entered, tenant)

    async def _as_tenant(self, tenant: Tenant, answer: Awaitable[Response]) -> Response:
        """A completion endpoint's answer for `tenant`: within its rate limits (else 429 with
        Retry-After: before the body is read, or as its prompt is sent when its tokens a minute are
        spent), its refusals counted by code."""
        try:
            try:
                self.tenants.admit(tenant)
                return await answer
            except RateLimited as e:  # (admit's, before the body is read; or its prompt's tokens, as sent)
                raise APIError(
                    429,
                    str(e),
                    type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": retry_after(e.retry_after_s)},
                ) from None
        except APIError as e:
            self.tenants.counts.reject(tenant.name, e.detail.code or e.detail.type)
            raise
        finally:
            if inspect.iscoroutine(answer) and inspect.getcoroutinestate(answer) == inspect.CORO_CREATED:
                answer.close()  # (refused before it ran: never awaited)

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> JSONResponse:
        """vLLM's: a prompt's token ids (or a chat's, as /v1/chat/completions renders it)."""
        self._authorize(request)
        body = await self._parse(request, TokenizeRequest)
        self._check_model(body.model)
        if body.messages is not None:
            ids = await self._chat_prompt_off_loop(body)
        else:
            await self._check_chars(len(body.prompt), "prompt")
            ids = await _off_loop_if(
                len(body.prompt) > _OFF_LOOP_SIZE,
                self._tokenizer_for("text prompts").encode,
                body.prompt,
                body.add_special_tokens,
                self._split_special_tokens,
            )
        info = await self._model_info()
        return JSONResponse(
            TokenizeResponse(count=len(ids), max_model_len=info["max_model_len"], tokens=ids).model_dump()
        )

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's: token ids' text."""
        self._authorize(request)
        body = await self._parse(request, DetokenizeRequest)
        self._check_model(body.model)
        vocab = (await self._model_info())["vocab_size"]
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="tokens")
        tokenizer = self._tokenizer_for("token texts")
        text = await _off_loop_if(len(body.tokens) > _OFF_LOOP_SIZE, tokenizer.decode, body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def _respond(
        self,
        request: Request,
        reqs: list[GenerateRequest],
        fmt: _CompletionFormat,
        stream: bool,
        include_usage: bool,
        entered: float,
        tenant: Tenant,
    ) -> Response:
        """Start every choice's request (each waits for its first output, so errors get a status
        code), then answer with all of them. entered: when the endpoint was called (perf_counter).
        Until a stream begins (StreamingResponse then watches the connection itself) or the whole
        response is ready, a client's disconnect (its body read, `request.receive` says so)
        aborts every choice: the front's uvicorn does not cancel the handler as Serve's proxy does.
        The tenant's prompt tokens count against its limits when sent, its completion tokens
        when the response ends."""
        sent = time.perf_counter()
        limit = self.config.request_deadline_s
        deadline = None if limit is None else entered + limit
        if deadline is not None and sent >= deadline:  # (its own checks took the time: nothing sent)
            raise self._deadline_exceeded()
        self.tenants.take_prompt(tenant, sum(len(r.prompt_token_ids) for r in reqs[:: fmt.n]))
        gone = asyncio.ensure_future(_until_gone(request.receive))
        try:
            return await self._respond_unless_gone(
                reqs, fmt, stream, include_usage, entered, sent, deadline, gone, tenant
            )
        finally:
            gone.cancel()  # (one receiver at a time: a stream's response listens from here on)

    async def _respond_unless_gone(
        self,
        reqs: list[GenerateRequest],
        fmt: _CompletionFormat,
        stream: bool,
        include_usage: bool,
        entered: float,
        sent: float,
        deadline: float | None,
        gone: asyncio.Future,
        tenant: Tenant,
    ) -> Response:
        starts = [asyncio.ensure_future(self._start(req, own_id=len(reqs) > 1, deadline=deadline)) for req in reqs]
        try:
            results = await _unless_gone(asyncio.gather(*starts, return_exceptions=True), gone)
        except BaseException:
            _abandon(starts)  # the client went away while the choices waited for their first outputs
            raise
        first = time.perf_counter()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            _cancel([r for r in results if not isinstance(r, BaseException)])
            raise failed[0]
        # the replica(s) that served it, in choice order
        headers = {
            REPLICA_HEADER: ",".join(dict.fromkeys(out.replica_id for out, _ in results)),
            TIMING_HEADER: _server_timing(
                sent - entered, first - sent, max(out.first_output_s or 0.0 for out, _ in results)
            ),
        }
        predicted = self._predictions(reqs, [out for out, _ in results])
        if None not in predicted:  # (a prefix router routed every choice)
            headers[PREDICTED_HEADER] = ",".join(map(str, predicted))

        def ended(lasts: list[GenerateOutput]) -> None:
            usage = Usage.of(lasts, fmt.n)
            self.tenants.charge(tenant, usage.completion_tokens)
            self.tenants.counts.served(
                tenant.name, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens
            )

        if stream:
            return _sse(results, fmt, include_usage, headers, ended)
        return await _whole(results, fmt, headers, gone, ended)

    def _predictions(self, reqs: list[GenerateRequest], firsts: list[GenerateOutput]) -> list[int | None]:
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

    # -- request checks ---------------------------------------------------------------------
    def _authorize(self, request: Request) -> Tenant:
        """The request's tenant, from its key (chunkserve/cluster/tenants.py); 401 without a known key."""
        try:
            return self.tenants.authorize(request.headers.get("authorization"))
        except Unauthorized as e:
            raise APIError(401, str(e), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}) from None

    async def _parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        _check_content_type(request)
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(
                413, f"request body of {declared} bytes exceeds the limit of {limit}", code="request_too_large"
            )
        body = bytearray()
        async for piece in request.stream():  # a missing or false Content-Length still stops at the limit
            body += piece
            if len(body) > limit:
                raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        return await _off_loop_if(len(body) > _OFF_LOOP_SIZE, _validate, bytes(body), model)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    async def _completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The body's prompts as token ids (texts tokenized, ids checked against the vocabulary)."""
        sent = body.prompts
        if isinstance(sent[0], str):
            await self._check_chars(max(map(len, sent)), "prompt")
            encode, split = self._tokenizer_for("text prompts").encode, self._split_special_tokens
            return await _off_loop_if(
                sum(map(len, sent)) > _OFF_LOOP_SIZE, lambda: [encode(p, split_special_tokens=split) for p in sent]
            )
        vocab = (await self._model_info())["vocab_size"]
        for prompt in sent:
            bad = None if 0 <= min(prompt) and max(prompt) < vocab else next(t for t in prompt if not 0 <= t < vocab)
            if bad is not None:
                raise APIError(400, f"token id {bad} is out of range [0, {vocab})", param="prompt")
        return [list(p) for p in sent]

    def _echo_hidden(self, sent: str | list[int], prompt: list[int]) -> frozenset[int]:
        """Positions of the prompt's tokens whose text its echo does not show: of a text prompt
        the special tokens the tokenizer added (every special one: typed ones are text; with
        allow_special_tokens_in_prompt, an added BOS only), of an id prompt every special token
        (its echo is decoded without them)."""
        tok = self.tokenizer
        if tok is None:
            return frozenset()
        if isinstance(sent, str) and not self._split_special_tokens:
            added_bos = prompt[:1] == [tok.bos_token_id] and not sent.startswith(tok.bos_token or "")
            return frozenset({0}) if added_bos else frozenset()
        return frozenset(i for i, t in enumerate(prompt) if t in tok.special_ids)

    def _echo_text(self, sent: str | list[int], prompt: list[int]) -> str:
        """A prompt as echoed: as sent, or its token ids decoded ("" without a tokenizer)."""
        if isinstance(sent, str):
            return sent
        return "" if self.tokenizer is None else self.tokenizer.decode(prompt)

    async def _chat_prompt_off_loop(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        """_chat_prompt, in a worker thread when the messages are long."""
        chars = sum(len(m.text()) for m in body.messages)
        await self._check_chars(chars, "messages")
        return await _off_loop_if(chars > _OFF_LOOP_SIZE, self._chat_prompt, body)

    async def _check_chars(self, chars: int, param: str) -> None:
        """400 before tokenizing text of `chars` characters that no prompt the context takes is as
        long as: a token is at most the tokenizer's max_token_chars characters, so text has at
        least chars / max_token_chars tokens (allowed twice that: a normalizer may fold characters
        together, as NFC does an accent into its letter)."""
        if self.tokenizer is None:
            return  # (text is refused: _tokenizer_for)
        max_len = (await self._model_info())["max_model_len"]
        limit = 2 * max_len * self.tokenizer.max_token_chars
        if chars > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens, and {param} of {chars} "
                f"characters is longer than any text that fits (at most {limit}); shorten it",
                param=param,
                code="context_length_exceeded",
            )

    def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        tokenizer = self._tokenizer_for("chat")
        try:
            messages = [m.for_template() for m in body.messages]
            return tokenizer.encode_chat(
                messages,
                add_generation_prompt=True,
                tools=template_tools(body.tools),
                plain_roles=PLAIN_TEXT_ROLES if self._split_special_tokens else (),
            )
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    def _tokenizer_for(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} need a tokenizer and model `{self.model_name}` has none: send token ids")
        return self.tokenizer

    async def _check_logit_bias(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 when the body's logit_bias names a token past the vocabulary."""
        if body.logit_bias:
            vocab = (await self._model_info())["vocab_size"]
            bad = [t for t in body.logit_bias if int(t) >= vocab]
            if bad:
                raise APIError(400, f"logit_bias token id {bad[0]} is out of range [0, {vocab})", param="logit_bias")

    async def _check_guide(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """400 when the body's structured output does not parse (a schema xgrammar cannot take, a
        bad regex or grammar), or the model has no tokenizer to guide text with."""
        guide = body.guide
        if guide is None:
            return
        self._tokenizer_for("structured outputs")
        parsed = asyncio.get_running_loop().run_in_executor(self._grammars, guide.grammar)
        try:
            await asyncio.wait_for(parsed, GUIDE_DEADLINE_S)  # (on time out, a parse not begun is dropped)
        except ValueError as e:
            raise APIError(400, str(e), param=body.guide_field) from None
        except TimeoutError:
            raise APIError(
                400,
                f"{body.guide_field}: its grammar took more than {GUIDE_DEADLINE_S:g} s to compile; simplify it",
                param=body.guide_field,
            ) from None

    async def _check_length(self, prompt: list[int], max_tokens: int | None, param: str) -> int:
        """-> max_tokens (None: the rest of the context); 400 when prompt + max_tokens exceed it."""
        max_len = (await self._model_info())["max_model_len"]
        wanted = max(max_len - len(prompt), 1) if max_tokens is None else max_tokens
        if len(prompt) + wanted > max_len:
            raise APIError(
                400,
                f"this model's maximum context length is {max_len} tokens, but "
                f"{len(prompt) + wanted} were requested ({len(prompt)} in the prompt, {wanted} for "
                "the completion); shorten the prompt or lower the completion's length",
                param=param if max_tokens is not None else None,
                code="context_length_exceeded",
            )
        return wanted

    def _generate_request(
        self,
        kind: str,
        prompts: list[list[int]],
        limits: list[int],
        body: CompletionRequest | ChatCompletionRequest,
        tenant: Tenant,
        think: tuple[int | None, int] | None = None,
        session: int | None = None,
    ) -> tuple[str, list[GenerateRequest]]:
        """-> (the response's id, one generate request per choice: prompt after prompt, each
        with its n choices); limits: each prompt's max_tokens; think: SamplingParams.think.
        The tenant's cache policy and the body's cache_salt make the salt its prompts' chunks
        are hashed (for the router) and cached (in the engine) under; session: the router's
        session hint (tenants.session_key)."""
        if body.stop_strings and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; use stop_token_ids", param="stop")
        _check_logprob_entries(body, prompts, limits, self.config.max_logprob_entries)
        if body.min_tokens > min(limits):  # (max_tokens: the request's, or what the context leaves)
            raise APIError(
                400,
                f"min_tokens={body.min_tokens} is more than the {min(limits)} tokens this completion may have",
                param="min_tokens",
            )
        # n choices: n requests with the same prompt and hashes (so the router sends them to the
        # replica that holds it, whose prefix tree stores it once), ids <id>-<k> (k = prompt * n +
        # choice), choice i seeded seed + i (unseeded choices get a random seed: the engine's own
        # keys come from its seed and the request's arrival, alike on every replica, so choices on
        # two replicas could draw alike)
        rid = f"{kind}-{uuid.uuid4().hex}"
        stop = body.stop_strings  # (one tuple for all: each call pickles it, the replica keeps one copy)
        seed = None if body.n == 1 or body.seed is not None else secrets.randbits(64)
        one = len(prompts) == 1 and body.n == 1
        salt = cache_salt(tenant, body.cache_salt)
        tenancy, seed_of_chain = Tenancy(tenant.name, salt, tenant.priority), cache_seed(self.model_name, salt)
        reqs = []
        for p, (prompt, max_tokens) in enumerate(zip(prompts, limits)):
            # the router's key (DESIGN §3): hashed once here; the router also reads the prompt's
            # length and params.max_tokens from this request
            hashes = tuple(
                chunk_hashes(prompt, self.config.engine.chunk_size, self.config.router.route_chunks, seed_of_chain)
            )
            params = [body.sampling_params(max_tokens, i, seed) for i in range(body.n)]
            if think is not None:
                params = [dataclasses.replace(one_params, think=think) for one_params in params]
            reqs += [
                GenerateRequest(
                    request_id=rid if one else f"{rid}-{p * body.n + i}",
                    prompt_token_ids=tuple(prompt),
                    params=params[i],
                    stop=stop,
                    model=self.model_name,
                    prefix_hashes=hashes,
                    skip_special_tokens=body.skip_special_tokens,
                    include_stop_str_in_output=body.include_stop_str_in_output,
                    tenancy=tenancy,
                    session=session,
                    router=direct_routes.ROUTER_ID,
                )
                for i in range(body.n)
            ]
        return rid, reqs

    async def record_routing_stats(self) -> dict:
        """Serve's hook (its controller polls it each routing-stats period): this ingress replica's
        response counts, which another ingress replica's /metrics asks for (chunkserve/cluster/metrics.py)."""
        return self.record_http()

    def record_http(self) -> dict:
        # The counts are chunkserve.cluster.metrics.HTTP of this process, named through the module: Serve ships
        # this class by value (cloudpickle), which would give a global named here a copy of its own.
        # per-tenant series tell each tenant's volumes and hit rates: with a tenant table, only on a
        # /metrics that asks for metrics_api_key (else a tenant could read another's)
        tenants = not self.config.tenants or self._metrics_key is not None
        return {
            "http": cluster_metrics.HTTP.snapshot(),
            "predictions": cluster_metrics.PREDICTIONS.snapshot(self.config.engine.chunk_size),
            **({"tenants": self.tenants.counts.snapshot()} if tenants else {}),
        }

    # -- talking to the replicas ------------------------------------------------------------
    async def _replica_states(self) -> dict[str, int]:
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

    async def _model_info(self) -> dict:
        if self._info is None:
            try:
                self._info = await self._llm.model_info.remote()
            except (BackPressureError, DeploymentUnavailableError) as e:
                raise _unavailable(e) from None
        return self._info

    def _deadline_exceeded(self) -> APIError:
        return APIError(
            503,
            f"the request got no output within its deadline of {self.config.request_deadline_s:g} s "
            "(request_deadline_s): the model is overloaded, retry later",
            type="server_error",
            code="deadline_exceeded",
            headers={"Retry-After": str(max(1, math.ceil(self.config.retry_after_s)))},
        )

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
                self._log_retry(e)
                started, retried = None, True
            if started is not None:
                return started
        while True:
            if own_id or retried:  # (a retry is a new call to Serve: an id of its own too)
                _own_serve_request_id()
            gen: DeploymentResponseGenerator = self._stream.generate.remote(req)
            try:
                return await _first_output(gen, deadline), gen
            except _Late:
                gen.cancel()
                raise self._deadline_exceeded() from None
            except (BackPressureError, DeploymentUnavailableError) as e:
                raise _unavailable(e) from None
            except Exception as e:
                gen.cancel()
                self._raise_if_refused(e)
                if not retried and isinstance(e, (RayActorError, EngineDied)):
                    self._log_retry(e)
                    retried = True
                    continue
                raise _server_error(e) from None
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
            return await _first_output(stream, deadline), stream
        except ReplicaFull:
            return None
        except _Late:
            stream.cancel()
            raise self._deadline_exceeded() from None
        except (StreamLost, EngineDied):
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            self._raise_if_refused(e)
            raise _server_error(e) from None
        except BaseException:
            stream.cancel()  # the client went away while waiting
            raise

    @staticmethod
    def _raise_if_refused(e: Exception) -> None:
        refused = _request_refused(e)
        if refused is not None:  # the engine refused the request (the checks before should have)
            raise APIError(400, str(refused)) from None

    @staticmethod
    def _log_retry(e: Exception) -> None:
        logger.warning(
            "request %s: its replica failed before its first output (%s); retrying once",
            _request_id(),
            type(e).__name__,
        )
