"""Parameter and FLOP accounting, computed analytically from the config (no model is built).

Each family computes its own (`models.families`: decoder, mamba, encdec); this module asks the table
and holds the definitions and formulas they follow.

Definitions:
- embedding: token embedding table + learned position table (if any) + the output head when it is
  NOT tied (a tied head is the embedding table, counted once).
- non_embedding: everything else (attention, FFN / experts / routers / shared experts, norms, biases).
- active: parameters one token actually uses: total minus, in every MoE layer, the (E - k) routed
  experts it does not visit. Shared experts and routers are always active.

FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B):
    total   = 6 * N + 12 * L * H * K * T
    forward = 2 * N +  4 * L * H * K * T
with N = active non-embedding parameters + V * D (the output projection is a matmul whatever the tying;
the input lookup is not), L layers, H query heads, K head_dim, T the sequence length. The attention
term counts Q K^T and A V (2 matmuls * 2 FLOPs per multiply-add) over the full T keys, as PaLM does,
i.e. it does not halve for the causal mask. total = forward + backward (backward = 2 * forward).
Under MLA the two matmuls have different widths, Q K^T over qk_nope_head_dim + qk_rope_head_dim and
A V over v_head_dim, so its attention term is 6 * L * H * (Q + V) * T (forward 2 * ...), which is
PaLM's when Q = V = K. The key/value up-projection (kv_b_proj) is in N: it runs once per token in
training, like every other projection.
Use `total * tokens_per_second / peak_flops` for MFU.

Mamba (arch 'mamba'): the same 6 * N for the projections and the convolution, and in place of the
attention term the selective scan's 9 * E * N FLOPs per token and layer forward (Gu & Dao 2023, section
3.3.2, which counts 9 B L D N for the scan), times 3 for forward + backward. Unlike attention it does not
grow with T.

Mamba-2 (arch 'mamba2'): 6 * N, and per token and layer the chunked scan's forward 2 Q H (N + P) (the
within-chunk scores and their product with the inputs over the whole Q x Q block) + 4 H P N (the chunk
states in and out), times 3. Hybrid (arch 'hybrid'): 6 * N, the attention term over its attention
layers only, and the Mamba-2 term over its Mamba-2 layers.

Encoder-decoder (arch 'encoder_decoder'): N and the attention term per token of either stack, with the
source and target streams taken as equally long (S = T = seq_len): half the FLOPs of one source token
through the encoder plus one target token through the decoder, whose attention term counts self- and
cross-attention. Span corruption makes the source longer than the target, so this is an estimate.
The decoder's cache holds what the formula below gives per target token, and the cross-attention keys
and values take the same bytes per source token, once per request.

KV-cache bytes per token (`kv_cache_bytes_per_token`), what `models.layers.attention.KVCache` stores per
generated or prompt token, over all layers:
    mha / gqa / mqa:  L * 2 * G * K * bytes       (a key and a value for each of G key/value heads)
    mla:              L * (R + P) * bytes          (the latent c_KV and the one shared RoPE key)
with G num_kv_heads (H for MHA, 1 for MQA), R kv_lora_rank, P qk_rope_head_dim; L counts a hybrid's
attention layers only. What an SSM layer keeps does not grow with the length: `state_bytes_per_sequence`.
"""

from __future__ import annotations

from models.config import ModelConfig
from models.families import family
from models.families.parts import Activations


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the model `cfg` describes (equal to sum(p.numel()) of the built model).

    Args:
        cfg: the model config.

    Returns:
        dict with total, active, embedding, non_embedding and active_non_embedding.
    """
    return family(cfg).param_counts(cfg)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> dict[str, int]:
    """Training and forward FLOPs per token (formula in the module docstring).

    Args:
        cfg: the model config.
        seq_len: T, the training sequence length.

    Returns:
        dict with total (forward + backward) and forward.

    Raises:
        ValueError: if seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return family(cfg).flops_per_token(cfg, seq_len)


def kv_cache_bytes_per_token(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes the KV cache holds per token over all layers (formula in the module docstring).

    Args:
        cfg: the model config.
        bytes_per_element: 2 for a bf16/fp16 cache (the default), 4 for fp32.

    Returns:
        Bytes per cached token.

    Raises:
        ValueError: if bytes_per_element < 1.
    """
    if bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be >= 1, got {bytes_per_element}")
    return family(cfg).kv_cache_bytes_per_token(cfg, bytes_per_element)


def state_bytes_per_sequence(cfg: ModelConfig, bytes_per_element: int = 2) -> int:
    """Bytes of generation state a sequence holds whatever its length: the SSM layers' last K - 1 conv
    inputs (in the model's dtype, ``bytes_per_element``) and their state (fp32); 0 for a Transformer.
    Mamba: L ((K - 1) E b + 4 E N); Mamba-2: L ((K - 1)(E + 2 G N) b + 4 H P N); a hybrid: its Mamba-2 layers'.

    Raises:
        ValueError: if bytes_per_element < 1.
    """
    if bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be >= 1, got {bytes_per_element}")
    return family(cfg).state_bytes_per_sequence(cfg, bytes_per_element)


def activations(cfg: ModelConfig, seq_len: int, bytes_per_element: int = 4) -> Activations:
    """What one training forward keeps for backward, in bytes per token at ``seq_len``, with activations of
    ``bytes_per_element`` (4: fp32 or amp_bf16; 2: bf16 or fp16): the family's own count
    (`models.families.parts.Activations`; each family counts its layers from its code, and
    `pipeline.plan.measure` checks the count against a real step in fp32 and in bf16).

    Raises:
        ValueError: if seq_len < 1 or bytes_per_element is not 2 or 4, or the family does not count its
            activations.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if bytes_per_element not in (2, 4):
        raise ValueError(f"bytes_per_element must be 2 or 4, got {bytes_per_element}")
    fam = family(cfg)
    if fam.activations is None:
        raise ValueError(f"the {fam.title} family (arch {cfg.arch!r}) does not count its activations")
    return fam.activations(cfg, seq_len, bytes_per_element)
