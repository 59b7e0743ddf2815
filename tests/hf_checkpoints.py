"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Qwen3) with a tokenizer, for tests.

Weights are re-drawn after HF's init (whose std 0.02 gives near-flat logits) at scales where each
layer changes the residual stream substantially: greedy decoding then depends on the context,
does not loop on one token, and its top-1/top-2 logit gaps are far above fp32 rounding noise.
Norm weights and q/k/v biases are random too, so loading them into the wrong slot is visible.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHS = {
    "LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
    "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM),
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
}

# A byte-level BPE: the 256 byte symbols, a few merges, then the special tokens of the flavour.
_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("i", "n"),
    ("e", "r"),
    ("a", "n"),
    ("o", "n"),
    ("Ġ", "a"),
    ("r", "e"),
    ("Ġ", "s"),
    ("e", "n"),
    ("a", "t"),
    ("o", "r"),
    ("Ġ", "w"),
    ("l", "l"),
    ("Ġ", "f"),
]
_LLAMA3 = {
    "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "bos": "<|begin_of_text|>",
    "eos": "<|eot_id|>",
    "chat_template": (
        "{{ bos_token }}{% for m in messages %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
        "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
}
_CHATML = {
    "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "bos": None,
    "eos": "<|im_end|>",
    "chat_template": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}


def make_hf_checkpoint(arch: str, path: str | Path, *, seed: int = 0, shards: bool = False, **overrides) -> Path:
    """Write a random `arch` model (fp32, safetensors) plus tokenizer files into `path`; return it.

    `overrides` go to the HF config (e.g. tie_word_embeddings=True, num_hidden_layers=3);
    `shards=True` splits the weights over several files with an index.
    """
    config_cls, model_cls = ARCHS[arch]
    path = Path(path)
    flavour = _LLAMA3 if arch == "LlamaForCausalLM" else _CHATML
    backend = _tokenizer(flavour)
    kwargs = dict(
        vocab_size=320,  # > the tokenizer's 277-280 ids: padded rows, as in real checkpoints
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=backend.token_to_id(flavour["bos"]) if flavour["bos"] else None,
        eos_token_id=backend.token_to_id(flavour["eos"]),
    )
    if arch == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 64  # != hidden_size / num_attention_heads
    kwargs.update(overrides)
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG
        model = model_cls(config_cls(**kwargs)).eval()
    _randomize(model, seed)
    model.save_pretrained(path, max_shard_size="200KB" if shards else "50GB")

    backend.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": flavour["bos"],
        "eos_token": flavour["eos"],
        "chat_template": flavour["chat_template"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return path


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [out, in]: unit-variance inputs give outputs of std 1.5 (lm_head: logits of std ~1.5)
                p.copy_(1.5 * noise / p.shape[1] ** 0.5)


def _tokenizer(flavour: dict) -> _Backend:
    symbols = _byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    for a, b in _MERGES:
        vocab[a + b] = len(vocab)
    backend = _Backend(models.BPE(vocab=vocab, merges=_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in flavour["specials"]])
    if flavour["bos"]:  # Llama-3 style: the post-processor prepends BOS
        bos = flavour["bos"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    return backend


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins byte-level BPE uses for bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]
