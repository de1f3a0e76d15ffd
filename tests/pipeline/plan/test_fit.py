"""The train stage's memory preflight (`pipeline.preflight.check_cluster_resources` -> `pipeline.plan.fit`):
on GPUs it refuses a config whose planned peak exceeds a GPU's memory, naming the largest term and the
cheapest change that fits; the change it names really fits; CPU clusters are not judged.

The cluster is what the preflight sees: the resources dict ``ray.cluster_resources()`` returns, with a
GPU count and the ``accelerator_type:<name>`` resource Ray gives GPU nodes.
"""

from __future__ import annotations

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.preflight import check_cluster_resources

L4_NODE = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:L4": 8.0}


@pytest.mark.parametrize("config,overrides,term,fix", [
    ("gpu_mla_moe", ["train.activation_checkpointing=false", "train.micro_batch_size_per_rank=8"], "activations",
     "train.activation_checkpointing=true"),
    ("gpu_moe", ["parallel.ep_size=1", "train.micro_batch_size_per_rank=8", "train.activation_checkpointing=false"],
     "activations", "train.micro_batch_size_per_rank=4"),
    ("gpu_moe", ["parallel.ep_size=1", "train.zero_stage=0", "train.micro_batch_size_per_rank=2"], "optimizer",
     "parallel.ep_size=2"),
    ("gpu_mla_moe", ["train.zero_stage=0"], "optimizer", "train.zero_stage=1"),
])
def test_refuses_what_does_not_fit_and_names_the_term_and_a_change_that_fits(config, overrides, term, fix):
    cfg = load_config(f"configs/{config}.yaml", overrides)
    with pytest.raises(ConfigError) as refused:
        check_cluster_resources(cfg, L4_NODE)
    message = str(refused.value)
    assert "planned peak" in message and "exceeds the L4's 24.00 GB" in message
    assert f"the largest term is {term} (" in message
    assert f"the cheapest change that fits: {fix} (" in message
    check_cluster_resources(load_config(f"configs/{config}.yaml", [*overrides, fix]), L4_NODE)  # it does fit


def test_shipped_gpu_configs_fit_an_l4_node():
    for config in ("gpu_125m", "gpu_1b", "gpu_moe", "gpu_mla_moe"):
        check_cluster_resources(load_config(f"configs/{config}.yaml"), L4_NODE)


def test_cpu_clusters_and_unknown_gpus_are_not_judged():
    too_big = load_config("configs/gpu_mla_moe.yaml", ["train.zero_stage=0", "parallel.device=auto",
                                                       "train.precision=bf16"])
    check_cluster_resources(too_big, {"CPU": 64.0})  # no GPU: trains on CPU, whose memory is checked elsewhere
    check_cluster_resources(too_big, {"CPU": 64.0, "GPU": 8.0})  # a GPU type Ray does not name: memory unknown
    check_cluster_resources(too_big, {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 8.0})  # 141 GB: fits
    with pytest.raises(ConfigError, match="exceeds the L4's 24.00 GB; the largest term is optimizer"):
        # A cluster of H200 and L4 nodes: a worker may land on an L4, so the L4 is planned against.
        check_cluster_resources(too_big, {"CPU": 128.0, "GPU": 16.0, "accelerator_type:H200": 8.0,
                                          "accelerator_type:L4": 8.0})
