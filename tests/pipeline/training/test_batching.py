"""ParallelDims arithmetic, the generated DeepSpeed config, and the resumable block loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.config import TrainSection
from pipeline.training.loader import BlockLoader
from pipeline.training.ds_config import build_ds_config
from pipeline.training.engine import engine_zero_stage
from pipeline.training.layout import ParallelDims


def test_parallel_dims_arithmetic():
    d = ParallelDims(world_size=4, ep_size=2, global_batch_size=32, micro_batch_size_per_rank=2, seq_len=128)
    assert (d.dp_size, d.expert_dp_size, d.grad_accum_steps, d.global_batch_tokens) == (4, 2, 4, 4096)
    assert "4 accum" in d.describe()


@pytest.mark.parametrize("kw,pattern", [
    (dict(world_size=2, ep_size=1, global_batch_size=10, micro_batch_size_per_rank=4, seq_len=8),
     r"train\.global_batch_size=10 must be a multiple of parallel\.num_workers=2 x "
     r"train\.micro_batch_size_per_rank=4 = 8"),
    (dict(world_size=3, ep_size=2, global_batch_size=6, micro_batch_size_per_rank=1, seq_len=8),
     r"parallel\.ep_size=2 must divide parallel\.num_workers=3"),
    (dict(world_size=2, ep_size=1, global_batch_size=4, micro_batch_size_per_rank=0, seq_len=8),
     r"micro_batch_size_per_rank=0"),
])
def test_parallel_dims_errors_name_every_factor(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        ParallelDims(**kw)


def test_ds_config_golden():
    dims = ParallelDims(world_size=2, ep_size=1, global_batch_size=16, micro_batch_size_per_rank=4, seq_len=64)
    assert build_ds_config(dims=dims, zero_stage=1, precision="fp32", grad_clip=1.0) == {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": False},
        "fp16": {"enabled": False, "initial_scale_power": 12},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    bf16 = build_ds_config(dims=dims, zero_stage=3, precision="bf16", grad_clip=0.0)
    assert bf16["bf16"] == {"enabled": True} and bf16["zero_optimization"] == {"stage": 3}
    offload = build_ds_config(dims=dims, zero_stage=3, precision="fp32", grad_clip=1.0,
                              offload_optimizer=True, offload_params=True)
    assert offload["zero_optimization"] == {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
    }
    assert offload["zero_force_ds_cpu_optimizer"] is False
    amp = build_ds_config(dims=dims, zero_stage=1, precision="amp_bf16", grad_clip=1.0)
    assert amp["torch_autocast"] == {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    assert amp["bf16"] == {"enabled": False} and amp["fp16"]["enabled"] is False  # weights stay fp32
    assert "torch_autocast" not in build_ds_config(dims=dims, zero_stage=1, precision="bf16", grad_clip=1.0)
    with pytest.raises(ValueError, match="offload_params needs zero_stage=3"):
        build_ds_config(dims=dims, zero_stage=2, precision="fp32", grad_clip=1.0, offload_params=True)
    with pytest.raises(ValueError, match="precision='fp8'"):
        build_ds_config(dims=dims, zero_stage=1, precision="fp8", grad_clip=1.0)


@pytest.fixture()
def blocks_file(tmp_path):
    blocks = np.arange(37 * 9, dtype=np.uint16).reshape(37, 9)  # 37 blocks of seq_len 8 (+1)
    path = tmp_path / "train.tokens.npy"
    np.save(path, blocks)
    return path, blocks


def global_batches(path, world, micro, steps, global_batch=8, seed=3):
    """Per step: the set of all ranks' input rows, in (micro step, rank) order."""
    dims = ParallelDims(world, 1, global_batch, micro, 8)
    loaders = [BlockLoader(path, dims, r, seed) for r in range(world)]
    out = []
    for _ in range(steps):
        per_rank = [ld.next_step() for ld in loaders]
        rows = []
        for m in range(dims.grad_accum_steps):
            for r in range(world):
                rows += per_rank[r][m][0].tolist()
        out.append(rows)
    return out


def test_global_order_does_not_depend_on_world_size(blocks_file):
    path, _ = blocks_file
    one = global_batches(path, world=1, micro=2, steps=12)
    two = global_batches(path, world=2, micro=2, steps=12)
    four = global_batches(path, world=4, micro=1, steps=12)
    assert one == two == four


def test_each_epoch_is_a_permutation_and_targets_shift(blocks_file):
    path, blocks = blocks_file
    dims = ParallelDims(1, 1, 37, 37, 8)
    ld = BlockLoader(path, dims, 0, seed=5)
    (x, y), = ld.next_step()
    assert sorted(map(tuple, torch.cat([x, y[:, -1:]], 1).tolist())) == sorted(map(tuple, blocks.tolist()))
    assert torch.equal(x[:, 1:], y[:, :-1])
    (x2, _), = ld.next_step()
    assert x2.tolist() != x.tolist()  # a new permutation for epoch 1


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_exact(blocks_file, world):
    path, _ = blocks_file
    dims = ParallelDims(world, 1, 8, 2, 8)
    straight = [BlockLoader(path, dims, r, 11) for r in range(world)]
    for _ in range(7):
        [ld.next_step() for ld in straight]
    states = [ld.state_dict() for ld in straight]
    expected = [[ld.next_step() for ld in straight] for _ in range(5)]
    resumed = [BlockLoader(path, dims, r, 0) for r in range(world)]
    for ld, st in zip(resumed, states):
        ld.load_state_dict(st)
    got = [[ld.next_step() for ld in resumed] for _ in range(5)]
    for e_step, g_step in zip(expected, got):
        for e_rank, g_rank in zip(e_step, g_step):
            for (ex, ey), (gx, gy) in zip(e_rank, g_rank):
                assert torch.equal(ex, gx) and torch.equal(ey, gy)


def test_ranks_are_disjoint_within_a_step(blocks_file):
    path, _ = blocks_file
    dims = ParallelDims(2, 1, 8, 4, 8)
    a, b = (BlockLoader(path, dims, r, 1).next_step()[0][0] for r in range(2))
    assert not set(map(tuple, a.tolist())) & set(map(tuple, b.tolist()))


def test_a_checkpoint_without_canonical_copy_is_refused_clearly(tmp_path):
    from pipeline.training.checkpoint.canonical import load_canonical

    class Engine:  # load_canonical looks for the file before touching the engine
        pass

    with pytest.raises(ValueError, match=r"has no canonical\.pt \(an older checkpoint\): it resumes only with the same"):
        load_canonical(Engine(), tmp_path, scheduler=None)


@pytest.mark.parametrize("world, stage, precision, offload, expected", [
    (1, 1, "fp32", False, 0), (1, 2, "fp32", False, 0), (1, 1, "amp_bf16", False, 0),  # nothing to partition
    (1, 0, "fp32", False, 0), (1, 3, "fp32", False, 3),  # ZeRO-3 keeps its own gather/partition path
    (1, 1, "bf16", False, 1), (1, 2, "fp16", False, 2),  # 16-bit weights: ZeRO keeps the fp32 master copy
    (1, 1, "fp32", True, 1),  # offloading is where memory lives, not a partition
    (2, 1, "fp32", False, 1), (2, 2, "amp_bf16", False, 2),
])
def test_engine_zero_stage_is_0_where_zero_has_nothing_to_partition(world, stage, precision, offload, expected):
    dims = ParallelDims(world_size=world, ep_size=1, global_batch_size=8, micro_batch_size_per_rank=4, seq_len=8)
    train = TrainSection(zero_stage=stage, offload_optimizer=offload)
    assert engine_zero_stage(train, dims, precision) == expected
