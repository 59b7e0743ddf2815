"""LLMEngine: one replica's engine. No Ray, no HTTP: add requests, `step()`, read tokens.

    engine = LLMEngine.from_model("tiny", kv_cache_tokens=8192)
    engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...

`python -m chunkserve.replicas.engine --model tiny --prompt "Hello"` prints a completion.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

import torch

from chunkserve.kernels.block_union import BlockUnion
from chunkserve.replicas.engine.attention import Attention
from chunkserve.replicas.engine.distributed import agree_min
from chunkserve.replicas.engine.guided import Guides
from chunkserve.replicas.engine.kv_pool import HostPool, KVPool
from chunkserve.replicas.engine.prefix_tree import PrefixTree
from chunkserve.replicas.engine.runner import Launched, ModelRunner
from chunkserve.replicas.engine.sampler import unseeded_key
from chunkserve.replicas.engine.scheduler import Scheduler
from chunkserve.replicas.engine.sequence import GUIDED, MAY_THINK, THINKING, SamplingParams, Sequence, Status, Tenancy
from chunkserve.replicas.engine.stats import EngineStats
from chunkserve.replicas.engine.tree_events import RouteEvents
from chunkserve.replicas.model import load_model
from chunkserve.replicas.model.layers import kv_heads_of_rank
from chunkserve.router.events import Events
from chunkserve.router.hashing import model_seed

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model: str  # Hugging Face directory or preset name (chunkserve/replicas/model/presets/<name>.json)
    chunk_size: int = 64
    enable_prefix_sharing: bool = True
    kv_cache_tokens: int | None = None  # pool size; None: 32768 on CPU, a share of free memory on GPU
    gpu_memory_utilization: float = 0.9  # share of free GPU memory the pool may take (when sized automatically)
    # The host tier (DESIGN §3): tokens of K/V kept in host memory (pinned on CUDA; on the CPU a
    # second tensor) for chunks the pool evicts; a request matching them copies them back instead
    # of recomputing them. 0: none (evicted chunks are dropped). Every tensor-parallel rank holds
    # its own heads' share of each chunk.
    host_cache_tokens: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context, capped by the pool
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto (float32 on CPU, bfloat16 on GPU, whatever the checkpoint) | float32 | float16 | bfloat16
    dtype: str = "auto"
    seed: int = 0  # preset weights and requests' default sampling seeds
    tp_rank: int = 0
    tp_size: int = 1
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | triton | torch | reference
    # triton backend, eager engines (enforce_eager): decode a batch with nothing shared through
    # FlashInfer's paged decode (GQA, 16-bit caches, flashinfer installed), faster there than TPP
    # without a phase 1. Engines with CUDA graphs decode it through TPP: a whole-step graph through
    # TPP beats an eager step through FlashInfer (not yet compared under the piecewise graphs,
    # between whose pieces either could run; figures: chunkserve/cluster/loadtest/records/README.md,
    # 'Figures behind the code').
    flashinfer_fallback: bool = True
    # triton backend: a step's prefill spans through FlashInfer's paged prefill, one launch per
    # layer over the pool as it is (16-bit caches, head size 64/128/256, flashinfer installed;
    # chunkserve/kernels/paged_prefill.py), not the plain-torch reference span by span, which takes several
    # times as long (figures: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code')
    flashinfer_prefill: bool = True
    # CUDA: False runs steps' forwards from CUDA graphs (the piecewise graphs below; whole-step
    # graphs too with decode_graphs); True launches every kernel from Python (vLLM's option)
    enforce_eager: bool = False
    # The forward's pieces between attentions as CUDA graphs per token-count bucket, for the steps
    # no whole-step graph runs (mixed steps, decode plans no fixed plan holds): chunkserve/replicas/engine/piecewise.py.
    # None: on CUDA with the triton backend unless enforce_eager; True on the CPU runs the same
    # pieces as plain calls (tests); False: those steps run eagerly.
    piecewise_graphs: bool | None = None
    # Decode-only steps replay a whole-step CUDA graph per padded batch size up to max_num_seqs,
    # captured when the engine is built and valid for any TPP plan of its size (fixed plans:
    # chunkserve/replicas/engine/cuda_graph.py); decode steps whose plan does not fit one, and mixed steps, run
    # from the piecewise graphs. None: on CUDA with the triton backend unless enforce_eager;
    # True on the CPU (triton backend) runs the same path as plain calls (tests); False: every
    # step from the piecewise graphs (figures: chunkserve/cluster/loadtest/records/README.md, call N).
    decode_graphs: bool | None = None
    # With decode_graphs, a step holding prefill tokens replays the decode graph of its token
    # count too where it fits (at most max_num_seqs tokens, dense pieces): each prefill token a
    # decode row of the TPP plan, of its causal length, FlashInfer's prefill not launched
    # (Attention._plan_rows). False: such steps run from the piecewise graphs.
    graph_mixed_steps: bool = True
    # Prepare and queue each step while the device runs the one before, collecting that one's
    # tokens after (vLLM's option of the name); None: on for CUDA, off elsewhere (the CPU runs
    # the step itself: nothing to overlap). A sequence's next step is then scheduled before its
    # last token is known: one that ends on a stop token has run one token more, which is
    # dropped (never emitted or counted); one that ends by length does not. A step's host work
    # then hides behind the device's, most where it is longest, sampling rows (figures:
    # chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code').
    async_scheduling: bool | None = None
    # Block-union sparse prefill (DESIGN §5, chunkserve/kernels/block_union.py): a prefill piece after at
    # least sparse_prefill.min_context cached tokens attends only the context blocks its queries
    # score high on (approximate attention: outputs change). None (default): every prefill is
    # dense, exact. A dict is taken as BlockUnion's fields; BlockUnion(budget=...) is planned once
    # a step, and prefills a long prompt faster than dense (figures:
    # chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code'). The pool then keeps each
    # chunk's key bounds per layer ([max | min] per dimension, in K's dtype: 2/c of K's size again).
    sparse_prefill: BlockUnion | dict | None = None

    def __post_init__(self):
        if isinstance(self.sparse_prefill, dict):
            object.__setattr__(self, "sparse_prefill", BlockUnion(**self.sparse_prefill))
        if self.chunk_size not in (16, 32, 64, 128):
            raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {self.chunk_size}")
        if self.sparse_prefill is not None:
            self.sparse_prefill.check_chunk_size(self.chunk_size)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if isinstance(self.host_cache_tokens, bool) or not isinstance(self.host_cache_tokens, int):
            raise ValueError(f"host_cache_tokens must be an integer, got {self.host_cache_tokens!r}")
        if self.host_cache_tokens < 0:
            raise ValueError(f"host_cache_tokens must be >= 0 (0: no host tier), got {self.host_cache_tokens}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.chunk_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one chunk ({self.chunk_size}), got {self.kv_cache_tokens}"
            )


class RequestOutput(NamedTuple):
    """What one request produced in one step (or its end).

    Immutable as a named tuple rather than a frozen dataclass: the engine makes one per row per
    step, and a frozen dataclass's __init__ (a guarded setattr per field) is several times slower
    to build: a visible share of a large decode step's host time (figures:
    chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code')."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache (both tiers)
    output_tokens: int
    # per new token, if the request asked (SamplingParams.logprobs): (its logprob, the most
    # likely tokens' (id, logprob), most likely first)
    logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] | None = None
    # the request's first output, if it asked (SamplingParams.prompt_logprobs): per prompt token,
    # the same (None for the first)
    prompt_logprobs: list | None = None
    cached_tokens_host: int = 0  # of cached_tokens, those copied back from the host tier


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = _resolve_device(config.device)
        _check_tp_group(config)
        dtype = _resolve_dtype(config.dtype, self.device)
        self.model, self.model_config, self.tokenizer = load_model(
            config.model,
            dtype=dtype,
            device=self.device,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            seed=config.seed,
        )
        mc, c = self.model_config, config.chunk_size
        kv_heads = kv_heads_of_rank(mc.num_kv_heads, config.tp_rank, config.tp_size)[1]
        sparse = config.sparse_prefill
        per_chunk = KVPool.bytes_per_chunk(
            mc.num_layers, kv_heads, c, mc.head_dim, dtype, key_bounds=sparse is not None
        )
        self.pool = KVPool(
            num_layers=mc.num_layers,
            num_chunks=self._num_chunks(per_chunk),
            num_kv_heads=kv_heads,
            chunk_size=c,
            head_dim=mc.head_dim,
            dtype=dtype,
            device=self.device,
            key_bounds=sparse is not None,
        )
        capacity = self.pool.num_chunks * c
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, capacity)
        if self.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV pool ({capacity} tokens): "
                "raise kv_cache_tokens or lower max_model_len"
            )
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context "
                f"({mc.max_position_embeddings} positions)"
            )
        # every count the engine and its parts keep (stats(), the benchmarks), one object they share
        self.counters = EngineStats()
        host_chunks = -(-config.host_cache_tokens // c)
        self.host = HostPool(self.pool, host_chunks, self.counters) if host_chunks else None
        self.tree = PrefixTree(self.pool, self.host)
        self.scheduler = Scheduler(
            self.tree,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_sharing=config.enable_prefix_sharing,
            max_model_len=self.max_model_len,
            counters=self.counters,
        )
        self.attention = Attention(
            self.pool,
            backend=config.attention_backend,
            device=self.device,
            num_q_heads=mc.num_heads // config.tp_size,
            head_dim=mc.head_dim,
            flashinfer_fallback=config.flashinfer_fallback and config.enforce_eager,
            flashinfer_prefill=config.flashinfer_prefill,
            sparse=sparse,
            counters=self.counters,
        )
        self.runner = ModelRunner(
            self.model,
            self.attention,
            self.device,
            enforce_eager=config.enforce_eager,
            tp_size=config.tp_size,
            vocab_size=mc.vocab_size,
            eos_token_ids=tuple(mc.eos_token_ids),
            max_num_batched_tokens=config.max_num_batched_tokens,
            piecewise=config.piecewise_graphs,
            decode_graphs=config.decode_graphs,
            max_num_seqs=config.max_num_seqs,
            counters=self.counters,
        )
        if config.graph_mixed_steps and self.attention.fixed is not None:
            self.attention.plan_rows = self.scheduler.prefill_rows_last = True
        self.async_scheduling = (
            self.device.type == "cuda" if config.async_scheduling is None else config.async_scheduling
        )
        self._inflight: Launched | None = None  # the step launched, not collected yet (async_scheduling)
        self._seqs: dict[str, Sequence] = {}
        self._guides: Guides | None = None  # grammars of guided requests, made at the first one
        self._guides_lock = threading.Lock()
        # live guided requests (Sequence.guided): while any, the collect goes inside the launch (step)
        self._num_guided = 0
        self._arrivals = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(config)

    @classmethod
    def from_model(cls, model: str, **options) -> LLMEngine:
        unknown = set(options) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(EngineConfig(model=model, **options))

    def _num_chunks(self, bytes_per_chunk: int) -> int:
        n = self._own_num_chunks(bytes_per_chunk)
        if self.config.tp_size > 1:  # every rank's pool the same size, or their schedules part
            n = agree_min(n, self.device)
        return n

    def _own_num_chunks(self, bytes_per_chunk: int) -> int:
        c = self.config.chunk_size
        if self.config.kv_cache_tokens is not None:
            return -(-self.config.kv_cache_tokens // c)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * self.config.gpu_memory_utilization) // bytes_per_chunk
        return 32768 // c

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Seq[int],
        params: SamplingParams | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        """Queue a request; raises ValueError (and changes nothing) when the input is bad.
        tenancy: its tenant, cache salt (the prefix tree it shares) and priority; None: none."""
        params = SamplingParams() if params is None else params
        tenancy = Tenancy() if tenancy is None else tenancy
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(tenancy, Tenancy):
            raise ValueError(f"tenancy must be a Tenancy, got {type(tenancy).__name__}")
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = self._validate_prompt(prompt_token_ids)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(
                f"logit_bias names token {max(t for t, _ in params.logit_bias)}: token ids are in [0, {vocab})"
            )
        if params.think is not None and any(t is not None and t >= vocab for t in params.think):
            raise ValueError(f"think names tokens {params.think}: token ids are in [0, {vocab})")
        # (tensor parallelism: rank 0's tokens are every rank's, so only rank 0 needs the grammar;
        # the others count the request as guided, to collect each step where rank 0 does: inside
        # the next launch)
        guided = params.guided is not None
        matcher = self.guides().matcher(params.guided) if guided and self.config.tp_rank == 0 else None
        seq = Sequence(
            request_id,
            prompt,
            params,
            next(self._arrivals),
            matcher=matcher,
            thinking=GUIDED if params.think is None else THINKING if params.think[0] is None else MAY_THINK,
            tenancy=tenancy,
        )
        self._num_guided += guided
        if not params.greedy:  # an unseeded request's key: from the engine's seed and its arrival
            seq.draw_key = params.seed if params.seed is not None else unseeded_key(self.config.seed, seq.arrival)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def guides(self) -> Guides:
        """The engine's grammars (chunkserve.replicas.engine.guided), made on first use. `guides().compile(guide)`
        may run in another thread (the replica compiles before it adds a request)."""
        with self._guides_lock:
            if self._guides is None:
                if self.tokenizer is None:
                    raise ValueError("guided decoding needs a tokenizer and this model has none")
                self._guides = Guides(
                    self.tokenizer, self.model_config.vocab_size, tuple(self.model_config.eos_token_ids)
                )
            return self._guides

    def _validate_prompt(self, ids: Seq[int]) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Seq):
            raise ValueError(f"prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        if len(ids) == 0:
            raise ValueError("prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}: token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}: no room left to generate"
            )
        return list(ids)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its private chunks; False if it is unknown or finished."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._retire(seq, "abort")
        return True

    def _retire(self, seq: Sequence, reason: str) -> None:
        """The one way a request leaves the engine (finished: stop or length; or aborted): its
        chunks go back to the tree, what it held of the engine's goes (its id, its place among
        the guided, its penalty slot), and it is counted, its prompt tokens too once it was
        admitted (a request aborted while it waited reached no model)."""
        self.scheduler.finish(seq, reason)
        del self._seqs[seq.request_id]
        self._num_guided -= seq.guided
        self.runner.penalties.release(seq)
        c = self.counters
        c.finished_requests += 1
        if seq.num_cached_prompt is not None:
            c.prompt_tokens += len(seq.prompt_ids)
            c.cached_prompt_tokens += seq.num_cached_prompt
            c.cached_prompt_tokens_host += seq.num_cached_prompt_host

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> launch -> collect -> advance. With async_scheduling the
        tokens collected (returned) are the step launched before, while the device runs this
        one; else this step's own, after its advance. While guided requests live, the collect
        comes inside the launch: once this step's forward is queued, before its grammar masks
        are made, which need the tokens collected."""
        batch = self.scheduler.schedule()
        if self.host is not None:  # the host tier's copies this schedule decided, before any kernel
            self.host.flush()
        outputs: list[RequestOutput] = []
        collect = functools.partial(self._collect_inflight, outputs)
        launched = None
        if batch:
            launched = self.runner.launch(batch, self._inflight, before_mask=collect if self._num_guided else None)
        collect()  # (not collected inside: nothing guided, or nothing in the step sampled)
        self._inflight = launched
        if batch:  # after the collect: the chunks this step fills hold the tokens it collected
            self.scheduler.advance(batch)
            self._count_step(batch)
        if not self.async_scheduling:
            collect()  # this step's own tokens
        return outputs

    def _collect_inflight(self, outputs: list[RequestOutput]) -> None:
        """The step in flight's tokens into `outputs`, once (a second call finds none)."""
        if self._inflight is not None:
            outputs.extend(self._collect(self._inflight))
            self._inflight = None

    def _collect(self, launched: Launched) -> list[RequestOutput]:
        """A launched step's tokens into their placeholders; a sequence that finished since
        (its token before ended it, or an abort) drops its own."""
        outputs, finished = [], Status.FINISHED
        tokens, logprobs = self.runner.collect(launched)
        for i, (seq, slot, token) in enumerate(zip(launched.samplers, launched.slots, tokens)):
            if seq.status is not finished:
                seq.output_ids[slot] = token
                outputs.append(self._settle(seq, token, slot + 1, logprobs.get(i)))
        self.counters.generated_tokens += len(outputs)
        return outputs

    def _count_step(self, batch) -> None:
        c = self.counters
        c.steps += 1
        c.decode_steps += not batch.prefills  # decode-only steps: the ones a CUDA graph may run
        c.last_decode_batch = len(batch.decodes)
        c.max_decode_batch = max(c.max_decode_batch, len(batch.decodes))
        used = self.pool.num_chunks - self.pool.num_free - self.tree.num_cached  # held by live sequences
        c.max_kv_chunks_used = max(c.max_kv_chunks_used, used)
        # prompt positions among the tokens that just ran: a decode row's one token is the
        # prompt's last when the row had nothing but it left to compute (its first output)
        # (a row that finished while the step ran, async_scheduling, computed no prompt token)
        running = Status.RUNNING
        c.computed_prompt_tokens += sum(
            seq.num_computed <= len(seq.prompt_ids) and seq.status is running for seq in batch.decodes
        )
        for seq, n in batch.prefills:
            if seq.status is not running:
                continue
            start = seq.num_computed - n
            c.computed_prompt_tokens += max(0, min(seq.num_computed, len(seq.prompt_ids)) - start)

    def _settle(self, seq: Sequence, token: int, n: int, logprobs: tuple | None = None) -> RequestOutput:
        """The output of `token`, the sequence's n-th; finishes the sequence if it ends there
        (dropping a placeholder past it). Runs per row per step: attribute lookups kept few."""
        p = seq.params
        reason = None
        if (
            seq.matcher is not None
            and (seq.thinking == GUIDED or _grammar_takes(seq, token))
            and not seq.matcher.is_terminated()
            and not seq.matcher.accept_token(token)
        ):
            raise RuntimeError(
                f"request {seq.request_id}: token {token} is outside its grammar (the mask was not applied)"
            )
        if token in p.stop_token_set or (not p.ignore_eos and token in self.model_config.eos_token_ids):
            reason = "stop"
        elif seq.ends_by_length(n, self.max_model_len):
            reason = "length"  # (Scheduler.schedule skips the rows this will end, by the same rule)
        if reason is not None:
            del seq.output_ids[n:]
            self._retire(seq, reason)
        return RequestOutput(
            seq.request_id,
            [token],
            reason is not None,
            reason,
            len(seq.prompt_ids),
            seq.num_cached_prompt,
            n,
            None if logprobs is None else [logprobs],
            seq.prompt_logprobs if n == 1 else None,
            seq.num_cached_prompt_host,
        )

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Run prompts to completion (alongside anything already queued); returns their tokens."""
        params_list = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"generate-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        added = []
        try:
            for rid, prompt, p in zip(ids, prompts, params_list):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except ValueError:
            for rid in added:
                self.abort(rid)
            raise
        outputs: dict[str, list[int]] = {rid: [] for rid in ids}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.request_id in outputs:
                    outputs[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        pending.discard(out.request_id)
        return [outputs[rid] for rid in ids]

    # -- observability ----------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        """The pool's use and the queues now, and the engine's counts (chunkserve.replicas.engine.stats): requests,
        tokens, steps; with sparse_prefill, the pages its pieces read and would have read dense.
        The replica sends it every step."""
        if self.host is not None:
            self.host.settle()  # (the copy time of those finished: CUDA times them as they run)
        free, cached, c = self.pool.num_free, self.tree.num_cached, self.counters
        stats = {
            "kv_chunks_total": self.pool.num_chunks,
            "kv_chunks_used": self.pool.num_chunks - free - cached,  # held by live sequences
            "kv_chunks_cached": cached,  # finished sequences' chunks kept as prefix cache
            "kv_chunks_free": free,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "preemptions": c.preemptions,
            "prompt_tokens": c.prompt_tokens,
            "cached_prompt_tokens": c.cached_prompt_tokens,
            "cached_prompt_tokens_host": c.cached_prompt_tokens_host,
            "computed_prompt_tokens": c.computed_prompt_tokens,
            "generated_tokens": c.generated_tokens,
            "finished_requests": c.finished_requests,
            "steps": c.steps,
            "decode_steps": c.decode_steps,
            "max_decode_batch": c.max_decode_batch,
            "last_decode_batch": c.last_decode_batch,
            "max_kv_chunks_used": c.max_kv_chunks_used,
            # the host tier (zeros without one): its chunks, and the copies each way
            "host_chunks_total": 0 if self.host is None else self.host.num_chunks,
            "host_chunks_used": self.tree.num_host,
            "host_spills": c.host_spills,
            "host_loads": c.host_loads,
            "host_copy_bytes": c.host_copy_bytes,
            "host_copy_ms": int(c.host_copy_s * 1000),
        }
        if self.attention.sparse is not None:
            stats["sparse_pages_read"] = c.sparse_pages_read
            stats["sparse_pages_dense"] = c.sparse_pages_dense
        return stats

    def reset_counters(self) -> None:
        """Zero what stats() and the benchmarks count (after chunkserve.replicas.engine.warmup): requests, tokens,
        steps, preemptions, decode and prefill plans built, graphs replayed, host waits (the
        graphs' capture times stay: they are measured once, when the engine is built)."""
        self.counters.reset()

    def cache_digest(self, model_name: str, route_chunks: int, limit: int = 4096) -> list[int]:
        """The chained chunk hashes (chunkserve.router.hashing, seeded by the served model name) of the
        prefixes this engine's tree holds, for the router. Call between steps."""
        return self.tree.digest(model_seed(model_name), route_chunks, limit)

    def record_route_events(self, model_name: str, route_chunks: int) -> None:
        """From now on, record the tree's routing events (chunkserve/replicas/engine/tree_events.py): the
        chained hashes, seeded as `cache_digest`'s, of the chunks it stores and evicts up to
        `route_chunks` deep, for `take_route_events`. A new epoch starts here."""
        self.tree.events = RouteEvents(self.tree, model_seed(model_name), route_chunks)

    def take_route_events(self) -> Events | None:
        """The routing events since the last take (chunkserve/router/events.py: a delta, or a snapshot at an
        epoch's start or after many changes); None if nothing changed or none are recorded. Call
        between steps."""
        return None if self.tree.events is None else self.tree.events.take()

    def check(self) -> None:
        """Assert the KV cache's invariants (tests call this after every step)."""
        self.tree.check(self.scheduler.running, self.scheduler.last_decode_paths)
        self.scheduler.check()


def _grammar_takes(seq: Sequence, token: int) -> bool:
    """Whether a guided row still outside its grammar (params.think) gives `token` to it; moves
    the row on: a first token that is not `start` begins the grammar, `start` begins thinking,
    `end` ends it (the tags go to neither)."""
    start, end = seq.params.think
    if seq.thinking == MAY_THINK and token != start:
        seq.thinking = GUIDED
        return True
    if seq.thinking == MAY_THINK:
        seq.thinking = THINKING
    elif token == end:
        seq.thinking = GUIDED
    return False


def _check_tp_group(config: EngineConfig) -> None:
    """tp_size > 1 runs inside a torch.distributed group of that many ranks (chunkserve.replicas.engine.distributed)."""
    if not 0 <= config.tp_rank < config.tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size={config.tp_size}), got {config.tp_rank}")
    if config.tp_size == 1:
        return
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ValueError(
            f"tp_size={config.tp_size} needs a torch.distributed group of its ranks: "
            "join it first (chunkserve.replicas.engine.distributed.init_group), one process per rank"
        )
    if (dist.get_world_size(), dist.get_rank()) != (config.tp_size, config.tp_rank):
        raise ValueError(
            f"tp_size={config.tp_size}, tp_rank={config.tp_rank} but this process is rank "
            f"{dist.get_rank()} of {dist.get_world_size()}"
        )


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available")
    return dev


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return _DTYPES[dtype]
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m chunkserve.replicas.engine", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="preset name or Hugging Face directory")
    ap.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt with the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-size", type=int, default=64)
    args = ap.parse_args(argv)
    engine = LLMEngine.from_model(args.model, device=args.device, dtype=args.dtype, chunk_size=args.chunk_size)
    tok = engine.tokenizer
    if tok is None:
        ap.error(f"model {args.model!r} has no tokenizer: text prompts need one")
    texts = [tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else p for p in args.prompt]
    prompts = [tok.encode(t) for t in texts]
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    for text, out in zip(args.prompt, engine.generate(prompts, params)):
        print(f"--- {text!r}\n{tok.decode(out)}")
    s = engine.stats()
    print(
        f"--- {s['prompt_tokens']} prompt tokens ({s['cached_prompt_tokens']} cached), "
        f"{s['generated_tokens']} generated, {s['steps']} steps"
    )


if __name__ == "__main__":
    main()
