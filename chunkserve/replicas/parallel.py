"""Tensor parallelism inside one replica: one process per rank, each with a whole engine.

Every rank holds its shard of the weights (chunkserve/replicas/model/layers.py: heads and MLP columns split,
all-reduce after the row-parallel layers) and the KV of its own heads, so attention, its plans and
its chunk pool are local to the rank (DESIGN §8). What must agree across ranks is the work: each
step every rank must run the same batch, or their all-reduces pair up wrongly and hang.

So every rank runs the same engine (scheduler, prefix tree, pool of the same size) and is fed the
same operations in the same order; all of it is deterministic given those operations:

    rank 0 (the replica)                       ranks 1 .. n-1 (TPWorker.serve, one process each)
    TPEngine.add_request / abort ──record──▶ ops: AddRequest, AbortRequest (chunkserve/replicas/wire.py)
    TPEngine.step(): ops ══ broadcast (control group) ══▶ apply ops
                     engine.step()  ◀═══ all-reduces in the forward pass ═══▶ engine.step()
                     sampled tokens ═══════ broadcast from rank 0 ════════▶ the same tokens
                     outputs' hash  ◀══ all-gather (control group) ══▶ each rank's outputs' hash

The token broadcast makes ranks agree on sampled tokens even where their logits differ in the last
bit; comparing the outputs' hashes turns any divergence into an error on every rank instead of a
hang at the next step.

Two process groups: the default one for the model's collectives (NCCL between GPUs, gloo between
CPU ranks), and a gloo control group for the ops and hashes (a worker waits in it while the
replica is idle, so it has no timeout). Per step it carries two 8-byte collectives, and the
pickled ops only in a step that has some: pickled objects both ways every step
(broadcast_object_list / gather_object) slowed the CUDA-graphed decode steps, small ones most
(figures: chunkserve/cluster/loadtest/records/README.md, 'Figures behind the code'). No Ray here: the replica
(chunkserve/replicas/deployment.py) starts the workers as Ray actors running TPWorker.serve.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from chunkserve.replicas.engine.distributed import control_group
from chunkserve.replicas.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from chunkserve.replicas.engine.sequence import SamplingParams, Tenancy
from chunkserve.replicas.wire import RANK_OPS, AbortRequest, AddRequest, RankOp, check

__all__ = ["TPEngine", "TPWorker", "rank_device", "worker_config"]

# (request_id, new tokens, finished): what a rank's step produced, to compare across ranks
Fingerprint = list[tuple[str, tuple[int, ...], bool]]


def _fingerprint(outputs: Sequence[RequestOutput]) -> Fingerprint:
    return [(o.request_id, tuple(o.new_token_ids), o.finished) for o in outputs]


_CLOSE = -1  # an ops length that ends the workers' serve loops


def _send_ops(ops: list[RankOp] | None) -> None:
    """Rank 0: the ops (None: close) to every rank over the control group."""
    for op in ops or ():
        check(op, RANK_OPS, "the ranks' ops")
    payload = b"" if not ops else pickle.dumps(ops)
    dist.broadcast(torch.tensor([_CLOSE if ops is None else len(payload)]), src=0, group=control_group())
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=control_group())


def _recv_ops() -> list[RankOp] | None:
    """Ranks > 0: the ops rank 0 sent, None when it closed the group."""
    n = torch.zeros(1, dtype=torch.long)
    dist.broadcast(n, src=0, group=control_group())
    if int(n) <= 0:
        return None if int(n) == _CLOSE else []
    buf = torch.empty(int(n), dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=control_group())
    return pickle.loads(buf.numpy().tobytes())


def _check_same(outputs: Sequence[RequestOutput], engine: LLMEngine) -> None:
    """Every rank: all ranks' outputs of this step hash alike, or raise (on every rank)."""
    digest = hashlib.blake2b(pickle.dumps(_fingerprint(outputs)), digest_size=8).digest()
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)])
    every = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(control_group()))]
    dist.all_gather(every, mine, group=control_group())
    differ = [r for r, h in enumerate(every) if int(h) != int(every[0])]
    if differ:
        raise RuntimeError(
            f"tensor-parallel ranks {differ} diverged from rank 0 in step {engine.stats()['steps']} "
            f"(this is rank "
            f"{dist.get_rank()}; its outputs: {str(_fingerprint(outputs))[:300]})"
        )


def _apply(engine: LLMEngine, ops: list[RankOp]) -> None:
    for op in ops:
        match op:
            case AddRequest(rid, prompt, params, tenancy):
                engine.add_request(rid, prompt, params, tenancy)
            case AbortRequest(rid):
                engine.abort(rid)
            case other:  # (rank 0 checks what it sends: a bug there)
                raise TypeError(f"a rank got {type(other).__name__} {other!r:.100}, not an op")


class TPWorker:
    """Rank r > 0: an engine on the rank's shard that repeats rank 0's operations."""

    def __init__(self, config: EngineConfig):
        if config.tp_rank == 0:
            raise ValueError("rank 0 is the replica's own engine (TPEngine), not a worker")
        self.engine = LLMEngine(config)

    def serve(self) -> None:
        """Step with rank 0 until it closes the group (TPEngine.close): apply its adds and aborts
        since the last step, step, check that every rank's outputs are alike."""
        while (ops := _recv_ops()) is not None:
            _apply(self.engine, ops)
            _check_same(self.engine.step(), self.engine)


class TPEngine:
    """Rank 0: the replica's engine, driving the worker ranks (TPWorker.serve) through every step.

    The LLMEngine interface (reads go to rank 0's engine): add_request and abort apply on rank 0
    at once (a bad request raises there and reaches no worker) and go to the workers with the
    next step; step() runs all ranks' steps together and checks that they produced the same."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._ops: list[RankOp] = []

    def __getattr__(self, name: str) -> Any:  # tokenizer, stats, cache_digest, has_unfinished, ...
        return getattr(self.engine, name)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        self.engine.add_request(request_id, prompt_token_ids, params, tenancy)
        self._ops.append(AddRequest(request_id, list(prompt_token_ids), params, tenancy))

    def abort(self, request_id: str) -> bool:
        if not self.engine.abort(request_id):
            return False
        self._ops.append(AbortRequest(request_id))
        return True

    def step(self) -> list[RequestOutput]:
        ops, self._ops = self._ops, []
        _send_ops(ops)
        outputs = self.engine.step()
        _check_same(outputs, self.engine)
        return outputs

    def close(self) -> None:
        """End the workers' serve loops (they return)."""
        _send_ops(None)

    generate = LLMEngine.generate  # through this class's add_request / step / abort


def rank_device(config: EngineConfig) -> str:
    """The device a replica's rank runs on: each rank's process sees its own GPU only (Ray sets
    CUDA_VISIBLE_DEVICES, the engine process inherits it), so cuda means cuda:0."""
    return "cuda:0" if config.device == "cuda" else config.device


def worker_config(config: EngineConfig, rank: int) -> EngineConfig:
    """config for rank `rank` of its tensor-parallel group."""
    return dataclasses.replace(config, tp_rank=rank)
