"""The one typed model configuration.

`ModelConfig` is a frozen dataclass: every architectural option of the Transformer is a field here, and
`__post_init__` rejects bad values early with an error that names the field and the allowed values.
Derived sizes (`head_dim`, `resolved_d_ff`, ...) are properties so that they can never disagree with the
fields they come from.

This module is data: it imports no other module of `models` at its top. The rules that depend on a
config's family and attention kind (which values ``arch`` and ``attention`` may take, the fields of
every other family left at their defaults, each family's own checks) belong to the family table,
`models.families`, which sits above this module. The table hands them in through
`register_family_rules` when it is imported, and importing any module of `models` imports the table
first (``models/__init__.py`` imports it), so ``ModelConfig(...)`` and every config load run them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

POS_ENCODINGS = ("rope", "alibi", "sinusoidal", "learned", "none")
FFN_KINDS = ("swiglu", "gelu", "relu")
NORM_KINDS = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
# How MoE experts run (models/layers/grouped_experts.py): one grouped matmul per projection where it works, or a loop.
MOE_EXPERT_IMPLS = ("auto", "grouped_mm", "loop")
MOE_ROUTERS = ("softmax", "sigmoid")
MOE_AUX_LOSS_SCOPES = ("batch", "sequence")
ROPE_SCALING_TYPES = ("linear", "ntk", "dynamic", "yarn", "llama3")  # models.layers.positions.RopeScaling
# Tokens per chunk of the chunked loss (models.layers.loss): train.loss_chunk_tokens's default, and evaluation's
# (see benchmarks/train_step.py). Here rather than beside the loss so that a run config reads it without torch.
DEFAULT_CHUNK_TOKENS = 512
# Optional sizes: None (derived) or an int >= 1.
_OPTIONAL_SIZES = ("num_kv_heads", "d_ff", "moe_d_ff", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                   "qk_rope_head_dim", "v_head_dim", "ssm_dt_rank", "n_encoder_layers")


# What a run that continues a model's weights (a context extension, pipeline train.init_from) may set
# differently: the context and its RoPE scaling, and options of training that no weight depends on.
CONTINUABLE_FIELDS = ("max_seq_len", "rope_scaling", "rope_scaling_type", "rope_original_max_seq_len",
                      "rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_mscale", "rope_yarn_mscale_all_dim",
                      "rope_llama3_low_freq_factor", "rope_llama3_high_freq_factor", "dropout", "attn_dropout",
                      "init_std", "moe_capacity_factor", "moe_aux_loss_coef", "moe_aux_loss_scope", "moe_z_loss_coef",
                      "moe_expert_impl", "moe_bias_update_rate", "denoise_noise_density", "denoise_mean_span_length")


def continuation_problems(parent: "ModelConfig", child: "ModelConfig") -> list[str]:
    """Why ``child`` cannot start from ``parent``'s weights: each field outside ``CONTINUABLE_FIELDS``
    that differs, as ``name: parent value -> child value`` (empty when it can)."""
    problems = [f"{f.name}: {getattr(parent, f.name)!r} -> {getattr(child, f.name)!r}"
                for f in dataclasses.fields(parent)
                if f.name not in CONTINUABLE_FIELDS and getattr(parent, f.name) != getattr(child, f.name)]
    if parent.max_seq_len != child.max_seq_len and parent.pos_encoding == "learned":
        problems.append(f"max_seq_len: {parent.max_seq_len} -> {child.max_seq_len} with learned positions (a table "
                        "of max_seq_len rows; RoPE extends, a learned table does not)")
    return problems


@dataclass(frozen=True)
class FamilyRules:
    """What the family table (`models.families`) tells the config about families and attention kinds.

    Attributes:
        families: the family table, read live: its keys are the values ``arch`` may take.
        attention_kinds: the attention-kind table, read live: its keys are the values ``attention`` may take.
        check: the rules that depend on the family and the attention kind; raises ValueError naming the
            field. Called with the config and the fields' defaults.
        rope_head_dim: how many features of each query/key head RoPE rotates, by attention kind.
    """

    families: Mapping[str, Any]
    attention_kinds: Mapping[str, Any]
    check: Callable[["ModelConfig", dict], None]
    rope_head_dim: Callable[["ModelConfig"], int]


_FAMILY_RULES: list[FamilyRules] = []  # one entry, set by models.families when it is imported


def register_family_rules(rules: FamilyRules) -> None:
    """Install the family table's rules (`models.families` calls this once, at its import)."""
    _FAMILY_RULES[:] = [rules]


