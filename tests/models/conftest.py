"""Fixtures for the models tests: tiny configs that run in milliseconds on one CPU thread."""

from __future__ import annotations

import pytest
import torch

from models import ModelConfig, Transformer


def tiny_config(**overrides) -> ModelConfig:
    """d 32, 2 layers, 4 heads, vocab 64, seq 32; any field overridable."""
    base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=32, ffn_multiple_of=16)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_model(seed: int = 0, **overrides) -> Transformer:
    """An initialised tiny model in eval mode, with weights from `seed`."""
    cfg = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights()
    return model.eval()


def random_model(make_cfg, seed: int = 0, **kw) -> Transformer:
    """Random weights everywhere, norms included, so a mis-mapped tensor cannot hide (export tests)."""
    torch.manual_seed(seed)
    model = Transformer(make_cfg(**kw))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


@pytest.fixture
def make_cfg():
    return tiny_config


@pytest.fixture
def make_model():
    return tiny_model
