"""ModelConfig: the model shape the engine needs, parsed from a Hugging Face config.json dict."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ROPE_TYPES = ("llama3", "linear")
_ROPE_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "llama3" | "linear", ...}; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json dict; raise ValueError naming the first problem found."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if not isinstance(archs, list) or not archs:
            raise ValueError("config has no 'architectures' list")
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")

        vocab_size = _pos_int(d, "vocab_size")
        hidden_size = _pos_int(d, "hidden_size")
        intermediate_size = _pos_int(d, "intermediate_size")
        num_layers = _pos_int(d, "num_hidden_layers")
        num_heads = _pos_int(d, "num_attention_heads")
        num_kv_heads = _pos_int(d, "num_key_value_heads", default=num_heads)
        max_pos = _pos_int(d, "max_position_embeddings")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
        if d.get("head_dim") is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_heads}")
            head_dim = hidden_size // num_heads
        else:
            head_dim = _pos_int(d, "head_dim")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for RoPE")

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu'")
        if d.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")

        attention_bias = _bool(d, "attention_bias", False)
        rope_theta, rope_scaling = _rope(d)
        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
        if not all(_is_int(e) and 0 <= e < vocab_size for e in eos_ids):
            raise ValueError(f"eos_token_id {eos!r} must be token ids in [0, {vocab_size})")
        bos = d.get("bos_token_id")
        if bos is not None and not (_is_int(bos) and 0 <= bos < vocab_size):
            raise ValueError(f"bos_token_id {bos!r} must be a token id in [0, {vocab_size})")
        eps = d.get("rms_norm_eps", 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise ValueError(f"rms_norm_eps must be a positive number, got {eps!r}")
        dtype = d.get("torch_dtype", d.get("dtype")) or "float32"
        if not isinstance(dtype, str):
            raise ValueError(f"torch_dtype must be a string, got {dtype!r}")

        return cls(
            architecture=arch,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=_bool(d, "tie_word_embeddings", False),
            # Qwen2 hard-codes q/k/v bias and no o_proj bias; Llama and Qwen3 put attention_bias on all four.
            attention_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_proj_bias=attention_bias and arch != "Qwen2ForCausalLM",
            mlp_bias=arch == "LlamaForCausalLM" and _bool(d, "mlp_bias", False),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=bos,
            eos_token_ids=tuple(eos_ids),
            torch_dtype=dtype,
        )


def _rope(d: dict[str, Any]) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either the v4 keys (rope_theta, rope_scaling) or v5's rope_parameters."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters / rope_scaling must be an object, got {params!r}")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: default, {', '.join(ROPE_TYPES)}")
    scaling: dict[str, Any] = {"rope_type": rope_type}
    for key in _ROPE_KEYS[rope_type]:
        value = params.get(key)
        if key == "original_max_position_embeddings" and value is None:
            value = d.get("max_position_embeddings")  # HF's default for llama3
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"rope scaling {rope_type!r} needs a positive {key!r}, got {value!r}")
        scaling[key] = value
    return float(theta), scaling


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pos_int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    v = d.get(key)
    if v is None:
        v = default
    if v is None:
        raise ValueError(f"config is missing required field {key!r}")
    if not _is_int(v) or v <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer, got {v!r}")
    return v


def _bool(d: dict[str, Any], key: str, default: bool) -> bool:
    v = d.get(key, default)
    if not isinstance(v, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {v!r}")
    return v


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ValueError if the file is missing, not JSON, or not an object."""
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ValueError(f"{path} does not exist") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(d).__name__}")
    return d
