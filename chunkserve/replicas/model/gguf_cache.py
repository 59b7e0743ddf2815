"""A GGUF's dequantized weights kept on disk after the first load, as a Hugging Face directory.

Reading a GGUF parses its metadata in Python and dequantizes every tensor with numpy (SmolLM2-135M
Q4_1 on 2 CPU cores: 1.9 s + 0.9 s); the same weights from safetensors, and its tokenizer from
tokenizer.json, load in a fraction of that. An entry is a complete HF directory (config.json,
tokenizer.json, tokenizer_config.json, model.safetensors or shards), one per GGUF file and dtype,
so the loader reads it as any other checkpoint. It is written under a temporary name and renamed
into place, so replicas starting together never see half an entry.

The root is $CHUNKSERVE_CACHE_DIR, else $XDG_CACHE_HOME/chunkserve, else ~/.cache/chunkserve;
CHUNKSERVE_CACHE_DIR=none turns the cache off.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

from chunkserve.replicas.model.tokenizer import Tokenizer

VERSION = 1  # bump when what an entry holds for a given GGUF changes
SHARD_BYTES = 1 << 30


def cache_root() -> Path | None:
    root = os.environ.get("CHUNKSERVE_CACHE_DIR")
    if root is not None:
        return None if root.lower() in ("", "none", "off") else Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chunkserve"


def _stem(gguf_file: Path) -> str:
    """Names the entries of one GGUF file as it is now: its path, size and modification time."""
    st = gguf_file.stat()
    key = f"{VERSION}:{gguf_file.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return f"{gguf_file.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def lookup(gguf_file: Path, dtype: torch.dtype | None = None) -> Path | None:
    """The entry of `gguf_file` in `dtype` (None: any dtype, for its tokenizer), if one exists."""
    root = cache_root()
    if root is None:
        return None
    stem = _stem(gguf_file)
    if dtype is not None:
        entry = root / f"{stem}-{_dtype_name(dtype)}"
        return entry if entry.is_dir() else None
    return next((p for p in sorted(root.glob(f"{stem}-*")) if p.is_dir() and not p.name.startswith(".")), None)


class Writer:
    """Collects the weights as the loader consumes them (`tee`), then `commit`s the entry; or
    `discard`s it when the load failed. A disabled or unwritable cache makes both no-ops."""

    def __init__(self, gguf_file: Path, dtype: torch.dtype, hf_config: dict, tokenizer: Tokenizer):
        self.dtype = dtype
        root = cache_root()
        self.entry = None if root is None else root / f"{_stem(gguf_file)}-{_dtype_name(dtype)}"
        self.tmp: Path | None = None
        self.shards: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        if self.entry is None or self.entry.exists():
            return
        try:
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.entry.name}.", dir=self.entry.parent))
            (self.tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
            tokenizer.backend.save(str(self.tmp / "tokenizer.json"))
            (self.tmp / "tokenizer_config.json").write_text(
                json.dumps(
                    {
                        "bos_token": tokenizer.bos_token,
                        "eos_token": tokenizer.eos_token,
                        "chat_template": tokenizer.chat_template,
                    },
                    indent=2,
                )
            )
        except OSError:
            self.discard()

    def tee(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if self.tmp is not None:
                t = tensor.to(self.dtype).contiguous()
                self.pending[name] = t
                self.pending_bytes += t.numel() * t.element_size()
                if self.pending_bytes >= SHARD_BYTES:
                    self._flush()
            yield name, tensor

    def _flush(self) -> None:
        if not self.pending or self.tmp is None:
            return
        shard = f"model-{len(self.shards) + 1:05d}.safetensors"
        try:
            save_file(self.pending, str(self.tmp / shard))
        except OSError:
            self.discard()
            return
        self.shards.append(shard)
        self.weight_map.update(dict.fromkeys(self.pending, shard))
        self.pending, self.pending_bytes = {}, 0

    def commit(self) -> None:
        self._flush()
        if self.tmp is None:
            return
        try:
            if len(self.shards) == 1:
                (self.tmp / self.shards[0]).rename(self.tmp / "model.safetensors")
            else:
                (self.tmp / "model.safetensors.index.json").write_text(json.dumps({"weight_map": self.weight_map}))
            self.tmp.rename(self.entry)  # atomic; fails if another process committed first
        except OSError:
            pass
        self.discard()

    def discard(self) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
        self.pending = {}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
