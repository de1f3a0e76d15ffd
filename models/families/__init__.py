"""Model families as entries in one table: `FAMILIES`, keyed by ``ModelConfig.arch``.

Each family is one package here (``models/families/<name>/``): its nn.Module (``model.py``), its
Hugging Face format(s) (``hf_*.py``: config.json both ways, ``to_hf``/``from_hf``), and in its
``__init__`` its config checks, its accounting (parameters, FLOPs, cache bytes) and its `Family`
record (`models.families.spec`). The attention kinds of Transformer layers are a table of their own
beside the layers (`models.layers.kinds`). Everything above asks this table (`family(cfg)`,
`hf_format_of_model_type(...)`) and never compares family names: adding a family is one new package
and one line below. Nothing below the table imports it: the config learns the family-dependent rules
through `models.config.register_family_rules`, called at the bottom of this module.

The table imports no torch (nor does anything it imports), so a run config is read and checked without it:
a family names its nn.Module by path (`Family.model_class` imports it on first use), an attention kind
imports its module when it builds one, and the ``hf_*.py`` modules import torch in the functions that make
tensors.

Families today: ``decoder`` (the decoder-only Transformer, dense or MoE, mha or mla attention),
``mamba`` (Mamba), ``mamba2`` (Mamba-2), ``hybrid`` (attention and Mamba-2 layers in one stack) and
``encoder_decoder`` (the encoder-decoder Transformer).
"""

from __future__ import annotations

from models.config import FamilyRules, ModelConfig, register_family_rules
from models.families import decoder, encdec, hybrid, mamba, mamba2
from models.families.spec import Family, HFFormat
from models.layers.kinds import ATTENTION_KINDS, AttentionKind, attention_kind

FAMILIES: dict[str, Family] = {f.arch: f for f in (decoder.FAMILY, mamba.FAMILY, mamba2.FAMILY, hybrid.FAMILY,
                                                   encdec.FAMILY)}


def family(cfg: ModelConfig) -> Family:
    """The family of `cfg` (by ``cfg.arch``, which the config has already checked)."""
    return FAMILIES[cfg.arch]


def hf_format_of_model_type(model_type: str | None) -> tuple[Family, HFFormat]:
    """The family and HF format that read a config.json of `model_type`.

    Raises:
        ValueError: naming the model types that load.
    """
    for fam in FAMILIES.values():
        for fmt in fam.hf_formats:
            if model_type in fmt.model_types:
                return fam, fmt
    known = [t for fam in FAMILIES.values() for fmt in fam.hf_formats for t in fmt.model_types]
    raise ValueError(f"load_hf supports model_type {', '.join(repr(t) for t in known)}, got {model_type!r}")


def check_family(cfg: ModelConfig, defaults: dict) -> None:
    """The rules that depend on `cfg`'s family and attention kind: the fields of every other family and
    kind left at their defaults (naming the field and whose it is), then the family's own checks and the
    attention kind's.

    Raises:
        ValueError: naming the field.
    """
    for owner, table, current in (("arch", FAMILIES, cfg.arch), ("attention", ATTENTION_KINDS, cfg.attention)):
        for name, entry in table.items():
            if name == current:
                continue
            own = table[current].fields
            for f in entry.fields:
                if f not in own and getattr(cfg, f) != defaults[f]:
                    raise ValueError(f"{f} is an option of {owner} {name!r}; with {owner} {current!r} leave it at "
                                     f"{defaults[f]!r}, got {getattr(cfg, f)!r}")
    family(cfg).check(cfg)
    attention_kind(cfg).check(cfg)


register_family_rules(FamilyRules(families=FAMILIES, attention_kinds=ATTENTION_KINDS, check=check_family,
                                  rope_head_dim=lambda cfg: attention_kind(cfg).rope_head_dim(cfg)))

__all__ = ["ATTENTION_KINDS", "AttentionKind", "FAMILIES", "Family", "HFFormat", "attention_kind", "check_family",
           "family", "hf_format_of_model_type"]
