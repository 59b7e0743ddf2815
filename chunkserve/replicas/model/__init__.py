"""Llama-family models: HF checkpoints or seeded random presets, tensor-parallel layers, tokenizers.

config      ModelConfig, the shape the engine needs, from a Hugging Face config.json
llama       the decoder (Llama, Qwen2, Qwen3); layers: its tensor-parallel layers
loader      load_model / load_tokenizer: an HF directory, a GGUF file or a preset (presets/)
gguf        llama.cpp's single-file checkpoints; gguf_cache: their dequantized weights on disk
tokenizer   HF tokenizer.json or the presets' byte-level one, chat templates, detokenizing
"""

from chunkserve.replicas.model.config import ModelConfig
from chunkserve.replicas.model.loader import load_model, load_tokenizer
from chunkserve.replicas.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = ["IncrementalDetokenizer", "ModelConfig", "Tokenizer", "load_model", "load_tokenizer"]
