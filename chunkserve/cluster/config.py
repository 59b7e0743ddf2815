"""AppConfig: the `args:` of a Serve config file (`import_path: chunkserve.cluster.app:build_app`).

Every sub-model forbids unknown fields, so a typo in a config file fails the deploy with an error
naming the field instead of being ignored.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, SecretStr, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SparsePrefillOptions(_Strict):
    """Block-union sparse prefill of long contexts (chunkserve.kernels.block_union.BlockUnion; DESIGN §8).
    Approximate attention: outputs change. Validated again by BlockUnion (block against the
    chunk size)."""

    min_context: int = Field(8192, ge=0)  # a piece after fewer cached tokens runs dense
    block: Literal[16, 32, 64, 128, 256, 512] = 128  # tokens a block: a multiple of the chunk size
    alpha: float = Field(0.1, ge=0, le=1)  # keep the blocks scoring >= alpha x the best
    budget: float | None = Field(None, gt=0, le=1)  # or this share of the context's blocks (one plan a step)
    sink: int = Field(1, ge=0)  # first blocks always kept
    window: int = Field(4, ge=0)  # blocks before each span always kept (>= 1 with a budget)
    subgroup: PositiveInt = 4  # query heads of a KV head sharing one page list
    spread: float = Field(0.5, ge=0, le=1)  # score a key box's center + this share of its radius
    # query blocks sharing page lists, choosing among all before them; None: the piece; "auto"
    # (with a budget): per piece, sized by its context (BlockUnion.span)
    span: PositiveInt | Literal["auto"] | None = None
    stride: Literal[1, 2, 4, 8] = 1  # score every stride-th query row of a block (at least 16 rows)
    dense_tail: int = Field(128, ge=0)  # the prompt's last tokens attend densely (its question)


class EngineOptions(_Strict):
    """chunkserve.replicas.engine.config.EngineConfig fields a deployment may set (the rest follow from
    AppConfig), with its defaults: restated so that this module imports no torch, and checked
    equal (tests/test_serve_config.py)."""

    chunk_size: Literal[16, 32, 64, 128] = 64
    kv_cache_tokens: PositiveInt | None = None  # None: 32768 on CPU, gpu_memory_utilization of free memory on GPU
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    host_cache_tokens: NonNegativeInt = 0  # the host tier's size in tokens (pinned host memory); 0: none
    host_write_ahead_tokens: NonNegativeInt | None = None  # copied to host ahead of eviction (EngineConfig)
    max_num_seqs: PositiveInt = 256
    max_num_batched_tokens: PositiveInt = 2048
    max_model_len: PositiveInt | None = None  # None: the model's context, capped by the KV pool
    enable_prefix_sharing: bool = True
    seed: int = 0
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (GPU replicas)
    piecewise_graphs: bool | None = None  # the forward between attentions as CUDA graphs; None: on GPUs unless eager
    decode_graphs: bool | None = None  # whole-step graphs per padded batch size (EngineConfig; None: on CUDA)
    graph_mixed_steps: bool = True  # with decode_graphs, mixed steps too where they fit (EngineConfig)
    async_scheduling: bool | None = None  # each step prepared while the one before runs; None: on GPUs (EngineConfig)
    sparse_prefill: SparsePrefillOptions | None = None  # None: every prefill dense (exact)

    @model_validator(mode="after")
    def _check_sparse(self) -> EngineOptions:
        sparse = self.sparse_prefill
        if sparse is not None and sparse.block % self.chunk_size:
            raise ValueError(f"sparse_prefill.block {sparse.block} must be a multiple of chunk_size {self.chunk_size}")
        if sparse is not None and sparse.budget is not None and sparse.window < 1:
            raise ValueError("sparse_prefill.budget needs a window >= 1 (the context's last, partial block)")
        if sparse is not None and sparse.block // sparse.stride < 16:
            raise ValueError(
                f"sparse_prefill.stride {sparse.stride} leaves fewer than 16 rows of a block of {sparse.block}"
            )
        if sparse is not None and sparse.span == "auto" and sparse.budget is None:
            raise ValueError("sparse_prefill.span 'auto' sizes spans by the budget: set a budget")
        return self


class RouterOptions(_Strict):
    """Prefix-aware routing (DESIGN §3)."""

    route_chunks: PositiveInt = (
        128  # leading chunks of a prompt hashed for routing (past EAGER_DEPTH: published once reused)
    )
    # prefix: chunkserve.router.serve_router.PrefixAffinityRouter; pow2: Serve's default power of two
    # choices; ray_prefix: Ray Serve LLM's PrefixCacheAffinityRouter, as a peer to compare against
    # (it matches GenerateRequest.prompt, a character per token, in one tree actor)
    policy: Literal["prefix", "pow2", "ray_prefix"] = "prefix"
    routing_stats_period_s: float = Field(1.0, gt=0)  # how often replicas publish load and routing events
    # a prompt chunk in a replica's host tier (engine.host_cache_tokens) scores this fraction of
    # one on its GPU (PolicyConfig.host_hit_credit, DESIGN §3 "Tiers"); 0: a host hit scores as a miss
    host_hit_credit: float = Field(0.8, ge=0, le=1)
    # the ingress sends a request to the replica the policy chose over a connection of its own and
    # reads its outputs back there, not through Serve's handle calls (chunkserve/replicas/direct_stream.py);
    # Serve takes the requests a full replica refuses. Needs policy prefix and a fixed replica
    # count (Serve's autoscaling counts only the requests it routed itself). Serve's queue then
    # sees only its own calls: a replica holding max_ongoing_requests lets Serve's next ones wait
    # inside it (up to max_ongoing_requests more) before Serve queues (max_queued_requests)
    direct_stream: bool = False
    # each ingress's router books the other ingresses' routing decisions and completions as its
    # own, milliseconds after them (chunkserve/router/peers.py, DESIGN §3 "Routers that agree"),
    # where otherwise it learns their share of a replica's load from the replicas' reports, a
    # second late: None (the default) shares where there are several ingress replicas (and policy
    # prefix), whose routers otherwise place the same prefixes apart once the replicas queue
    share_decisions: bool | None = None


class IngressOptions(_Strict):
    """The FastAPI ingress deployment: light (tokenize, format), so many requests per replica."""

    num_replicas: PositiveInt = 1
    max_ongoing_requests: PositiveInt = 1024
    num_cpus: float = Field(0, ge=0)
    # each ingress replica also serves the API on this port of its node itself, all of a node's
    # ingress replicas sharing it (chunkserve/cluster/front.py): no hop through Serve's HTTP proxy, which
    # keeps http_options.port (a different port). The front serves the app at the root path
    # (route_prefix is the proxy's). None: through the proxy alone
    http_port: int | None = Field(None, ge=1, le=65535)
    http_host: str = "127.0.0.1"  # the front's address: 0.0.0.0 to take requests from other hosts
    # the front closes a connection that has not sent a complete request head this long after it
    # opened (or after a kept-alive one's next request began), with a 408 if part of one came:
    # uvicorn has no such timeout, so slow-header clients could hold connections open indefinitely
    header_timeout_s: float = Field(10, gt=0)


TENANT_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DEFAULT_TENANT = "default"  # the tenant of api_key / api_key_env, or of every request without a key


class TenantOptions(_Strict):
    """One tenant (chunkserve/cluster/tenants.py, DESIGN §2): its keys, whom its cached prompts are
    shared with, its rate limits and its priority."""

    name: str = Field(pattern=TENANT_NAME)  # the `tenant` label of its /metrics series
    api_keys: list[SecretStr] = []  # keys its clients send as `Authorization: Bearer <key>`
    api_key_sha256: list[str] = []  # or their SHA-256, hex (the config then holds no key)
    api_key_env: str | None = None  # or: an environment variable holding one key
    # shared: cached prompts shared with every other `shared` tenant's (and salted alike: see
    # cache_salt); private: with this tenant's own requests only; group:<name>: with the tenants of
    # that group. A request's own cache_salt narrows it further, within the tenant's namespace
    cache: str = Field("private", pattern=r"^(shared|private|group:[A-Za-z0-9_.-]{1,64})$")
    # beyond these a request gets 429 with Retry-After (per ingress replica: each holds limit /
    # ingress.num_replicas; bursts of up to 10 s worth); None: no limit. Tokens: prompt tokens
    # when sent, completion tokens when done (a request is refused while the budget is spent)
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    priority: int = 0  # the engines admit lower values first (vLLM's priority); then fair by tenant

    @model_validator(mode="after")
    def _check(self) -> TenantOptions:
        if not (self.api_keys or self.api_key_sha256 or self.api_key_env):
            raise ValueError(f"tenant {self.name!r} needs a key: api_keys, api_key_sha256 or api_key_env")
        bad = [h for h in self.api_key_sha256 if len(h) != 64 or any(c not in "0123456789abcdef" for c in h)]
        if bad:
            raise ValueError(f"tenant {self.name!r}: api_key_sha256 takes 64 lowercase hex digits, got {bad[0]!r}")
        if self.name == DEFAULT_TENANT:
            raise ValueError(f"tenant name {DEFAULT_TENANT!r} is api_key's (or no key's): pick another")
        return self


class AppConfig(_Strict):
    model: str = (
        "tiny"  # preset name (chunkserve/replicas/model/presets/<name>.json), a Hugging Face directory or a GGUF file
    )
    served_model_name: str | None = None  # the `model` clients send; None: `model` itself
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when the cluster has GPUs

    # LLM replicas: a fixed count (None: 1), or Serve's autoscaling_config passed through as is
    num_replicas: PositiveInt | None = None
    autoscaling_config: dict[str, Any] | None = None
    tensor_parallel_size: PositiveInt = 1  # ranks per replica, one placement-group bundle each
    # GPUs per replica on CUDA (ignored on CPU); None: one per rank. A fraction lets small replicas
    # share a GPU (then set engine.kv_cache_tokens: the automatic pool takes most of the GPU).
    num_gpus_per_replica: float | None = Field(None, gt=0)
    num_cpus_per_replica: float = Field(1, ge=0)
    max_ongoing_requests: PositiveInt = 64  # per replica: the engine's concurrent sequences from Serve
    max_queued_requests: int = Field(-1, ge=-1)  # per caller; beyond it: 503 (-1: unbounded)
    # a stream's tokens after its first are sent at most this often, as one chunk per interval
    # (Ray Serve LLM's stream batching, 50 ms by default there too); 0: a chunk per engine step
    stream_interval_ms: float = Field(50, ge=0)
    retry_after_s: float = Field(1, ge=0)  # Retry-After of a 503
    # a request whose first output has not come this many seconds after it reached the ingress
    # (its parsing, tokenizing, Serve's queue, the engine's queue and prefill) is refused with a
    # 503 `deadline_exceeded`, its sequence aborted, rather than served late; None: no deadline
    # (Serve's http_options.request_timeout_s still bounds whole requests)
    request_deadline_s: float | None = Field(None, gt=0)

    # run chunkserve.replicas.engine.warmup in each LLM replica before it serves (kernels compiled at startup, not
    # on users' requests); None: on GPUs
    warmup: bool | None = None
    engine: EngineOptions = EngineOptions()
    router: RouterOptions = RouterOptions()
    ingress: IngressOptions = IngressOptions()

    # how tool calls are found in a model's text under tool_choice `auto` (chunkserve/cluster/tool_calls.py; vLLM's
    # --tool-call-parser): `hermes` (<tool_call> blocks: Hermes, Qwen, the tiny preset's template),
    # `llama3_json` (Llama 3.1+). None: `auto` is a 400 (`required` and named functions still work)
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    # reasoning models' thinking as chat messages' `reasoning_content` apart from their content
    # (chunkserve/cluster/reasoning.py; vLLM's --reasoning-parser): `deepseek_r1`, `qwen3`. None: all content
    reasoning_parser: Literal["deepseek_r1", "qwen3"] | None = None
    # special tokens' text in completions' text prompts and in user and tool messages (and in
    # /tokenize's) tokenized as their special ids, as vLLM does: users could forge role markers
    # such as `<|system|>`. False (the default): it is tokenized as text; the chat template's own
    # markers are special either way
    allow_special_tokens_in_prompt: bool = False

    # Stop strings a request may give, and their characters in all. The ingress sends them with
    # each of the request's prompts x n choices, and each choice's stream searches its text for
    # every one at every token, holding back as much text as the longest could begin. OpenAI takes
    # 4 stop strings; 64 of up to 8192 characters in all cover any ordinary use (words, markers,
    # a template's end tags) and refuse megabyte-sized ones, whose copies cost the ingress and the
    # replica gigabytes (issue #45). Past either: a 400 naming the limit
    max_stop_strings: PositiveInt = 64
    max_stop_chars: PositiveInt = 8192
    # Logprob entries one response may carry (vLLM bounds only their k: max_logprobs): per choice,
    # for each token it asks to generate (max_tokens; unset, none counted: the output runs to the
    # context's end, its entries made as it goes) and, with echo and logprobs, each prompt token,
    # the token's entry and its k most likely tokens'. 2**18
    # passes a whole 8K context of one choice with the 20 most likely tokens (8192 x 21) and
    # lm-eval-harness's loglikelihood requests (echo, logprobs 0 or 1) over 100K prompt tokens;
    # it refuses 4 echoed 3900-token prompts with 20 each (328K entries: megabytes of JSON from a
    # 15 KB request). Past it: a 400 naming the limit before anything runs
    max_logprob_entries: PositiveInt = 2**18

    api_key: SecretStr | None = None  # clients must send `Authorization: Bearer <key>`
    # FastAPI's API docs (GET /docs: Swagger UI, /redoc, /openapi.json): `key` behind the API key
    # as /v1/models (open when there is no key), `open` to anyone (FastAPI's and vLLM's default,
    # which has no key on them), `off` a 404 (vLLM's --disable-fastapi-docs)
    openapi_docs: Literal["off", "key", "open"] = "key"
    api_key_env: str | None = None  # or: the name of an environment variable holding the key
    max_request_bytes: PositiveInt = 10 * 2**20  # larger bodies get 413
    # tenants (chunkserve/cluster/tenants.py): keys -> tenant, cache policy, limits, priority. Empty:
    # one tenant, `default`, whose key is api_key (if any) and whose cache is shared, as before.
    # With tenants, api_key (if set) is still the `default` tenant's (shared, no limits)
    tenants: list[TenantOptions] = []
    # /metrics (per-tenant series tell each tenant's volumes and hit rates) needs this key when set;
    # None: open, as vLLM's (for scrapers inside the cluster's network)
    metrics_api_key: SecretStr | None = None

    @model_validator(mode="after")
    def _check(self) -> AppConfig:
        if self.autoscaling_config is not None and self.num_replicas is not None:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("set api_key or api_key_env, not both")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must differ: {sorted(n for n in set(names) if names.count(n) > 1)}")
        if self.router.direct_stream and (self.router.policy != "prefix" or self.autoscaling_config is not None):
            raise ValueError(
                "router.direct_stream needs router.policy prefix and a fixed num_replicas (Serve's "
                "autoscaling counts only the requests Serve routed)"
            )
        if self.router.share_decisions and self.router.policy != "prefix":
            raise ValueError(
                "router.share_decisions shares the prefix router's decisions: it needs router.policy prefix"
            )
        tp = self.tensor_parallel_size
        if tp > 1 and self.num_gpus_per_replica not in (None, tp):
            raise ValueError(
                f"tensor_parallel_size={tp} takes one GPU per rank: num_gpus_per_replica must be "
                f"{tp} or unset, got {self.num_gpus_per_replica}"
            )
        return self

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def resolve_api_key(self) -> str | None:
        """The key clients must present; read from the environment of the calling process."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"api_key_env={self.api_key_env!r} but that environment variable is not set")
        return key
