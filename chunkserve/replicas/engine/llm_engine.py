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
import itertools
import threading
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from chunkserve.replicas.engine.attention import Attention
from chunkserve.replicas.engine.config import EngineConfig
from chunkserve.replicas.engine.distributed import agree_min
from chunkserve.replicas.engine.guided import Guides
from chunkserve.replicas.engine.kv_pool import HostPool, KVPool, KVShape
from chunkserve.replicas.engine.prefix_tree import PrefixTree
from chunkserve.replicas.engine.runner import Launched, ModelRunner
from chunkserve.replicas.engine.sampler import unseeded_key
from chunkserve.replicas.engine.scheduler import Scheduler
from chunkserve.replicas.engine.sequence import GUIDED, MAY_THINK, THINKING, SamplingParams, Sequence, Status, Tenancy
from chunkserve.replicas.engine.stats import EngineStats
from chunkserve.replicas.engine.tree_events import RouteEvents
from chunkserve.replicas.model import load_model
from chunkserve.replicas.model.layers import kv_heads_of_rank
from chunkserve.router.events import Events, PublishConfig
from chunkserve.router.hashing import model_seed

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams"]


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
        config = config.resolved()
        _check_tp_group(config)
        self.device = config.torch_device
        self.model, self.model_config, self.tokenizer = load_model(
            config.model,
            dtype=config.torch_dtype,
            device=self.device,
            tp_rank=config.tp_rank,
            tp_size=config.tp_size,
            seed=config.seed,
        )
        mc = self.model_config
        kv_heads = kv_heads_of_rank(mc.num_kv_heads, config.tp_rank, config.tp_size)[1]
        shape = KVShape(
            mc.num_layers,
            kv_heads,
            config.chunk_size,
            mc.head_dim,
            config.torch_dtype,
            config.sparse_prefill is not None,
        )
        self.pool = KVPool(shape, self._num_chunks(config, shape.bytes_per_chunk), self.device)
        capacity = self.pool.num_chunks * config.chunk_size
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
        # resolved: its switches decided, its context length known; the parts read it whole
        self.config = config = dataclasses.replace(config, max_model_len=self.max_model_len)
        # every count the engine and its parts keep (stats(), the benchmarks), one object they share
        self.counters = EngineStats()
        c = config.chunk_size
        host_chunks = -(-config.host_cache_tokens // c)
        self.host = HostPool(self.pool, host_chunks, self.counters) if host_chunks else None
        ahead = config.host_write_ahead_tokens  # (None: two steps' worth, at most half of either pool)
        steps2 = -(-2 * config.max_num_batched_tokens // c)
        ahead = min(steps2, host_chunks // 2, self.pool.num_chunks // 2) if ahead is None else -(-ahead // c)
        self.tree = PrefixTree(self.pool, self.host, write_ahead=ahead)
        self.scheduler = Scheduler(self.tree, config, self.counters)
        self.attention = Attention(self.pool, config, mc.num_heads // config.tp_size, self.counters)
        self.runner = ModelRunner(self.model, self.attention, config, mc, self.counters)
        self._inflight: Launched | None = None  # the step launched, not collected yet (async_scheduling)
        self._seqs: dict[str, Sequence] = {}
        self._guides: Guides | None = None  # grammars of guided requests, made at the first one
        self._guides_lock = threading.Lock()
        # live guided requests (Sequence.guided): while any, the step in flight is collected before the masks (step)
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

    def _num_chunks(self, config: EngineConfig, bytes_per_chunk: int) -> int:
        n = _own_num_chunks(config, self.device, bytes_per_chunk)
        if config.tp_size > 1:  # every rank's pool the same size, or their schedules part
            n = agree_min(n, self.device)
        return n

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
        # the others count the request as guided, to collect each step where rank 0 does: before
        # the next step's masks)
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
        """One iteration as vLLM v1 shows it: schedule -> forward -> masks -> sample -> advance.
        With async_scheduling the tokens returned are the step launched before, collected while
        the device runs this one; else this step's own, after its advance. The step in flight is
        collected once this step's draw is queued, or before its masks while guided requests
        live: their grammar matchers need its tokens."""
        batch = self.scheduler.schedule()
        if self.host is not None:  # the host tier's copies this schedule decided, before any kernel
            self.tree.write_ahead()
            self.host.flush()
        outputs, launched = [], None
        if batch:
            fwd = self.runner.forward(batch, self._inflight)
            if self._num_guided and fwd.samplers:
                outputs += self._collect_inflight()
            launched = self.runner.sample(fwd, self.runner.masks(fwd))
        outputs += self._collect_inflight()
        self._inflight = launched
        if batch:  # after the collect: the chunks this step fills hold the tokens it collected
            self.scheduler.advance(batch)
            self._count_step(batch)
        if not self.config.async_scheduling:
            outputs += self._collect_inflight()  # this step's own tokens
        return outputs

    def _collect_inflight(self) -> list[RequestOutput]:
        """The step in flight's tokens, once (a second call finds none)."""
        launched, self._inflight = self._inflight, None
        return [] if launched is None else self._collect(launched)

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
            "host_chunks_used": self.tree.num_host + self.tree.num_backups,
            "host_spills": c.host_spills,
            "host_write_ahead": c.host_write_ahead,
            "host_spills_ahead": c.host_spills_ahead,
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
        self.tree.events = RouteEvents(self.tree, model_seed(model_name), PublishConfig(route_chunks))

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


def _own_num_chunks(config: EngineConfig, device: torch.device, bytes_per_chunk: int) -> int:
    c = config.chunk_size
    if config.kv_cache_tokens is not None:
        return -(-config.kv_cache_tokens // c)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * config.gpu_memory_utilization) // bytes_per_chunk
    return 32768 // c


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
