"""Tensor-parallel layers for Llama-family models.

Every parameter carries `weight_loader(param, full_tensor[, shard_id])`: it receives the FULL
checkpoint tensor and copies the slice that belongs to this rank. Column-parallel layers split
output features across ranks; row-parallel layers split input features and all-reduce their output;
the vocabulary is split in contiguous row blocks of ceil(V / tp) (the last block zero-padded).
Each layer takes its rank's place in the group as one TP(rank, size); with size 1 nothing here
touches torch.distributed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from chunkserve.replicas.model.config import ModelConfig


@dataclass(frozen=True)
class TP:
    """A rank's place in its tensor-parallel group: rank `rank` of `size` (one rank: no group)."""

    rank: int = 0
    size: int = 1


def divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what}={n} is not divisible by tp_size={tp_size}")
    return n // tp_size


def kv_heads_of_rank(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """The KV heads rank tp_rank holds, (first, count): num_kv_heads / tp_size of them, or, with
    more ranks than KV heads (tp_size a multiple of num_kv_heads, as vLLM allows), one head
    replicated on tp_size / num_kv_heads ranks: the one its query heads read (rank r's query heads
    [r Hq / tp, (r + 1) Hq / tp) all belong to KV head r // (tp / Hkv))."""
    if num_kv_heads >= tp_size:
        n = divide(num_kv_heads, tp_size, "num_kv_heads")
        return tp_rank * n, n
    if tp_size % num_kv_heads:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is neither divisible by tp_size={tp_size} nor divides it "
            f"(more ranks than KV heads replicate each head on tp_size / num_kv_heads ranks)"
        )
    return tp_rank // (tp_size // num_kv_heads), 1


def _param(*shape: int, loader) -> nn.Parameter:
    # Allocated uninitialised with the ambient default dtype/device; the loader fills it.
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


