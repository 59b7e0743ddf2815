"""load_model: a local Hugging Face directory, a GGUF file (or a directory holding one) or a preset
name -> (model, config, tokenizer).

Checkpoint tensors, a GGUF's dequantized tensors and a preset's random tensors all arrive as (HF
name, full tensor) pairs, one at a time, and go through the same mapping onto (possibly fused,
possibly sharded) parameters. A preset either draws random weights (`init_std`, byte tokenizer) or
names a GGUF file inside an installed Python package (`gguf`); a GGUF's weights are cached on disk
after the first load (chunkserve/replicas/model/gguf_cache.py).
"""

from __future__ import annotations

import importlib.util
import math
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from chunkserve.replicas.model import gguf_cache
from chunkserve.replicas.model.config import ModelConfig, read_json
from chunkserve.replicas.model.gguf import GGUFCheckpoint, find_gguf
from chunkserve.replicas.model.layers import TP
from chunkserve.replicas.model.llama import LlamaForCausalLM, checkpoint_shapes
from chunkserve.replicas.model.tokenizer import BYTE_SPECIALS, Tokenizer

PRESETS_DIR = Path(__file__).resolve().parent / "presets"  # <name>.json each, shipped in the package
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")  # buffers some checkpoints carry


def load_model(
    model: str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    seed: int = 0,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None]:
    """`seed` only matters for presets, whose weights are random."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} must be in [0, tp_size={tp_size})")
    gguf_file = _gguf_file(model)
    if gguf_file is not None:
        cached = gguf_cache.lookup(gguf_file, dtype)
        if cached is None:
            return _load_gguf(gguf_file, dtype, device, tp_rank, tp_size)
        model = str(cached)  # an HF directory
    cfg, path, std = _resolve(model)
    net = _build(cfg, dtype, device, tp_rank, tp_size)
    if path is not None:
        _load_weights(net, _checkpoint_tensors(path))
    else:
        _load_weights(net, _random_tensors(cfg, std, seed, dtype, torch.device(device)))
    return net, cfg, load_tokenizer(model)


def load_tokenizer(model: str) -> Tokenizer | None:
    """The tokenizer alone (no weights), e.g. for an ingress; None for a directory without one."""
    gguf_file = _gguf_file(model)
    if gguf_file is not None:
        cached = gguf_cache.lookup(gguf_file)
        return Tokenizer.from_pretrained(cached) if cached is not None else GGUFCheckpoint(gguf_file).tokenizer()
    path = Path(model)
    if path.is_dir():
        return Tokenizer.from_pretrained(path) if (path / "tokenizer.json").is_file() else None
    _resolve(model)  # a preset: validates the name and its config
    return Tokenizer.byte()


def _load_gguf(
    gguf_file: Path, dtype: torch.dtype, device: str | torch.device, tp_rank: int, tp_size: int
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer]:
    ckpt = GGUFCheckpoint(gguf_file)
    cfg = ModelConfig.from_hf(ckpt.hf_config)
    tokenizer = ckpt.tokenizer()
    net = _build(cfg, dtype, device, tp_rank, tp_size)
    cache = gguf_cache.Writer(gguf_file, dtype, ckpt.hf_config, tokenizer)
    try:
        _load_weights(net, cache.tee(ckpt.tensors()))
    except BaseException:
        cache.discard()
        raise
    cache.commit()
    return net, cfg, tokenizer


def _gguf_file(model: str) -> Path | None:
    """The GGUF file `model` names (a .gguf file, a directory holding one, a preset naming one in an
    installed package), or None."""
    found = find_gguf(Path(model))
    if found is not None or Path(model).exists():
        return found
    preset = PRESETS_DIR / f"{model}.json"
    if not preset.is_file():
        return None
    spec = read_json(preset).get("gguf")
    if spec is None:
        return None
    if not isinstance(spec, dict) or not all(isinstance(spec.get(k), str) for k in ("package", "file", "install")):
        raise ValueError(f"preset {model!r}: 'gguf' must be an object with string fields package, file, install")
    try:  # the package's directory, without importing it (it may import what it needs for itself)
        found = importlib.util.find_spec(spec["package"])
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ValueError(f"preset {model!r} needs the Python package {spec['package']!r}: {spec['install']}")
    path = Path(next(iter(found.submodule_search_locations))) / spec["file"]
    if not path.is_file():
        raise ValueError(
            f"preset {model!r}: {path} is missing from the installed {spec['package']!r} "
            f"package (reinstall it: {spec['install']})"
        )
    return path


def _resolve(model: str) -> tuple[ModelConfig, Path | None, float]:
    """(config, checkpoint directory or None for a random preset, a preset's init std)."""
    path = Path(model)
    if path.is_dir():
        hf = read_json(path / "config.json")
        return ModelConfig.from_hf(_with_generation_eos(hf, path)), path, 0.0
    preset = PRESETS_DIR / f"{model}.json"
    if not preset.is_file():
        names = sorted(p.stem for p in PRESETS_DIR.glob("*.json"))
        raise ValueError(
            f"{model!r} is neither a model directory nor a preset (nor a .gguf file; presets: {', '.join(names)})"
        )
    hf = read_json(preset)
    cfg = ModelConfig.from_hf(hf)
    if hf.get("tokenizer") != "byte":
        raise ValueError(f"preset {model!r}: 'tokenizer' must be \"byte\", got {hf.get('tokenizer')!r}")
    if cfg.vocab_size < 256 + len(BYTE_SPECIALS):
        raise ValueError(f"preset {model!r}: vocab_size={cfg.vocab_size} is smaller than the byte tokenizer's")
    std = hf.get("init_std")
    if not isinstance(std, (int, float)) or isinstance(std, bool) or std <= 0:
        raise ValueError(f"preset {model!r}: 'init_std' must be a positive number, got {std!r}")
    return cfg, None, float(std)


def _build(
    cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, tp_rank: int, tp_size: int
) -> LlamaForCausalLM:
    # Parameters are allocated empty, directly in `dtype` on `device` (no fp32 CPU copy of the model).
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg, TP(tp_rank, tp_size))
    finally:
        torch.set_default_dtype(previous)


