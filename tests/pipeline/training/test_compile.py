"""train.compile: the compiled regions (every block, and the output end: final norm, LM head and loss)
compute the eager model's loss and gradients, and compile once per run, not per step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters

from models import ModelConfig, build_model
from pipeline.config import TrainSection
from pipeline.training.layout import ParallelDims
from pipeline.training.parallelize import parallelize

pytestmark = pytest.mark.slow  # inductor compiles C++ (about 10 s per case on 2 cores)

DIMS = ParallelDims(1, 1, 2, 2, 12)
DENSE = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, num_kv_heads=2, max_seq_len=16)
MOE = DENSE.replace(num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.01, moe_z_loss_coef=0.01)


def first_step(model, x_BT, y_BT, **loss_options):
    out = model(x_BT, targets_BT=y_BT, **loss_options)
    grads = torch.autograd.grad(out.loss + out.aux_loss, [p for p in model.parameters()])
    return out, grads


@pytest.mark.parametrize("case", ["dense_smoothed_chunked_checkpointed", "moe_aux_and_z_loss"])
def test_compiled_equals_eager_at_the_first_step(case):
    cfg = DENSE if case.startswith("dense") else MOE
    options = {"label_smoothing": 0.1, "chunk_tokens": 5} if case.startswith("dense") else {}
    train = TrainSection(compile=True, activation_checkpointing="checkpointed" in case, zero_stage=0)
    torch.manual_seed(0)
    eager = build_model(cfg)
    compiled = copy.deepcopy(eager)
    parallelize(compiled, train, DIMS, rank=0)
    x = torch.randint(0, 97, (2, 13))
    y = x[:, 1:].clone()
    y[0, :3] = -100
    ref, ref_grads = first_step(eager, x[:, :-1], y, **options)
    counters.clear()
    got, grads = first_step(compiled, x[:, :-1], y, **options)
    assert counters["stats"]["unique_graphs"] >= 2  # the blocks' graph and the output end's
    # The output end (final norm, LM head and loss: the model's ``output`` method, which returns the loss)
    # is a compiled region of its own: this model's method wrapped by Dynamo, which holds compiled code
    # for it.
    assert compiled.output._torchdynamo_orig_callable.__self__ is compiled
    assert not hasattr(eager.output, "_torchdynamo_orig_callable")
    assert _debug_get_cache_entry_list(type(compiled).output.__code__)
    assert abs(got.loss.item() - ref.loss.item()) < 1e-6
    assert abs(got.aux_loss.item() - ref.aux_loss.item()) < 1e-6
    if cfg is MOE:
        assert ref.aux_loss.item() > 0  # the load-balancing and z-losses are really there
    for (name, _), g, r in zip(eager.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=name)
    # More steps with new data of the same shapes compile nothing more.
    graphs = counters["stats"]["unique_graphs"]
    for seed in (1, 2):
        x = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(seed))
        first_step(compiled, x[:, :-1], x[:, 1:].clone(), **options)
    assert counters["stats"]["unique_graphs"] == graphs
