"""Conduit MLA models <-> Hugging Face DeepseekV2 and DeepseekV3 (`DeepseekV2ForCausalLM`,
`DeepseekV3ForCausalLM`): config and tensors.

A decoder with multi-head latent attention exports as DeepseekV3 when its MoE layers route with the
sigmoid router (``moe_router: sigmoid``), else as DeepseekV2 (the attention kind "mla" in
`models.layers.kinds` picks the format by `format_for`); these functions only map dicts (no file I/O).

What maps how:
- names: Conduit's MLA parameters carry DeepseekV2's names except `kv_a_proj` (HF
  `kv_a_proj_with_mqa`), `kv_a_norm` (`kv_a_layernorm`) and `q_a_norm` (`q_a_layernorm`); dense FFNs are
  `mlp.{gate,up,down}_proj`, routed experts `mlp.experts.{e}.{gate,up,down}_proj` (the per-expert
  layout DeepSeek's checkpoints use, which transformers packs on load), the router `mlp.gate`.
- RoPE rows: Conduit rotates feature pairs (j, j + P/2) of the qk_rope_head_dim = P features,
  DeepseekV2 rotates adjacent pairs (2j, 2j + 1) (a complex multiply), both with angle pos * base^(-2j/P).
  So the P RoPE output rows of every query head in q_proj / q_b_proj and of the shared RoPE key in
  kv_a_proj are reordered [0, P/2, 1, P/2 + 1, ...] on export; q and k get the same permutation, so
  every score q . k is unchanged.
- shared experts: Conduit has moe_shared_experts separate SwiGLU FFNs of width F; DeepseekV2 one of
  width n_shared_experts * F. A sum of SwiGLU FFNs is the SwiGLU FFN with their gate and up rows and
  their down columns concatenated, so this is a concatenation (and a split on import).
- routing, V2: DeepseekV2's "greedy" router is Conduit's softmax router (fp32 over all experts, top-k)
  without renormalising the k weights (its norm_topk_prob is unused by the V2 router), times
  routed_scaling_factor. Export therefore needs moe_renormalize=False and no groups (V2's
  "group_limited_greedy" scores a group by its best expert, Conduit by its two best), and writes
  topk_method "greedy" and moe_routed_scaling_factor.
- routing, V3: DeepseekV3's router is Conduit's sigmoid router: top-k of sigmoid(logits) +
  `e_score_correction_bias` (our `ffn.score_bias` buffer) among the `topk_group` best of `n_group`
  groups (a group's score: its two best biased affinities), gates the unbiased affinities, renormalised
  when norm_topk_prob (= moe_renormalize; HF adds 1e-20 to the sum), times routed_scaling_factor. HF's
  group score needs two experts per group, so num_experts >= 2. V3 writes its RoPE rows interleaved
  (rope_interleave true, as DeepSeek's checkpoints): the same row order as V2's; a V3 config.json with
  rope_interleave false is refused on import.
- layer kinds: DeepseekV2 makes layer i MoE iff i >= first_k_dense_replace, which is Conduit's
  moe_first_dense_layers with moe_every=1; a dense model is first_k_dense_replace = num_hidden_layers.
- attention: num_key_value_heads = num_attention_heads (the expanded keys are per head); the softmax
  scale (qk_nope + qk_rope)^-0.5 is DeepseekV2's, times mscale(factor, mscale_all_dim)^2 under YaRN with DeepSeek's mscale.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

from models.config import ModelConfig
from models.families.decoder import hf_llama
from models.families.spec import HFFormat

# torch is imported by the functions that make tensors, so that the family table, and a config checked
# against it, load without it.
if TYPE_CHECKING:
    import torch

# Our MLA / MoE names (after "layers.{i}.") -> DeepseekV2's (after "model.layers.{i}.").
_ATTN_NAMES = {
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.router.weight": "mlp.gate.weight",
    "ffn.score_bias": "mlp.gate.e_score_correction_bias",
}
_FIXED = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight"}
_HF_W = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def format_for(cfg: ModelConfig) -> HFFormat:
    """The class an MLA decoder exports as: DeepseekV3 for the sigmoid router, else DeepseekV2."""
    return FORMAT_V3 if cfg.num_experts > 0 and cfg.moe_router == "sigmoid" else FORMAT


def _unsupported(cfg: ModelConfig, target: str) -> list[str]:
    """Options of an MLA config DeepseekV2 / DeepseekV3 (`target`) cannot express, as "field=value (reason)"."""
    problems = hf_llama.block_problems(cfg, target)
    if cfg.num_experts > 0:
        v3 = target == "DeepseekV3"
        router = "sigmoid" if v3 else "softmax"
        if cfg.moe_router != router:
            problems.append(f"moe_router={cfg.moe_router!r} ({target}'s router is {router!r})")
        if cfg.moe_every != 1:
            problems.append(f"moe_every={cfg.moe_every} ({target}'s MoE layers are all layers from "
                            "first_k_dense_replace = moe_first_dense_layers on)")
        if cfg.moe_capacity_factor is not None:
            problems.append(f"moe_capacity_factor={cfg.moe_capacity_factor} ({target} is dropless)")
        if not v3 and cfg.moe_renormalize:
            problems.append("moe_renormalize=True (DeepseekV2's greedy router does not renormalise the top-k "
                            "weights)")
        if not v3 and cfg.moe_n_group > 1:
            problems.append(f"moe_n_group={cfg.moe_n_group} (DeepseekV2's group-limited routing scores a group by "
                            "its best expert, Conduit's by its two best)")
        if v3 and cfg.num_experts < 2:
            problems.append(f"num_experts={cfg.num_experts} (DeepseekV3's group score sums two experts)")
    return problems


def unsupported_options(cfg: ModelConfig) -> list[str]:
    """Options of an MLA config DeepseekV2 cannot express, as "field=value (reason)" strings."""
    return _unsupported(cfg, "DeepseekV2")


def unsupported_options_v3(cfg: ModelConfig) -> list[str]:
    """Options of an MLA config DeepseekV3 cannot express, as "field=value (reason)" strings."""
    return _unsupported(cfg, "DeepseekV3")


def rope_row_order(P: int) -> torch.Tensor:
    """Row i of the DeepseekV2 layout is row order[i] of ours: [0, P/2, 1, P/2 + 1, ...]."""
    import torch

    half = P // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def _permute_rope_rows(w: torch.Tensor, cfg: ModelConfig, name: str, to_hf: bool) -> torch.Tensor:
    """Reorder the RoPE output rows of q_proj / q_b_proj (per head) or kv_a_proj (after the latent)."""
    import torch

    P = cfg.resolved_qk_rope_head_dim
    order = rope_row_order(P)
    if not to_hf:
        order = torch.argsort(order)
    if name.endswith("kv_a_proj.weight"):
        R = cfg.resolved_kv_lora_rank
        return torch.cat([w[:R], w[R:][order]], dim=0)
    N, H = cfg.resolved_qk_nope_head_dim, cfg.n_heads
    w_HQi = w.reshape(H, N + P, -1)
    return torch.cat([w_HQi[:, :N], w_HQi[:, N:][:, order]], dim=1).reshape(w.shape)


def _rope_rows(rest: str) -> bool:
    return rest in ("attn.q_proj.weight", "attn.q_b_proj.weight", "attn.kv_a_proj.weight")


def to_hf_tensors(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (lm_head absent when tied) -> DeepseekV2 / V3 checkpoint tensors.

    Raises:
        ValueError: on a parameter with no DeepseekV2 name.
    """
    import torch

    from models.layers.grouped_experts import unstack_expert_state

    out: dict[str, torch.Tensor] = {}
    shared: dict[tuple[str, str], list[tuple[int, torch.Tensor]]] = {}
    for name, t in unstack_expert_state(state).items():
        if name in _FIXED:
            out[_FIXED[name]] = t
            continue
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        i, rest = m.groups()
        prefix = f"model.layers.{i}."
        e = re.fullmatch(r"ffn\.(experts|shared_experts)\.(\d+)\.(w[123])\.weight", rest)
        if e is not None:
            kind, idx, w = e.groups()
            if kind == "experts":
                out[prefix + f"mlp.experts.{idx}.{_HF_W[w]}.weight"] = t
            else:
                shared.setdefault((prefix, w), []).append((int(idx), t))
            continue
        if rest not in _ATTN_NAMES:
            raise ValueError(f"no Hugging Face name for parameter {name!r}")
        out[prefix + _ATTN_NAMES[rest]] = _permute_rope_rows(t, cfg, rest, to_hf=True) if _rope_rows(rest) else t
    # The shared experts, one FFN of n_shared * F: gate/up rows and down columns concatenated.
    D, F = cfg.d_model, cfg.resolved_moe_d_ff
    dtype = state["tok_embeddings.weight"].dtype
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            continue
        prefix = f"model.layers.{i}."
        for w, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            parts = [t for _, t in sorted(shared.get((prefix, w), []), key=lambda p: p[0])]
            empty = torch.zeros((0, D) if dim == 0 else (D, 0), dtype=dtype)
            out[prefix + f"mlp.shared_experts.{_HF_W[w]}.weight"] = torch.cat(parts, dim=dim) if parts else empty
            assert all(p.shape[1 - dim] == D and p.shape[dim] == F for p in parts)
    return out