def _load_weights(net: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    cfg = net.config
    expected = checkpoint_shapes(cfg)
    params = dict(net.named_parameters())
    loaded: set[str] = set()
    for name, full in tensors:
        if _IGNORED.search(name) or (cfg.tie_word_embeddings and name == "lm_head.weight"):
            continue
        if name not in expected:
            raise ValueError(f"unexpected tensor {name!r} in the checkpoint of a {cfg.architecture} with this config")
        if tuple(full.shape) != expected[name]:
            raise ValueError(f"tensor {name!r} has shape {tuple(full.shape)}, expected {expected[name]}")
        target, shard = name, ()
        for hf_name, (ours, shard_id) in net.packed_modules_mapping.items():
            if f".{hf_name}." in name:
                target, shard = name.replace(f".{hf_name}.", f".{ours}."), (shard_id,)
                break
        param = params[target]
        param.weight_loader(param, full, *shard)
        loaded.add(name)
    missing = sorted(expected.keys() - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} of {len(expected)} weights: {shown}")


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in model.safetensors or in the shards its index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} holds no weights (model.safetensors or model.safetensors.index.json)")
    for file in files:
        try:
            with safe_open(path / file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, FileNotFoundError) as e:
            raise ValueError(f"cannot read weights file {path / file}: {e}") from e


def _with_generation_eos(hf: dict, path: Path) -> dict:
    """Add generation_config.json's eos ids (what HF generate stops on) to config.json's."""
    gen_path = path / "generation_config.json"
    if not gen_path.is_file():
        return hf
    gen_eos = read_json(gen_path).get("eos_token_id")
    ids = []
    for eos in (hf.get("eos_token_id"), gen_eos):
        for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if i not in ids:
                ids.append(i)
    return {**hf, "eos_token_id": ids}


def _random_tensors(
    cfg: ModelConfig, std: float, seed: int, dtype: torch.dtype, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """A preset's weights: norms 1, biases 0, everything else uniform with standard deviation `std`.

    Each value is a hash of (seed, tensor name, element index), computed on `device`: the same
    weights on every device and every TP rank, with no whole-model pass through the CPU.
    """
    for name, shape in checkpoint_shapes(cfg).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, dtype=dtype, device=device)
        else:
            key = zlib.crc32(f"{seed}:{name}".encode())
            yield name, _hash_uniform(shape, std, key, dtype, device)


_M32 = 0xFFFFFFFF


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    # In place on int64 holding uint32 values: xorshift-multiply rounds, a bijection on 32 bits.
    # The multipliers are < 2^31, so products stay below 2^63 and never overflow int64.
    x ^= x >> 16
    x *= 0x7FEB352D
    x &= _M32
    x ^= x >> 15
    x *= 0x2C1B3C6D
    x &= _M32
    x ^= x >> 16
    return x


def _hash_uniform(
    shape: tuple[int, ...], std: float, key: int, dtype: torch.dtype, device: torch.device, chunk: int = 1 << 26
) -> torch.Tensor:
    n = math.prod(shape)
    if n > 1 << 32:
        raise ValueError(f"a {shape} tensor is too large for the preset initialiser (2^32 elements at most)")
    out = torch.empty(n, dtype=dtype, device=device)
    step = std * math.sqrt(3.0) / (1 << 23)  # U(-a, a) has std a / sqrt(3)
    for start in range(0, n, chunk):  # bounded int64 temporaries for the 0.5G-element embedding
        x = torch.arange(start, min(start + chunk, n), dtype=torch.int64, device=device)
        x ^= key
        x = _mix32_(_mix32_(x) ^ key)  # two keyed rounds: tensors with different keys are unrelated
        # 23 random bits -> odd integers in (-2^23, 2^23): exact in fp32, and a single rounding
        # multiply scales them, so the weights are bit-identical on CPU and GPU.
        x >>= 9
        x <<= 1
        x += 1 - (1 << 23)
        out[start : start + x.numel()] = (x.to(torch.float32) * step).to(dtype)
    return out.view(shape)
