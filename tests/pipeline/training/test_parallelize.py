"""parallelize: checkpointing and compile applied in that order, and the limits it relies on."""

from __future__ import annotations

import pytest
import torch

from models import build_model
from pipeline.config import TrainSection
from pipeline.training.layout import ParallelDims
from pipeline.training.parallelize import parallelize

DIMS = ParallelDims(world_size=1, ep_size=1, global_batch_size=4, micro_batch_size_per_rank=4, seq_len=16)


def test_blocks_are_checkpointed_before_they_are_compiled(monkeypatch):
    compiled_forwards, compiled_functions = [], []
    # Record, for every block compiled, the forward it is compiled with, and every function compiled
    # (no real compile: no time).
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, *a, **kw: compiled_forwards.append(self.__dict__.get("forward")))
    monkeypatch.setattr(torch, "compile", lambda fn, *a, **kw: compiled_functions.append(fn) or fn)
    model = build_model("debug_dense", n_layers=3)
    parallelize(model, TrainSection(activation_checkpointing=True, compile=True), DIMS, rank=0)
    assert len(compiled_forwards) == 3
    # The output end (final norm, LM head and loss) is a compiled region of its own.
    assert compiled_functions == [model.output] and model.output.__func__ is type(model).output
    # The checkpointing wrapper is each block's own forward when it is compiled (the class's
    # forward otherwise), so the compiled unit recomputes inside itself.
    assert all(f is not None and f is block.forward for f, block in zip(compiled_forwards, model.layers))


def test_plain_training_leaves_the_model_alone():
    model = build_model("debug_dense", n_layers=2)
    parallelize(model, TrainSection(), DIMS, rank=0)
    assert all("forward" not in block.__dict__ and block._compiled_call_impl is None for block in model.layers)
    assert "output" not in model.__dict__


def test_compile_with_zero3_is_refused_with_the_config_message():
    with pytest.raises(ValueError, match=r"train\.compile=true with train\.zero_stage=3 is not supported"):
        parallelize(build_model("debug_dense"), TrainSection(compile=True, zero_stage=3), DIMS, rank=0)