def from_hf_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """DeepseekV2 / V3 checkpoint tensors -> our state dict (inverse of `to_hf_tensors`).

    Raises:
        ValueError: on an unexpected tensor name.
    """
    inverse_fixed = {v: k for k, v in _FIXED.items()}
    inverse_attn = {v: k for k, v in _ATTN_NAMES.items()}
    inverse_w = {v: k for k, v in _HF_W.items()}
    F = cfg.resolved_moe_d_ff
    out: dict[str, torch.Tensor] = {}
    for hf_name, t in tensors.items():
        if hf_name in inverse_fixed:
            out[inverse_fixed[hf_name]] = t
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if m is None:
            raise ValueError(f"unexpected tensor {hf_name!r} in a DeepSeek checkpoint")
        i, rest = m.groups()
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if e is not None:
            out[f"layers.{i}.ffn.experts.{e.group(1)}.{inverse_w[e.group(2)]}.weight"] = t
            continue
        s = re.fullmatch(r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight", rest)
        if s is not None:
            w = inverse_w[s.group(1)]
            dim = 1 if w == "w2" else 0
            for idx, part in enumerate(t.split(F, dim=dim) if t.shape[dim] else ()):
                out[f"layers.{i}.ffn.shared_experts.{idx}.{w}.weight"] = part.contiguous()
            continue
        if rest not in inverse_attn:
            raise ValueError(f"unexpected tensor {hf_name!r} in a DeepSeek checkpoint")
        ours = inverse_attn[rest]
        out[f"layers.{i}.{ours}"] = _permute_rope_rows(t, cfg, ours, to_hf=False) if _rope_rows(ours) else t
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of DeepseekV2ForCausalLM for an MLA model: the Llama-like keys and its own."""
    moe = cfg.num_experts > 0
    return {**hf_llama.common_config(cfg, dtype), **{
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.resolved_qk_rope_head_dim,  # what DeepseekV2's RoPE reads (it sets it so itself)
        "intermediate_size": cfg.resolved_d_ff,
        "moe_intermediate_size": cfg.resolved_moe_d_ff,
        "kv_lora_rank": cfg.resolved_kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_nope_head_dim": cfg.resolved_qk_nope_head_dim,
        "qk_rope_head_dim": cfg.resolved_qk_rope_head_dim,
        "v_head_dim": cfg.resolved_v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k if moe else None,
        "n_shared_experts": cfg.moe_shared_experts,
        "first_k_dense_replace": cfg.moe_first_dense_layers if cfg.is_moe else cfg.n_layers,
        "topk_method": "greedy",
        "n_group": None,
        "topk_group": None,
        "routed_scaling_factor": cfg.moe_routed_scaling_factor,
        "norm_topk_prob": False,
        "mlp_bias": False,
    }}


def hf_config_v3(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of DeepseekV3ForCausalLM: V2's keys with V3's router and RoPE layout."""
    out = hf_config(cfg, dtype)
    out.update({
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "n_group": cfg.moe_n_group,
        "topk_group": cfg.moe_topk_group,
        "norm_topk_prob": cfg.moe_renormalize,
        "rope_interleave": True,
        "num_mtp_layers": 0,  # Conduit trains no multi-token prediction module
        # As DeepSeek's own config.json says it: sigmoid scores, the top-k picked with the bias added
        # ("noaux_tc"). transformers reads neither; vLLM creates e_score_correction_bias only for noaux_tc.
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
    })
    out.pop("mlp_bias")
    return out


def config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig a DeepseekV2 or DeepseekV3 config.json describes."""
    fields = {**hf_llama.common_fields(hf, check_head_dim=False), **config_fields(hf)}
    fields.pop("num_kv_heads")  # MLA has no separate key/value heads
    return ModelConfig.from_dict(fields)


def architecture(cfg: ModelConfig) -> tuple:
    """What a DeepseekV2 / V3 config.json determines: the Llama-like sizes, MLA's and the router's."""
    router = ((cfg.moe_router, cfg.moe_n_group, cfg.moe_topk_group, cfg.moe_routed_scaling_factor)
              if cfg.num_experts else None)
    return (*hf_llama.architecture(cfg), cfg.q_lora_rank,
            *(getattr(cfg, f"resolved_{f}") for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                       "v_head_dim")), router)


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a DeepseekV2 / V3 config.json beyond the ones Llama-like configs share.

    Raises:
        ValueError: on a DeepseekV2 / V3 option Conduit cannot express, naming it.
    """
    v3 = hf.get("model_type") == "deepseek_v3"
    n_layers = hf["num_hidden_layers"]
    first_dense = hf.get("first_k_dense_replace", 0)
    experts = hf.get("n_routed_experts", 0) or 0
    moe = experts > 0 and first_dense < n_layers
    if moe and not v3 and hf.get("topk_method", "greedy") != "greedy":
        raise ValueError(f"topk_method={hf['topk_method']!r}: only 'greedy' routing loads as DeepseekV2")
    if v3 and not hf.get("rope_interleave", True):
        raise ValueError("rope_interleave=false: only DeepSeek's interleaved RoPE layout (true) loads as DeepseekV3")
    if hf.get("num_key_value_heads", hf["num_attention_heads"]) != hf["num_attention_heads"]:
        raise ValueError("num_key_value_heads must equal num_attention_heads for DeepSeek's MLA attention")
    fields = dict(
        attention="mla",
        kv_lora_rank=hf["kv_lora_rank"],
        q_lora_rank=hf.get("q_lora_rank"),
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        d_ff=hf["intermediate_size"],
    )
    if moe:
        fields.update(num_experts=experts, moe_top_k=hf["num_experts_per_tok"], moe_d_ff=hf["moe_intermediate_size"],
                      moe_shared_experts=hf.get("n_shared_experts") or 0, moe_renormalize=False,
                      moe_first_dense_layers=first_dense,
                      moe_routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
        if v3:
            fields.update(moe_router="sigmoid", moe_n_group=hf.get("n_group") or 1,
                          moe_topk_group=hf.get("topk_group") or 1,
                          moe_renormalize=bool(hf.get("norm_topk_prob", True)))
    return fields


FORMAT = HFFormat(
    name="DeepseekV2ForCausalLM",
    model_types=("deepseek_v2",),
    unsupported_options=unsupported_options,
    hf_config=hf_config,
    config_from_hf=config_from_hf,
    to_hf=to_hf_tensors,
    from_hf=from_hf_tensors,
    architecture=architecture,
)

FORMAT_V3 = dataclasses.replace(FORMAT, name="DeepseekV3ForCausalLM", model_types=("deepseek_v3",),
                                unsupported_options=unsupported_options_v3, hf_config=hf_config_v3)
