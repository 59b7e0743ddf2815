"""Llama-family decoder (HF LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM), tensor-parallel.

The model holds no KV cache: each layer hands q, k, v to the caller's attention backend,
`attn.forward(layer_idx, q, k, v) -> o`, which owns the cache and the softmax scale. A layer is
`before_attention` (norm, q/k/v projection, rotary), the attention, then `after_attention` (output
projection, norm, MLP): chunkserve/replicas/engine/piecewise.py runs the halves as CUDA graphs with the attention
between them.
"""

from __future__ import annotations

import torch
from torch import nn

from chunkserve.replicas.model.config import ModelConfig
from chunkserve.replicas.model.layers import (
    TP,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    apply_rotary_qk,
    divide,
    kv_heads_of_rank,
    silu_and_mul,
)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TP):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        self.num_heads = divide(cfg.num_heads, tp.size, "num_heads")
        self.num_kv_heads = kv_heads_of_rank(cfg.num_kv_heads, tp.rank, tp.size)[1]  # (replicated past Hkv ranks)
        self.qkv_proj = QKVParallelLinear(cfg, tp=tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias, tp=tp)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """x: [T, H] -> q: [T, Hq, D], k, v: [T, Hkv, D] (heads local to this rank), rotated
        (rotate=False: not yet, views into the projection's output, for a kernel that rotates q
        and k as it stores them: StepAttention.forward_rope)."""
        T, D = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1)
        q = q.view(T, self.num_heads, D)
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotate:
            q, k = apply_rotary_qk(q, k, cos, sin)
        return q, k, v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The attention's output o: [T, Hq, D] -> [T, H]."""
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn) -> torch.Tensor:
        return self.out(attn.forward(self.layer_idx, *self.qkv(x, cos, sin)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, bias=cfg.mlp_bias, tp=tp
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, I/tp] in between


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TP):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_idx, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    # The residual stream h is carried beside the layer outputs so that each add fuses into the
    # norm after it: h = x + residual (x: the last layer's MLP output), then h + attention. The
    # same sums as `h + attn(norm(h))`, `h + mlp(norm(h))`. h is updated in place (each norm
    # writes it over the residual it is given, as vLLM's fused_add_rms_norm does), so the
    # piecewise graphs keep it in their static buffer with no copy a layer; the first layer's
    # residual is the embedding itself.
    def before_attention(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, rotate: bool = True
    ) -> tuple[torch.Tensor, ...]:
        """-> (q, k, v, residual); rotate: as LlamaAttention.qkv's."""
        if residual is None:  # the first layer: x is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual, inplace=True)
        return *self.self_attn.qkv(x, cos, sin, rotate), residual

    def after_attention(self, o: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's output o: [T, Hq, D] -> (the layer's output, residual)."""
        x, residual = self.post_attention_layernorm(self.self_attn.out(o), residual, inplace=True)
        return self.mlp(x), residual

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, attn
    ) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.self_attn.layer_idx
        rope = getattr(attn, "forward_rope", None)  # an attention that rotates q and k as it stores them
        if rope is not None:
            q, k, v, residual = self.before_attention(x, residual, cos, sin, rotate=False)
            return self.after_attention(rope(layer, q, k, v, cos, sin), residual)
        q, k, v, residual = self.before_attention(x, residual, cos, sin)
        return self.after_attention(attn.forward(layer, q, k, v), residual)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """-> (embeddings [T, H], cos, sin [T, D])."""
        x = self.embed_tokens(input_ids)
        return x, *self.rotary_emb(positions, x.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x, cos, sin = self.embed(input_ids, positions)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, attn)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # HF checkpoint projection name -> (our fused parameter's module, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, tp: TP):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, tp)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """input_ids, positions: [T] (tokens of several sequences, flattened) -> final-normed hidden [T, H]."""
        return self.model(input_ids, positions, attn)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> fp32 logits over the full vocabulary [N, V] (gathered across TP ranks)."""
        return self.lm_head(hidden).float()


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config must hold, with its full (unsharded) shape."""
    H, D, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, H)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        for name, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = (out, H)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (D,)
            shapes[p + "self_attn.k_norm.weight"] = (D,)
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = shape[:1]
    shapes["model.norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, H)
    return shapes
