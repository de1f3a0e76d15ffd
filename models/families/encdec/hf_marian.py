"""The encoder-decoder part of the Hugging Face export: MarianMTModel and BART names, config.json, inverse.

An encoder-decoder (the family in `models.families.encdec`) exports by its positions: sinusoidal
positions export as MarianMTModel, learned positions with embedding_norm as BartForConditionalGeneration.

BART: the same layer names as Marian; a learned position table per stack, which BART indexes from row 2
(its two first rows are never read: written as zeros, dropped on import); a LayerNorm over each stack's
embeddings (our embedding_norm); no feature permutation. BART counts positions from 0 at every row,
and ours count real tokens, so the two agree on unpadded and right-padded inputs.

MarianMTModel
is the `transformers` class that computes the original paper's layout: Post-LN LayerNorm (eps 1e-5)
with biases everywhere, sinusoidal positions added to the embeddings, ReLU (or GELU) feed-forward, one
embedding table shared by encoder, decoder and (tied) output, separate encoder and decoder depths. Its
config.json says `scale_embedding: false`, since Conduit's models add positions to unscaled embeddings.

One difference is not a renaming: Marian's sinusoidal table puts the sines in the first half of the
features and the cosines in the second, where ours (models.layers.positions, the paper's formula) interleaves
them. Both hold the same D numbers per position, so the two models are the same function of their
inputs once the residual stream's features are relabelled by the permutation `_PERM` (Marian feature j
= our feature perm[j]): every tensor that reads the residual stream (embeddings, lm_head, q/k/v
projections, fc1) has its input columns permuted, every tensor that writes it (out_proj, fc2 and their
biases) its output rows, and LayerNorm weights and biases are permuted too (a LayerNorm's mean and
variance do not depend on feature order). The permutation is exact indexing, so parity holds to
rounding of the matmuls alone.

Shape legend: D d_model, V vocab.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.spec import HFFormat

# torch is imported by the functions that make tensors, so that the family table, and a config checked
# against it, load without it.
if TYPE_CHECKING:
    import torch

# Our per-layer names -> Marian's, for an encoder layer (e) and a decoder layer (d).
_ENCODER_PARTS = {"attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm", "attn.q_proj": "self_attn.q_proj",
                  "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
                  "attn.o_proj": "self_attn.out_proj", "ffn.w1": "fc1", "ffn.w2": "fc2"}
_DECODER_PARTS = {**_ENCODER_PARTS, "cross_norm": "encoder_attn_layer_norm", "cross_attn.q_proj": "encoder_attn.q_proj",
                  "cross_attn.k_proj": "encoder_attn.k_proj", "cross_attn.v_proj": "encoder_attn.v_proj",
                  "cross_attn.o_proj": "encoder_attn.out_proj"}
_FIXED = {"tok_embeddings.weight": "model.shared.weight", "lm_head.weight": "lm_head.weight"}
_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}  # our ffn -> Marian's activation_function (exact erf GELU)


def encdec_unsupported_options(cfg: ModelConfig) -> list[str]:
    """Options of an encoder-decoder `cfg` MarianMTModel (sinusoidal positions) or BART (learned positions)
    cannot express, as "field=value (reason)"."""
    if cfg.pos_encoding not in ("sinusoidal", "learned"):
        return [f"pos_encoding={cfg.pos_encoding!r} (MarianMTModel adds sinusoidal, BART learned positions)"]
    target = "MarianMTModel" if cfg.pos_encoding == "sinusoidal" else "BART"
    problems = []
    needed = {"norm": "layernorm", "norm_position": "post", "bias": True, "norm_eps": 1e-5,
              "embedding_norm": target == "BART"}
    for name, value in needed.items():
        if getattr(cfg, name) != value:
            problems.append(f"{name}={getattr(cfg, name)!r} ({target} has {value!r})")
    if cfg.ffn not in _ACTIVATIONS:
        problems.append(f"ffn={cfg.ffn!r} ({target}'s feed-forward is two matrices: relu or gelu)")
    if cfg.resolved_num_kv_heads != cfg.n_heads:
        problems.append(f"num_kv_heads={cfg.num_kv_heads} ({target} has one key/value head per query head)")
    return problems


def _perm(d_model: int) -> torch.Tensor:
    """Marian feature j = our feature perm[j]: our sin features (even) first, then our cos features (odd)."""
    import torch

    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def _relabel(name: str, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Index the residual-stream axis of our tensor `name` by `index` (see the module docstring)."""
    if name in ("tok_embeddings.weight", "lm_head.weight") or (name.endswith(".weight") and name.rsplit(".", 2)[-2]
                                                                  in ("q_proj", "k_proj", "v_proj", "w1")):
        return t[:, index]
    if name.endswith(("norm.weight", "norm.bias")) or name.rsplit(".", 2)[-2] in ("o_proj", "w2"):
        return t[index]
    return t  # q/k/v/w1 biases live in head or hidden space


