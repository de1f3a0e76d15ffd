"""Each limit has one message: config validation and the code that relies on the limit say the same."""

from __future__ import annotations

import pytest

from models import build_model
from pipeline.config import ConfigError, limits, load_config
from pipeline.training.ds_config import build_ds_config
from pipeline.training.expert_parallel import apply_expert_parallel
from pipeline.training.layout import ParallelDims

DIMS = ParallelDims(world_size=2, ep_size=1, global_batch_size=16, micro_batch_size_per_rank=4, seq_len=64)


def config_message(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides))
    return str(e.value)


def code_message(call) -> str:
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


@pytest.mark.parametrize("overrides,rule,call", [
    (["train.global_batch_size=10"], limits.global_batch(10, 2, 4),
     lambda: ParallelDims(2, 1, 10, 4, 8)),
    (["parallel.num_workers=3", "train.global_batch_size=12", "model.preset=debug_moe", "parallel.ep_size=2"],
     limits.ep_divides_workers(2, 3), lambda: ParallelDims(3, 2, 12, 4, 8)),
    (["train.micro_batch_size_per_rank=0"], limits.layout_sizes(2, 1, 0), lambda: ParallelDims(2, 1, 16, 0, 8)),
    (["train.offload_params=true"], limits.offload(1, False, True),
     lambda: build_ds_config(dims=DIMS, zero_stage=1, precision="fp32", grad_clip=1.0, offload_params=True)),
    (["train.offload_optimizer=true", "train.zero_stage=0"], limits.offload(0, True, False),
     lambda: build_ds_config(dims=DIMS, zero_stage=0, precision="fp32", grad_clip=1.0, offload_optimizer=True)),
    (["parallel.ep_size=2"], limits.ep_needs_moe(2, 0),
     lambda: apply_expert_parallel(build_model("debug_dense"), 2, 0)),
    (["model.preset=debug_moe", "model.num_experts=3", "parallel.ep_size=2"], limits.ep_divides_experts(2, 3),
     lambda: apply_expert_parallel(build_model("debug_moe", num_experts=3), 2, 0)),
    (["model.preset=debug_moe", "model.moe_shared_experts=1", "parallel.ep_size=2"], limits.ep_shared_experts(2, 1),
     lambda: apply_expert_parallel(build_model("debug_moe", moe_shared_experts=1), 2, 0)),
    (["parallel.sequence_parallel_size=3", "parallel.num_workers=2"], limits.sequence_parallel(3, 2, 1, 128),
     lambda: ParallelDims(2, 1, 16, 4, 128, 3)),
    (["parallel.sequence_parallel_size=2", "tokenize.seq_len=127"], limits.sequence_parallel(2, 2, 1, 127),
     lambda: ParallelDims(2, 1, 16, 4, 127, 2)),
    (["parallel.sequence_parallel_size=2", "model.preset=debug_moe", "parallel.ep_size=2"],
     limits.sequence_parallel(2, 2, 2, 128), lambda: ParallelDims(2, 2, 16, 4, 128, 2)),
    (["parallel.sequence_parallel_size=2", "parallel.num_workers=4", "train.global_batch_size=12"],
     limits.global_batch(12, 4, 4, 2), lambda: ParallelDims(4, 1, 12, 4, 128, 2)),
], ids=["global_batch", "ep_divides_workers", "layout_sizes", "offload_params", "offload_optimizer", "ep_needs_moe",
        "ep_divides_experts", "ep_shared_experts", "sp_divides_workers", "sp_divides_seq_len", "sp_with_ep",
        "sp_global_batch"])
def test_config_and_code_refuse_with_the_same_message(overrides, rule, call):
    assert rule is not None  # the rule itself refuses these values
    assert config_message(*overrides) == f"<defaults>: {rule}"
    assert code_message(call).startswith(f"{rule} (a limit of pipeline.config.limits")


def test_sequence_parallel_messages_name_the_fields():
    assert limits.sequence_parallel(3, 2, 1, 128) == ("parallel.sequence_parallel_size=3 must be >= 1 and divide "
                                                      "parallel.num_workers=2")
    assert limits.sequence_parallel(2, 2, 1, 127) == ("parallel.sequence_parallel_size=2 must divide "
                                                      "tokenize.seq_len=127 (each rank holds seq_len / sp positions)")
    assert "with parallel.ep_size=2: expert parallelism and sequence parallelism" in limits.sequence_parallel(2, 2, 2, 8)
    assert limits.global_batch(12, 4, 4, 2) == (
        "train.global_batch_size=12 must be a multiple of (parallel.num_workers=4 / "
        "parallel.sequence_parallel_size=2) x train.micro_batch_size_per_rank=4 = 8")
    assert limits.sequence_parallel(2, 4, 1, 128) is None and limits.global_batch(16, 4, 4, 2) is None


def test_ep_with_zero3_is_refused_at_config_validation():
    rule = limits.ep_zero_stage(2, 3)
    assert rule is not None and "train.zero_stage=3 with parallel.ep_size > 1 is not supported" in rule
    assert config_message("model.preset=debug_moe", "parallel.ep_size=2", "train.zero_stage=3") == f"<defaults>: {rule}"


@pytest.mark.parametrize("rule", [
    limits.layout_sizes(1, 1, 1), limits.global_batch(16, 2, 4), limits.ep_divides_workers(2, 4),
    limits.ep_needs_moe(1, 0), limits.ep_divides_experts(2, 8), limits.ep_zero_stage(1, 3),
    limits.ep_zero_stage(2, 2), limits.ep_shared_experts(1, 2), limits.offload(3, True, True),
    limits.offload(1, True, False), limits.compile_zero_stage(True, 2), limits.compile_zero_stage(False, 3),
])
def test_allowed_values_pass(rule):
    assert rule is None
    limits.require(rule)
