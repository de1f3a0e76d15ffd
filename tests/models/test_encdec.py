"""The encoder-decoder (arch 'encoder_decoder'): its forward against the paper's formulas written out,
padding and causality, KV-cached generation against full recomputation, config validation and the
hash-neutrality of its config fields for decoder configs."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from models import ModelConfig, build_model
from models.families import FAMILIES
from models.families.encdec.model import EncoderDecoderLM, generate_encdec


def encdec_cfg(**kw) -> ModelConfig:
    """The paper's layout (Post-LN LayerNorm, sinusoidal, ReLU, biases, tied embeddings), tiny."""
    base = dict(arch="encoder_decoder", vocab_size=64, d_model=32, n_layers=2, n_encoder_layers=3, n_heads=4,
                max_seq_len=32, norm="layernorm", norm_position="post", pos_encoding="sinusoidal", ffn="relu",
                bias=True, tie_embeddings=True)
    base.update(kw)
    return ModelConfig(**base)


def random_encdec(seed: int = 0, **kw) -> EncoderDecoderLM:
    """An initialised model with every parameter moved off its init, so every tensor matters.

    Query and key weights move by 0.5 * N(0, 1), so attention is far from uniform (at init_std it is
    nearly uniform, and swapped queries and keys would pass the parity tests, see
    test_random_model_notices_swapped_queries_and_keys); the rest by 0.1 * N(0, 1), as larger values
    and outputs would make the encoder's outputs alike at every source position.
    """
    torch.manual_seed(seed)
    model = build_model(encdec_cfg(**kw))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.1
            p.add_(scale * torch.randn(p.shape, generator=g))
    return model.eval()


# ---------------------------------------------------------------------- reference math


def _ln(x, norm):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + 1e-5) * norm.weight + norm.bias