def _hf_name(name: str) -> str:
    if name in _FIXED:
        return _FIXED[name]
    m = re.fullmatch(r"(encoder_layers|layers)\.(\d+)\.(.+)\.(weight|bias)", name)
    parts = _ENCODER_PARTS if m and m.group(1) == "encoder_layers" else _DECODER_PARTS
    if m is None or m.group(3) not in parts:
        raise ValueError(f"no MarianMTModel name for parameter {name!r}")
    stack = "encoder" if m.group(1) == "encoder_layers" else "decoder"
    return f"model.{stack}.layers.{m.group(2)}.{parts[m.group(3)]}.{m.group(4)}"


def to_marian_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (lm_head absent when tied) -> MarianMTModel checkpoint tensors."""
    index = _perm(cfg.d_model)
    out = {_hf_name(name): _relabel(name, t, index).contiguous() for name, t in state.items()}
    # transformers ties the stacks' embed_tokens to model.shared only together with tie_word_embeddings,
    # so the table is written under all three names (copies: safetensors refuses shared storage).
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_tokens.weight"] = out["model.shared.weight"].clone()
    return out


def from_marian_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, permute: bool = True) -> dict[str, torch.Tensor]:
    """MarianMTModel checkpoint tensors -> our state dict (inverse of `to_marian_tensors`).

    The copies of the shared table (encoder/decoder embed_tokens, which must equal it) and positional
    tables (computed by Marian, never trained) are dropped; final_logits_bias must be zero, since our lm_head has no bias.

    Raises:
        ValueError: on a non-zero final_logits_bias, stack embeddings that differ from the shared table,
            or a tensor with no counterpart here.
    """
    import torch

    inverse = {}
    for name in _FIXED:
        inverse[_FIXED[name]] = name
    for i in range(cfg.resolved_n_encoder_layers):
        for ours in _ENCODER_PARTS:
            for kind in ("weight", "bias"):
                inverse[_hf_name(f"encoder_layers.{i}.{ours}.{kind}")] = f"encoder_layers.{i}.{ours}.{kind}"
    for i in range(cfg.n_layers):
        for ours in _DECODER_PARTS:
            for kind in ("weight", "bias"):
                inverse[_hf_name(f"layers.{i}.{ours}.{kind}")] = f"layers.{i}.{ours}.{kind}"
    back = torch.argsort(_perm(cfg.d_model)) if permute else torch.arange(cfg.d_model)
    state = {}
    for hf_name, t in tensors.items():
        if hf_name == "final_logits_bias":
            if bool(t.ne(0).any()):
                raise ValueError("final_logits_bias is not zero: our lm_head has no bias")
            continue
        if hf_name in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"):
            if "model.shared.weight" in tensors and not torch.equal(t, tensors["model.shared.weight"]):
                raise ValueError(f"{hf_name} differs from model.shared.weight: one table must serve both stacks")
            continue
        if hf_name.endswith("embed_positions.weight"):
            continue
        if hf_name not in inverse:
            raise ValueError(f"unexpected tensor {hf_name!r} in MarianMTModel checkpoint")
        name = inverse[hf_name]
        state[name] = _relabel(name, t, back).contiguous()
    return state


_BART_EMBEDDINGS = {"encoder_pos_embeddings.weight": "model.encoder.embed_positions.weight",
                    "pos_embeddings.weight": "model.decoder.embed_positions.weight",
                    "encoder_embed_norm.weight": "model.encoder.layernorm_embedding.weight",
                    "encoder_embed_norm.bias": "model.encoder.layernorm_embedding.bias",
                    "embed_norm.weight": "model.decoder.layernorm_embedding.weight",
                    "embed_norm.bias": "model.decoder.layernorm_embedding.bias"}
BART_POSITION_OFFSET = 2  # BartLearnedPositionalEmbedding reads row position + 2


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict -> MarianMTModel (sinusoidal) or BART (learned positions) checkpoint tensors."""
    import torch

    if cfg.pos_encoding == "sinusoidal":
        return to_marian_tensors(state, cfg)
    rest = {k: v for k, v in state.items() if k not in _BART_EMBEDDINGS}
    out = {_hf_name(name): t.contiguous() for name, t in rest.items()}
    for stack in ("encoder", "decoder"):
        out[f"model.{stack}.embed_tokens.weight"] = out["model.shared.weight"].clone()
    for ours, theirs in _BART_EMBEDDINGS.items():
        t = state[ours]
        if ours.endswith("pos_embeddings.weight"):
            t = torch.cat([torch.zeros(BART_POSITION_OFFSET, t.shape[1], dtype=t.dtype), t])
        out[theirs] = t.contiguous()
    return out


