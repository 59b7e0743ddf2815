"""A replica's tensor-parallel process groups and the collectives the engine itself calls.

Below the engine: chunkserve/replicas/engine/llm_engine.py and chunkserve/replicas/engine/runner.py call agree_min and
broadcast_from_first when tp_size > 1, chunkserve/replicas/parallel.py (TPEngine, TPWorker, which drive
whole engines) builds on both. Two groups per replica: the default one for the model's
collectives (NCCL between GPUs, gloo between CPU ranks) and a gloo control group for the ranks'
operations and output hashes (chunkserve/replicas/parallel.py).
"""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

__all__ = ["agree_min", "broadcast_from_first", "control_group", "free_port", "init_group"]

_IDLE_TIMEOUT = datetime.timedelta(days=365)  # the control group: workers wait there while the replica idles
_control: dist.ProcessGroup | None = None


def free_port(addr: str = "127.0.0.1") -> int:
    """A port on addr free now, for rank 0's rendezvous (init_group)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


def init_group(
    rank: int, size: int, addr: str, port: int, device: str | torch.device, timeout_s: float = 600.0
) -> None:
    """Join the replica's tensor-parallel groups (blocks until all `size` ranks have joined).
    device: the rank's engine device; CUDA ranks use NCCL (each on its own GPU), CPU ranks gloo.
    timeout_s bounds each model collective: a rank that stops answering fails the others."""
    global _control
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo",
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


def control_group() -> dist.ProcessGroup:
    if _control is None:
        raise RuntimeError("no tensor-parallel group: call init_group first")
    return _control


def _group_device(device: torch.device) -> torch.device:
    return device if device.type == "cuda" else torch.device("cpu")


def agree_min(n: int, device: torch.device) -> int:
    """The least of every rank's n (the pool size all ranks can hold)."""
    t = torch.tensor([n], dtype=torch.long, device=_group_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def broadcast_from_first(t: torch.Tensor) -> None:
    """Rank 0's t on every rank, in place (each rank passes a tensor of the same shape and
    dtype, on its engine device: a GPU tensor goes by NCCL without a trip through the host)."""
    dist.broadcast(t, src=0)
