"""The chunked LM head + cross-entropy (models.layers.loss.linear_cross_entropy, models.layers.head.LMHead): the plain
loss and gradients, to float32 rounding, without ever holding the whole logits."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from models import ModelConfig, build_model
from models.layers.loss import linear_cross_entropy, lm_loss

N_TOKENS_BT = (3, 7)


def inputs(V: int = 50, D: int = 16, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*N_TOKENS_BT, D, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=dtype) * 0.3).requires_grad_()
    t = torch.randint(0, V, N_TOKENS_BT, generator=g)
    t[0, :3] = -100  # ignored positions
    t[2, 6] = -100
    return h, w, t


def plain(h, w, t, eps, reduction):
    """Reference: the whole logits, torch's cross-entropy (lm_loss)."""
    return lm_loss(h @ w.T, t, eps, reduction=reduction)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 5, 21, 64])  # one token, uneven chunks, exactly N, more than N
def test_chunked_equals_plain_loss_and_gradients(eps, reduction, chunk):
    h, w, t = inputs()
    ref = plain(h, w, t, eps, reduction)
    ref_gh, ref_gw = torch.autograd.grad(ref * 1.7, (h, w))  # a non-unit incoming gradient
    got = linear_cross_entropy(h, w, t, eps, chunk_tokens=chunk, reduction=reduction)
    gh, gw = torch.autograd.grad(got * 1.7, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, ref_gh, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, ref_gw, rtol=1e-5, atol=1e-7)
    assert gh[0, :3].abs().max() == 0 and gh[2, 6].abs().max() == 0  # ignored tokens get no gradient


def test_the_smoothed_loss_is_the_formula():
    """Per counted token (1 - eps) * -log p_target + eps * mean_v(-log p_v), averaged (float64 by hand)."""
    h, w, t = inputs(dtype=torch.float64)
    eps = 0.2
    logp = torch.log_softmax(h.detach() @ w.detach().T, dim=-1)
    keep = t != -100
    per = (1 - eps) * -logp[keep].gather(1, t[keep][:, None]).squeeze(1) + eps * -logp[keep].mean(dim=-1)
    got = linear_cross_entropy(h, w, t, eps, chunk_tokens=4)
    assert got.item() == pytest.approx(per.mean().item(), rel=1e-6)


def test_under_bf16_autocast_it_is_the_plain_loss_to_bf16_rounding():
    h, w, t = inputs(V=200, D=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = plain(h, w, t, 0.1, "mean")
        ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
        got = linear_cross_entropy(h, w, t, 0.1, chunk_tokens=5)
        gh, gw = torch.autograd.grad(got, (h, w))
    assert gh.dtype == gw.dtype == torch.float32  # the parameters' dtype, as autocast's backward gives
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)  # the same bf16 logits, reduced in fp32
    torch.testing.assert_close(gh, ref_gh, rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(gw, ref_gw, rtol=2e-2, atol=1e-4)


def test_without_grad_only_the_loss_is_computed():
    h, w, t = inputs()
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, 0.1, chunk_tokens=4, reduction="sum")
        ref = plain(h, w, t, 0.1, "sum")
    assert not got.requires_grad
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_every_target_ignored_gives_nan_like_torch():
    h, w, t = inputs()
    t = torch.full_like(t, -100)
    assert math.isnan(linear_cross_entropy(h, w, t, chunk_tokens=4).item())
    assert math.isnan(plain(h, w, t, 0.0, "mean").item())
    assert linear_cross_entropy(h, w, t, chunk_tokens=4, reduction="sum").item() == 0.0


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def test_the_whole_logits_never_exist():
    """Forward and backward of the chunked loss make no tensor larger than one chunk's logits; the
    plain path makes the whole (B*T, V) logits."""
    V, D = 1000, 3
    h, w, t = inputs(V=V, D=D)
    N, chunk = h.shape[0] * h.shape[1], 4
    with LargestTensor() as seen:
        linear_cross_entropy(h, w, t, chunk_tokens=chunk).backward()
    assert seen.largest == chunk * V  # one chunk's logits (the weight's gradient is V * D = 3,000)
    with LargestTensor() as seen:
        plain(h, w, t, 0.0, "mean").backward()
    assert seen.largest == N * V


@pytest.mark.parametrize("tie", [False, True])
def test_the_model_returns_the_plain_loss_and_gradients_from_its_head(tie):
    """Through a whole Transformer (tied and untied embeddings, label smoothing, ignored targets):
    ``model(x, targets_BT=...)`` trains on the same loss, every parameter's gradient the same."""
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, tie_embeddings=tie)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 97, (2, 13))
    y = x[:, 1:].clone()
    y[1, :4] = -100
    ref = lm_loss(model(x[:, :-1]).logits, y, 0.1)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    out = model(x[:, :-1], targets_BT=y, label_smoothing=0.1, chunk_tokens=5)
    assert out.logits is None
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-6)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7, msg=name)
    assert (model.lm_head.weight is model.tok_embeddings.weight) == tie


@pytest.mark.parametrize("arch", ["mamba", "encoder_decoder"])
def test_every_family_takes_targets(arch):
    if arch == "mamba":
        cfg = ModelConfig(arch="mamba", pos_encoding="none", vocab_size=97, d_model=32, n_layers=2, max_seq_len=16,
                          ssm_state_size=4)
    else:
        cfg = ModelConfig(arch="encoder_decoder", vocab_size=97, d_model=32, n_layers=1, n_encoder_layers=1,
                          n_heads=4, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 97, (2, 9))
    args = (x[:, :-1],) if arch == "mamba" else (x[:, :-1], x[:, :-1])
    ref = lm_loss(model(*args).logits, x[:, 1:])
    got = model(*args, targets_BT=x[:, 1:], chunk_tokens=3).loss
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_bad_arguments_are_named():
    h, w, t = inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        linear_cross_entropy(h, w, t, chunk_tokens=-1)
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        linear_cross_entropy(h, w, t, chunk_tokens=4, reduction="none")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        linear_cross_entropy(h, w, t, 1.0, chunk_tokens=4)
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(h, w, t[:, :3], chunk_tokens=4)
    model = build_model("debug_dense")
    with pytest.raises(ValueError, match=r"loss options \['chunk_tokens'\] given without targets_BT"):
        model(torch.zeros(1, 4, dtype=torch.long), chunk_tokens=4)
