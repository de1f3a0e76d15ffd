"""Whole-model properties: meta-device build, initialisation, tying, outputs, gradients."""

from __future__ import annotations

import math

import pytest
import torch

from models import ModelConfig, ModelOutput, Transformer, build_model
from models.accounting import param_counts


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(pos_encoding="learned", norm="layernorm", bias=True, ffn="gelu", tie_embeddings=True),
        dict(pos_encoding="sinusoidal", norm_position="post", ffn="relu"),
        dict(num_experts=4, moe_top_k=2, moe_shared_experts=1, num_kv_heads=2),
    ],
)
def test_meta_build_then_init_gives_a_finite_model(make_cfg, kw):
    cfg = make_cfg(**kw)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert all(p.is_meta for p in model.parameters())
    assert list(model.buffers()) == []  # nothing to recompute after to_empty
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert sum(p.numel() for p in model.parameters()) == param_counts(cfg)["total"]
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.tok_embeddings.weight
    out = model(torch.randint(0, 64, (2, 16)))
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 16, 64) and torch.isfinite(out.logits).all()
    assert torch.isfinite(out.aux_loss)


def test_init_statistics():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, d_model=128, n_layers=8, n_heads=4, max_seq_len=16, init_std=0.05, bias=True,
                      norm="layernorm", num_experts=2, moe_top_k=1, moe_every=2)
    model = build_model(cfg)
    resid = 0.05 / math.sqrt(16)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.layers[0].attn.q_proj.weight.std().item() == pytest.approx(0.05, rel=0.05)
    assert model.layers[0].attn.o_proj.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert model.layers[0].ffn.w2.weight.std().item() == pytest.approx(resid, rel=0.05)
    assert model.layers[1].ffn.experts.w2[1].std().item() == pytest.approx(resid, rel=0.05)
    assert model.layers[1].ffn.experts.w13[0].std().item() == pytest.approx(0.05, rel=0.05)
    assert (model.layers[1].ffn.experts.b13 == 0).all() and (model.layers[1].ffn.experts.b2 == 0).all()
    assert model.layers[1].ffn.router.weight.std().item() == pytest.approx(0.05, rel=0.2)
    assert (model.layers[0].attn.q_proj.bias == 0).all()
    assert (model.layers[0].attn_norm.weight == 1).all() and (model.layers[0].attn_norm.bias == 0).all()


def test_init_is_reproducible_with_a_generator(make_cfg):
    a, b = Transformer(make_cfg()), Transformer(make_cfg())
    a.init_weights(torch.Generator().manual_seed(3))
    b.init_weights(torch.Generator().manual_seed(3))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_tied_embeddings_share_one_parameter(make_model):
    model = make_model(tie_embeddings=True)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once
    model.train()
    model(torch.randint(0, 64, (1, 5))).logits.sum().backward()
    assert model.tok_embeddings.weight.grad is model.lm_head.weight.grad


def test_dense_output_fields_and_backward(make_model):
    model = make_model().train()
    out = model(torch.randint(0, 64, (2, 6)))
    assert out.aux_loss.shape == () and out.aux_loss.item() == 0.0
    assert out.moe_stats == [] and out.attentions is None and out.kv_cache is None
    out.logits.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_residual_dropout_in_training_only(make_cfg):
    torch.manual_seed(0)
    model = build_model(make_cfg(dropout=0.3))
    x = torch.randint(0, 64, (2, 8))
    model.eval()
    a = model(x).logits
    torch.testing.assert_close(model(x).logits, a)
    model.train()
    assert not torch.allclose(model(x).logits, a)


def test_input_validation(make_model):
    model = make_model()
    with pytest.raises(ValueError, match="2-D"):
        model(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask_BT shape"):
        model(torch.zeros(1, 5, dtype=torch.long), attention_mask_BT=torch.ones(1, 4))
    with pytest.raises(ValueError, match="ModelConfig"):
        Transformer({"d_model": 3})
