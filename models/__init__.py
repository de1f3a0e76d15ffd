"""Conduit models: pure torch.nn decoder-only Transformer, Mamba, Mamba-2, hybrid and encoder-decoder.

Floors, bottom up (docs/architecture.md): `models.config` (data), `models.layers` (the shared parts),
`models.families.<name>` (one package per family), the family table `models.families`, and on top the
modules that ask the table: `models.presets` (build_model, PRESETS), `models.export` (save_hf,
load_hf), `models.accounting` and `models.generate`. Importing this package imports the table, which
registers the family-dependent config rules with `models.config` (so every ``ModelConfig`` runs them).

Imports torch and the standard library only (safetensors in models.export).
"""

from models.config import ModelConfig
from models.families.decoder.model import Transformer
from models.layers.attention import KVCache
from models.layers.base import ModelOutput
from models.presets import PRESETS, build_model, get_preset

__all__ = ["KVCache", "ModelConfig", "ModelOutput", "PRESETS", "Transformer", "build_model", "get_preset"]
