"""Named model presets and `build_model`.

debug_* run a training step in well under a second on one CPU core; cpu_* are for laptop-scale runs;
gpt_125m, llama_1b and moe_8x_top2 are GPU sizes (GPT-3 Small, a Llama-3.2-1B-like shape with GQA, and
a Mixtral-style 8-expert top-2 model); debug_mamba (debug_mamba2) is a Mamba (Mamba-2) model at debug_dense's
width and depth, mamba (mamba2) one with cpu_small's width and about its parameter count (8 layers);
debug_hybrid and hybrid mix attention and Mamba-2 layers at the same widths.

cpu_mla_moe and mla_moe_32x_top4 pair multi-head latent attention with shared plus routed experts, as
DeepSeek-V2 does (narrow routed experts, no top-k renormalisation, the first layer dense), so they export
to DeepseekV2ForCausalLM.
mla_moe_32x_top4, by models.accounting: 2.56 B parameters, 0.68 B active per token; weights 5.1 GB in
bf16; training with bf16 mixed precision and AdamW holds about 16 bytes per parameter (bf16 weights and
gradients, fp32 master weights and two Adam moments), 41.0 GB before activations, to be split by ZeRO
over the GPUs; its KV cache holds 23,040 bytes per token in bf16 (94 MB for one 4,096-token sequence),
against 122,880 for MHA with the same 12 x 128 heads, 5.3 times less.
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families import family

# torch, and the model classes, are imported when a model is built: the presets, read by every run config,
# load without them.
if TYPE_CHECKING:
    import torch

    from models.families.decoder.model import Transformer
    from models.families.encdec.model import EncoderDecoderLM
    from models.families.mamba.model import MambaLM

_debug_dense = ModelConfig(vocab_size=512, d_model=64, n_layers=2, n_heads=4, max_seq_len=128)
_cpu_small = ModelConfig(vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=256)

PRESETS: dict[str, ModelConfig] = {
    "debug_dense": _debug_dense,
    "debug_moe": _debug_dense.replace(num_experts=4, moe_top_k=2),
    "cpu_small": _cpu_small,
    "cpu_medium": ModelConfig(vocab_size=512, d_model=256, n_layers=6, n_heads=8, max_seq_len=256),
    "cpu_moe": _cpu_small.replace(num_experts=8, moe_top_k=2),
    "gpt_125m": ModelConfig(vocab_size=32000, d_model=768, n_layers=12, n_heads=12, max_seq_len=2048),
    "llama_1b": ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=16, n_heads=32, num_kv_heads=8, max_seq_len=2048
    ),
    "moe_8x_top2": ModelConfig(
        vocab_size=32000, d_model=1024, n_layers=16, n_heads=16, max_seq_len=2048, num_experts=8, moe_top_k=2
    ),
    "cpu_mla_moe": _cpu_small.replace(
        attention="mla", kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        num_experts=8, moe_top_k=2, moe_shared_experts=1, moe_d_ff=128, moe_renormalize=False,
        moe_first_dense_layers=1,
    ),
    "mla_moe_32x_top4": ModelConfig(
        vocab_size=32000, d_model=1536, n_layers=20, n_heads=12, max_seq_len=4096, attention="mla",
        kv_lora_rank=512, q_lora_rank=768, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        num_experts=32, moe_top_k=4, moe_shared_experts=2, moe_d_ff=768, moe_renormalize=False,
        moe_first_dense_layers=1,
    ),
    # Mamba at cpu_small's width with twice its layers: a Mamba block (in_proj D x 2E, out_proj E x D, E = 2D)
    # holds about half a Transformer block's parameters, so 8 of them match cpu_small's 4 (933k against
    # 853k non-embedding parameters), as Gu & Dao pair two Mamba blocks with one attention + MLP block.
    "mamba": ModelConfig(
        arch="mamba", vocab_size=512, d_model=128, n_layers=8, max_seq_len=256, pos_encoding="none"
    ),
    "debug_mamba2": ModelConfig(
        arch="mamba2", vocab_size=512, d_model=64, n_layers=2, max_seq_len=128, pos_encoding="none",
        ssm_head_dim=16, ssm_chunk_size=16,
    ),
    # Mamba-2 at cpu_small's width, 8 layers like mamba (a Mamba-2 block holds about half a Transformer block).
    "mamba2": ModelConfig(
        arch="mamba2", vocab_size=512, d_model=128, n_layers=8, max_seq_len=256, pos_encoding="none",
        ssm_head_dim=32, ssm_chunk_size=64,
    ),
    # Hybrids: debug_hybrid at debug_mamba2's width, two attention layers among four; hybrid at cpu_small's
    # width and about its parameter count, one attention layer among four (Jamba and Granite 4.0 lean
    # further to Mamba: one in eight, one in ten).
    "debug_hybrid": ModelConfig(
        arch="hybrid", vocab_size=512, d_model=64, n_layers=4, n_heads=4, max_seq_len=128, hybrid_layers="MAMA",
        ssm_head_dim=16, ssm_chunk_size=16,
    ),
    "hybrid": ModelConfig(
        arch="hybrid", vocab_size=512, d_model=128, n_layers=4, n_heads=4, max_seq_len=256,
        hybrid_layers="MMAM", ssm_head_dim=32, ssm_chunk_size=64,
    ),
    "debug_mamba": ModelConfig(
        arch="mamba", vocab_size=512, d_model=64, n_layers=2, max_seq_len=128, pos_encoding="none"
    ),
    # The original Transformer's layout (Post-LN LayerNorm with biases, sinusoidal positions, ReLU, one
    # embedding table for source, target and output) at debug_dense's and cpu_small's widths; the
    # decoder depth n_layers, the encoder depth n_encoder_layers.
    "debug_encdec": ModelConfig(
        arch="encoder_decoder", vocab_size=512, d_model=64, n_layers=2, n_encoder_layers=2, n_heads=4,
        max_seq_len=128, norm="layernorm", norm_position="post", pos_encoding="sinusoidal", ffn="relu",
        bias=True, tie_embeddings=True,
    ),
    "encdec": ModelConfig(
        arch="encoder_decoder", vocab_size=512, d_model=128, n_layers=4, n_encoder_layers=4, n_heads=4,
        max_seq_len=256, norm="layernorm", norm_position="post", pos_encoding="sinusoidal", ffn="relu",
        bias=True, tie_embeddings=True,
    ),
}


def model_class(cfg: ModelConfig) -> type[Transformer] | type[MambaLM] | type[EncoderDecoderLM]:
    """The nn.Module class that builds `cfg` (its family's, `models.families`; importing it imports torch)."""
    return family(cfg).model_class


def get_preset(name: str) -> ModelConfig:
    """The preset config called `name`.

    Raises:
        ValueError: on an unknown name (with the closest preset name and the full list).
    """
    if name not in PRESETS:
        close = difflib.get_close_matches(name, list(PRESETS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model preset {name!r}{hint} (allowed: {sorted(PRESETS)})")
    return PRESETS[name]


def build_model(
    cfg_or_preset_name: ModelConfig | str,
    device: torch.device | str | None = None,
    **overrides,
) -> Transformer | MambaLM | EncoderDecoderLM:
    """Build and initialise a model of `cfg`'s family (a Transformer, a MambaLM, an EncoderDecoderLM).

    The module is created on the meta device, materialised on `device` with `to_empty` and then set
    by `init_weights()`, so weights are initialised once, directly where they live.

    Args:
        cfg_or_preset_name: a ModelConfig or a key of PRESETS.
        device: where the parameters live (default CPU); "meta" gives an uninitialised shape-only model.
        **overrides: ModelConfig fields to change, e.g. vocab_size=8000.

    Returns:
        The initialised Transformer (in training mode, fp32).

    Raises:
        ValueError: on an unknown preset, unknown override key or bad value.
    """
    import torch

    if isinstance(cfg_or_preset_name, str):
        cfg = get_preset(cfg_or_preset_name)
    elif isinstance(cfg_or_preset_name, ModelConfig):
        cfg = cfg_or_preset_name
    else:
        raise ValueError(f"build_model expects a ModelConfig or preset name, got {type(cfg_or_preset_name).__name__}")
    if overrides:
        cfg = cfg.replace(**overrides)
    from models.layers.base import SkipInitOnMeta

    device = torch.device("cpu" if device is None else device)
    with torch.device("meta"), SkipInitOnMeta():
        model = model_class(cfg)(cfg)
    if device.type == "meta":
        return model
    model.to_empty(device=device)
    model.init_weights()
    return model
