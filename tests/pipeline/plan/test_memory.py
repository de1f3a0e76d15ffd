"""The planner's model shapes under expert parallelism, and DeepSpeed's defaults the planner assumes. Each
model-state term against DeepSpeed's own estimators, exactly: tests/pipeline/plan/test_deepspeed_estimators.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from models import build_model
from models.presets import PRESETS
from pipeline.plan.memory import DS_ZERO_DEFAULTS, ModelShape, Setup, model_shape, model_states

MODELS = {"dense": PRESETS["cpu_small"], "mla_moe": PRESETS["cpu_mla_moe"], "mamba2": PRESETS["debug_mamba2"]}


def setup(cfg, world: int, stage: int, offload_optimizer=False, offload_params=False) -> Setup:
    return Setup(model=cfg, seq_len=64, micro_batch=1, global_batch=world, world=world, ep_size=1, zero_stage=stage,
                 precision="bf16", offload_optimizer=offload_optimizer, offload_params=offload_params,
                 checkpointing=False, chunk_tokens=0, zero={"stage": stage})


def test_expert_parallelism_shards_experts_and_partitions_each_group():
    cfg = PRESETS["cpu_moe"]  # 8 experts, no shared ones
    whole, split = model_shape(cfg, 1), model_shape(cfg, 4)
    model = build_model(cfg)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert whole.experts == 0 and whole.dense == whole.total
    assert split.experts == experts // 4 and split.dense == whole.total - experts
    states = model_states(dataclasses.replace(setup(cfg, 8, 2), ep_size=4), split)
    # Dense parameters partitioned over the 8 ranks, each rank's quarter of the experts over their 2 replicas.
    assert states["optimizer"] == round(16 * split.dense / 8 + 16 * split.experts / 2)
    assert states["weights"] == 2 * (split.dense + split.experts)


def shape_of_the_built_model(cfg, ep_size: int) -> ModelShape:
    """What `model_shape` reads from the config, read off the model built on the meta device."""
    from models.layers.grouped_experts import StackedExperts

    model = build_model(cfg, device="meta")
    expert_ids = {id(p) for m in model.modules() if isinstance(m, StackedExperts) for p in m.parameters()
                  if ep_size > 1}

    def on_rank(params) -> int:
        return sum(p.numel() // ep_size if id(p) in expert_ids else p.numel() for p in params)

    experts = sum(p.numel() for p in model.parameters() if id(p) in expert_ids) // ep_size
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    blocks = tuple(on_rank(b.parameters()) for b in [*getattr(model, "encoder_layers", ()), *model.layers])
    sizes = tuple(sorted(p.numel() for p in model.parameters() if id(p) not in expert_ids))
    return ModelShape(dense=on_rank(model.parameters()) - experts, experts=experts, largest_layer=largest,
                      blocks=blocks, dense_sizes=sizes)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_the_shape_read_from_the_config_is_the_built_models(name):
    cfg = PRESETS[name]
    for ep_size in (1, 2, 4) if cfg.num_experts % 4 == 0 and cfg.num_experts else (1,):
        assert model_shape(cfg, ep_size) == shape_of_the_built_model(cfg, ep_size), ep_size


def test_deepspeed_defaults_the_planner_assumes():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds = DeepSpeedZeroConfig(stage=2)
    # overlap_comm unset: DeepSpeed turns it on for stage 3 only, which is what the planner's None means.
    assert ds.overlap_comm is False and DeepSpeedZeroConfig(stage=3).overlap_comm is True
    for key, value in DS_ZERO_DEFAULTS.items():
        if key == "overlap_comm":
            continue
        name = {"stage3_prefetch_bucket_size": "prefetch_bucket_size",
                "stage3_param_persistence_threshold": "param_persistence_threshold",
                "stage3_max_reuse_distance": "max_reuse_distance"}.get(key, key)
        assert getattr(ds, name) == value, key
