"""The family table: every question about a model family is asked of ``models.families``, so a family
added to the table is built, checked, counted and exported through its entry alone."""

from __future__ import annotations

import dataclasses

import pytest

from models import ModelConfig, PRESETS, Transformer, build_model
from models.accounting import flops_per_token, kv_cache_bytes_per_token, param_counts
from models.export import hf_unsupported_options
from models.families import ATTENTION_KINDS, FAMILIES, family, hf_format_of_model_type
from models.families.spec import HFFormat

FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def test_each_entry_names_real_fields_and_every_preset_has_one():
    for table in (FAMILIES, ATTENTION_KINDS):
        for name, entry in table.items():
            assert set(entry.fields) <= FIELDS, name
    # A field belongs to one attention kind, or to families: Mamba, Mamba-2 and the hybrid share the sizes
    # they read.
    kinds = [f for e in ATTENTION_KINDS.values() for f in e.fields]
    families = {f for e in FAMILIES.values() for f in e.fields}
    assert len(kinds) == len(set(kinds)) and not families & set(kinds), "a field belongs to one attention kind"
    shared = {f for f in families if sum(f in e.fields for e in FAMILIES.values()) > 1}
    assert shared == {"ssm_state_size", "ssm_conv_kernel", "ssm_expand", "ssm_head_dim", "ssm_n_groups",
                      "ssm_chunk_size"}
    assert {family(cfg).arch for cfg in PRESETS.values()} == set(FAMILIES)
    for cfg in PRESETS.values():
        assert type(build_model(cfg, device="meta")) is family(cfg).model_class


def test_a_field_of_another_family_is_refused_naming_whose_it_is():
    with pytest.raises(ValueError, match=r"ssm_state_size is an option of arch 'mamba'; with arch 'decoder' leave it "
                                         r"at 16, got 32"):
        ModelConfig(ssm_state_size=32)
    with pytest.raises(ValueError, match=r"embedding_norm is an option of arch 'encoder_decoder'"):
        PRESETS["debug_mamba"].replace(embedding_norm=True)
    with pytest.raises(ValueError, match=r"q_lora_rank is an option of attention 'mla'; with attention 'mha'"):
        ModelConfig(q_lora_rank=8)


def test_a_family_added_to_the_table_is_asked_for_everything(monkeypatch):
    """A toy family, one entry: ModelConfig accepts its name, build_model builds its class, accounting
    and the HF export ask it, and load_hf finds it by its model_type; no string compares anywhere."""
    toy_format = HFFormat(name="ToyForCausalLM", model_types=("toy",),
                          unsupported_options=lambda cfg: ["toy=1 (no such transformers class)"],
                          hf_config=lambda cfg, dtype: {}, config_from_hf=lambda hf: ModelConfig(),
                          to_hf=lambda state, cfg: state, from_hf=lambda tensors, cfg: tensors,
                          architecture=lambda cfg: ("toy",))
    toy = dataclasses.replace(
        FAMILIES["decoder"], arch="toy", title="toy", fields=(),
        param_counts=lambda cfg: {"total": 7, "active": 7, "embedding": 0, "non_embedding": 7,
                                  "active_non_embedding": 7},
        flops_per_token=lambda cfg, seq_len: {"total": 6 * seq_len, "forward": 2 * seq_len},
        kv_cache_bytes_per_token=lambda cfg, b: 11 * b, hf_format=lambda cfg: toy_format, hf_formats=(toy_format,))
    monkeypatch.setitem(FAMILIES, "toy", toy)
    cfg = ModelConfig(arch="toy")
    assert type(build_model(cfg, device="meta")) is Transformer
    assert param_counts(cfg)["total"] == 7
    assert flops_per_token(cfg, 10) == {"total": 60, "forward": 20}
    assert kv_cache_bytes_per_token(cfg, 4) == 44
    assert hf_unsupported_options(cfg) == ["toy=1 (no such transformers class)"]
    assert hf_format_of_model_type("toy") == (toy, toy_format)
    monkeypatch.delitem(FAMILIES, "toy")
    with pytest.raises(ValueError, match=r"arch must be one of \['decoder', 'mamba', 'mamba2', 'hybrid', 'encoder_decoder'\], got 'toy'"):
        ModelConfig(arch="toy")
    with pytest.raises(ValueError, match=r"load_hf supports model_type 'llama', 'mixtral', 'deepseek_v2', 'deepseek_v3', 'mamba', "
                                         r"'mamba2', 'granitemoehybrid', 'marian', 'bart', got 'toy'"):
        hf_format_of_model_type("toy")


def test_the_config_alone_runs_the_family_rules():
    """``models.config`` does not import the table; the table registers its rules with the config when it
    is imported, and importing ``models.config`` alone imports it first (``models/__init__.py``): a fresh
    interpreter that imports only the config still refuses a bad combination with the table's message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = ("from models.config import ModelConfig\n"
              "for kw in ({'arch': 'decoder', 'ssm_state_size': 8}, {'attention': 'mla', 'num_kv_heads': 2},\n"
              "           {'arch': 'toy'}):\n"
              "    try:\n"
              "        ModelConfig(**kw)\n"
              "    except ValueError as e:\n"
              "        print(e)\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ssm_state_size is an option of arch 'mamba'; with arch 'decoder' leave it at 16")
    assert lines[1].startswith("num_kv_heads must be None with attention 'mla'")
    assert lines[2] == "arch must be one of ['decoder', 'mamba', 'mamba2', 'hybrid', 'encoder_decoder'], got 'toy'"
