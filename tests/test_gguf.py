"""GGUF loading on small files written like llama.cpp's converter writes them (tests/gguf_files.py):
weights against the HF checkpoint they came from and against transformers' own GGUF loader,
every quantization gguf dequantizes, tied embeddings, the tokenizer, the disk cache, bad files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chunkserve.replicas.model import gguf_cache, load_model, load_tokenizer
from chunkserve.replicas.model.gguf import GGUFCheckpoint
from tests.gguf_files import Q, llama_cpp_permute, make_gguf
from tests.test_model import PROMPT, greedy, our_logits

TEXTS = [
    PROMPT,
    "  two  spaces\nand a new line\t tab",
    "numbers 12345 and 7, x=3.14;",
    "the <|eot_id|> inside",
    "café naïve — ünïcödé 日本語",
    "",
]


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", "none")  # each test opts in to a cache of its own


def _load(path, dtype=torch.float32):
    return load_model(str(path), dtype=dtype, device="cpu")


def _hf_gguf(path):
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def test_f32_gguf_loads_the_hf_checkpoints_weights_exactly(tmp_path):
    """F32 is lossless: the weights equal the checkpoint's bit for bit, so the Q/K rows are back
    in HF's order and every name lands on its parameter; the config is the checkpoint's too."""
    path, hf_dir = make_gguf(tmp_path / "m.gguf")
    ours, cfg, tok = _load(path)
    ref, ref_cfg, ref_tok = _load(hf_dir)
    want = ref.state_dict()
    got = ours.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert cfg == ref_cfg
    assert [tok.encode(t) for t in TEXTS] == [ref_tok.encode(t) for t in TEXTS]


def test_q_k_rows_are_unpermuted(tmp_path):
    """Loading the permuted rows as they are gives other logits: the un-permutation is needed."""
    path, hf_dir = make_gguf(tmp_path / "m.gguf")
    ours = _load(path)[0]
    ids = _load(hf_dir)[2].encode(PROMPT)
    good = our_logits(ours, ids)
    q = ours.model.layers[0].self_attn.qkv_proj.weight
    rows = ours.config.num_heads * ours.config.head_dim
    with torch.no_grad():
        q[:rows] = torch.from_numpy(llama_cpp_permute(q[:rows].numpy(), ours.config.num_heads))
    assert (our_logits(ours, ids) - good).abs().max() > 1e-2


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_quantized_gguf_matches_transformers(qtype, tmp_path):
    path, hf_dir = make_gguf(tmp_path / "m.gguf", qtype=qtype, embed_qtype=Q.Q8_0)
    ours, _, tok = _load(path)
    hf, hf_tok = _hf_gguf(path)
    ids = tok.encode(PROMPT)
    assert ids == hf_tok(PROMPT).input_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, pad_token_id=0)[0, len(ids) :]
    torch.testing.assert_close(our_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)
    assert greedy(ours, ids, 16) == out.tolist()
    # and the quantization is what was read: the weights are near the unquantized ones, not equal
    exact = _load(hf_dir)[0].model.layers[1].mlp.down_proj.weight
    w = ours.model.layers[1].mlp.down_proj.weight
    err = ((w - exact).norm() / exact.norm()).item()
    assert 0 < err < {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(qtype, 0.2)


def test_bfloat16_engine_dtype(tmp_path):
    path, _ = make_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    fp32 = _load(path)[0]
    bf16 = _load(path, torch.bfloat16)[0]
    w32, w16 = fp32.model.layers[0].mlp.gate_up_proj.weight, bf16.model.layers[0].mlp.gate_up_proj.weight
    assert w16.dtype == torch.bfloat16 and torch.equal(w16, w32.to(torch.bfloat16))


def test_tied_embeddings(tmp_path):
    path, hf_dir = make_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0, tie_word_embeddings=True)
    ours, cfg, tok = _load(path)
    assert cfg.tie_word_embeddings and ours.lm_head.weight is ours.model.embed_tokens.weight
    hf, _ = _hf_gguf(path)
    ids = tok.encode(PROMPT)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(our_logits(ours, ids), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2", "smollm"])
def test_tokenizer_matches_transformers(pre, tmp_path):
    path, _ = make_gguf(tmp_path / "m.gguf", pre=pre)
    tok = load_tokenizer(str(path))
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in TEXTS:
        ids = tok.encode(text)
        if pre == "smollm":  # transformers splits as GPT-2 does; llama.cpp and SmolLM's tokenizer.json
            # split every digit apart first
            pieces = [tok.decode([i]) for i in ids]
            assert not any(len(p) > 1 and any(c.isdigit() for c in p) for p in pieces), pieces
            if any(c.isdigit() for c in text):
                continue
        assert ids == hf_tok(text).input_ids, (pre, text)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.bos_token_id == hf_tok.bos_token_id and tok.eos_token_ids == (hf_tok.eos_token_id,)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == hf_tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_directory_holding_one_gguf(tmp_path):
    path, _ = make_gguf(tmp_path / "d" / "m.gguf", qtype=Q.Q8_0)
    by_file, by_dir = _load(path)[0].state_dict(), _load(path.parent)[0].state_dict()
    assert all(torch.equal(by_file[k], by_dir[k]) for k in by_file)
    (path.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(ValueError, match="several GGUF files.*m.gguf.*other.gguf"):
        _load(path.parent)


def test_cache_holds_the_same_weights_and_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path, _ = make_gguf(tmp_path / "m.gguf", qtype=Q.Q4_1)
    assert gguf_cache.lookup(path, torch.float32) is None and load_tokenizer(str(path)) is not None
    first, cfg, tok = _load(path)  # dequantizes and writes the entry
    entry = gguf_cache.lookup(path, torch.float32)
    assert entry is not None and (entry / "model.safetensors").is_file()
    assert gguf_cache.lookup(path, torch.bfloat16) is None
    calls = []
    monkeypatch.setattr(GGUFCheckpoint, "tensors", lambda self: calls.append(1) or iter(()))
    second, cfg2, tok2 = _load(path)  # from the entry: the GGUF's tensors are not read
    assert not calls and cfg2 == cfg
    a, b = first.state_dict(), second.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    cached_tok = load_tokenizer(str(path))
    for t in (tok2, cached_tok):
        assert [t.encode(x) for x in TEXTS] == [tok.encode(x) for x in TEXTS]
        assert t.eos_token_ids == tok.eos_token_ids and t.bos_token_id == tok.bos_token_id
        assert t.chat_template == tok.chat_template
    # another file (or the same one changed) is another entry
    path.touch()
    assert gguf_cache.lookup(path, torch.float32) is None


def test_cache_shards_and_failed_loads(tmp_path, monkeypatch):
    monkeypatch.setenv("CHUNKSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache, "SHARD_BYTES", 200_000)
    path, _ = make_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    first = _load(path, torch.bfloat16)[0]
    entry = gguf_cache.lookup(path, torch.bfloat16)
    assert len(list(entry.glob("model-*.safetensors"))) > 2 and (entry / "model.safetensors.index.json").is_file()
    second = _load(path, torch.bfloat16)[0]
    a, b = first.state_dict(), second.state_dict()
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    # a load that fails half way leaves no entry and no temporary files
    other, _ = make_gguf(tmp_path / "o.gguf", qtype=Q.Q8_0, seed=1)
    real = GGUFCheckpoint.tensors
    monkeypatch.setattr(GGUFCheckpoint, "tensors", lambda self: (t for i, t in enumerate(real(self)) if i < 5))
    with pytest.raises(ValueError, match="missing"):
        _load(other)
    assert gguf_cache.lookup(other, torch.float32) is None
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [entry.name]


# --- bad files ----------------------------------------------------------------------------------


def test_other_architecture_raises(tmp_path):
    path, _ = make_gguf(tmp_path / "m.gguf", arch="falcon")
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported; supported: llama"):
        _load(path)


@pytest.mark.parametrize("keep", [0.999, 0.5, 0.02, 100])
def test_truncated_file_raises(keep, tmp_path):
    path, _ = make_gguf(tmp_path / "m.gguf", qtype=Q.Q8_0)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    with pytest.raises(ValueError, match="truncated"):
        _load(cut)
    with pytest.raises(ValueError, match="truncated"):
        load_tokenizer(str(cut))


def test_quantization_gguf_cannot_dequantize_raises(tmp_path):
    # Q8_1 (llama.cpp's activation type: 32 int8 and two fp16 a block) has no dequantizer in gguf
    block, size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((256, 128 // block * size), dtype=np.uint8)
    path, _ = make_gguf(tmp_path / "m.gguf", raw={"blk.1.ffn_up.weight": (raw, Q.Q8_1)})
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' is Q8_1, which gguf .* cannot dequantize"):
        _load(path)


def test_unsupported_pre_tokenizer_raises(tmp_path):
    path, _ = make_gguf(tmp_path / "m.gguf", pre="no-such-pre")
    with pytest.raises(ValueError, match="pre-tokenizer 'no-such-pre'"):
        load_tokenizer(str(path))


def test_not_a_gguf_raises(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(ValueError, match="cannot read GGUF file"):
        _load(bad)