def family_rules() -> FamilyRules:
    """The family table's rules.

    Raises:
        RuntimeError: the table has not been imported (it always is once any module of `models` is).
    """
    if not _FAMILY_RULES:
        raise RuntimeError("the family table (models.families) has not registered its rules with models.config; "
                           "import models (or models.families) before building a ModelConfig")
    return _FAMILY_RULES[0]


def _swiglu_hidden(d_model: int, multiple_of: int) -> int:
    """SwiGLU hidden size: int(8/3 * d) rounded up to a multiple of `multiple_of`.

    The 8/3 factor keeps SwiGLU's three matrices at the parameter count of a 4*d two-matrix FFN
    (Shazeer 2020, "GLU Variants Improve Transformer"); rounding up keeps matmuls hardware friendly.
    """
    hidden = int(8 * d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Conduit model: a decoder-only Transformer, a Mamba model or an encoder-decoder (`arch`).

    Field groups: sizes (vocab_size .. max_seq_len), attention kind (attention and the MLA sizes
    kv_lora_rank .. v_head_dim), positions (pos_encoding, rope_*), block layout (ffn, norm,
    norm_position, norm_eps, bias, tie_embeddings), regularisation (dropout, attn_dropout),
    initialisation (init_std), mixture of experts (num_experts, moe_*), the family (arch) with Mamba's
    ssm_* and the encoder-decoder's fields. Which fields belong to which family or attention kind, and
    the checks that depend on them, are the family table's (`models.families`). See the field comments.

    Raises:
        ValueError: from `__post_init__` when a field has a bad type or value; the message names the
            field and what is allowed.
    """

    vocab_size: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    num_kv_heads: int | None = None  # None = n_heads (MHA); 1 = MQA; otherwise GQA; must divide n_heads
    d_ff: int | None = None  # None: 4*d for relu/gelu, int(8/3*d) rounded up to ffn_multiple_of for swiglu
    ffn_multiple_of: int = 64
    max_seq_len: int = 256

    # mha: multi-head attention with n_heads query heads and num_kv_heads key/value heads (MHA/GQA/MQA).
    # mla: multi-head latent attention (DeepSeek-V2, DeepSeek-AI 2024): keys and values come from one
    # kv_lora_rank-wide latent per token, which (with one shared qk_rope_head_dim RoPE key) is all the
    # KV cache holds. The five sizes below are MLA's; they must stay None (unset) with mha. None under
    # mla takes DeepSeek-V2's proportions of a head_dim (= d_model / n_heads) model: kv_lora_rank
    # 4 * head_dim, q_lora_rank None (queries through a full-rank projection), qk_nope_head_dim
    # head_dim, qk_rope_head_dim head_dim / 2, v_head_dim head_dim.
    attention: str = "mha"
    kv_lora_rank: int | None = None  # width of the compressed key/value latent c_KV
    q_lora_rank: int | None = None  # width of the compressed query latent c_Q; None: no query compression
    qk_nope_head_dim: int | None = None  # per-head query/key features without position
    qk_rope_head_dim: int | None = None  # per-head query features (and the one shared key) carrying RoPE; even
    v_head_dim: int | None = None  # per-head value width

    pos_encoding: str = "rope"
    rope_base: float = 10000.0
    # Context extension (models.layers.positions.RopeScaling): rope_scaling is the factor s (1 = none),
    # rope_scaling_type the method: linear (position interpolation: RoPE sees position / s), ntk,
    # dynamic, yarn or llama3. dynamic, yarn and llama3 need rope_original_max_seq_len, the context
    # the model was trained at; the yarn_* and llama3_* fields are those methods' parameters.
    rope_scaling: float = 1.0
    rope_scaling_type: str = "linear"
    rope_original_max_seq_len: int | None = None
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    rope_yarn_mscale: float | None = None  # DeepSeek's mscale and mscale_all_dim (both or neither)
    rope_yarn_mscale_all_dim: float | None = None
    rope_llama3_low_freq_factor: float = 1.0
    rope_llama3_high_freq_factor: float = 4.0

    ffn: str = "swiglu"
    norm: str = "rmsnorm"
    norm_position: str = "pre"
    norm_eps: float = 1e-5
    bias: bool = False  # biases on attention/FFN linears and on LayerNorm (never on router or lm_head)
    tie_embeddings: bool = False
    dropout: float = 0.0  # embedding and residual-branch dropout
    attn_dropout: float = 0.0  # dropout on attention probabilities
    init_std: float = 0.02

    num_experts: int = 0  # 0 = dense model
    moe_top_k: int = 2
    # Layer i is MoE iff num_experts > 0, i >= moe_first_dense_layers and (i + 1) % moe_every == 0.
    moe_every: int = 1
    moe_first_dense_layers: int = 0  # the first layers stay dense (DeepSeek's first_k_dense_replace)
    moe_capacity_factor: float | None = None  # None = dropless
    moe_renormalize: bool = True  # renormalise the selected top-k router probabilities to sum to 1
    moe_shared_experts: int = 0  # dense experts that every token passes through
    moe_aux_loss_coef: float = 0.01
    # What the load-balance loss balances: "batch" (Switch: the experts' loads over all tokens of the
    # micro-batch) or "sequence" (DeepSeek-V3's complementary sequence-wise loss: the same formula per
    # sequence, averaged over the sequences; with the sigmoid router V3 keeps it tiny, alpha ~ 1e-4).
    moe_aux_loss_scope: str = "batch"
    moe_z_loss_coef: float = 0.001
    moe_d_ff: int | None = None  # expert hidden size; None = same rule as d_ff
    # "auto": grouped_mm where the device, dtype and widths allow it, else the per-expert loop (same math).
    moe_expert_impl: str = "auto"
    # The router's affinities: "softmax" over the experts (Mixtral, DeepSeek-V2), or "sigmoid" per expert
    # (DeepSeek-V3), whose layers also hold a per-expert score bias added only to choose the top-k (the
    # gates are the chosen affinities without it; HF's e_score_correction_bias).
    moe_router: str = "softmax"
    # Group-limited routing (DeepSeek-V3): the experts fall into moe_n_group groups, a group scores the
    # sum of its two highest (biased) affinities, and only a token's best moe_topk_group groups are eligible.
    moe_n_group: int = 1
    moe_topk_group: int = 1
    moe_routed_scaling_factor: float = 1.0  # multiplies the routed experts' gates (V3's routed_scaling_factor)
    # Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3): after every optimizer step each score
    # bias moves by this rate (gamma) towards balance, b_i += gamma * sign(mean load - load_i), the load
    # counted over the whole global batch. 0: the bias stays as it is. Needs moe_router "sigmoid".
    moe_bias_update_rate: float = 0.0

    # Architecture family. "decoder": the Transformer above. "mamba": Mamba blocks
    # (models/families/mamba/model.py), which use vocab_size, d_model, n_layers, max_seq_len, norm_eps, bias,
    # tie_embeddings, dropout, init_std and the ssm_* fields; the attention, position, FFN and MoE fields do not
    # apply (see models/families/mamba/__init__.py).
    arch: str = "decoder"
    ssm_state_size: int = 16  # N, the SSM state per channel
    ssm_conv_kernel: int = 4  # width of the causal depthwise convolution
    ssm_expand: int = 2  # inner width = ssm_expand * d_model
    ssm_dt_rank: int | None = None  # rank of the delta projection; None = ceil(d_model / 16)
    # Mamba-2 (arch mamba2, models/families/mamba2/model.py) also reads ssm_state_size, ssm_conv_kernel and ssm_expand.
    ssm_head_dim: int = 16  # P: the inner width splits into ssm_expand * d_model / P heads, one decay each
    ssm_n_groups: int = 1  # G: groups of B and C, each shared by heads / G heads
    ssm_chunk_size: int = 64  # Q: tokens per chunk of the chunked scan (a speed setting: any Q, the same function)
    # "hybrid" (models/families/hybrid/model.py, as Jamba, Bamba, Nemotron-H and Granite 4.0): one letter per
    # layer, "A" an attention layer (the attention, position and MoE fields above) or "M" a Mamba-2 layer (the
    # ssm_* fields), each followed by the feed-forward (dense, or MoE by moe_every / moe_first_dense_layers), e.g.
    # "MMMA" * 2.
    hybrid_layers: str = ""

    # "encoder_decoder": a Transformer encoder over the source and a decoder with cross-attention over its
    # output (models/families/encdec/model.py). n_layers is the decoder's depth, n_encoder_layers the encoder's. Both
    # stacks use the attention, position, FFN and norm fields above and share one embedding table; the
    # original paper's choices (Post-LN LayerNorm, sinusoidal, ReLU, tied embeddings) are the presets
    # debug_encdec and encdec (see models/families/encdec/__init__.py for what does not apply).
    n_encoder_layers: int | None = None  # None = n_layers
    embedding_norm: bool = False  # a norm over each stack's summed embeddings, before its first layer (BART)
    # The denoising objective it is trained with (T5 span corruption, pipeline/data/span_corruption.py):
    # the fraction of each block's tokens dropped into spans, and the spans' mean length. Kept with the
    # architecture so that evaluation and serving know what the weights were trained to do.
    denoise_noise_density: float = 0.15
    denoise_mean_span_length: float = 3.0

    # ------------------------------------------------------------------ validation

    def __post_init__(self) -> None:
        ints = {
            "vocab_size": 1, "d_model": 1, "n_layers": 1, "n_heads": 1, "ffn_multiple_of": 1,
            "max_seq_len": 1, "num_experts": 0, "moe_top_k": 1, "moe_every": 1, "moe_shared_experts": 0,
            "moe_first_dense_layers": 0, "moe_n_group": 1, "moe_topk_group": 1,
        }
        for name, minimum in ints.items():
            _check_int(name, getattr(self, name), minimum)
        for name in ("ssm_state_size", "ssm_conv_kernel", "ssm_expand"):
            _check_int(name, getattr(self, name), 1)
        for name in _OPTIONAL_SIZES:
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        for name in ("bias", "tie_embeddings", "moe_renormalize", "embedding_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool (True or False), got {getattr(self, name)!r}")
        rules = family_rules()
        _check_choice("arch", self.arch, tuple(rules.families))
        _check_choice("attention", self.attention, tuple(rules.attention_kinds))
        _check_choice("pos_encoding", self.pos_encoding, POS_ENCODINGS)
        _check_choice("ffn", self.ffn, FFN_KINDS)
        _check_choice("norm", self.norm, NORM_KINDS)
        _check_choice("norm_position", self.norm_position, NORM_POSITIONS)
        _check_choice("moe_expert_impl", self.moe_expert_impl, MOE_EXPERT_IMPLS)
        _check_choice("moe_router", self.moe_router, MOE_ROUTERS)
        _check_choice("moe_aux_loss_scope", self.moe_aux_loss_scope, MOE_AUX_LOSS_SCOPES)
        _check_float("moe_routed_scaling_factor", self.moe_routed_scaling_factor)
        if self.moe_routed_scaling_factor <= 0:
            raise ValueError(f"moe_routed_scaling_factor must be > 0, got {self.moe_routed_scaling_factor!r}")
        _check_float("moe_bias_update_rate", self.moe_bias_update_rate)
        if self.moe_bias_update_rate < 0:
            raise ValueError(f"moe_bias_update_rate must be >= 0, got {self.moe_bias_update_rate!r}")
        if self.moe_bias_update_rate > 0 and self.moe_router != "sigmoid":
            raise ValueError(f"moe_bias_update_rate={self.moe_bias_update_rate} moves the sigmoid router's score "
                             f"bias: set moe_router to 'sigmoid' (got {self.moe_router!r})")
        for name in ("rope_base", "rope_scaling", "norm_eps", "init_std", "moe_aux_loss_coef", "moe_z_loss_coef"):
            _check_float(name, getattr(self, name))
        for name in ("rope_base", "rope_scaling", "norm_eps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("init_std", "moe_aux_loss_coef", "moe_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("dropout", "attn_dropout"):
            _check_float(name, getattr(self, name))
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")

        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}); "
                f"allowed n_heads: divisors of {self.d_model}"
            )
        kv = self.resolved_num_kv_heads
        if self.n_heads % kv != 0:
            raise ValueError(
                f"num_kv_heads ({kv}) must divide n_heads ({self.n_heads}); allowed: None or "
                f"{[h for h in range(1, self.n_heads + 1) if self.n_heads % h == 0]}"
            )
        self._check_rope_scaling()
        if self.pos_encoding == "sinusoidal" and self.d_model % 2 != 0:
            raise ValueError(f"pos_encoding 'sinusoidal' needs an even d_model, got {self.d_model}")
        if self.num_experts > 0 and self.moe_top_k > self.num_experts:
            raise ValueError(
                f"moe_top_k ({self.moe_top_k}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.num_experts > 0:
            self._check_groups()
        if self.moe_capacity_factor is not None:
            _check_float("moe_capacity_factor", self.moe_capacity_factor)
            if self.moe_capacity_factor <= 0:
                raise ValueError(
                    f"moe_capacity_factor must be None (dropless) or > 0, got {self.moe_capacity_factor!r}"
                )
        _check_float("denoise_noise_density", self.denoise_noise_density)
        _check_float("denoise_mean_span_length", self.denoise_mean_span_length)
        if not 0.0 < self.denoise_noise_density < 1.0:
            raise ValueError(f"denoise_noise_density must be in (0, 1), got {self.denoise_noise_density!r}")
        if self.denoise_mean_span_length < 1.0:
            raise ValueError(f"denoise_mean_span_length must be >= 1, got {self.denoise_mean_span_length!r}")
        rules.check(self, _DEFAULTS)

    def _check_groups(self) -> None:
        """Group-limited routing must be able to route: the groups split the experts evenly, a group has
        the two experts its score sums, and the eligible groups hold moe_top_k experts."""
        E, G, top_g = self.num_experts, self.moe_n_group, self.moe_topk_group
        if E % G != 0:
            raise ValueError(f"moe_n_group ({G}) must divide num_experts ({E}); allowed: "
                             f"{[g for g in range(1, E + 1) if E % g == 0]}")
        if top_g > G:
            raise ValueError(f"moe_topk_group ({top_g}) must be in 1..moe_n_group ({G})")
        if G > 1 and E // G < 2:
            raise ValueError(f"moe_n_group ({G}) leaves {E // G} expert per group, and a group's score is the sum "
                             f"of its two best experts' affinities: use at most {E // 2} groups")
        if top_g * (E // G) < self.moe_top_k:
            raise ValueError(f"moe_topk_group ({top_g}) groups of {E // G} experts cannot hold moe_top_k "
                             f"({self.moe_top_k}) experts: raise moe_topk_group to at least "
                             f"{math.ceil(self.moe_top_k / (E // G))} or lower moe_top_k")

    # ------------------------------------------------------------------ derived sizes

    @property
    def head_dim(self) -> int:
        """Per-head width d_model // n_heads."""
        return self.d_model // self.n_heads

    def _mla_size(self, name: str, default: int) -> int:
        value = getattr(self, name)
        return default if value is None else value

    @property
    def resolved_kv_lora_rank(self) -> int:
        """MLA latent width (4 * head_dim when kv_lora_rank is None)."""
        return self._mla_size("kv_lora_rank", 4 * self.head_dim)

    @property
    def resolved_qk_nope_head_dim(self) -> int:
        """MLA per-head non-positional query/key width (head_dim when None)."""
        return self._mla_size("qk_nope_head_dim", self.head_dim)

    @property
    def resolved_qk_rope_head_dim(self) -> int:
        """MLA per-head RoPE query/key width (head_dim // 2 rounded down to even, at least 2, when None)."""
        return self._mla_size("qk_rope_head_dim", max(2, self.head_dim // 2 // 2 * 2))

    @property
    def resolved_v_head_dim(self) -> int:
        """MLA per-head value width (head_dim when None)."""
        return self._mla_size("v_head_dim", self.head_dim)

    @property
    def rope_head_dim(self) -> int:
        """How many features of each query/key head RoPE rotates: head_dim (mha) or qk_rope_head_dim (mla)."""
        return family_rules().rope_head_dim(self)

    @property
    def resolved_num_kv_heads(self) -> int:
        """Number of key/value heads (n_heads when num_kv_heads is None)."""
        return self.n_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_d_ff(self) -> int:
        """Hidden width of the dense feed-forward layers."""
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn == "swiglu":
            return _swiglu_hidden(self.d_model, self.ffn_multiple_of)
        return 4 * self.d_model

    @property
    def resolved_moe_d_ff(self) -> int:
        """Hidden width of each expert (and each shared expert)."""
        if self.moe_d_ff is not None:
            return self.moe_d_ff
        if self.ffn == "swiglu":
            return _swiglu_hidden(self.d_model, self.ffn_multiple_of)
        return 4 * self.d_model

    @property
    def is_moe(self) -> bool:
        """True when at least one layer is a mixture-of-experts layer."""
        return self.num_moe_layers > 0

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` (0-based) uses MoE: num_experts > 0, i >= moe_first_dense_layers and
        (i + 1) % moe_every == 0."""
        return (self.num_experts > 0 and layer_idx >= self.moe_first_dense_layers
                and (layer_idx + 1) % self.moe_every == 0)

    @property
    def num_moe_layers(self) -> int:
        """How many layers are MoE layers."""
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def resolved_n_encoder_layers(self) -> int:
        """Encoder depth of an encoder-decoder (n_layers when n_encoder_layers is None)."""
        return self.n_layers if self.n_encoder_layers is None else self.n_encoder_layers

    @property
    def ssm_d_inner(self) -> int:
        """Mamba's inner width ssm_expand * d_model."""
        return self.ssm_expand * self.d_model

    @property
    def ssm_heads(self) -> int:
        """Mamba-2's heads: ssm_expand * d_model / ssm_head_dim."""
        return self.ssm_d_inner // self.ssm_head_dim

    @property
    def resolved_ssm_dt_rank(self) -> int:
        """Rank of Mamba's delta projection (ceil(d_model / 16) when ssm_dt_rank is None)."""
        return math.ceil(self.d_model / 16) if self.ssm_dt_rank is None else self.ssm_dt_rank

    def _check_rope_scaling(self) -> None:
        _check_choice("rope_scaling_type", self.rope_scaling_type, ROPE_SCALING_TYPES)
        kind, s = self.rope_scaling_type, self.rope_scaling
        if kind != "linear" and self.pos_encoding != "rope":
            raise ValueError(f"rope_scaling_type {kind!r} scales RoPE; pos_encoding is {self.pos_encoding!r}")
        if kind != "linear" and s < 1.0:
            raise ValueError(f"rope_scaling={s} must be >= 1 with rope_scaling_type {kind!r} (it extends the context)")
        L = self.rope_original_max_seq_len
        if kind in ("dynamic", "yarn", "llama3") and L is None:
            raise ValueError(f"rope_scaling_type {kind!r} needs rope_original_max_seq_len, the context the model "
                             f"was trained at")
        if L is not None and not (isinstance(L, int) and 1 <= L <= self.max_seq_len):
            raise ValueError(f"rope_original_max_seq_len must be an int in 1..max_seq_len ({self.max_seq_len}), got {L!r}")
        for name in ("rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_llama3_low_freq_factor",
                     "rope_llama3_high_freq_factor"):
            _check_float(name, getattr(self, name))
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.rope_yarn_beta_fast <= self.rope_yarn_beta_slow:
            raise ValueError(f"rope_yarn_beta_fast ({self.rope_yarn_beta_fast}) must be > rope_yarn_beta_slow "
                             f"({self.rope_yarn_beta_slow})")
        if self.rope_llama3_high_freq_factor <= self.rope_llama3_low_freq_factor:
            raise ValueError(f"rope_llama3_high_freq_factor ({self.rope_llama3_high_freq_factor}) must be > "
                             f"rope_llama3_low_freq_factor ({self.rope_llama3_low_freq_factor})")
        mscales = (self.rope_yarn_mscale, self.rope_yarn_mscale_all_dim)
        if any(m is not None for m in mscales):
            if kind != "yarn" or any(m is None for m in mscales):
                raise ValueError("rope_yarn_mscale and rope_yarn_mscale_all_dim go together, with rope_scaling_type "
                                 f"'yarn' (got {mscales}, {kind!r})")
            for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
                _check_float(name, getattr(self, name))
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def rope(self):
        """The context-extension method and its parameters (``models.layers.positions.RopeScaling``)."""
        from models.layers.positions import RopeScaling

        return RopeScaling(self.rope_scaling_type, self.rope_scaling, self.rope_original_max_seq_len,
                           self.rope_yarn_beta_fast, self.rope_yarn_beta_slow, self.rope_yarn_mscale,
                           self.rope_yarn_mscale_all_dim, self.rope_llama3_low_freq_factor,
                           self.rope_llama3_high_freq_factor)

    # ------------------------------------------------------------------ (de)serialisation

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain JSON-serialisable dict (`from_dict` gives missing fields their defaults,
        so the round trip is exact)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build a config from a dict of field values (missing fields take their defaults).

        Args:
            d: mapping from field name to value.

        Returns:
            The validated config.

        Raises:
            ValueError: on an unknown key (naming it and the closest valid key), or a bad value.
        """
        if not isinstance(d, dict):
            raise ValueError(f"ModelConfig.from_dict expects a dict, got {type(d).__name__}")
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in d:
            if key not in valid:
                close = difflib.get_close_matches(str(key), valid, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {valid}"
                raise ValueError(f"unknown ModelConfig key {key!r}{hint}")
        return cls(**d)

    def replace(self, **kw: Any) -> "ModelConfig":
        """A copy with some fields changed (validated again).

        Raises:
            ValueError: on an unknown field name or a bad value.
        """
        merged = self.to_dict()
        merged.update(kw)
        return type(self).from_dict(merged)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def _check_int(name: str, value: Any, minimum: int) -> None:
    # bool is a subclass of int; a True where a size belongs is a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_float(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