def default_weight_loader(param: nn.Parameter, full: torch.Tensor) -> None:
    """Replicated parameters: every rank holds the whole tensor."""
    param.data.copy_(full)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split: rank r holds rows [r*n, (r+1)*n), n = out/tp
    (out_local: this rank's rows where a subclass places them otherwise)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        tp: TP = TP(),
        out_local: int | None = None,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        if out_local is None:
            out_local = divide(out_features, tp.size, "output features")
        self.weight = _param(out_local, in_features, loader=self.weight_loader)
        self.bias = _param(out_local, loader=self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = param.shape[0]
        param.data.copy_(full.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [T, out/tp]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate/up).

    The local weight is [sum(out_i)/tp, in]: each projection's rank-r slice, stacked in order, so
    the output splits into per-projection chunks of out_i/tp. local: (first row, rows) of each
    projection's full weight that this rank holds, where not its even slice (replicated KV heads).
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp: TP = TP(),
        local: list[tuple[int, int]] | None = None,
    ):
        if local is None:
            local = [(tp.rank * n, n) for n in (divide(o, tp.size, "output features") for o in output_sizes)]
        sizes = [n for _, n in local]
        super().__init__(in_features, sum(output_sizes), bias=bias, tp=tp, out_local=sum(sizes))
        self.local, self.local_sizes = local, sizes

    # (a loader takes the shard id its module's packed_modules_mapping gives: not the base's signature)
    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:  # type: ignore[override]
        start, n = self.local[shard_id]
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, n).copy_(full.narrow(0, start, n))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections in one matmul, shaped by the model's config (hidden size, heads, head
    dim, attention_bias); heads split across ranks (shard ids "q", "k", "v"), the KV heads
    replicated where there are fewer than ranks (kv_heads_of_rank)."""

    def __init__(self, config: ModelConfig, *, tp: TP = TP()):
        head_dim, num_heads, num_kv_heads = config.head_dim, config.num_heads, config.num_kv_heads
        q = divide(num_heads, tp.size, "num_heads") * head_dim
        first, count = kv_heads_of_rank(num_kv_heads, tp.rank, tp.size)
        kv = (first * head_dim, count * head_dim)
        super().__init__(
            config.hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            bias=config.attention_bias,
            tp=tp,
            local=[(tp.rank * q, q), kv, kv],
        )

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:  # type: ignore[override]
        super().weight_loader(param, full, "qkv".index(shard_id))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split; partial products are summed across ranks."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, tp: TP = TP()):
        super().__init__()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.weight = _param(out_features, divide(in_features, tp.size, "input features"), loader=self.weight_loader)
        self.bias = _param(out_features, loader=default_weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        n = param.shape[1]
        param.data.copy_(full.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # [T, out], this rank's partial sum
        if self.tp_size > 1:
            dist.all_reduce(y)
        # Bias after the reduction so it is added once, not tp_size times.
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows: rank r holds ids [r*n, (r+1)*n), n = ceil(V/tp)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TP = TP()):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.rows = math.ceil(num_embeddings / tp.size)
        self.start = tp.rank * self.rows
        self.weight = _param(self.rows, embedding_dim, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor) -> None:
        shard = full[self.start : self.start + self.rows]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()  # padding rows past V on the last rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)  # [T, D]
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        y = F.embedding(local.masked_fill(~mine, 0), self.weight).masked_fill(~mine[:, None], 0)
        dist.all_reduce(y)  # each id is embedded by exactly one rank
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding; logits of all ranks are gathered."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)  # [N, V/tp (padded)]
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)]
            dist.all_gather(parts, logits)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.num_embeddings]  # [N, V]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, loader=default_weight_loader)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, inplace: bool = False):
        """rms_norm(x), or with a residual (norm(x + residual), x + residual); inplace: the sum
        written over residual. On CUDA rows [T, N] run as one Triton kernel
        (chunkserve/kernels/norm_rope.py)."""
        if (
            x.is_cuda
            and x.dim() == 2
            and x.stride(-1) == 1
            and (
                residual is None
                or (residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1)
            )
        ):
            from chunkserve.kernels.norm_rope import rmsnorm  # imports triton: the CPU path must not need it

            return rmsnorm(x, self.weight, self.eps, residual, inplace)
        return rms_norm(x, self.weight, self.eps, residual, inplace)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, inplace: bool = False
):
    """Plain torch (the reference of chunkserve/kernels/norm_rope.py's kernel). x, residual: [..., N].

    With a residual, h = x + residual is normalised and returned too: (y, h), the add fused
    before the norm (inplace: h written over residual, the same bits). Normalise in fp32, round
    to the input dtype, then scale: HF's order, so bf16 matches it."""
    h = x if residual is None else residual.add_(x) if inplace else x + residual
    xf = h.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(h.dtype)
    return y if residual is None else (y, h)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] = [gate | up] -> silu(gate) * up [T, I]; on CUDA one Triton kernel
    (chunkserve/kernels/norm_rope.py), the same bits."""
    if x.is_cuda and x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0:
        from chunkserve.kernels.norm_rope import silu_mul  # imports triton: the CPU path must not need it

        return silu_mul(x)
    return silu_mul_ref(x)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch (the reference of chunkserve/kernels/norm_rope.py's kernel)."""
    gate, up = x.chunk(2, dim=-1)  # x: [T, 2I] = [gate | up]
    return F.silu(gate) * up


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF Llama layout) with optional "linear" or "llama3" frequency scaling.

    forward(positions) gives cos/sin for one batch, shared by all layers; apply_rotary uses them.
    """

    inv_freq: torch.Tensor  # [D/2], a buffer

    def __init__(self, head_dim: int, base: float, scaling: dict | None = None):
        super().__init__()
        # Computed on the CPU in fp32 like HF, so the frequencies are identical on every device.
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D] (plain torch: the reference of chunkserve/kernels/norm_rope.py's kernel)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q: [T, Hq, D] and k: [T, Hkv, D]; on CUDA one Triton kernel per tensor
    (chunkserve/kernels/norm_rope.py), the same bits."""
    if (
        q.is_cuda
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and q.dtype == k.dtype == cos.dtype == sin.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
    ):
        from chunkserve.kernels.norm_rope import rope  # imports triton: the CPU path must not need it

        return rope(q, k, cos, sin)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, medium)
    return torch.where(wavelen < old_ctx / high, inv_freq, scaled)
