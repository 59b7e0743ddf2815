"""OpenAIIngress: the HTTP front of the application (FastAPI inside a Serve deployment).

    POST /v1/completions, POST /v1/chat/completions (stream: true -> SSE), GET /v1/models, GET /health,
    GET /ready, GET /metrics, POST /tokenize, POST /detokenize; GET /docs, /redoc, /openapi.json
    (as AppConfig.openapi_docs says)

A completion reads top-down: the key names the tenant (chunkserve/cluster/tenants.py), the body
becomes checked token prompts and GenerateRequests (prompts.py: bad input is answered here and
never reaches a replica), every choice starts on a replica (replica_calls.py: a direct stream to
the replica the router chose, or Serve's handle) and its outputs go back as OpenAI's response,
whole or as SSE (responses.py). Errors use OpenAI's body (errors.py):
{"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import hmac
import inspect
import time
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from ray import serve
from ray.serve import context as serve_context
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkserve.cluster import errors
from chunkserve.cluster import metrics as cluster_metrics
from chunkserve.cluster.config import AppConfig
from chunkserve.cluster.errors import APIError, RateLimitError, ServerError
from chunkserve.cluster.front import HTTPFront
from chunkserve.cluster.logprobs import TokenTexts
from chunkserve.cluster.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from chunkserve.cluster.metrics import MetricsText
from chunkserve.cluster.prompts import Prompts, check_stop
from chunkserve.cluster.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from chunkserve.cluster.reasoning import think_tags
from chunkserve.cluster.replica_calls import Replicas, until_gone
from chunkserve.cluster.responses import (
    ChatFormat,
    CompletionFormat,
    ResponseHead,
    server_timing,
    sse_response,
    whole_response,
)
from chunkserve.cluster.tenants import (
    SESSION_HEADER,
    RateLimited,
    Tenant,
    Tenants,
    Unauthorized,
    retry_after,
    session_key,
)
from chunkserve.replicas.model import load_tokenizer
from chunkserve.replicas.wire import GenerateOutput, GenerateRequest
from chunkserve.router import direct

FRONT_DRAIN_S = 15.0  # a stopping replica's front finishes its open requests this long at most
REPLICA_HEADER = "x-chunkserve-replica"  # which LLMReplica served the request
TIMING_HEADER = "server-timing"  # where the time to first output went (responses.server_timing)
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
errors.install(app)  # OpenAI's error body for every error; every response counted by status


# Module-level helpers come before the deployment class: @serve.ingress freezes a pickled copy of
# the FastAPI app (routes = our methods) when the class is decorated, and that copy sees only the
# module globals defined by then.
def _proxy_port() -> int:
    """The port of Serve's HTTP proxies (http_options.port), from Serve's controller."""
    return serve_context._get_global_client().http_config.port


@serve.deployment
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, llm: DeploymentHandle, config: AppConfig):
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = load_tokenizer(config.model)  # None: the model takes token ids only
        self.token_texts = TokenTexts(self.tokenizer)  # logprobs' token texts
        self.tenants = Tenants(config)  # keys -> tenants, their limits and counts
        self._metrics_key = None if config.metrics_api_key is None else config.metrics_api_key.get_secret_value()
        self.replicas = Replicas(llm, config)  # the calls to the model replicas
        self.prompts = Prompts(config, self.tokenizer, self.replicas.model_info)  # bodies -> GenerateRequests
        self._created = int(time.time())
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
        if getattr(self, "replicas", None) is not None:
            self.replicas.close()
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
        states = await self.replicas.states()
        if states.get("RUNNING", 0) > 0:
            return JSONResponse({"ready": True, "model_replicas": states})
        doing = ", ".join(f"{n} {state.lower()}" for state, n in states.items()) or "none deployed"
        raise ServerError(
            503, f"not ready: no model replica is running and warmed up (model replicas: {doing})", code="not_ready"
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
        info = await self.replicas.model_info()
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
        body = await self.prompts.parse(request, CompletionRequest)
        self.prompts.check_model(body.model)
        check_stop(body.stop_strings, self.config)
        if len(body.prompts) * body.n > MAX_PROMPTS:
            raise APIError(
                400,
                f"{len(body.prompts)} prompts x n={body.n} choices exceed {MAX_PROMPTS} completions in one request",
                param="prompt",
            )
        prompts = await self.prompts.completion_prompts(body)
        await self.prompts.check_logit_bias(body)
        await self.prompts.check_guide(body)
        limits = [await self.prompts.check_length(p, body.max_tokens, param="max_tokens") for p in prompts]
        session = session_key(tenant, request.headers.get(SESSION_HEADER))
        rid, reqs = self.prompts.generate_request("cmpl", prompts, limits, body, tenant, session=session)
        echo = [self.prompts.echo_text(sent, ids) for sent, ids in zip(body.prompts, prompts)] if body.echo else None
        fmt = CompletionFormat(
            ResponseHead(rid, self.model_name, body.n, body.return_token_ids, self.token_texts),
            prompts,
            echo,
            [self.prompts.echo_hidden(sent, ids) for sent, ids in zip(body.prompts, prompts)],
            self.prompts.hidden_ids(body),
        )
        return await self._respond(request, reqs, fmt, body.stream, body.include_usage, entered, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        entered = time.perf_counter()
        tenant = self._authorize(request)
        return await self._as_tenant(tenant, self._chat_completions(request, tenant, entered))

    async def _chat_completions(self, request: Request, tenant: Tenant, entered: float) -> Response:
        body = await self.prompts.parse(request, ChatCompletionRequest)
        self.prompts.check_model(body.model)
        check_stop(body.stop_strings, self.config)
        if body.effective_tool_choice == "auto" and self.config.tool_call_parser is None:
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) needs the server\'s tool_call_parser '
                'set; send tool_choice "required", a named function or "none"',
                param="tool_choice",
            )
        prompt = await self.prompts.chat_prompt(body)
        await self.prompts.check_logit_bias(body)
        await self.prompts.check_guide(body)
        max_tokens = await self.prompts.check_length(
            prompt,
            body.requested_max_tokens,
            param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        )
        # a guided request under a reasoning parser thinks freely first, where the tags are tokens
        think = think_tags(self.tokenizer, self.config.reasoning_parser, body.guide is not None)
        session = session_key(tenant, request.headers.get(SESSION_HEADER))
        rid, reqs = self.prompts.generate_request("chatcmpl", [prompt], [max_tokens], body, tenant, think, session)
        fmt = ChatFormat(
            ResponseHead(rid, self.model_name, body.n, body.return_token_ids, self.token_texts),
            prompt,
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
                raise RateLimitError(
                    429,
                    str(e),
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
        body = await self.prompts.parse(request, TokenizeRequest)
        self.prompts.check_model(body.model)
        if body.messages is not None:
            ids = await self.prompts.chat_prompt(body)
        else:
            ids = await self.prompts.text_prompt(body.prompt, body.add_special_tokens)
        info = await self.replicas.model_info()
        return JSONResponse(
            TokenizeResponse(count=len(ids), max_model_len=info["max_model_len"], tokens=ids).model_dump()
        )

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> JSONResponse:
        """vLLM's: token ids' text."""
        self._authorize(request)
        body = await self.prompts.parse(request, DetokenizeRequest)
        self.prompts.check_model(body.model)
        text = await self.prompts.token_text(body.tokens)
        return JSONResponse(DetokenizeResponse(prompt=text).model_dump())

    async def _respond(
        self,
        request: Request,
        reqs: list[GenerateRequest],
        fmt: CompletionFormat,
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
            raise errors.deadline_exceeded(self.config)
        self.tenants.take_prompt(tenant, sum(len(r.prompt_token_ids) for r in reqs[:: fmt.n]))
        gone = asyncio.ensure_future(until_gone(request.receive))
        try:
            results = await self.replicas.start_all(reqs, deadline, gone)
            first = time.perf_counter()
            # the replica(s) that served it, in choice order
            headers = {
                REPLICA_HEADER: ",".join(dict.fromkeys(out.replica_id for out, _ in results)),
                TIMING_HEADER: server_timing(
                    sent - entered, first - sent, max(out.first_output_s or 0.0 for out, _ in results)
                ),
            }
            predicted = self.replicas.predictions(reqs, [out for out, _ in results])
            if None not in predicted:  # (a prefix router routed every choice)
                headers[PREDICTED_HEADER] = ",".join(map(str, predicted))

            def ended(lasts: list[GenerateOutput]) -> None:
                usage = Usage.of(lasts, fmt.n)
                self.tenants.charge(tenant, usage.completion_tokens)
                self.tenants.counts.served(
                    tenant.name, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens
                )

            if stream:
                return sse_response(results, fmt, include_usage, headers, ended)
            return await whole_response(results, fmt, headers, gone, ended)
        finally:
            gone.cancel()  # (one receiver at a time: a stream's response listens from here on)

    # -- the request's tenant; Serve's hook ------------------------------------------------
    def _authorize(self, request: Request) -> Tenant:
        """The request's tenant, from its key (chunkserve/cluster/tenants.py); 401 without a known key."""
        try:
            return self.tenants.authorize(request.headers.get("authorization"))
        except Unauthorized as e:
            raise APIError(401, str(e), code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}) from None

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
            "peers": direct.peer_stats(),
            **({"tenants": self.tenants.counts.snapshot()} if tenants else {}),
        }
