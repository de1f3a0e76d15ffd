"""An encoder-decoder's evaluation (denoising loss, bits per target byte) against the same numbers computed
by hand, and its text generation: sentinels in, the spans that fill them out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import build_model
from pipeline.data.span_corruption import DECODER_START_ID, EVAL_SALT, SpanCorruption, sentinel_symbols
from pipeline.evaluation.denoising import denoising_metrics, piece_bytes
from pipeline.inference.generator import TextGenerator
from pipeline.tokenization.spm import EOS_ID, load_sentencepiece, train_sentencepiece

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


# Prompts and the spans that fill their sentinels, in order.
FILLS = {"First Citizen: <extra_id_0> we proceed any further, <extra_id_1> speak.": ("Before", "hear me"),
         "You are all <extra_id_0> to die than <extra_id_1>?": ("resolved rather", "to famish")}


def _span_target(sp, spans) -> list[int]:
    """A decoder target as SpanCorruption.corrupt writes it: each span after its sentinel, then EOS."""
    first_sentinel = sp.piece_to_id("<extra_id_0>")
    return [t for k, span in enumerate(spans) for t in (first_sentinel + k, *sp.encode(span))] + [EOS_ID]


@pytest.fixture(scope="module")
def filler(sp):
    """A model trained on FILLS (the encoder reads EOS + prompt, the decoder starts from DECODER_START_ID)
    until its teacher-forced greedy answers are the targets."""
    torch.manual_seed(0)
    model = build_model("debug_encdec", vocab_size=sp.get_piece_size(), max_seq_len=40)
    pairs = [(torch.tensor([[EOS_ID, *sp.encode(p)]]), torch.tensor([_span_target(sp, spans)]))
             for p, spans in FILLS.items()]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(200):
        logits = [model(src, F.pad(tgt[:, :-1], (1, 0), value=DECODER_START_ID)).logits for src, tgt in pairs]
        if all(torch.equal(lg.argmax(-1), tgt) for lg, (_, tgt) in zip(logits, pairs)):
            return model.eval()
        loss = sum(F.cross_entropy(lg[0], tgt[0]) for lg, (_, tgt) in zip(logits, pairs))
        opt.zero_grad()
        loss.backward()
        opt.step()
    raise AssertionError("the model did not learn FILLS in 200 steps")


def _greedy_by_hand(model, prompt: str, sp, max_new_tokens: int) -> list[int]:
    """Greedy decoding written out from the forward: EOS + prompt in, the whole decoder input again at
    every step, until EOS."""
    src, dec = torch.tensor([[EOS_ID, *sp.encode(prompt)]]), [DECODER_START_ID]
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(src, torch.tensor([dec])).logits[0, -1].argmax())
            if nxt == EOS_ID:
                break
            dec.append(nxt)
    return dec[1:]


def test_the_generator_fills_sentinels(sp, model, filler):
    # A model taught the spans answers each prompt with its spans, each after its sentinel, as T5 does.
    out = TextGenerator(filler, sp).generate(list(FILLS), max_new_tokens=12, temperature=0.0)
    assert out == ["<extra_id_0> Before<extra_id_1> hear me", "<extra_id_0> resolved rather<extra_id_1> to famish"]
    # Any model: the served text is its greedy decoding written out by hand, sentinels kept, cut at EOS.
    prompts = ["First Citizen: <extra_id_0> speak, <extra_id_1>.", "All: <extra_id_0>"]
    want = [sp.decode(_greedy_by_hand(model, p, sp, 10)) for p in prompts]
    assert TextGenerator(model, sp).generate(prompts, max_new_tokens=10, temperature=0.0) == want
    assert sp.encode(prompts[0]).count(5) == 1  # the sentinel is one token


def test_ray_serves_batch_generation_fills_each_request_as_alone(sp, model):
    """The deployment's batch path (``generate_batch``) answers each encoder-decoder request as it would
    be answered alone: greedy rows as the generator's text, a sampled row as its own seed gives."""
    from pipeline.inference.batched import generate_batch
    from pipeline.inference.requests import GenRequest

    prompts = ["First Citizen: <extra_id_0> speak, <extra_id_1>.", "All: <extra_id_0>"]
    rows = [GenRequest((EOS_ID, *sp.encode(p)), 8) for p in prompts]
    sampled = GenRequest(rows[0].prompt_ids, 8, temperature=1.0, top_p=0.9, seed=11)
    out = generate_batch(model, [*rows, sampled], EOS_ID)
    assert [sp.decode(ids) for ids in out[:2]] == TextGenerator(model, sp).generate(prompts, max_new_tokens=8,
                                                                                      temperature=0.0)
    assert out[2] == generate_batch(model, [sampled], EOS_ID)[0]
    assert all(len(ids) <= 8 and EOS_ID not in ids for ids in out)
