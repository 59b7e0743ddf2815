"""Small GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter writes
them: from a Hugging Face Llama checkpoint (tests/hf_checkpoints.py), Q/K rows permuted, names
llama.cpp's, 2-D weights quantized, norms F32, the tokenizer and chat template as metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from tests.hf_checkpoints import make_hf_checkpoint

Q = gguf.GGMLQuantizationType

_NAMES = {  # HF name (layer i) -> llama.cpp's
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotate-half pairs interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(
    path: str | Path,
    *,
    qtype: Q = Q.F32,
    embed_qtype: Q | None = None,
    pre: str = "llama-bpe",
    arch: str = "llama",
    seed: int = 0,
    raw: dict[str, tuple[np.ndarray, Q]] | None = None,
    **overrides,
) -> tuple[Path, Path]:
    """-> (the GGUF file, the HF checkpoint it was made from). `overrides` go to the HF config;
    `raw` replaces tensors (by llama.cpp name) with given bytes of a given type."""
    path = Path(path)
    hf_dir = make_hf_checkpoint("LlamaForCausalLM", path.parent / f"{path.stem}-hf", seed=seed, **overrides)
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("test llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])

    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [t for t, _ in vocab] + [added[i] for i in sorted(added)]
    assert all(tokens.index(added[i]) == i for i in added)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    if tok_cfg["bos_token"]:
        w.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
        w.add_add_bos_token(True)  # the Llama-3 flavour's post-processor prepends it
    w.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))
    w.add_chat_template(tok_cfg["chat_template"])

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for name, t in load_file(hf_dir / "model.safetensors").items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers.") :].split(".", 1)
            gname = f"blk.{i}.{_NAMES[rest]}"
        else:
            gname = _NAMES[name]
        if gname.endswith("attn_q.weight"):
            a = llama_cpp_permute(a, heads)
        elif gname.endswith("attn_k.weight"):
            a = llama_cpp_permute(a, kv_heads)
        if raw and gname in raw:
            data, q = raw[gname]
            w.add_tensor(gname, data, raw_shape=None, raw_dtype=q)
            continue
        q = (embed_qtype or qtype) if gname == "token_embd.weight" else qtype if a.ndim == 2 else Q.F32
        if q == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(a))
        elif q == Q.F16:
            w.add_tensor(gname, a.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf_dir
