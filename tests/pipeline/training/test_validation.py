"""Validation during training (pipeline.training.validation): the subset, the ranks' shares summed
back to the one-process loss, no effect on training, and early stopping (also as a resumed run sees it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig, build_model
from pipeline.config import ConfigError, load_config
from pipeline.training.engine import train_step
from pipeline.training.layout import ParallelDims
from pipeline.training.validation import check_split, stop_early, validation_loss

TINY = ModelConfig(vocab_size=37, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, dropout=0.1)


class PlainEngine(torch.nn.Module):
    """What the training step and the validation pass need of a DeepSpeed engine, in one process."""

    def __init__(self, model: torch.nn.Module, lr: float = 0.05):
        super().__init__()
        self.module = model
        self.opt = torch.optim.SGD(model.parameters(), lr=lr)

    def forward(self, *inputs, **loss_inputs):
        return self.module(*inputs, **loss_inputs)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.opt.step()
        self.opt.zero_grad()


def blocks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, TINY.vocab_size, size=(n, 9)).astype(np.uint16)


def test_ranks_shares_sum_to_the_loss_over_the_whole_subset():
    torch.manual_seed(0)
    engine = PlainEngine(build_model(TINY))
    val = blocks(40)
    one = ParallelDims(1, 1, global_batch_size=4, micro_batch_size_per_rank=2, seq_len=8)
    two = ParallelDims(2, 1, global_batch_size=4, micro_batch_size_per_rank=2, seq_len=8)
    cpu = torch.device("cpu")
    single = validation_loss(engine, val, one, 0, eval_batches=3, device=cpu, all_reduce=None)
    # The reference: plain cross-entropy over the first 3 x 4 blocks, in one batch.
    x = torch.from_numpy(val[:12].astype(np.int64))
    engine.eval()
    with torch.no_grad():
        ref = F.cross_entropy(engine(x[:, :-1]).logits.flatten(0, 1), x[:, 1:].flatten()).item()
    assert single == pytest.approx(ref, rel=1e-6)
    # Two ranks, each scoring its half; the all-reduce is a sum of (nll, tokens).
    parts = []
    for rank in (0, 1):
        seen = []
        validation_loss(engine, val, two, rank, eval_batches=3, device=cpu, all_reduce=seen.append)
        parts.append(seen[0].clone())
    total = parts[0] + parts[1]
    assert total[1].item() == 12 * 8 and (total[0] / total[1]).item() == pytest.approx(single, rel=1e-12)
    assert parts[0][1].item() == parts[1][1].item()  # the same number of forward passes on each rank


def test_a_validation_pass_changes_nothing_training_sees():
    """Dropout on: training draws from the RNG; the validation pass (eval mode, no grad) must not."""
    train = [(torch.from_numpy(b[:, :-1].astype(np.int64)), torch.from_numpy(b[:, 1:].astype(np.int64)))
             for b in np.split(blocks(8, seed=1), 4)]
    dims = ParallelDims(1, 1, global_batch_size=2, micro_batch_size_per_rank=2, seq_len=8)
    weights = []
    for with_validation in (False, True):
        torch.manual_seed(0)
        engine = PlainEngine(build_model(TINY))
        for step, batch in enumerate(train):
            train_step(engine, [batch], torch.device("cpu"))
            if with_validation and step % 2 == 0:
                validation_loss(engine, blocks(8), dims, 0, eval_batches=2, device=torch.device("cpu"),
                                all_reduce=None)
                assert engine.training
        weights.append({k: v.clone() for k, v in engine.module.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_early_stopping_waits_patience_validations_without_a_new_best():
    assert not stop_early([3.0, 2.5, 2.6], patience=2)
    assert stop_early([3.0, 2.5, 2.6, 2.5], patience=2)  # equal is no improvement
    assert not stop_early([3.0, 2.5, 2.6, 2.4], patience=2)
    assert not stop_early([3.0, 3.1, 3.2, 3.3], patience=0)  # off
    assert not stop_early([3.0, 3.1], patience=2)  # not enough validations yet
    # What a resumed run recomputes from its restored history decides the same.
    history = [{"step": 10, "loss": 4.0}, {"step": 20, "loss": 3.9, "val_loss": 3.0},
               {"step": 40, "loss": 3.8, "val_loss": 3.2}, {"step": 60, "loss": 3.7, "val_loss": 3.1}]
    assert stop_early([h["val_loss"] for h in history if "val_loss" in h], patience=2)


def test_config_and_split_checks_name_the_fields():
    with pytest.raises(ConfigError, match=r"validation.every=15 must be a multiple of train.log_every=10"):
        load_config(None, ["validation.every=15", "train.log_every=10"])
    with pytest.raises(ConfigError, match=r"validation.early_stop_patience=2 needs validation: set validation.every"):
        load_config(None, ["validation.early_stop_patience=2"])
    with pytest.raises(ConfigError, match=r"validation.batches=0 must be >= 1"):
        load_config(None, ["validation.batches=0"])
    with pytest.raises(ValueError, match=r"validation.batches=4 asks for 64 validation blocks .* the validation "
                                         r"split has 50"):
        check_split(4, 16, 50)
    check_split(4, 16, 64)


def test_an_encoder_decoders_validation_scores_its_span_corrupted_targets():
    """With the run's span corruption, the validation loss is the mean decoder-target cross-entropy of
    each block corrupted with evaluation's fixed noise, and 2 ranks' shares still sum to it."""
    from pipeline.data.span_corruption import EVAL_SALT, SpanCorruption

    cfg = ModelConfig(arch="encoder_decoder", vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=12,
                      pos_encoding="sinusoidal", denoise_noise_density=0.3, denoise_mean_span_length=1.5)
    torch.manual_seed(0)
    engine = PlainEngine(build_model(cfg))
    sc = SpanCorruption(0.3, 1.5, first_sentinel_id=5, seed=1)
    val = blocks(16) + 10  # no sentinel ids in the text
    one = ParallelDims(1, 1, global_batch_size=4, micro_batch_size_per_rank=2, seq_len=8)
    two = ParallelDims(2, 1, global_batch_size=4, micro_batch_size_per_rank=2, seq_len=8)
    cpu = torch.device("cpu")
    single = validation_loss(engine, val, one, 0, eval_batches=2, device=cpu, all_reduce=None, corruption=sc)
    enc, dec_in, tgt = sc.batch(torch.from_numpy(val[:8].astype(np.int64)), EVAL_SALT)
    engine.eval()
    with torch.no_grad():
        ref = F.cross_entropy(engine(enc, dec_in).logits.flatten(0, 1), tgt.flatten()).item()
    assert single == pytest.approx(ref, rel=1e-6)
    parts = []
    for rank in (0, 1):
        seen = []
        validation_loss(engine, val, two, rank, eval_batches=2, device=cpu, all_reduce=seen.append, corruption=sc)
        parts.append(seen[0].clone())
    total = parts[0] + parts[1]
    assert total[1].item() == tgt.numel() and (total[0] / total[1]).item() == pytest.approx(single, rel=1e-12)
