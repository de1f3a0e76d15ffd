"""Model states per GPU against DeepSpeed's own estimators, and DeepSpeed's defaults the planner assumes.

What is compared, and why not everything equals an estimator: DeepSpeed 0.19 ships
``estimate_zero2_model_states_mem_needs`` (stages 1-2 share its optimizer) and
``estimate_zero3_model_states_mem_needs``, both for 16-bit weights and Adam. The planner's stage 2 must
equal the first; its stage 1, which keeps every 16-bit gradient instead of a 1/N partition, must equal it
plus 2P(N-1)/N; its stage 3 must equal the second plus the 16-bit gradient partition 2P/N, which that
estimator's GPU figure leaves out (its 18 bytes per parameter are the 16-bit weights and the 16 of fp32
master, moments and gradients). Each within 1% (they come out exact). P and the largest layer come
from the estimators' own ``model_to_params`` / module walk over the real built model, so the planner's
counts (read from the config, `models.tensors`) are checked too.
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


def deepspeed_counts(cfg) -> tuple[int, int]:
    """(P, largest layer) as DeepSpeed's estimators count them on the real model."""
    from deepspeed.runtime.zero.stage_1_and_2 import model_to_params

    model = build_model(cfg)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    return model_to_params(model), largest


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("nodes,per_node", [(1, 2), (1, 8), (8, 8)])
def test_zero_1_2_3_equal_deepspeeds_estimators(name, nodes, per_node):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    cfg, N = MODELS[name], nodes * per_node
    P, largest = deepspeed_counts(cfg)
    shape = model_shape(cfg, 1)
    assert shape.total == P and shape.largest_layer == largest

    def ours(stage, **kw) -> int:
        return sum(model_states(setup(cfg, N, stage, **kw), shape).values())

    zero2 = estimate_zero2_model_states_mem_needs(P, per_node, nodes, cpu_offload=False)[1]
    zero2_offload = estimate_zero2_model_states_mem_needs(P, per_node, nodes, cpu_offload=True)[1]
    zero3 = estimate_zero3_model_states_mem_needs(P, largest, per_node, nodes, cpu_offload=False)[1]
    zero3_offload = estimate_zero3_model_states_mem_needs(P, largest, per_node, nodes, cpu_offload=True,
                                                          cpu_offload_params=False)[1]
    zero3_offload_all = estimate_zero3_model_states_mem_needs(P, largest, per_node, nodes, cpu_offload=True,
                                                              cpu_offload_params=True)[1]
    expected = {
        "zero2": (ours(2), zero2),
        "zero1": (ours(1), zero2 + 2 * P * (N - 1) / N),
        "zero3": (ours(3), zero3 + 2 * P / N),
        "zero2 offload": (ours(2, offload_optimizer=True), zero2_offload),
        "zero3 offload": (ours(3, offload_optimizer=True), zero3_offload + 2 * P / N),
        "zero3 offload all": (ours(3, offload_optimizer=True, offload_params=True), zero3_offload_all + 2 * P / N),
    }
    for case, (planned, reference) in expected.items():
        assert planned == pytest.approx(reference, rel=0.01), case


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
