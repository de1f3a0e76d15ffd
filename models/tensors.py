"""A model's parameter tensors, module by module, from its config alone: no torch, nothing built.

The planner (`pipeline.plan.memory.model_shape`) needs more than the families' parameter counts: which
parameters are routed experts (split over expert-parallel ranks), how many each layer holds, the most one
module holds itself (what ZeRO-3 gathers at once) and the size of every tensor (ZeRO-3 keeps the small
ones whole). Building the model on the meta device gives all of it but costs importing torch (about 2 s),
which a config's dry run should not pay. So each family lists its modules here (`Family.modules`, and
each attention kind `AttentionKind.modules`), from the parts below, in the image of the constructors
(`models.layers.*`, the families' ``model.py``); a test compares the listing with the meta build for
every preset and family option.

A `Module` is one ``nn.Module`` that holds parameters itself (``parameters(recurse=False)``), by its
dotted path in the model; modules that hold none (dropouts, blocks, lists) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig


@dataclass(frozen=True)
class Module:
    """One module of a built model and the parameters it holds itself.

    Attributes:
        path: its name in ``model.named_modules()``, e.g. ``layers.3.attn.q_proj``.
        sizes: the element count of each parameter it holds itself.
        experts: a stack of routed experts (`models.layers.grouped_experts.StackedExperts`): split over the
            expert-parallel ranks.
        tied: its one parameter is another module's (the output head tied to the token embeddings): the
            model's parameters count it once, at the other module.
    """

    path: str
    sizes: tuple[int, ...]
    experts: bool = False
    tied: bool = False


def linear(path: str, fan_in: int, fan_out: int, bias: bool) -> Module:
    """``nn.Linear(fan_in, fan_out, bias=bias)``."""
    return Module(path, (fan_out * fan_in,) + ((fan_out,) if bias else ()))


def rms_norm(path: str, dim: int) -> Module:
    """``RMSNorm(dim)``: a weight."""
    return Module(path, (dim,))


def norm(cfg: ModelConfig, path: str) -> Module:
    """``build_norm(cfg)`` over d_model: RMSNorm's weight, or LayerNorm's weight and (with ``bias``) bias."""
    D = cfg.d_model
    return Module(path, (D,) if cfg.norm == "rmsnorm" or not cfg.bias else (D, D))


def embedding(path: str, rows: int, dim: int) -> Module:
    """``nn.Embedding(rows, dim)``."""
    return Module(path, (rows * dim,))


def ffn(cfg: ModelConfig, path: str, hidden: int) -> list[Module]:
    """``FeedForward(d_model, hidden)``: w1, w2 and (SwiGLU) w3."""
    D, b = cfg.d_model, cfg.bias
    out = [linear(f"{path}.w1", D, hidden, b), linear(f"{path}.w2", hidden, D, b)]
    return out + ([linear(f"{path}.w3", D, hidden, b)] if cfg.ffn == "swiglu" else [])


def moe(cfg: ModelConfig, path: str) -> list[Module]:
    """``MoEFeedForward``: the router, the stacked routed experts and the shared experts."""
    D, E, F = cfg.d_model, cfg.num_experts, cfg.resolved_moe_d_ff
    up = 2 * F if cfg.ffn == "swiglu" else F
    experts = (E * up * D, E * D * F) + ((E * up, E * D) if cfg.bias else ())
    out = [linear(f"{path}.router", D, E, False), Module(f"{path}.experts", experts, experts=True)]
    for i in range(cfg.moe_shared_experts):
        out += ffn(cfg, f"{path}.shared_experts.{i}", F)
    return out


def block_ffn(cfg: ModelConfig, path: str, layer: int) -> list[Module]:
    """``build_ffn(cfg, cfg.is_moe_layer(layer))``: the MoE feed-forward or the dense one."""
    return moe(cfg, path) if cfg.is_moe_layer(layer) else ffn(cfg, path, cfg.resolved_d_ff)


def output_head(cfg: ModelConfig, path: str = "lm_head") -> Module:
    """``LMHead(d_model, vocab)``: its own weight, or the token embeddings' when ``tie_embeddings``."""
    return Module(path, (cfg.vocab_size * cfg.d_model,), tied=cfg.tie_embeddings)
