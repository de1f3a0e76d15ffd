"""Sequence parallelism (``pipeline.training.sequence_parallel``): two ranks splitting every sequence equal one
process on the whole of it, and models whose shards cannot be computed alone are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from models import build_model, get_preset
from pipeline.training.sequence_parallel import check_shardable, shard
from tests.distributed import run_world

ROOT = Path(__file__).resolve().parents[3]

TOLERANCE = 1e-5  # float32


@pytest.mark.slow
def test_two_ranks_splitting_each_sequence_equal_one_process(tmp_path):
    """Dense MHA, GQA, MQA (fewer key/value heads than ranks), YaRN, learned positions, tied GELU with LayerNorm,
    mixtures of experts (softmax router with the batch balancing and z losses; V3's sigmoid router with the
    per-sequence balance loss), the loss including their auxiliary losses, and multi-head latent attention
    (with a query latent, and with YaRN's softmax scale and shared plus routed experts); each
    with activation checkpointing off and on: the loss, every gradient and the weights after three SGD
    steps (sequence_parallel_dist.py)."""
    run_world("tests.pipeline.training.sequence_parallel_dist", str(tmp_path))
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(results) == 20
        for case, diff in results.items():
            assert diff["grad_scale"] > 1e-3, case  # gradients that are there to compare
            assert diff["loss"] < TOLERANCE and diff["grad"] < TOLERANCE and diff["weights"] < TOLERANCE, (case, diff)


def test_a_shard_is_consecutive_positions_and_its_offset():
    tokens = torch.arange(24).view(2, 12)
    part, offset = shard(tokens, 1, 3)
    assert offset == 4 and part.tolist() == [[4, 5, 6, 7], [16, 17, 18, 19]]
    with pytest.raises(ValueError, match="sequence length 12 must be a multiple of parallel.sequence_parallel_size=5"):
        shard(tokens, 0, 5)


@pytest.mark.parametrize("cfg,pattern", [
    (get_preset("debug_mamba2"), r"sequence_parallel_size=2: the mamba2 family's layers read the whole sequence"),
    (get_preset("debug_hybrid"), r"the hybrid family's layers read the whole sequence"),
    (get_preset("debug_dense").replace(pos_encoding="alibi"), r"not supported with model\.pos_encoding=alibi"),
    (get_preset("debug_moe").replace(moe_capacity_factor=1.25), r"not supported with model\.moe_capacity_factor=1\.25"),
    (get_preset("debug_dense").replace(rope_scaling_type="dynamic", rope_scaling=2.0, rope_original_max_seq_len=64),
     r"model\.rope_scaling_type=dynamic"),
    (get_preset("debug_dense").replace(n_heads=2, num_kv_heads=2), r"model\.n_heads=2 must be a multiple of it"),
], ids=["mamba2", "hybrid", "alibi", "moe-capacity", "dynamic-ntk", "heads"])
def test_what_cannot_be_split_along_the_sequence_is_refused_by_name(cfg, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_shardable(cfg, build_model(cfg), 4 if "heads" in pattern else 2)


def test_the_refusal_comes_before_any_stage_as_a_config_error():
    """``run_pipeline``'s preflight (``check_cluster_resources``) refuses it, naming the field, before any
    stage runs (the train stage would refuse it only after the data stages); a run without the train
    stage (``--only shard``) is not judged by it."""
    from pipeline.config import ConfigError, load_config
    from pipeline.preflight import check_cluster_resources

    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["model.preset=debug_mamba2", "parallel.num_workers=2",
                                                      "parallel.sequence_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel_size=2: the mamba2 family's layers"):
        check_cluster_resources(cfg, {"CPU": 4.0}, ["shard", "tokenizer", "tokenize", "train"])
    check_cluster_resources(cfg, {"CPU": 4.0}, ["shard"])


def test_an_installed_core_refuses_a_cache_or_a_mask_and_offsets_shift_positions():
    cfg = get_preset("debug_dense").replace(pos_encoding="learned")
    torch.manual_seed(0)
    model = build_model(cfg)
    ids = torch.randint(cfg.vocab_size, (1, 16))
    whole = model(ids).logits
    # a shard's logits with its offset are the whole sequence's at those positions only where attention sees
    # nothing before it: position 0 alone equals; the offset reaches the learned positions
    first = model(ids[:, :1]).logits
    torch.testing.assert_close(first[0, 0], whole[0, 0])
    moved = model(ids[:, 4:5], position_offset=4).logits
    plain = model(ids[:, 4:5]).logits
    assert not torch.allclose(moved, plain)  # position 4's embedding, not position 0's
    with pytest.raises(ValueError, match="position_offset is for a shard of an unpadded training sequence"):
        model(ids, attention_mask_BT=torch.ones_like(ids), position_offset=4)
    with pytest.raises(ValueError, match="sequence length 132 exceeds max_seq_len 128"):
        model(ids, position_offset=116)
    model.layers[0].attn.core = lambda *a: (_ for _ in ()).throw(AssertionError("the core is not for masks"))
    with pytest.raises(ValueError, match="attends plain causal training sequences only"):
        model(ids, attention_mask_BT=torch.ones_like(ids))
