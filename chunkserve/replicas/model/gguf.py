"""GGUF checkpoints (llama.cpp's single-file format) of the Llama architecture.

A GGUF holds the model's shape, its tokenizer and chat template as metadata under llama.cpp's key
names, and its tensors under llama.cpp's names, many of them quantized. `GGUFCheckpoint` turns one
into what the rest of the loader takes from a Hugging Face directory: an HF config.json dict, (HF
name, tensor) pairs (dequantized by the `gguf` package to fp32, which the parameters' loaders
cast to the engine's dtype) and a `tokenizers` tokenizer.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from chunkserve.replicas.model.tokenizer import Tokenizer, _byte_to_unicode

ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # general.architecture -> ours

# llama.cpp name -> HF name; {i} is the layer
_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
    "blk.{i}.ffn_gate.bias": "model.layers.{i}.mlp.gate_proj.bias",
    "blk.{i}.ffn_up.bias": "model.layers.{i}.mlp.up_proj.bias",
    "blk.{i}.ffn_down.bias": "model.layers.{i}.mlp.down_proj.bias",
}
_LAYER = re.compile(r"^blk\.(\d+)\.")

# tokenizer.ggml.pre -> the pre-tokenizer its merges were learned with, as llama.cpp splits text
# (llama-vocab.cpp's regex groups) and the models' own tokenizer.json files write it.
_GPT2 = ("gpt-2", "gpt2", "default", "mpt", "olmo", "jais")
_DIGITS = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")  # + GPT-2's regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "pixtral", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
PRE_TOKENIZERS = (*_GPT2, *_DIGITS, *_SPLITS)
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def find_gguf(path: Path) -> Path | None:
    """The GGUF file `path` names: itself if it is a .gguf file, or the one .gguf in a directory
    that is not a Hugging Face checkpoint (no config.json); None if it names none."""
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)}): name one")
    return files[0] if files else None


class GGUFCheckpoint:
    """One GGUF file, its metadata parsed and checked; tensors are read on demand (memory-mapped)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(self.path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct or numpy errors
            raise ValueError(f"cannot read GGUF file {self.path} (truncated or not a GGUF file?): {e}") from e
        size = self.path.stat().st_size
        for t in self._reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(
                    f"GGUF file {self.path} is truncated: tensor {t.name!r} ends at byte "
                    f"{t.data_offset + t.n_bytes}, the file has {size}"
                )
        arch = self.metadata("general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"GGUF file {self.path}: architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
            )
        self.arch = arch
        self._check_dequantizable()
        self.hf_config = self._hf_config()

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    # --- the model --------------------------------------------------------------------------------

    def _check_dequantizable(self) -> None:
        """Fail at load, before any weight is read, on a type the installed gguf cannot dequantize."""
        for qtype in sorted({t.tensor_type for t in self._reader.tensors}):
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                continue
            probe = np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)  # one block's bytes
            try:
                gguf.quants.dequantize(probe, qtype)
            except NotImplementedError:
                names = [t.name for t in self._reader.tensors if t.tensor_type == qtype]
                raise ValueError(
                    f"GGUF file {self.path}: tensor {names[0]!r} is {qtype.name}, which gguf "
                    f"{_gguf_version()} cannot dequantize ({len(names)} tensors of that type)"
                ) from None

    def _hf_config(self) -> dict:
        a = self.arch
        if self.metadata(f"{a}.expert_count", 0):
            raise ValueError(f"GGUF file {self.path}: mixture-of-experts {a} models are not supported")
        names = {t.name for t in self._reader.tensors}
        if "rope_freqs.weight" in names:
            raise ValueError(
                f"GGUF file {self.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1's "
                "rope scaling) are not supported"
            )
        hidden = self._int(f"{a}.embedding_length")
        heads = self._int(f"{a}.attention.head_count")
        kv_heads = self._int(f"{a}.attention.head_count_kv", heads)
        head_dim = self._int(f"{a}.attention.key_length", hidden // heads)
        if self._int(f"{a}.attention.value_length", head_dim) != head_dim:
            raise ValueError(f"GGUF file {self.path}: key and value head sizes differ")
        if self._int(f"{a}.rope.dimension_count", head_dim) != head_dim:
            raise ValueError(
                f"GGUF file {self.path}: partial rotary embeddings ({a}.rope.dimension_count "
                f"{self.metadata(f'{a}.rope.dimension_count')} of head size {head_dim}) are not supported"
            )
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._int(f"{a}.vocab_size", len(tokens.data) if tokens is not None else None)
        eos = [self.metadata(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return {
            "architectures": [ARCHITECTURES[a]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._int(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._int(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": self._int(f"{a}.context_length"),
            "rms_norm_eps": _decimal(self.metadata(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": _decimal(self.metadata(f"{a}.rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(),
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "mlp_bias": "blk.0.ffn_gate.bias" in names,
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
            "torch_dtype": "float32",  # what gguf dequantizes to
        }

    def _rope_scaling(self) -> dict | None:
        kind = self.metadata(f"{self.arch}.rope.scaling.type", "none")
        if kind == "none":
            return None
        if kind != "linear":
            raise ValueError(f"GGUF file {self.path}: rope scaling {kind!r} is not supported (none, linear)")
        return {"rope_type": "linear", "factor": self.metadata(f"{self.arch}.rope.scaling.factor")}

    def _int(self, key: str, default: int | None = None) -> int:
        v = self.metadata(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"GGUF file {self.path}: metadata {key!r} must be a positive integer, got {v!r}")
        return v

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 tensor in HF layout) for every tensor, one at a time."""
        cfg = self.hf_config
        for t in self._reader.tensors:
            layer = _LAYER.match(t.name)
            key = t.name if layer is None else _LAYER.sub("blk.{i}.", t.name)
            if key not in _TENSOR_NAMES:
                raise ValueError(f"GGUF file {self.path}: unexpected tensor {t.name!r} for {self.arch}")
            name = _TENSOR_NAMES[key].format(i=layer.group(1) if layer else "")
            raw = gguf.quants.dequantize(t.data, t.tensor_type)  # [rows, cols] (numpy order), fp32
            w = torch.from_numpy(np.array(raw, dtype=np.float32))  # a copy: the reader's memory map is read-only
            if t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = _unpermute(w, cfg["num_key_value_heads"])
            yield name, w

    # --- the tokenizer ----------------------------------------------------------------------------

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the metadata describes: byte-level BPE (`tokenizer.ggml.model` gpt2), its
        control tokens special, BOS prepended only where `tokenizer.ggml.add_bos_token` says so."""
        kind = self.metadata("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF file {self.path}: tokenizer model {kind!r} is not supported (gpt2: byte-level BPE)")
        pre = self.metadata("tokenizer.ggml.pre", "default")
        if pre not in PRE_TOKENIZERS:
            raise ValueError(
                f"GGUF file {self.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; "
                f"supported: {', '.join(PRE_TOKENIZERS)}"
            )
        tokens: list[str] = self.metadata("tokenizer.ggml.tokens")
        types: list[int] = self.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ")) for m in self.metadata("tokenizer.ggml.merges") or []]
        if any(len(m) != 2 for m in merges):
            raise ValueError(f"GGUF file {self.path}: a merge in tokenizer.ggml.merges is not two tokens")
        # Byte-level vocabularies spell every byte as a printable character; a normal token spelled
        # otherwise (raw text) is respelled so the BPE finds it.
        alphabet = _byte_to_unicode()
        spelled = set(alphabet.values())
        vocab: dict[str, int] = {}
        for i, (tok, token_type) in enumerate(zip(tokens, types)):
            if token_type not in (_CONTROL, _USER_DEFINED) and not set(tok) <= spelled:
                tok = "".join(alphabet[b] for b in tok.encode())
            vocab.setdefault(tok, i)
        backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
        )

        def token(key: str) -> tuple[str | None, int | None]:
            i = self.metadata(key)
            if i is None:
                return None, None
            if not 0 <= i < len(tokens):
                raise ValueError(f"GGUF file {self.path}: {key} {i} is outside the vocabulary")
            return tokens[i], i

        (bos, bos_id), (eos, eos_id) = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        template, specials = ["$A:0"], []
        if self.metadata("tokenizer.ggml.add_bos_token", False) and bos is not None:
            template.insert(0, f"{bos}:0")
            specials.append((bos, bos_id))
        if self.metadata("tokenizer.ggml.add_eos_token", False) and eos is not None:
            template.append(f"{eos}:0")
            specials.append((eos, eos_id))
        if specials:
            backend.post_processor = processors.TemplateProcessing(single=" ".join(template), special_tokens=specials)
        return Tokenizer(
            backend,
            bos_token=bos,
            eos_tokens=() if eos is None else (eos,),
            chat_template=self.metadata("tokenizer.chat_template"),
        )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's regex
    if pre in _DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _decimal(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974738e-06)."""
    return float(str(np.float32(x)))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Per head, HF keeps the rotate-half pairs (j, j + D/2) apart
    and llama.cpp interleaves them (2j, 2j + 1): rows [heads, 2, D/2] were written as [heads, D/2, 2]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
