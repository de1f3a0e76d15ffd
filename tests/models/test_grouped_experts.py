"""Stacked experts: the layout against per-expert FFNs, old checkpoints, the grouped matmul against the
per-expert loop, the backward that grouped_mm lacks, and host syncs."""

from __future__ import annotations

import json

import pytest
import torch

from models.layers.ffn import FeedForward
from models.layers.grouped_experts import (GroupedMatmul, StackedExperts, _grouped_mm_runs, grouped_experts,
                                           looped_experts, resolve_impl, stack_expert_state, unstack_expert_state)
from models.layers.moe import MoEFeedForward


def _experts(kind: str, bias: bool, E: int = 4, D: int = 16, hidden: int = 24) -> StackedExperts:
    torch.manual_seed(0)
    experts = StackedExperts(E, D, hidden, kind, bias)
    for p in experts.parameters():
        p.data = torch.randn_like(p) * 0.3
    return experts


@pytest.mark.parametrize("kind,bias", [("swiglu", False), ("swiglu", True), ("gelu", True), ("relu", False)])
def test_expert_e_is_the_ffn_of_its_slices_and_the_layout_round_trips(kind, bias):
    """Unstacked, expert e's tensors are a FeedForward's (the Mixtral per-expert layout: w1 gate, w3 up, w2
    down), which computes what the stacked expert computes; stacking them back gives the same tensors,
    and a state dict in the per-expert layout (an older checkpoint) loads into the stacked module."""
    experts = _experts(kind, bias)
    per_expert = unstack_expert_state({f"ffn.experts.{k}": v for k, v in experts.state_dict().items()})
    names = {"w1", "w2", "w3"} if kind == "swiglu" else {"w1", "w2"}
    assert set(per_expert) == {f"ffn.experts.{e}.{w}.{t}" for e in range(4) for w in names
                               for t in (("weight", "bias") if bias else ("weight",))}
    x = torch.randn(5, 16)
    for e in range(4):
        ffn = FeedForward(16, 24, kind, bias)
        ffn.load_state_dict({k.removeprefix(f"ffn.experts.{e}."): v for k, v in per_expert.items()
                             if k.startswith(f"ffn.experts.{e}.")})
        torch.testing.assert_close(experts.expert(e, x), ffn(x), rtol=1e-6, atol=1e-6)  # one (2F, D) matmul vs two
    restacked = stack_expert_state(per_expert)
    assert restacked.keys() == {f"ffn.experts.{k}" for k in experts.state_dict()}
    for k, v in experts.state_dict().items():
        assert torch.equal(restacked[f"ffn.experts.{k}"], v)
    old = StackedExperts(4, 16, 24, kind, bias)
    old.load_state_dict({k.removeprefix("ffn.experts."): v for k, v in per_expert.items()})
    for k, v in experts.state_dict().items():
        assert torch.equal(old.state_dict()[k], v)


def test_a_per_expert_state_with_an_expert_missing_is_refused_by_name():
    per_expert = unstack_expert_state({f"layers.0.ffn.experts.{k}": v for k, v in _experts("swiglu", False).state_dict().items()})
    del per_expert["layers.0.ffn.experts.2.w3.weight"]
    with pytest.raises(ValueError, match=r"layers.0.ffn.experts: w3.weight is missing for some of experts \[0, 1, 3\]"):
        stack_expert_state(per_expert)


def test_an_old_moe_checkpoint_loads_into_the_stacked_model(make_cfg, tmp_path):
    """A model file in the per-expert layout (as Conduit wrote them before the experts were stacked)
    loads with the same logits."""
    from safetensors.torch import save_file

    from models import Transformer
    from models.export import CONFIG_METADATA_KEY, load_safetensors

    torch.manual_seed(0)
    model = Transformer(make_cfg(num_experts=4, moe_top_k=2)).eval()
    model.init_weights()
    old = unstack_expert_state(model.state_dict())
    assert "layers.1.ffn.experts.3.w2.weight" in old
    save_file({k: v.contiguous() for k, v in old.items()}, str(tmp_path / "old.safetensors"),
              metadata={CONFIG_METADATA_KEY: json.dumps(model.cfg.to_dict())})
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(load_safetensors(tmp_path / "old.safetensors").eval()(x).logits, model(x).logits,
                                   rtol=0, atol=0)


def test_grouped_matmul_forward_and_backward_with_a_stride0_gradient():
    torch.manual_seed(0)
    counts = [3, 0, 5, 4]  # an empty group: its weight gradient must be zeros
    x = torch.randn(12, 8, requires_grad=True)
    w = torch.randn(4, 8, 16, requires_grad=True)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = GroupedMatmul.apply(x, w, offsets)
    y.sum().backward()  # .sum() hands back an expanded (stride-0) gradient
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y_ref = torch.cat([xg @ w_ref[e] for e, xg in enumerate(x_ref.split(counts))])
    y_ref.sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    assert w.grad[1].abs().max().item() == 0.0


@pytest.mark.parametrize("kind,bias", [("swiglu", False), ("swiglu", True), ("gelu", True), ("relu", False)])
def test_grouped_experts_equal_the_loop_forward_and_gradients(kind, bias):
    counts = [5, 0, 9, 2]
    outs, grads = [], []
    for run in ("grouped", "loop"):
        experts = _experts(kind, bias)
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        dy = torch.randn(16, 16, generator=torch.Generator().manual_seed(2))
        if run == "grouped":
            y = grouped_experts(experts, x, torch.tensor(counts))
        else:
            y = looped_experts(experts, x, counts)
        y.backward(dy)
        outs.append(y)
        grads.append([x.grad, *(p.grad for p in experts.parameters())])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    assert len(grads[0]) == len(grads[1])
    for g_grouped, g_loop in zip(*grads):
        assert g_grouped is not None  # every expert joins the graph, also the one with no rows
        torch.testing.assert_close(g_grouped, g_loop, rtol=1e-5, atol=1e-6)


