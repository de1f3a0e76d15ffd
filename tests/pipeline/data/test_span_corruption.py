"""T5 span corruption at load time: T5's exact counts, the encoder/target layout against a token-by-token
reference, determinism, rank-layout independence of the training stream, the sentinels in the
tokenizer, and the hash-neutrality of it all for decoder runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import load_config
from pipeline.data.span_corruption import (
    DECODER_START_ID, EVAL_SALT, SpanCorruption, corrupt_micro_batches, first_sentinel_id, for_run, num_sentinels,
    sentinel_symbols, span_counts,
)
from pipeline.stages import tokenizer as tokenizer_stage
from pipeline.tokenization.spm import EOS_ID

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("length, density, span, want", [
    (65, 0.15, 3.0, (10, 3)),   # round(9.75) = 10 noise tokens, round(10 / 3) = 3 spans
    (512, 0.15, 3.0, (77, 26)),  # T5's default setting on its 512-token inputs
    (10, 0.01, 3.0, (1, 1)),    # at least one noise token and one span
    (4, 0.99, 1.0, (3, 1)),     # at least one kept token, and no more spans than kept runs
])
def test_span_counts_follow_t5(length, density, span, want):
    assert span_counts(length, density, span) == want


def reference_corrupt(block, mask, first_sentinel):
    """Walk the block: a kept token goes to the encoder; a span's first token puts the next sentinel in
    both streams; every noise token goes to the target; EOS ends the target."""
    enc, tgt, k = [], [], 0
    for i, tok in enumerate(block):
        if not mask[i]:
            enc.append(int(tok))
            continue
        if i == 0 or not mask[i - 1]:
            enc.append(first_sentinel + k)
            tgt.append(first_sentinel + k)
            k += 1
        tgt.append(int(tok))
    return enc, tgt + [EOS_ID]


@pytest.mark.parametrize("density, span", [(0.15, 3.0), (0.5, 1.0), (0.3, 8.0)])
def test_corruption_equals_the_reference_walk(density, span):
    sc = SpanCorruption(density, span, first_sentinel_id=5, seed=7)
    rng = np.random.default_rng(0)
    for salt in range(20):
        block = rng.integers(20, 500, size=65)
        mask = sc.noise_mask(block, salt)
        noise, spans = span_counts(65, density, span)
        starts = mask & ~np.concatenate([[False], mask[:-1]])
        assert mask.sum() == noise and starts.sum() == spans
        assert not mask[0] and mask[-1]  # kept text first, a span last, as T5's layout
        enc, tgt = sc.corrupt(block, salt)
        assert (list(enc), list(tgt)) == reference_corrupt(block, mask, 5)
        assert (len(enc), len(tgt)) == sc.lengths(65)


def test_noise_is_a_function_of_seed_salt_and_tokens():
    sc = SpanCorruption(0.15, 3.0, 5, seed=1)
    block = np.arange(100, 165)
    same = [sc.noise_mask(block, 3) for _ in range(2)]
    assert np.array_equal(*same)
    others = [sc.noise_mask(block, 4), SpanCorruption(0.15, 3.0, 5, seed=2).noise_mask(block, 3),
              sc.noise_mask(block[::-1].copy(), 3)]
    assert all(not np.array_equal(same[0], o) for o in others)


def test_micro_batches_become_encoder_decoder_triples():
    sc = SpanCorruption(0.15, 3.0, 5, seed=0)
    blocks = torch.arange(2 * 65).view(2, 65) + 10
    (enc, dec_in, tgt), = corrupt_micro_batches(sc, [(blocks[:, :-1], blocks[:, 1:])], salt=0)
    S, T = sc.lengths(65)
    assert enc.shape == (2, S) and dec_in.shape == tgt.shape == (2, T)
    assert (dec_in[:, 0] == DECODER_START_ID).all() and torch.equal(dec_in[:, 1:], tgt[:, :-1])
    for b in range(2):
        want_enc, want_tgt = sc.corrupt(blocks[b].numpy(), 0)
        assert enc[b].tolist() == list(want_enc) and tgt[b].tolist() == list(want_tgt)


def test_two_ranks_see_the_stream_of_one():
    """A step's global batch is split over ranks by the loader; the noise does not depend on the split."""
    sc = SpanCorruption(0.15, 3.0, 5, seed=0)
    blocks = torch.randint(10, 400, (4, 65), generator=torch.Generator().manual_seed(0))
    one = corrupt_micro_batches(sc, [(blocks[:, :-1], blocks[:, 1:])], salt=9)[0]
    halves = [corrupt_micro_batches(sc, [(h[:, :-1], h[:, 1:])], salt=9)[0] for h in (blocks[:2], blocks[2:])]
    for i in range(3):
        assert torch.equal(one[i], torch.cat([halves[0][i], halves[1][i]]))


def test_run_settings_and_sentinels_in_the_tokenizer_config():
    enc = load_config(ROOT / "configs" / "smoke_encdec.yaml")
    sc = for_run(enc)
    assert (sc.noise_density, sc.mean_span_length, sc.first_sentinel_id) == (0.15, 3.0, 5)
    assert num_sentinels(enc) == 3
    assert tokenizer_stage.reserved_symbols(enc) == sentinel_symbols(3) == ["<extra_id_0>", "<extra_id_1>",
                                                                              "<extra_id_2>"]
    assert tokenizer_stage.hash_config(enc)["sentinels"] == 3
    assert first_sentinel_id(["<a>", "<b>"]) == 7


@pytest.mark.parametrize("name", ["smoke.yaml", "smoke_mamba.yaml", "smoke_moe.yaml", "demo.yaml"])
def test_decoder_runs_reserve_no_sentinels_and_keep_their_hashes(name):
    cfg = load_config(ROOT / "configs" / name)
    assert for_run(cfg) is None and num_sentinels(cfg) == 0
    assert tokenizer_stage.hash_config(cfg) == {"tokenizer": tokenizer_stage.hash_view(cfg.tokenizer)}
    from pipeline.stages import train as train_stage

    assert not {"n_encoder_layers", "denoise_noise_density", "denoise_mean_span_length",
                "embedding_norm"} & set(train_stage.hash_config(cfg)["model"])


def test_encdec_run_validation_names_the_fields():
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="eval.heldout_paths"):
        load_config(ROOT / "configs" / "smoke_encdec.yaml", ["eval.heldout_paths=[gutenberg/heldout/*.txt]"])
    with pytest.raises(ConfigError, match="max_seq_len"):
        load_config(ROOT / "configs" / "smoke_encdec.yaml", ["model.max_seq_len=32"])


def test_eval_salt_differs_from_every_training_step():
    assert EVAL_SALT < 0
