"""An encoder-decoder's evaluation (denoising loss, bits per target byte) against the same numbers computed
by hand, and its text generation: sentinels in, the spans that fill them out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import build_model
from pipeline.data.span_corruption import EVAL_SALT, SpanCorruption, sentinel_symbols
from pipeline.evaluation.denoising import denoising_metrics, piece_bytes
from pipeline.generation import TextGenerator
from pipeline.text import EOS_ID, load_sentencepiece, train_sentencepiece

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n") * 40


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(train_sentencepiece(iter(TEXT.split("\n")), vocab_size=400, model_type="bpe",
                                         character_coverage=1.0, byte_fallback=True, normalization="identity",
                                         num_threads=1, user_defined_symbols=sentinel_symbols(3)))
    return load_sentencepiece(str(path))


@pytest.fixture(scope="module")
def model(sp):
    torch.manual_seed(0)
    return build_model("debug_encdec", vocab_size=sp.get_piece_size(), max_seq_len=40).eval()


def test_piece_bytes_count_the_text(sp):
    text = "Speak, speak. You are all resolved?\nhear me"
    ids = sp.encode(text)
    # sentencepiece's dummy prefix is one more space than the text has
    assert piece_bytes(sp)[ids].sum() == len(text.encode("utf-8")) + 1
    assert piece_bytes(sp)[[0, 1, 2, 3]].tolist() == [0, 0, 0, 0]


def test_denoising_metrics_equal_the_sums_by_hand(sp, model):
    ids = np.array(sp.encode(TEXT)[: 4 * 33]).reshape(4, 33)
    sc = SpanCorruption(0.15, 3.0, first_sentinel_id=5, seed=3)
    m = denoising_metrics(model, ids, sc, batch_size=3, sp=sp)
    nll, n, nbytes = 0.0, 0, 0
    for row in ids:
        enc, tgt = sc.corrupt(row, EVAL_SALT)
        dec_in = np.concatenate([[0], tgt[:-1]])
        with torch.no_grad():
            logits = model(torch.from_numpy(enc)[None], torch.from_numpy(dec_in)[None]).logits[0]
        nll += F.cross_entropy(logits, torch.tensor(tgt), reduction="sum").item()
        n += len(tgt)
        span_text = sp.decode([int(t) for t in row[sc.noise_mask(row, EVAL_SALT)]])
        nbytes += int(piece_bytes(sp)[row[sc.noise_mask(row, EVAL_SALT)]].sum())
        assert span_text  # the spans restore real text
    assert m["val_targets_evaluated"] == n and m["val_target_bytes"] == nbytes
    assert m["val_loss"] == pytest.approx(nll / n, rel=1e-6)
    assert m["val_bits_per_target_byte"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-6)


def test_the_generator_fills_sentinels(sp, model):
    gen = TextGenerator(model, sp)
    prompt = "First Citizen: <extra_id_0> speak, <extra_id_1>."
    out = gen.generate([prompt], max_new_tokens=10, temperature=0.0)
    from models.encdec import generate_encdec

    ids = torch.tensor([[EOS_ID] + sp.encode(prompt)])
    want = generate_encdec(model, ids, decoder_start_id=0, max_new_tokens=10, eos_id=EOS_ID)[0].tolist()
    assert out == [sp.decode([t for t in want if t != EOS_ID])]
    assert sp.encode(prompt).count(5) == 1  # the sentinel is one token


def test_ray_serves_batch_generation_fills_each_request_as_alone(sp, model):
    """The deployment's batch path (``generate_batch``) answers each encoder-decoder request as it would
    be answered alone: greedy rows as the generator's text, a sampled row as its own seed gives."""
    from pipeline.batch_generation import GenRequest, generate_batch

    prompts = ["First Citizen: <extra_id_0> speak, <extra_id_1>.", "All: <extra_id_0>"]
    rows = [GenRequest((EOS_ID, *sp.encode(p)), 8) for p in prompts]
    sampled = GenRequest(rows[0].prompt_ids, 8, temperature=1.0, top_p=0.9, seed=11)
    out = generate_batch(model, [*rows, sampled], EOS_ID)
    assert [sp.decode(ids) for ids in out[:2]] == TextGenerator(model, sp).generate(prompts, max_new_tokens=8,
                                                                                      temperature=0.0)
    assert out[2] == generate_batch(model, [sampled], EOS_ID)[0]
    assert all(len(ids) <= 8 and EOS_ID not in ids for ids in out)
