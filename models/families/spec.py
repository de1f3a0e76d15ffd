"""The records of the family table: what a model family and an HF format declare (an attention kind's
record, ``AttentionKind``, lives with the layers, in `models.layers.kinds`).

Nothing here knows a family by name; `models.families` holds the table, and every question about a
config's family (how it is checked, built, exported, counted) is asked through these records.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from models.config import ModelConfig
    from models.families.parts import Activations
    from models.tensors import Module


@dataclass(frozen=True)
class HFFormat:
    """How a Conduit model maps onto one Hugging Face ``transformers`` class (export and import).

    Attributes:
        name: the class, as ``architectures`` in config.json names it (the first, when it has several).
        model_types: config.json ``model_type`` values this format reads.
        unsupported_options: the options of a config the class cannot express, as "field=value (reason)".
        hf_config: config.json for a config and the weights' dtype.
        config_from_hf: the ModelConfig a config.json describes (raises ValueError naming a key).
        to_hf: our state dict -> the checkpoint's tensors.
        from_hf: the checkpoint's tensors -> our state dict (raises ValueError on an unexpected tensor).
        architecture: what config.json determines of a config, with derived sizes resolved (two
            configs with equal architectures build the same HF model).
        config_defaults: config.json keys set when the caller names none (token ids).
    """

    name: str
    model_types: tuple[str, ...]
    unsupported_options: Callable[["ModelConfig"], list[str]]
    hf_config: Callable[["ModelConfig", "torch.dtype"], dict]
    config_from_hf: Callable[[dict], "ModelConfig"]
    to_hf: Callable[[dict, "ModelConfig"], dict]
    from_hf: Callable[[dict, "ModelConfig"], dict]
    architecture: Callable[["ModelConfig"], tuple]
    config_defaults: Callable[[dict], dict] = lambda hf_cfg: {}


@dataclass(frozen=True)
class Family:
    """One value of ``ModelConfig.arch``: a model family and everything the rest of Conduit asks of it.

    Attributes:
        arch: the value of ``arch``.
        title: how people name it ("dense Transformer", "Mamba", ...), for descriptions.
        fields: ModelConfig fields only this family reads; under another family they must stay at
            their default (refused otherwise, naming the field and the family it belongs to).
        check: raises ValueError, naming the field, on options this family cannot honour.
        model: where the family's nn.Module lives, as "package.module:Class"; `model_class` imports it on
            first use, so the table, and the config that is checked against it, load without torch.
        param_counts: total, active, embedding, non_embedding and active_non_embedding parameters.
        flops_per_token: training (total) and forward FLOPs per token at a sequence length.
        kv_cache_bytes_per_token: bytes the generation cache holds per token at a bytes-per-element.
        state_bytes_per_sequence: bytes of generation state a sequence holds whatever its length (the
            SSM layers' conv inputs and state), at a bytes-per-element for what is kept in the model's dtype.
        hf_format: the Hugging Face class a config of this family exports as.
        hf_formats: every Hugging Face format this family reads (``load_hf`` finds the family by them).
        modules: every module of the built model that holds parameters, with their sizes, from the config
            alone (`models.tensors`; the planner's model shape without torch).
        seq2seq: inputs are an encoder's source and a decoder's target (span-corruption data,
            denoising evaluation, encoder-decoder generation), not one causal stream.
        draws_attention: evaluate can draw its causal attention maps and expert routing.
        describe: a short label of a config, e.g. "MoE" or "Mamba", for model descriptions.
        activations: what one training forward keeps for backward, in bytes per token at a sequence length
            and activation width (4 or 2 bytes), as `models.families.parts.Activations`; None: not modelled.
    """

    arch: str
    title: str
    fields: tuple[str, ...]
    check: Callable[["ModelConfig"], None]
    model: str
    param_counts: Callable[["ModelConfig"], dict[str, int]]
    flops_per_token: Callable[["ModelConfig", int], dict[str, int]]
    kv_cache_bytes_per_token: Callable[["ModelConfig", int], int]
    hf_format: Callable[["ModelConfig"], HFFormat]
    hf_formats: tuple[HFFormat, ...]
    modules: Callable[["ModelConfig"], list["Module"]]
    seq2seq: bool = False
    draws_attention: bool = True
    state_bytes_per_sequence: Callable[["ModelConfig", int], int] = field(default=lambda cfg, bytes_per_element: 0)
    describe: Callable[["ModelConfig"], str] = field(default=lambda cfg: "")
    activations: Callable[["ModelConfig", int, int], "Activations"] | None = None

    @property
    def model_class(self) -> type:
        """The nn.Module built as ``model_class(cfg)`` (importing its module, and torch, on first use)."""
        module, _, name = self.model.partition(":")
        return getattr(importlib.import_module(module), name)
