"""The encoder-decoder Transformer (``arch: encoder_decoder``): an encoder over the source and a decoder
with cross-attention over its output, trained to denoise (T5 span corruption).

Built as `models.families.encdec.model.EncoderDecoderLM`, exported as MarianMTModel (sinusoidal positions) or BART
(learned positions, embedding_norm) by `models.families.encdec.hf_marian`. Its own fields: the encoder depth, the
embedding norm and the denoising objective's two settings, whose arithmetic (`span_counts`, `denoising_lengths`)
lives here so that the config, the data and evaluation all read it from the family.

Accounting: N and the attention term per token of either stack, with the source and target streams
taken as equally long (S = T = seq_len): half the FLOPs of one source token through the encoder plus one
target token through the decoder, whose attention term counts self- and cross-attention. Span
corruption makes the source longer than the target, so this is an estimate. The decoder's cache holds
what the attention kind caches per target token; the cross-attention keys and values take the same bytes
per source token, once per request.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families.encdec import hf_marian
from models.families.decoder import attention_sublayer, rope_tables
from models.families.parts import Activations, ffn_params, ffn_sublayer, norm_params, norm_saved, require
from models.families.spec import Family
from models.layers.kinds import MHA, attention_kind
from models.tensors import Module, block_ffn, embedding, ffn, norm, output_head


def span_counts(length: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a block of `length` tokens, T5's rounding: round(L * density)
    noise tokens (at least 1, at most L - 1) in max(1, round(noise / mean_span_length)) spans.

    Raises:
        ValueError: on a block shorter than 2 tokens (it has no room for kept and noise tokens).
    """
    if length < 2:
        raise ValueError(f"span corruption needs blocks of at least 2 tokens, got {length}")
    noise = min(max(round(length * noise_density), 1), length - 1)
    spans = max(round(noise / mean_span_length), 1)
    return noise, min(spans, noise, length - noise)  # every run non-empty


def denoising_lengths(cfg: ModelConfig, block_len: int) -> tuple[int, int]:
    """(encoder length, decoder length) of every span-corrupted block of `block_len` tokens: the kept
    tokens plus a sentinel per span, and the noise tokens plus a sentinel per span plus EOS."""
    noise, spans = span_counts(block_len, cfg.denoise_noise_density, cfg.denoise_mean_span_length)
    return block_len - noise + spans, noise + spans + 1


def _stack_params(cfg: ModelConfig) -> tuple[int, int, int]:
    """(encoder, decoder) non-embedding parameters and the encoder depth. An encoder layer is a decoder
    layer without cross-attention: two norms, self-attention, FFN; a decoder layer adds a norm and the
    cross-attention; pre-norm stacks end in one norm each, and embedding_norm adds one per stack."""
    attention = attention_kind(cfg).params(cfg)
    final = norm_params(cfg) if cfg.norm_position == "pre" else 0
    enc_layer = 2 * norm_params(cfg) + attention + ffn_params(cfg, cfg.resolved_d_ff)
    dec_layer = enc_layer + norm_params(cfg) + attention
    final += norm_params(cfg) if cfg.embedding_norm else 0
    L_enc = cfg.resolved_n_encoder_layers
    return L_enc * enc_layer + final, cfg.n_layers * dec_layer + final, L_enc


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """One shared token table, one learned position table per stack."""
    D, V = cfg.d_model, cfg.vocab_size
    embedding = V * D * (1 if cfg.tie_embeddings else 2)
    if cfg.pos_encoding == "learned":
        embedding += 2 * cfg.max_seq_len * D
    n_enc, n_dec, _ = _stack_params(cfg)
    total = embedding + n_enc + n_dec
    return {"total": total, "active": total, "embedding": embedding, "non_embedding": n_enc + n_dec,
            "active_non_embedding": n_enc + n_dec}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    n_enc, n_dec, L_enc = _stack_params(cfg)
    n = (n_enc + n_dec + cfg.vocab_size * cfg.d_model) / 2
    attn = (L_enc + 2 * cfg.n_layers) * cfg.n_heads * 2 * cfg.head_dim * seq_len / 2
    return {"total": round(6 * n + 6 * attn), "forward": round(2 * n + 2 * attn)}