def from_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """MarianMTModel or BART checkpoint tensors -> our state dict (inverse of `to_hf_tensors`)."""
    if cfg.pos_encoding == "sinusoidal":
        return from_marian_tensors(tensors, cfg)
    inverse = {v: k for k, v in _BART_EMBEDDINGS.items()}
    state = {}
    for name, t in tensors.items():
        if name in inverse:
            ours = inverse[name]
            state[ours] = t[BART_POSITION_OFFSET:].contiguous() if ours.endswith("pos_embeddings.weight") else t
    rest = {k: v for k, v in tensors.items() if k not in inverse}
    # The layers and the shared table map as in Marian's layout; undo no permutation, as none was applied.
    mapped = from_marian_tensors(rest, cfg, permute=False)
    return {**mapped, **state}


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of the class `cfg` exports as (see `to_hf_tensors`)."""
    out = marian_hf_config(cfg, dtype)
    if cfg.pos_encoding == "learned":
        out.update(architectures=["BartForConditionalGeneration"], model_type="bart")
        out.pop("decoder_vocab_size")
        out.pop("share_encoder_decoder_embeddings")
    return out


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a MarianMTModel or BART config.json describes (see `encdec_config_from_hf`)."""
    cfg = encdec_config_from_hf(hf)
    if hf.get("model_type") == "bart":
        cfg = cfg.replace(pos_encoding="learned", embedding_norm=True)
    return cfg


def marian_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of MarianMTModel for `cfg` (token ids are set by save_hf's caller or default to 0)."""
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "is_encoder_decoder": True,
        "vocab_size": cfg.vocab_size,
        "decoder_vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "encoder_layers": cfg.resolved_n_encoder_layers,
        "decoder_layers": cfg.n_layers,
        "encoder_attention_heads": cfg.n_heads,
        "decoder_attention_heads": cfg.n_heads,
        "encoder_ffn_dim": cfg.resolved_d_ff,
        "decoder_ffn_dim": cfg.resolved_d_ff,
        "activation_function": _ACTIVATIONS[cfg.ffn],
        "max_position_embeddings": cfg.max_seq_len,
        "scale_embedding": False,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": cfg.tie_embeddings,
        "init_std": cfg.init_std,
        "attention_dropout": cfg.attn_dropout,
        "dropout": cfg.dropout,
        "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


# Marian's defaults point at its 58,101-token vocabulary; ours are set when the caller names none.
TOKEN_ID_DEFAULTS = {"pad_token_id": 0, "eos_token_id": 0}


def encdec_config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a MarianMTModel config.json describes.

    Raises:
        ValueError: naming the key when the checkpoint computes something our encoder-decoder does not
            (scaled embeddings, separate encoder/decoder tables or vocabularies, unequal encoder and
            decoder widths, another activation).
    """
    if hf.get("scale_embedding", False):
        raise ValueError("scale_embedding=True is not supported (our embeddings are not multiplied by sqrt(d_model))")
    if not hf.get("share_encoder_decoder_embeddings", True):
        raise ValueError("share_encoder_decoder_embeddings=False is not supported (one table serves both stacks)")
    vocab = hf["vocab_size"]
    if hf.get("decoder_vocab_size", vocab) not in (None, vocab):
        raise ValueError(f"decoder_vocab_size {hf['decoder_vocab_size']} != vocab_size {vocab}")
    for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf[enc] != hf[dec]:
            raise ValueError(f"{enc} ({hf[enc]}) != {dec} ({hf[dec]}): both stacks share one width here")
    act = hf.get("activation_function", "gelu")
    if act not in _ACTIVATIONS.values():
        raise ValueError(f"activation_function must be one of {sorted(_ACTIVATIONS.values())}, got {act!r}")
    return ModelConfig(
        arch="encoder_decoder", vocab_size=vocab, d_model=hf["d_model"], n_layers=hf["decoder_layers"],
        n_encoder_layers=hf["encoder_layers"], n_heads=hf["encoder_attention_heads"], d_ff=hf["encoder_ffn_dim"],
        ffn=act, max_seq_len=hf["max_position_embeddings"], norm="layernorm", norm_position="post",
        pos_encoding="sinusoidal", bias=True, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        init_std=float(hf.get("init_std", 0.02)), attn_dropout=float(hf.get("attention_dropout", 0.0)),
    )


def encdec_architecture(cfg: ModelConfig) -> tuple:
    """What config.json determines of an encoder-decoder, with derived sizes resolved."""
    return (cfg.arch, cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.resolved_n_encoder_layers, cfg.n_heads,
            cfg.resolved_d_ff, cfg.ffn, cfg.max_seq_len, cfg.norm, cfg.norm_position, cfg.pos_encoding, cfg.bias,
            cfg.tie_embeddings, cfg.resolved_num_kv_heads, cfg.norm_eps, cfg.embedding_norm)


def _config_defaults(hf_cfg: dict) -> dict:
    """Token ids a caller left unset, and the decoder's start token (the pad id, Marian's convention)."""
    pad = hf_cfg.get("pad_token_id", TOKEN_ID_DEFAULTS["pad_token_id"])
    return {**TOKEN_ID_DEFAULTS, "decoder_start_token_id": pad}


FORMAT = HFFormat(
    name="MarianMTModel",
    model_types=("marian", "bart"),
    unsupported_options=encdec_unsupported_options,
    hf_config=hf_config,
    config_from_hf=config_from_hf,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    architecture=encdec_architecture,
    config_defaults=_config_defaults,
)