def _mha(q_in, kv_in, attn, n_heads, allowed_TS):
    """softmax(Q K^T / sqrt(d_k) masked) V per head, then the output projection."""
    d_k = q_in.shape[-1] // n_heads
    q = (q_in @ attn.q_proj.weight.T + attn.q_proj.bias).unflatten(-1, (n_heads, d_k)).transpose(0, 1)
    k = (kv_in @ attn.k_proj.weight.T + attn.k_proj.bias).unflatten(-1, (n_heads, d_k)).transpose(0, 1)
    v = (kv_in @ attn.v_proj.weight.T + attn.v_proj.bias).unflatten(-1, (n_heads, d_k)).transpose(0, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d_k)
    scores = scores.masked_fill(~allowed_TS, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(0, 1).flatten(-2) @ attn.o_proj.weight.T + attn.o_proj.bias


def _ffn(x, ffn):
    return torch.relu(x @ ffn.w1.weight.T + ffn.w1.bias) @ ffn.w2.weight.T + ffn.w2.bias


def _pe(n, d):
    pe = torch.zeros(n, d)
    for pos in range(n):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return pe


def reference_logits(model: EncoderDecoderLM, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """One unbatched sequence through Vaswani et al.'s equations, token by token of the formulas."""
    cfg = model.cfg
    E = model.tok_embeddings.weight
    x = E[src] + _pe(len(src), cfg.d_model)
    everything = torch.ones(len(src), len(src), dtype=torch.bool)
    for blk in model.encoder_layers:
        x = _ln(x + _mha(x, x, blk.attn, cfg.n_heads, everything), blk.attn_norm)
        x = _ln(x + _ffn(x, blk.ffn), blk.ffn_norm)
    y = E[tgt] + _pe(len(tgt), cfg.d_model)
    causal = torch.ones(len(tgt), len(tgt), dtype=torch.bool).tril()
    cross = torch.ones(len(tgt), len(src), dtype=torch.bool)
    for blk in model.layers:
        y = _ln(y + _mha(y, y, blk.attn, cfg.n_heads, causal), blk.attn_norm)
        y = _ln(y + _mha(y, x, blk.cross_attn, cfg.n_heads, cross), blk.cross_norm)
        y = _ln(y + _ffn(y, blk.ffn), blk.ffn_norm)
    return y @ E.T  # tied output projection


def test_forward_equals_the_papers_equations():
    model = random_encdec()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 64, (2, 11), generator=g), torch.randint(0, 64, (2, 7), generator=g)
    logits = model(src, tgt).logits
    for b in range(2):
        torch.testing.assert_close(logits[b], reference_logits(model, src[b], tgt[b]), atol=1e-5, rtol=1e-5)


def _swap_queries_and_keys(attns) -> None:
    """Exchange q_proj and k_proj (weight and bias) of each attention: what a mis-mapped export does."""
    with torch.no_grad():
        for attn in attns:
            for q, k in zip(attn.q_proj.parameters(), attn.k_proj.parameters()):
                q_copy = q.clone()
                q.copy_(k)
                k.copy_(q_copy)


@pytest.mark.parametrize("stack", ["encoder", "cross"])
def test_random_model_notices_swapped_queries_and_keys(stack):
    """The parity tests (above, and the HF exports) compare at 1e-5; on the random model, swapping queries
    and keys in the encoder's self-attention or in the cross-attention moves them by over 1e4 times that."""
    model = random_encdec()
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(0, 64, (2, 11), generator=g), torch.randint(0, 64, (2, 7), generator=g)
    swapped = copy.deepcopy(model)
    _swap_queries_and_keys([b.attn for b in swapped.encoder_layers] if stack == "encoder"
                           else [b.cross_attn for b in swapped.layers])
    with torch.no_grad():
        moved = (swapped(src, tgt).logits - model(src, tgt).logits).abs().max().item()
    assert moved > 0.1


def test_shared_embeddings_and_separate_depths():
    model = random_encdec(n_layers=2, n_encoder_layers=3)
    assert len(model.encoder_layers) == 3 and len(model.layers) == 2
    assert model.lm_head.weight is model.tok_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert sum("embeddings" in n for n in names) == 1  # one table serves encoder, decoder and output
    untied = random_encdec(tie_embeddings=False)
    assert untied.lm_head.weight is not untied.tok_embeddings.weight


# ---------------------------------------------------------------------- masks


@pytest.mark.parametrize("kw", [{}, dict(pos_encoding="rope", norm="rmsnorm", norm_position="pre", ffn="swiglu",
                                         bias=False, num_kv_heads=2),
                                dict(pos_encoding="learned")])
def test_source_padding_changes_nothing_for_the_real_tokens(kw):
    # float64: in float32 the padded forward's other reduction shapes move small logits by up to 2e-5
    # depending on torch's thread count (seen at 1 thread), which is rounding, not what is checked here.
    model = random_encdec(**kw).double()
    g = torch.Generator().manual_seed(2)
    src, tgt = torch.randint(1, 64, (1, 9), generator=g), torch.randint(1, 64, (1, 6), generator=g)
    alone = model(src, tgt).logits
    pad = torch.zeros(1, 4, dtype=torch.long)
    for padded, mask in (
        (torch.cat([src, pad], 1), torch.cat([torch.ones(1, 9), torch.zeros(1, 4)], 1)),
        (torch.cat([pad, src], 1), torch.cat([torch.zeros(1, 4), torch.ones(1, 9)], 1)),
    ):
        torch.testing.assert_close(model(padded, tgt, attention_mask_BS=mask.long()).logits, alone,
                                   atol=1e-10, rtol=1e-10)


def test_decoder_is_causal_and_encoder_is_not():
    model = random_encdec()
    g = torch.Generator().manual_seed(3)
    src, tgt = torch.randint(0, 64, (1, 8), generator=g), torch.randint(0, 64, (1, 6), generator=g)
    base = model(src, tgt).logits
    tgt2 = tgt.clone()
    tgt2[0, 4] = (tgt[0, 4] + 1) % 64
    changed = model(src, tgt2).logits
    torch.testing.assert_close(changed[:, :4], base[:, :4])  # the past does not see the future
    assert not torch.allclose(changed[:, 4:], base[:, 4:])
    src2 = src.clone()
    src2[0, -1] = (src[0, -1] + 1) % 64
    assert not torch.allclose(model(src2, tgt).logits[:, 0], base[:, 0])  # the first target sees the last source


# ---------------------------------------------------------------------- cached decoding


@pytest.mark.parametrize("kw", [{}, dict(pos_encoding="rope", norm="rmsnorm", norm_position="pre", ffn="swiglu",
                                         bias=False, num_kv_heads=2),
                                dict(pos_encoding="learned", tie_embeddings=False)])
def test_cached_decoding_equals_uncached(kw):
    model = random_encdec(**kw)
    g = torch.Generator().manual_seed(4)
    src = torch.randint(1, 64, (2, 10), generator=g)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # the second source is shorter
    tgt = torch.randint(1, 64, (2, 8), generator=g)
    full = model(src, tgt, attention_mask_BS=mask).logits
    state = model.encode(src, mask)
    cache = model.new_kv_cache(2, max_len=8)
    steps = [model.decode(tgt[:, :3], state, kv_cache=cache)]  # a prefix at once, then one at a time
    steps += [model.decode(tgt[:, t:t + 1], state, kv_cache=cache) for t in range(3, 8)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)


def test_generation_equals_greedy_full_recompute():
    model = random_encdec()
    g = torch.Generator().manual_seed(5)
    src = torch.randint(1, 64, (3, 9), generator=g)
    out = generate_encdec(model, src, decoder_start_id=0, max_new_tokens=12)
    tgt = torch.zeros(3, 1, dtype=torch.long)
    for _ in range(12):  # no cache: the whole decoder input again at every step
        nxt = model(src, tgt).logits[:, -1].argmax(-1, keepdim=True)
        tgt = torch.cat([tgt, nxt], 1)
    assert torch.equal(out, tgt[:, 1:])


def test_generation_stops_rows_at_eos():
    """A row that emits EOS keeps emitting it (padding) while the other row goes on, as it would alone."""
    model = random_encdec()
    src = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    free = generate_encdec(model, src, decoder_start_id=0, max_new_tokens=12)
    # EOS: row 0's first token that neither row emitted before and row 1 never emits.
    stops = [k for k in range(1, 12) if free[0, k] not in free[0, :k] and free[0, k] not in free[1]]
    stop, eos = stops[0], int(free[0, stops[0]])
    assert stop <= 8, f"row 0 should stop at an intermediate step, stops at {stop} of 12"
    out = generate_encdec(model, src, decoder_start_id=0, max_new_tokens=12, eos_id=eos)
    assert out.shape == (2, 12)  # row 1 never finishes, so every step runs
    assert torch.equal(out[0, :stop + 1], free[0, :stop + 1])
    assert (out[0, stop:] == eos).all()  # padded from its stop onward
    alone = generate_encdec(model, src[1:], decoder_start_id=0, max_new_tokens=12, eos_id=eos)
    assert torch.equal(out[1], alone[0]) and torch.equal(out[1], free[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_encdec(model, src, decoder_start_id=0, max_new_tokens=32)


# ---------------------------------------------------------------------- training and building


def test_training_step_lowers_the_loss_and_reaches_every_parameter():
    model = random_encdec().train()
    g = torch.Generator().manual_seed(7)
    src, tgt = torch.randint(0, 64, (4, 12), generator=g), torch.randint(0, 64, (4, 6), generator=g)
    dec_in = torch.cat([torch.zeros(4, 1, dtype=torch.long), tgt[:, :-1]], 1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.cross_entropy(model(src, dec_in).logits.flatten(0, 1), tgt.flatten())
        opt.zero_grad()
        loss.backward()
        if not losses:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_meta_build_then_init_matches_eager_shapes():
    meta = build_model(encdec_cfg(), device="meta")
    assert all(p.is_meta for p in meta.parameters())
    eager = build_model(encdec_cfg())
    assert {n: p.shape for n, p in meta.named_parameters()} == {n: p.shape for n, p in eager.named_parameters()}


# ---------------------------------------------------------------------- config


@pytest.mark.parametrize("kw, field", [
    (dict(n_encoder_layers=0), "n_encoder_layers"),
    (dict(attention="mla", pos_encoding="rope"), "attention"),
    (dict(num_experts=4), "num_experts"),
    (dict(pos_encoding="alibi"), "pos_encoding"),
    (dict(denoise_noise_density=1.0), "denoise_noise_density"),
    (dict(denoise_mean_span_length=0.5), "denoise_mean_span_length"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        encdec_cfg(**kw)


def test_n_encoder_layers_belongs_to_the_encoder_decoder():
    with pytest.raises(ValueError, match="n_encoder_layers"):
        ModelConfig(n_encoder_layers=2)
    with pytest.raises(ValueError, match="denoise_noise_density"):
        ModelConfig(denoise_noise_density=0.3)
    assert encdec_cfg(n_encoder_layers=None, n_layers=3).resolved_n_encoder_layers == 3


def test_encdec_fields_stay_out_of_decoder_hashes():
    """The train stage hashes the model through ``hash_view``, which leaves out fields at their default: a
    decoder's hash never sees the encoder-decoder family's fields (nor any field added later)."""
    from pipeline.config import hash_view

    dense = ModelConfig()
    encdec_fields = FAMILIES["encoder_decoder"].fields
    assert set(encdec_fields) == {"n_encoder_layers", "embedding_norm", "denoise_noise_density",
                                  "denoise_mean_span_length"}
    assert not set(encdec_fields) & set(hash_view(dense))
    assert set(encdec_fields) <= set(hash_view(encdec_cfg(embedding_norm=True, denoise_noise_density=0.3,
                                                          denoise_mean_span_length=2.0)))
    assert ModelConfig.from_dict(dense.to_dict()) == dense
    enc = encdec_cfg()
    assert enc.to_dict()["n_encoder_layers"] == 3
    assert ModelConfig.from_dict(enc.to_dict()) == enc
    assert dense.replace(arch="encoder_decoder", n_encoder_layers=1).resolved_n_encoder_layers == 1


@pytest.mark.parametrize("kw", [{}, dict(pos_encoding="learned", tie_embeddings=False, norm_position="pre", embedding_norm=True),
                                dict(ffn="swiglu", norm="rmsnorm", bias=False, num_kv_heads=1)])
def test_param_counts_equal_the_built_model(kw):
    from models.accounting import flops_per_token, param_counts

    cfg = encdec_cfg(**kw)
    counts = param_counts(cfg)
    model = build_model(cfg, device="meta")
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    emb = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n or n == "lm_head.weight")
    assert counts["embedding"] == emb
    # With S = T, a source and a target token together cost one forward of each stack: 2 * (all matmul
    # parameters) + attention over T keys (encoder self, decoder self and cross).
    L_enc, L_dec, H, K, T = 3, 2, 4, 8, 16
    fwd_pair = 2 * (counts["non_embedding"] + 64 * 32) + 4 * (L_enc + 2 * L_dec) * H * K * T
    assert flops_per_token(cfg, T)["forward"] == fwd_pair // 2


def test_embedding_norm_normalises_each_stacks_input():
    model = random_encdec(pos_encoding="learned", embedding_norm=True)
    src = torch.randint(0, 64, (1, 6))
    state = model.encode(src)
    x = model.tok_embeddings(src) + model.encoder_pos_embeddings(torch.arange(6))
    mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    normed = (x - mu) / torch.sqrt(var + 1e-5) * model.encoder_embed_norm.weight + model.encoder_embed_norm.bias
    h = normed
    for blk in model.encoder_layers:
        h = blk(h, None, torch.ones(1, 1, 6, 6, dtype=torch.bool), None, False)[0]
    torch.testing.assert_close(state.hidden_BSD, h, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="embedding_norm"):
        ModelConfig(embedding_norm=True)
