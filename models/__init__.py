"""Conduit models: pure torch.nn decoder-only Transformer, Mamba, Mamba-2, hybrid and encoder-decoder.

Floors, bottom up (docs/design.md): `models.config` (data), `models.layers` (the shared parts),
`models.families.<name>` (one package per family), the family table `models.families`, and on top the
modules that ask the table: `models.presets` (build_model, PRESETS), `models.export` (save_hf,
load_hf), `models.accounting` and `models.generate`. Importing this package imports the table, which
registers the family-dependent config rules with `models.config` (so every ``ModelConfig`` runs them).

Imports torch and the standard library only (safetensors in models.export), and torch only when a model
is built (`build_model`): the config, the presets, the family table and the accounting load without it,
so that a run config is read and checked (``jobs.submit --dry-run``) in a fraction of a second. The names
offered here that are torch modules (Transformer, KVCache, ModelOutput) are imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from models import families  # noqa: F401  (the table: registers the family rules every ModelConfig runs)
from models.config import ModelConfig
from models.presets import PRESETS, build_model, get_preset

if TYPE_CHECKING:
    from models.families.decoder.model import Transformer
    from models.layers.attention import KVCache
    from models.layers.base import ModelOutput

# The names offered here whose modules import torch: imported when first asked for.
_LAZY = {"Transformer": "models.families.decoder.model", "KVCache": "models.layers.attention",
         "ModelOutput": "models.layers.base"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once imported, found as a plain attribute
    return value


__all__ = ["KVCache", "ModelConfig", "ModelOutput", "PRESETS", "Transformer", "build_model", "get_preset"]