def activations(cfg: ModelConfig, seq_len: int, b: int) -> Activations:
    """Per target token with the source as long as the target: the encoder layers as decoder layers, then
    the decoder layers with a cross-attention sublayer (its norm and input, the queries, output and fp32
    log-sum-exp, and the source's keys and values, which the model projects once outside the blocks, so a
    checkpointed decoder layer keeps them beside its input). Activation checkpointing wraps the blocks of
    both stacks (`pipeline.training.parallelize`): a checkpointed encoder layer keeps its input alone.

    Outside the layers, in both modes: the encoder's bidirectional (B, 1, S, S) boolean mask (S bytes per
    token, which every encoder layer's attention, or its checkpoint, holds); the encoder's output, which the
    cross-attention projections read (with pre-norm the final norm's input and products; with post-norm the
    last layer's normed output, which only a checkpointed layer does not keep itself); and with
    ``embedding_norm`` each stack's embedding norm beyond its output (the first layer's input)."""
    H, G, K, D = cfg.n_heads, cfg.resolved_num_kv_heads, cfg.head_dim, cfg.d_model
    encoder = attention_sublayer(cfg, seq_len, b) + ffn_sublayer(cfg, 0, b)[0]
    cross = norm_saved(cfg, b) + b * (2 * H * K + 2 * G * K) + 4 * H
    L_enc, L = cfg.resolved_n_encoder_layers, cfg.n_layers
    layers = (encoder,) * L_enc + (encoder + cross,) * L
    pre = cfg.norm_position == "pre"
    memory, memory_checkpointed = (norm_saved(cfg, b),) * 2 if pre else (0.0, float(b * D))
    embed_norms = 2 * (norm_saved(cfg, b) - b * D) if cfg.embedding_norm else 0.0
    outside = float(seq_len) + embed_norms
    return Activations(stem=2 * rope_tables(cfg, b) + memory + outside,
                       stem_checkpointed=2 * rope_tables(cfg, b, True) + memory_checkpointed + outside, layers=layers,
                       widest=(float(cfg.resolved_d_ff * b),) * (L_enc + L),
                       inputs=(float(b * D),) * L_enc + (float(b * (D + 2 * G * K)),) * L)


def _check(cfg: ModelConfig) -> None:
    # ALiBi's bias is written for causal attention (distance to past keys) and MLA/MoE were never built
    # into the encoder-decoder layers: refused rather than silently ignored.
    require(cfg, {"attention": "mha", "num_experts": 0})
    if cfg.pos_encoding == "alibi":
        raise ValueError("pos_encoding must be one of ['rope', 'sinusoidal', 'learned', 'none'] when arch is "
                         "'encoder_decoder' (ALiBi is defined for causal attention), got 'alibi'")


def modules(cfg: ModelConfig) -> list[Module]:
    """`models.families.encdec.model.EncoderDecoderLM`'s modules (`models.tensors`): the shared token table,
    each stack's positions and embedding norm, the encoder's Transformer blocks, the decoder's blocks
    (self-attention, cross-attention, feed-forward, each with its norm) and the final norms."""
    D = cfg.d_model
    out = [embedding("tok_embeddings", cfg.vocab_size, D)]
    if cfg.pos_encoding == "learned":
        out += [embedding("encoder_pos_embeddings", cfg.max_seq_len, D), embedding("pos_embeddings", cfg.max_seq_len, D)]
    if cfg.embedding_norm:
        out += [norm(cfg, "encoder_embed_norm"), norm(cfg, "embed_norm")]
    for i in range(cfg.resolved_n_encoder_layers):
        p = f"encoder_layers.{i}"
        out += [norm(cfg, f"{p}.attn_norm"), *attention_kind(cfg).modules(cfg, f"{p}.attn"), norm(cfg, f"{p}.ffn_norm"),
                *block_ffn(cfg, f"{p}.ffn", i)]
    for i in range(cfg.n_layers):
        p = f"layers.{i}"
        out += [norm(cfg, f"{p}.attn_norm"), *MHA.modules(cfg, f"{p}.attn"), norm(cfg, f"{p}.cross_norm"),
                *MHA.modules(cfg, f"{p}.cross_attn"), norm(cfg, f"{p}.ffn_norm"), *ffn(cfg, f"{p}.ffn", cfg.resolved_d_ff)]
    if cfg.norm_position == "pre":
        out += [norm(cfg, "encoder_norm"), norm(cfg, "norm")]
    return out + [output_head(cfg)]


FAMILY = Family(
    arch="encoder_decoder",
    title="encoder-decoder Transformer",
    fields=("n_encoder_layers", "embedding_norm", "denoise_noise_density", "denoise_mean_span_length"),
    check=_check,
    model="models.families.encdec.model:EncoderDecoderLM",
    param_counts=param_counts,
    flops_per_token=flops_per_token,
    kv_cache_bytes_per_token=lambda cfg, b: cfg.n_layers * attention_kind(cfg).cache_width(cfg) * b,
    hf_format=lambda cfg: hf_marian.FORMAT,
    hf_formats=(hf_marian.FORMAT,),
    modules=modules,
    seq2seq=True,
    draws_attention=False,
    describe=lambda cfg: "encoder-decoder",
    activations=activations,
)
