"""What every family's model shares outside its layers: the output record of a forward
(`ModelOutput`), the first step of every ``init_weights`` (`init_base`) and the mode a model is built on
the meta device in (`SkipInitOnMeta`).

Shape legend: B batch, T time, S key time, V vocab, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from models.layers.attention import KVCache
from models.layers.norms import LayerNorm, RMSNorm


# The initialisers that torch's modules call in their constructors (nn.Linear's kaiming_uniform_ and
# uniform_, nn.Embedding's normal_, the norms' ones_ and zeros_), and the tensor methods under them.
_INITIALISERS = frozenset({
    "normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
    "xavier_normal_", "orthogonal_", "constant_", "ones_", "zeros_", "zero_", "fill_",
})


class SkipInitOnMeta(TorchFunctionMode):
    """Skip the initialisers that modules' constructors run, where they write to a meta tensor.

    A model is built on the meta device and its weights are set once, by ``init_weights()`` after
    ``to_empty`` (``models.presets.build_model``). The constructors' own initialisers have nothing to write
    there, but on meta tensors they run torch's Python reference kernels, whose first call imports
    ``torch._dynamo``: about a CPU-second in a process that builds a model and would not otherwise import it
    (an evaluation, an export, a server; a training worker's torch optimizer imports it anyway, and an MoE's
    experts do, for ``torch.compiler.disable``). Only those calls on meta tensors are skipped (they return
    the tensor, as the in-place call would); everything else, and every call on a real tensor, runs as usual.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INITIALISERS:
            # nn.init's functions pass their tensor by keyword; a tensor method gets it first
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@dataclass
class ModelOutput:
    """What a model's forward returns (`Transformer`, and every family after it).

    Attributes:
        logits: (B, T, V); None when the forward was given targets (it returns their loss instead).
        aux_loss: scalar; sum over MoE layers of moe_aux_loss_coef * load balance + moe_z_loss_coef *
            z-loss (differentiable); a zero tensor for dense models. Add it to the LM loss.
        moe_stats: one dict per MoE layer (see `MoEFeedForward.forward`), detached.
        attentions: one (B, H, T, S) weight tensor per layer when return_attention, else None.
        kv_cache: the cache passed in (now extended), or None.
        loss: the LM loss of the targets given to the forward (``models.layers.head.LMHead``), else None;
            ``aux_loss`` is not in it.
    """

    logits: torch.Tensor | None
    aux_loss: torch.Tensor
    moe_stats: list[dict[str, torch.Tensor]] = field(default_factory=list)
    attentions: list[torch.Tensor] | None = None
    kv_cache: KVCache | None = None
    loss: torch.Tensor | None = None


@torch.no_grad()
def init_base(model: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """The start of every family's ``init_weights``: linear and embedding weights ~ normal(0, std),
    linear biases 0, norms reset (weight 1, bias 0), in ``model.modules()`` order (so a seeded
    generator draws the same numbers whichever family calls it). Each family then redraws its own
    residual projections."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
        elif isinstance(module, (RMSNorm, LayerNorm)):
            module.reset_parameters()
