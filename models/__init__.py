"""Conduit models: pure torch.nn decoder-only Transformer, Mamba and encoder-decoder, and their parts.

Imports torch and the standard library only (safetensors in models.export).
"""

from models.attention import KVCache
from models.config import ModelConfig
from models.presets import PRESETS, build_model, get_preset
from models.transformer import ModelOutput, Transformer

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "PRESETS", "Transformer", "build_model", "get_preset"]
