"""Llama-family models: HF checkpoints or seeded random presets, tensor-parallel layers, tokenizers."""

from chunkserve.replicas.model.config import ModelConfig
from chunkserve.replicas.model.loader import load_model, load_tokenizer
from chunkserve.replicas.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "ModelConfig", "Tokenizer", "load_model", "load_tokenizer"]
