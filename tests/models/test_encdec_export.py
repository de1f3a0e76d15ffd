"""Hugging Face export and import of the encoder-decoder: logit parity with transformers' MarianMTModel
(Post-LN, sinusoidal, shared embeddings) in both directions, with padded sources, and the own format."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import MarianConfig, MarianMTModel

from models.export import hf_unsupported_options, load_hf, load_safetensors, save_hf, save_safetensors
from models.families.encdec.model import EncoderDecoderLM, generate_encdec
from tests.models.test_encdec import encdec_cfg, random_encdec


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(1, 64, (2, 12), generator=g), torch.randint(1, 64, (2, 9), generator=g)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # a padded source
    return src, tgt, mask


def test_own_format_round_trip(tmp_path):
    model = random_encdec()
    save_safetensors(model, model.cfg, tmp_path / "m.safetensors")
    back = load_safetensors(tmp_path / "m.safetensors").eval()
    assert isinstance(back, EncoderDecoderLM) and back.cfg == model.cfg
    src, tgt, mask = _inputs(0)
    torch.testing.assert_close(back(src, tgt, mask).logits, model(src, tgt, mask).logits, atol=0, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(ffn="gelu", tie_embeddings=False, n_encoder_layers=1, d_ff=48)],
                         ids=["relu_tied", "gelu_untied"])
def test_hf_export_logits_equal_ours(tmp_path, kw):
    model = random_encdec(**kw)
    save_hf(model, model.cfg, tmp_path, extra_config={"pad_token_id": 3})
    assert json.loads((tmp_path / "config.json").read_text())["decoder_start_token_id"] == 3
    hf = MarianMTModel.from_pretrained(tmp_path, dtype=torch.float32).eval()
    src, tgt, mask = _inputs(1)
    with torch.no_grad():
        ours = model(src, tgt, mask).logits
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, use_cache=False).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(src, tgt, mask).logits, ours, atol=0, rtol=0)


def test_hf_import_logits_equal_theirs(tmp_path):
    torch.manual_seed(5)
    hf_cfg = MarianConfig(vocab_size=64, decoder_vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=2,
                          encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=80,
                          decoder_ffn_dim=80, activation_function="relu", max_position_embeddings=40,
                          scale_embedding=False, pad_token_id=0, eos_token_id=0, decoder_start_token_id=0,
                          init_std=0.3)
    hf = MarianMTModel(hf_cfg).eval()
    hf.generation_config.forced_eos_token_id = None
    with torch.no_grad():  # move biases and LayerNorms off their initial 0 and 1
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.2 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    cfg = ours.cfg
    assert (cfg.arch, cfg.n_encoder_layers, cfg.n_layers, cfg.resolved_d_ff, cfg.max_seq_len) == \
        ("encoder_decoder", 3, 2, 80, 40)
    src, tgt, mask = _inputs(2)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, use_cache=False).logits
        torch.testing.assert_close(ours(src, tgt, mask).logits, theirs, atol=1e-5, rtol=1e-5)
        # their own cached generation and ours agree too
        want = hf.generate(src, attention_mask=mask, max_new_tokens=8, do_sample=False, num_beams=1,
                           min_new_tokens=8)[:, 1:]
    got = generate_encdec(ours, src, decoder_start_id=0, max_new_tokens=8, attention_mask_BS=mask)
    assert torch.equal(got, want)


@pytest.mark.parametrize("hf_kw, key", [(dict(scale_embedding=True), "scale_embedding"),
                                         (dict(activation_function="swish"), "activation_function"),
                                         (dict(decoder_ffn_dim=64), "decoder_ffn_dim")])
def test_hf_import_refuses_what_it_cannot_compute(tmp_path, hf_kw, key):
    base = dict(vocab_size=64, decoder_vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
                encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=80, decoder_ffn_dim=80,
                max_position_embeddings=40, scale_embedding=False, pad_token_id=0, decoder_start_token_id=0)
    base.update(hf_kw)
    MarianMTModel(MarianConfig(**base)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=key):
        load_hf(tmp_path)


def test_export_names_what_marian_cannot_express():
    problems = " ".join(hf_unsupported_options(encdec_cfg(norm_position="pre", ffn="swiglu", num_kv_heads=2,
                                                          embedding_norm=True)))
    for field in ("norm_position", "ffn", "num_kv_heads", "embedding_norm"):
        assert field in problems
    assert "pos_encoding='rope'" in hf_unsupported_options(encdec_cfg(pos_encoding="rope"))[0]
    assert hf_unsupported_options(encdec_cfg()) == []


# ---------------------------------------------------------------------- BART: learned positions


def _right_padded(seed: int):
    """BART counts positions 0.. whatever the mask, ours count real tokens: equal with right padding."""
    return _inputs(seed)


@pytest.mark.parametrize("kw", [dict(ffn="gelu"), dict(ffn="relu", tie_embeddings=False, n_encoder_layers=1)],
                         ids=["gelu_tied", "relu_untied"])
def test_bart_export_logits_equal_ours(tmp_path, kw):
    from transformers import BartForConditionalGeneration

    model = random_encdec(pos_encoding="learned", embedding_norm=True, **kw)
    with torch.no_grad():  # learned tables off their initial scale, so positions matter
        model.encoder_pos_embeddings.weight.mul_(20)
        model.pos_embeddings.weight.mul_(20)
    save_hf(model, model.cfg, tmp_path)
    hf = BartForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    src, tgt, mask = _right_padded(3)
    with torch.no_grad():
        ours = model(src, tgt, mask).logits
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, use_cache=False).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)
    back = load_hf(tmp_path).eval()
    assert back.cfg == model.cfg
    torch.testing.assert_close(back(src, tgt, mask).logits, ours, atol=0, rtol=0)


def test_bart_import_logits_equal_theirs(tmp_path):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(6)
    hf_cfg = BartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=72, decoder_ffn_dim=72, activation_function="gelu",
                        max_position_embeddings=40, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                        decoder_start_token_id=0, init_std=0.3)
    hf = BartForConditionalGeneration(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "layer_norm" in name or "layernorm" in name:
                p.add_(0.2 * torch.randn(p.shape))
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    cfg = ours.cfg
    assert (cfg.pos_encoding, cfg.embedding_norm, cfg.n_encoder_layers, cfg.n_layers, cfg.max_seq_len) == \
        ("learned", True, 2, 3, 40)
    src, tgt, mask = _right_padded(4)
    with torch.no_grad():
        theirs = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt, use_cache=False).logits
        torch.testing.assert_close(ours(src, tgt, mask).logits, theirs, atol=1e-5, rtol=1e-5)


def test_learned_positions_need_the_embedding_norm_for_bart():
    problems = hf_unsupported_options(encdec_cfg(pos_encoding="learned"))
    assert problems == ["embedding_norm=False (BART has True)"]
    assert "embedding_norm" in " ".join(hf_unsupported_options(encdec_cfg(embedding_norm=True)))