def test_moe_layer_grouped_equals_loop(make_cfg):
    results = {}
    for impl in ("grouped_mm", "loop"):
        torch.manual_seed(0)
        layer = MoEFeedForward(make_cfg(num_experts=4, moe_top_k=2, moe_expert_impl=impl))
        x = torch.randn(3, 6, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        y, aux, stats = layer(x)
        (y.square().sum() + aux).backward()
        results[impl] = (y, x.grad, [p.grad for p in layer.parameters()], stats["tokens_per_expert"])
    (y_g, dx_g, dp_g, tpe_g), (y_l, dx_l, dp_l, tpe_l) = results["grouped_mm"], results["loop"]
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_l, rtol=1e-5, atol=1e-6)
    for a, b in zip(dp_g, dp_l):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert tpe_g.tolist() == tpe_l.tolist()


def test_auto_falls_back_to_the_loop_where_grouped_mm_cannot_run():
    experts = _experts("swiglu", False)
    _grouped_mm_runs.cache_clear()
    with torch.no_grad():  # a first call from evaluation must not cache "unsupported"
        assert resolve_impl("auto", experts, torch.zeros(2, 16)) == "grouped_mm"
    assert resolve_impl("auto", experts, torch.zeros(2, 16)) == "grouped_mm"
    assert resolve_impl("auto", experts, torch.zeros(2, 16, dtype=torch.float64)) == "loop"  # no fp64 kernel
    narrow = _experts("swiglu", False, hidden=6)  # 6 floats = 24 bytes: not 16-byte aligned
    assert resolve_impl("auto", narrow, torch.zeros(2, 16)) == "loop"
    with pytest.raises(ValueError, match="moe_expert_impl='grouped_mm' cannot run"):
        resolve_impl("grouped_mm", experts, torch.zeros(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="moe_expert_impl must be one of"):
        resolve_impl("fast", experts, torch.zeros(2, 16))


def test_the_first_grouped_call_inside_a_checkpointed_block_recomputes_alike(make_cfg):
    """The support probe of grouped_mm runs on a process's first MoE call. Made inside an activation-checkpointed
    block (a fresh worker's first training step), it must save nothing there: the forward would hold three more
    saved tensors than the recomputation (the probe is cached by then) and backward would fail with
    torch's CheckpointError. It happened in CI on the first checkpointed MoE step of a test worker."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = MoEFeedForward(make_cfg(num_experts=4, moe_top_k=2, moe_expert_impl="auto"))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    _grouped_mm_runs.cache_clear()
    y, aux, _ = checkpoint(layer, x, use_reentrant=False)
    (y.square().sum() + aux).backward()
    assert _grouped_mm_runs(x.device.type, x.dtype)  # it took the grouped path
    grads = [p.grad.clone() for p in layer.parameters()], x.grad.clone()
    layer.zero_grad()
    x.grad = None
    y, aux, _ = layer(x)
    (y.square().sum() + aux).backward()
    torch.testing.assert_close(grads[1], x.grad, rtol=0, atol=0)
    for a, p in zip(grads[0], layer.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=0, atol=0)


def test_the_first_grouped_call_inside_a_compiled_block_probes_eagerly(make_cfg):
    """The probe's first call from a compiled block runs eagerly (Dynamo's fake grouped_mm takes bf16 alone: traced,
    an fp32 probe failed the compile), and the compiled layer then equals the eager one."""
    torch.manual_seed(0)
    layer = MoEFeedForward(make_cfg(num_experts=4, moe_top_k=2, moe_expert_impl="auto"))
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    eager = layer(x)[0]
    torch._dynamo.reset()
    _grouped_mm_runs.cache_clear()
    compiled = torch.compile(layer)(x)[0]
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert _grouped_mm_runs.cache_info().currsize == 1  # probed once, eagerly, and cached


def test_dropless_grouped_layer_reads_no_tensor_values_on_the_host(make_cfg):
    """On the meta device every read of a value (.tolist(), .item(), a boolean mask) raises, so a
    dropless MoE layer that trains there needs no host sync in forward or backward."""
    cfg = make_cfg(num_experts=4, moe_top_k=2, moe_expert_impl="grouped_mm")
    with torch.device("meta"):
        layer = MoEFeedForward(cfg).to(torch.bfloat16)  # grouped_mm's meta kernel takes bf16
        x = torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)
    y, aux, stats = layer(x)
    (y.sum() + aux).backward()
    assert layer.experts.w2.grad.shape == (4, 32, layer.experts.hidden)
    # The loop needs the per-expert counts on the host, so it cannot run there.
    layer.dispatcher.impl = "loop"
    with pytest.raises(NotImplementedError):
        layer(x)


def test_autocast_runs_the_grouped_experts_in_bf16():
    experts = _experts("swiglu", False)
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_grouped = grouped_experts(experts, x, torch.tensor([2, 2, 2, 2]))
        y_loop = looped_experts(experts, x, [2, 2, 2, 2])
    assert y_grouped.dtype == y_loop.dtype == torch.bfloat16
    torch.testing.assert_close(y_grouped.float(), y_loop.float(), rtol=2e-2, atol=2e-2)
