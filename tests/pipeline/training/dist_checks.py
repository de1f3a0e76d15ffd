"""Distributed training checks, run in gloo worlds by test_distributed_training.py.

    python -m tests.pipeline.training.dist_checks OUT_DIR                    (2 ranks)
    python -m tests.pipeline.training.dist_checks canonical-resume OUT_DIR   (1 rank)
    python -m tests.pipeline.training.dist_checks ep-replicas OUT_DIR        (4 ranks)

Rank 0 writes ``OUT_DIR/results.json`` and ``OUT_DIR/encdec/encdec.json`` (``canonical_resume.json``,
``ep_replicas.json``); the test asserts on them. Everything here goes through the same functions the Ray Train worker uses
(``pipeline.training.engine`` and ``BlockLoader``).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from models import ModelConfig, build_model
from models.layers.loss import lm_loss
from pipeline.config import OptimizerSection, TrainSection
from pipeline.data.span_corruption import SpanCorruption, corrupt_micro_batches
from pipeline.training.checkpoint.canonical import load_canonical, save_canonical
from pipeline.training.loader import BlockLoader
from pipeline.training.checkpoint.native import load_state, save_state
from pipeline.training.engine import build_engine, full_state_dict, make_optimizer, seed_everything, train_step
from pipeline.training.expert_parallel import moe_layers
from pipeline.training.metrics import MoEStats
from pipeline.training.layout import ParallelDims

SEQ, GLOBAL, MICRO, SEED = 8, 8, 2, 7
CPU = torch.device("cpu")
DENSE = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, num_kv_heads=2, max_seq_len=16)
# The load-balancing loss E * sum_i f_i P_i is a product of batch statistics, so its value over
# a whole batch differs from the mean of its values over micro-batches: any split of the global
# batch (over ranks or accumulation steps) changes it. The z-loss is a per-token mean and stays.
MOE = dataclasses.replace(DENSE, num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.01)
# adam_eps 1e-4, not 1e-8: with a tiny eps Adam's first step is lr * sign(g), which turns the
# rounding differences of near-zero gradients (summed in another order over ranks) into lr-sized
# jumps; the check would then measure rounding, not whether the distributed step is the same step.
MOE_AUX = dataclasses.replace(MOE, moe_aux_loss_coef=0.01)
MOE_CAPACITY = dataclasses.replace(MOE_AUX, moe_capacity_factor=1.0)
# Multi-head latent attention (with a query latent), dense and with DeepSeek-style shared + routed experts.
MLA = dataclasses.replace(DENSE, num_kv_heads=None, attention="mla", kv_lora_rank=16, q_lora_rank=12,
                          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
MLA_MOE = dataclasses.replace(MLA, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_renormalize=False,
                              moe_first_dense_layers=1, moe_aux_loss_coef=0.0, moe_z_loss_coef=0.01)
# DeepSeek-V3's router: sigmoid affinities, 4 groups of 2 experts with 2 eligible, and the score bias
# moved after every step by the routed counts of the whole global batch (an auxiliary-loss-free balance).
# (Not 2 groups of 2 with 1 eligible: top-2 inside one group of 2 loads both its experts alike, and the
# bias could only swing between the two groups, back to zero every other step.)
MOE_V3 = dataclasses.replace(MOE, num_experts=8, moe_router="sigmoid", moe_n_group=4, moe_topk_group=2,
                             moe_routed_scaling_factor=2.0, moe_bias_update_rate=0.01)
# V3's router with its complementary sequence-wise balance loss (a per-sequence mean: any split of the
# batch into micro-batches gives the same loss, so it is compared with one process exactly).
MOE_V3_SEQ = dataclasses.replace(MOE_V3, moe_aux_loss_coef=0.001, moe_aux_loss_scope="sequence")
# EP: no shared experts (pipeline.config.limits); layer 0 dense, layer 1 experts split over the ranks.
MLA_MOE_AUX = dataclasses.replace(MLA_MOE, moe_shared_experts=0, moe_aux_loss_coef=0.01)
# Mamba with a 4-wide state: its conv, A_log and D are partitioned under ZeRO-3 like any weight.
MAMBA = ModelConfig(arch="mamba", pos_encoding="none", vocab_size=97, d_model=32, n_layers=2, max_seq_len=16,
                    ssm_state_size=4)
# Mamba-2 with 2 groups of B and C and chunks of 3 tokens (the 8-token blocks are not a multiple).
MAMBA2 = ModelConfig(arch="mamba2", pos_encoding="none", vocab_size=97, d_model=32, n_layers=2, max_seq_len=16,
                     ssm_state_size=4, ssm_head_dim=8, ssm_n_groups=2, ssm_chunk_size=3)
# A hybrid: Mamba-2, attention (GQA), Mamba-2; its MoE twin has experts in the middle layer's feed-forward
# (z-loss only, as MOE: the balance loss depends on how the batch is split).
HYBRID = ModelConfig(arch="hybrid", vocab_size=97, d_model=32, n_layers=3, n_heads=4, num_kv_heads=2, max_seq_len=16,
                     hybrid_layers="MAM", ssm_state_size=4, ssm_head_dim=8, ssm_n_groups=2, ssm_chunk_size=3)
HYBRID_MOE = dataclasses.replace(HYBRID, num_experts=4, moe_top_k=2, moe_every=2, moe_aux_loss_coef=0.0,
                                 moe_z_loss_coef=0.01)
# An encoder-decoder in the paper's layout; its 9-token blocks become 8-token encoder inputs and 6-token
# decoder targets (3 noise tokens in 2 spans), corrupted by the run seed and the step.
ENCDEC = ModelConfig(arch="encoder_decoder", vocab_size=97, d_model=32, n_layers=2, n_encoder_layers=1, n_heads=4,
                     max_seq_len=16, norm="layernorm", norm_position="post", pos_encoding="sinusoidal", ffn="relu",
                     bias=True, tie_embeddings=True, denoise_noise_density=0.3, denoise_mean_span_length=1.5)
ENCDEC_CORRUPTION = SpanCorruption(0.3, 1.5, first_sentinel_id=5, seed=SEED)
# Every case trains on the chunked loss, in chunks of 5 of a micro-batch's 16 tokens (5, 5, 5, 1), against
# a reference that makes the whole logits (dense_zero1_plain_loss: the whole logits in both).
TRAIN = TrainSection(steps=4, global_batch_size=GLOBAL, micro_batch_size_per_rank=MICRO, loss_chunk_tokens=5)
OPTIM = OptimizerSection(lr=1e-2, warmup_steps=1, schedule="cosine", weight_decay=0.1, grad_clip=1.0, adam_eps=1e-4)


def reference_weights(model_cfg: ModelConfig, train: TrainSection, tokens: Path, steps: int,
                      micro: int = GLOBAL, autocast: bool = False, grad_norms: list | None = None,
                      corruption: SpanCorruption | None = None, optim: OptimizerSection = OPTIM) -> dict:
    """Single process, plain torch, torch's clipping. ``micro=GLOBAL``: the whole global batch in
    one forward; smaller: the same global batch accumulated over micro-batches of that size.
    ``autocast``: the forward under ``torch.autocast("cpu", bfloat16)``, the loss in fp32, chunked as the
    engine's (in bf16 the sum of the chunks' weight gradients rounds apart from the whole one's; in fp32
    the reference makes the whole logits, which proves the chunked loss).
    ``grad_norms``: gets each step's global gradient norm before clipping. ``corruption``: an
    encoder-decoder's span corruption, applied to each step's blocks as the training loop does."""
    seed_everything(SEED)
    model = build_model(model_cfg)
    optimizer, scheduler = make_optimizer(model, optim, train.steps, model_cfg.d_model)
    loader = BlockLoader(tokens, ParallelDims(1, 1, GLOBAL, micro, SEQ), 0, seed=SEED)
    for step in range(steps):
        batches = loader.next_step()
        if corruption is not None:
            batches = corrupt_micro_batches(corruption, batches, salt=step)
        routed = []
        for *x, y in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if autocast:  # bf16 matmuls: the chunks' weight gradients round apart from the whole one's
                    out = model(*x, targets_BT=y, label_smoothing=train.label_smoothing,
                                chunk_tokens=train.loss_chunk_tokens)
                else:
                    out = model(*x)
            lm = out.loss if autocast else lm_loss(out.logits.float(), y, label_smoothing=train.label_smoothing)
            ((lm + out.aux_loss) * micro / GLOBAL).backward()
            routed.append([st["routed_per_expert"] for st in out.moe_stats if "routed_per_expert" in st])
        if optim.grad_clip > 0 or grad_norms is not None:  # no clipping: the norm, at an infinite threshold
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip or math.inf)
            if grad_norms is not None:
                grad_norms.append(norm.item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        moe = [m for m in model.modules() if getattr(m, "bias_update_rate", 0) > 0]
        for i, layer in enumerate(moe):  # V3's bias step: the global batch's routed counts, after the update
            layer.update_score_bias(sum(r[i] for r in routed))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def distributed_weights(model_cfg, train, tokens, steps, world, rank, moe_stats=None, ep_size=1, precision="fp32",
                        grad_norms: list | None = None, corruption: SpanCorruption | None = None,
                        optim: OptimizerSection = OPTIM, sp_size: int = 1):
    """``grad_norms``: gets each step's global gradient norm as DeepSpeed computed it for clipping.
    ``sp_size``: sequence parallelism (each rank of a group a shard of every sequence)."""
    dims = ParallelDims(world, ep_size, GLOBAL, MICRO, SEQ, sp_size)
    engine, _ = build_engine(model_cfg, train, optim, dims, precision=precision, device=CPU, seed=SEED)
    loader = BlockLoader(tokens, dims, rank, seed=SEED)
    losses = []
    for step in range(steps):
        batches = loader.next_step()
        if corruption is not None:
            batches = corrupt_micro_batches(corruption, batches, salt=step)
        losses.append(train_step(engine, batches, CPU, moe_stats, train.label_smoothing, train.loss_chunk_tokens).item())
        if grad_norms is not None:
            grad_norms.append(float(engine.get_global_grad_norm()))
    if ep_size > 1:  # the experts really are split: this rank holds num_experts / ep_size of them
        for _, layer in moe_layers(engine.module):
            assert layer.experts is None
            assert len(layer.ep_shard.local_experts) == model_cfg.num_experts // ep_size
        assert engine.has_moe_layers
    state = full_state_dict(engine, train.zero_stage)
    del engine
    gc.collect()
    return state, losses


def expert_counts_check(tokens: Path, world: int, rank: int) -> dict | None:
    """Routing counts summed over ranks == the single process's counts on the whole global batch."""
    stats = MoEStats()
    distributed_weights(MOE, dataclasses.replace(TRAIN, zero_stage=1), tokens, 1, world, rank, stats)
    stats.all_reduce()
    if rank != 0:
        return None
    seed_everything(SEED)
    model = build_model(MOE)
    ((x, _),) = BlockLoader(tokens, ParallelDims(1, 1, GLOBAL, GLOBAL, SEQ), 0, seed=SEED).next_step()
    ref = [s["tokens_per_expert"].tolist() for s in model(x).moe_stats]
    got = [s["tokens_per_expert"].long().tolist() for s in stats.layers]
    return {"reference": ref, "distributed": got, "micro_batches": stats.micro_batches,
            "load_shares_sum": sum(v for k, v in stats.metrics().items() if k.startswith("expert_load/l0/"))}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def resume_check(tokens: Path, ckpt: Path, world: int, rank: int, model_cfg=DENSE, zero=1, ep_size=1) -> dict:
    """2N steps in one go == N steps, save, a fresh engine restores, N more steps (bit for bit)."""
    train = dataclasses.replace(TRAIN, zero_stage=zero)
    dims = ParallelDims(world, ep_size, GLOBAL, MICRO, SEQ)
    straight, straight_losses = distributed_weights(model_cfg, train, tokens, 4, world, rank, ep_size=ep_size)

    engine, _ = build_engine(model_cfg, train, OPTIM, dims, precision="fp32", device=CPU, seed=SEED)
    loader = BlockLoader(tokens, dims, rank, seed=SEED)
    chunk = train.loss_chunk_tokens
    first = [train_step(engine, loader.next_step(), CPU, loss_chunk_tokens=chunk).item() for _ in range(2)]
    save_state(engine, ckpt, step=2, loader_state=loader.state_dict())
    del engine
    gc.collect()

    # A fresh engine from different initial weights: everything must come from the checkpoint.
    engine, _ = build_engine(model_cfg, train, OPTIM, dims, precision="fp32", device=CPU, seed=SEED + 1)
    step, loader_state = load_state(engine, ckpt)
    loader = BlockLoader(tokens, dims, rank, seed=0)
    loader.load_state_dict(loader_state)
    second = [train_step(engine, loader.next_step(), CPU, loss_chunk_tokens=chunk).item() for _ in range(2)]
    resumed = full_state_dict(engine, train.zero_stage)
    out = {"step_restored": step, "losses_equal": straight_losses == first + second}
    if rank == 0:
        out["weights_identical"] = all(torch.equal(straight[k], resumed[k]) for k in straight)
    return out


def canonical_save(tokens: Path, ckpt: Path, world: int, rank: int, model_cfg=DENSE, zero=2, ep_size=1,
                   sp_size=1) -> int:
    """2 steps on this world and layout, then a layout-independent checkpoint."""
    train = dataclasses.replace(TRAIN, zero_stage=zero)
    dims = ParallelDims(world, ep_size, GLOBAL, MICRO, SEQ, sp_size)
    engine, scheduler = build_engine(model_cfg, train, OPTIM, dims, precision="fp32", device=CPU, seed=SEED)
    loader = BlockLoader(tokens, dims, rank, seed=SEED)
    for _ in range(2):
        train_step(engine, loader.next_step(), CPU, loss_chunk_tokens=train.loss_chunk_tokens)
    ckpt.mkdir(exist_ok=True)
    save_canonical(engine, ckpt, step=2, scheduler=scheduler, loader_state=loader.state_dict())
    del engine
    gc.collect()
    return world


def canonical_continue(tokens: Path, ckpt: Path, world: int, rank: int, model_cfg=DENSE, zero=1, ep_size=1,
                       micro=MICRO) -> dict | None:
    """Restore a canonical checkpoint into this layout (fresh, different initial weights), 2 more
    steps; on rank 0 the distance to 4 single-process steps on the same global batches. MoE models
    compare with a reference that accumulates micro-batches of ``MICRO`` (the load-balancing loss
    is computed per forward), so their runs use micro-batches of ``MICRO`` too."""
    train = dataclasses.replace(TRAIN, zero_stage=zero)
    dims = ParallelDims(world, ep_size, GLOBAL, micro, SEQ)
    engine, scheduler = build_engine(model_cfg, train, OPTIM, dims, precision="fp32", device=CPU, seed=SEED + 5)
    step, loader_state = load_canonical(engine, ckpt, scheduler=scheduler)
    loader = BlockLoader(tokens, dims, rank, seed=0)
    loader.load_state_dict(loader_state)
    for _ in range(2):
        train_step(engine, loader.next_step(), CPU, loss_chunk_tokens=train.loss_chunk_tokens)
    state = full_state_dict(engine, zero)
    del engine
    gc.collect()
    if rank != 0:
        return None
    ref = reference_weights(model_cfg, train, tokens, 4, micro=MICRO if model_cfg.is_moe else GLOBAL)
    return {"step": step, "max_abs_diff": max_diff(state, ref), "world_size": world}


def canonical_resume(out: Path) -> None:
    """On a 1-rank world: continue the canonical checkpoints the 2-rank world saved (ZeRO-2, ZeRO-3,
    and expert-parallel ep_size 2) with another ZeRO stage and ep_size 1 (ZeRO 1 runs as stage 0 on
    one rank, ``one_rank_check``)."""
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    tokens = out / "train.tokens.npy"
    results = {
        "zero2_to_zero1": canonical_continue(tokens, out / "ckpt_canonical", world, rank, zero=1, micro=GLOBAL // 2),
        "zero2_to_zero0": canonical_continue(tokens, out / "ckpt_canonical", world, rank, zero=0, micro=GLOBAL // 2),
        "zero3_to_zero1": canonical_continue(tokens, out / "ckpt_canonical_zero3", world, rank, zero=1,
                                             micro=GLOBAL // 2),
        "ep2_to_ep1_zero1": canonical_continue(tokens, out / "ckpt_canonical_ep2", world, rank, MOE_AUX, zero=1),
        # saved by 2 ranks splitting every sequence (sequence parallelism), continued by one holding them whole
        "sp2_to_sp1_zero1": canonical_continue(tokens, out / "ckpt_canonical_sp2", world, rank, zero=1,
                                               micro=GLOBAL // 2),
    }
    results["one_rank_zero1"] = one_rank_check(tokens, out / "ckpt_one_rank", world, rank)
    if rank == 0:
        (out / "canonical_resume.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def one_rank_check(tokens: Path, ckpt: Path, world: int, rank: int) -> dict:
    """ZeRO-1 configured on one rank runs as stage 0 (``engine_zero_stage``): no all-reduce, the same
    weights and clipping norms as plain torch, the norm kept for the ``grad_norm`` metric, and an
    exact resume."""
    assert world == 1
    train = dataclasses.replace(TRAIN, zero_stage=1)
    engine, _ = build_engine(DENSE, train, OPTIM, ParallelDims(world, 1, GLOBAL, MICRO, SEQ), precision="fp32", device=CPU,
                             seed=SEED)
    out = {"engine_stage": engine.zero_optimization_stage(), "allreduce": engine.enable_backward_allreduce}
    del engine
    norms: list[float] = []
    ref_norms: list[float] = []
    state, _ = distributed_weights(DENSE, train, tokens, 4, world, rank, grad_norms=norms)
    ref = reference_weights(DENSE, train, tokens, 4, grad_norms=ref_norms)
    # Without clipping (optimizer.grad_clip 0) DeepSpeed computes no norm at all: the logged grad_norm
    # read 0. It is the same norm now, and the weights are those of unclipped torch.
    noclip = dataclasses.replace(OPTIM, grad_clip=0.0)
    norms_noclip: list[float] = []
    ref_norms_noclip: list[float] = []
    state_noclip, _ = distributed_weights(DENSE, train, tokens, 4, world, rank, grad_norms=norms_noclip, optim=noclip)
    ref_noclip = reference_weights(DENSE, train, tokens, 4, grad_norms=ref_norms_noclip, optim=noclip)
    out.update(max_abs_diff=max_diff(state, ref), grad_norms=norms, reference_grad_norms=ref_norms,
               resume=resume_check(tokens, ckpt, world, rank),
               noclip={"max_abs_diff": max_diff(state_noclip, ref_noclip), "grad_norms": norms_noclip,
                       "reference_grad_norms": ref_norms_noclip})
    return out


def ep_cases(world: int, rank: int, tokens: Path, ep_size: int, cases) -> dict:
    """Expert-parallel runs against one process accumulating the same micro-batches (capacity and
    the load-balancing loss are computed per forward, so the reference sees what each rank sees).
    Beside the weights, the gradient norm that clipping used: expert gradients counted once each,
    whatever the number of replicas."""
    results = {}
    for name, model_cfg, zero in cases:
        train = dataclasses.replace(TRAIN, zero_stage=zero)
        stats, norms = MoEStats(), []
        state, losses = distributed_weights(model_cfg, train, tokens, 2, world, rank, stats, ep_size=ep_size,
                                            grad_norms=norms)
        stats.all_reduce()
        if rank == 0:
            ref_norms: list[float] = []
            ref = reference_weights(model_cfg, train, tokens, 2, micro=MICRO, grad_norms=ref_norms)
            init = reference_weights(model_cfg, train, tokens, 0)
            results[name] = {"max_abs_diff": max_diff(state, ref), "moved": max_diff(ref, init), "losses": losses,
                             "dropped_fraction": stats.metrics()["moe_dropped_fraction"],
                             "grad_norms": norms, "reference_grad_norms": ref_norms}
    return results


def ep_replicas(out: Path) -> None:
    """On 4 ranks with ep_size 2: every expert has two replicas (expert-data-parallel groups {0, 2}
    and {1, 3}), so expert gradients are reduced over those groups and dense ones over all 4 ranks.
    Against one process: ZeRO 1 and 2, dropless and with capacity; exact resume; and the canonical
    checkpoint of that layout continued on ep_size 1 and 4 in the same world."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4 and GLOBAL // (world * MICRO) == 1  # one micro-batch per rank per step
    torch.set_num_threads(1)
    tokens = out / "train.tokens.npy"
    if rank == 0:
        rng = np.random.default_rng(0)
        np.save(tokens, rng.integers(0, DENSE.vocab_size, size=(64, SEQ + 1), dtype=np.uint16))
    dist.barrier()
    results: dict = {"world_size": world}
    results.update(ep_cases(world, rank, tokens, 2, (
        ("ep2_zero1", MOE_AUX, 1), ("ep2_zero2", MOE_AUX, 2),
        ("ep2_capacity_zero1", MOE_CAPACITY, 1), ("ep2_capacity_zero2", MOE_CAPACITY, 2))))
    results["resume_ep2"] = resume_check(tokens, out / "ckpt_ep2", world, rank, MOE_AUX, zero=2, ep_size=2)
    canonical_save(tokens, out / "ckpt_canonical_ep2", world, rank, MOE_AUX, zero=2, ep_size=2)
    results["canonical"] = {
        "ep2_to_ep1_zero1": canonical_continue(tokens, out / "ckpt_canonical_ep2", world, rank, MOE_AUX, zero=1,
                                               ep_size=1),
        "ep2_to_ep4_zero2": canonical_continue(tokens, out / "ckpt_canonical_ep2", world, rank, MOE_AUX, zero=2,
                                               ep_size=4),
    }
    if rank == 0:
        (out / "ep_replicas.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main(out_dir: str) -> None:
    out = Path(out_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    tokens = out / "train.tokens.npy"
    if rank == 0:
        rng = np.random.default_rng(0)
        np.save(tokens, rng.integers(0, DENSE.vocab_size, size=(64, SEQ + 1), dtype=np.uint16))
    dist.barrier()

    results: dict = {"world_size": world}
    variants = {
        "dense_zero0": (DENSE, {"zero_stage": 0}), "dense_zero1": (DENSE, {"zero_stage": 1}),
        "dense_zero2": (DENSE, {"zero_stage": 2}), "dense_zero3": (DENSE, {"zero_stage": 3}),
        "dense_zero2_offload": (DENSE, {"zero_stage": 2, "offload_optimizer": True}),
        "dense_zero3_offload_all": (DENSE, {"zero_stage": 3, "offload_optimizer": True, "offload_params": True}),
        "dense_zero1_activation_ckpt": (DENSE, {"zero_stage": 1, "activation_checkpointing": True}),
        "moe_zero1": (MOE, {"zero_stage": 1}), "moe_zero2": (MOE, {"zero_stage": 2}),
        "dense_zero1_label_smoothing": (DENSE, {"zero_stage": 1, "label_smoothing": 0.1}),
        "dense_zero1_plain_loss": (DENSE, {"zero_stage": 1, "loss_chunk_tokens": 0}),
        "mla_zero3": (MLA, {"zero_stage": 3}), "mla_moe_shared_zero2": (MLA_MOE, {"zero_stage": 2}),
        "mamba_zero1": (MAMBA, {"zero_stage": 1}), "mamba_zero3": (MAMBA, {"zero_stage": 3}),
        "mamba_zero2_activation_ckpt": (MAMBA, {"zero_stage": 2, "activation_checkpointing": True}),
        "mamba2_zero1": (MAMBA2, {"zero_stage": 1}), "mamba2_zero3": (MAMBA2, {"zero_stage": 3}),
        "mamba2_zero1_activation_ckpt": (MAMBA2, {"zero_stage": 1, "activation_checkpointing": True}),
        "hybrid_moe_zero1": (HYBRID_MOE, {"zero_stage": 1}), "hybrid_zero3": (HYBRID, {"zero_stage": 3}),
        "hybrid_zero1_activation_ckpt": (HYBRID, {"zero_stage": 1, "activation_checkpointing": True}),
        "moe_v3_bias_zero1": (MOE_V3, {"zero_stage": 1}), "moe_v3_bias_zero2": (MOE_V3, {"zero_stage": 2}),
    }
    for case, (model_cfg, fields) in variants.items():
        train = dataclasses.replace(TRAIN, **fields)
        state, losses = distributed_weights(model_cfg, train, tokens, 2, world, rank)
        if rank == 0:
            ref = reference_weights(model_cfg, train, tokens, 2)
            init = reference_weights(model_cfg, train, tokens, 0)
            results[case] = {
                "max_abs_diff": max_diff(state, ref), "moved": max_diff(ref, init), "losses": losses,
                "score_bias": [v.tolist() for k, v in state.items() if k.endswith("score_bias")],
            }

    # Sequence parallelism: both ranks read the same sequences, each half of every one's positions (GQA,
    # 4 heads over 2 key/value heads), attention across them by DeepSpeed-Ulysses' all-to-all.
    # MoE: each rank routes its shard; the balancing statistics are the whole micro-batch's (a mean over the
    # group), so the reference accumulates micro-batches of MICRO, as for the other MoE cases.
    for case, model_cfg, fields in (
            ("sp2_zero1", DENSE, {"zero_stage": 1}), ("sp2_zero2", DENSE, {"zero_stage": 2}),
            ("sp2_zero3", DENSE, {"zero_stage": 3}),
            ("sp2_zero1_activation_ckpt", DENSE, {"zero_stage": 1, "activation_checkpointing": True}),
            ("sp2_moe_zero1", MOE_AUX, {"zero_stage": 1}), ("sp2_moe_v3_sequence_aux_zero2", MOE_V3_SEQ, {"zero_stage": 2}),
            ("sp2_mla_zero3", MLA, {"zero_stage": 3}), ("sp2_mla_moe_shared_zero2", MLA_MOE, {"zero_stage": 2})):
        train = dataclasses.replace(TRAIN, **fields)
        state, losses = distributed_weights(model_cfg, train, tokens, 2, world, rank, sp_size=world)
        if rank == 0:
            micro = MICRO if model_cfg.is_moe else GLOBAL
            ref = reference_weights(model_cfg, train, tokens, 2, micro=micro)
            results[case] = {"max_abs_diff": max_diff(state, ref), "moved": max_diff(ref, reference_weights(
                model_cfg, train, tokens, 0, micro=micro)), "losses": losses,
                "score_bias": [v.tolist() for k, v in state.items() if k.endswith("score_bias")]}
    # Expert parallelism: experts split over the 2 ranks (one replica each), tokens exchanged by all-to-all.
    results.update(ep_cases(world, rank, tokens, world, (
        ("ep2_zero1", MOE_AUX, 1), ("ep2_zero2", MOE_AUX, 2), ("ep2_capacity_zero1", MOE_CAPACITY, 1),
        ("ep2_mla_zero1", MLA_MOE_AUX, 1), ("ep2_v3_bias_zero1", MOE_V3, 1))))
    # bf16 autocast (fp32 weights): the reference runs the same micro-batches under autocast, so
    # each rank's bf16 matmuls have the shapes of the reference's.
    train = dataclasses.replace(TRAIN, zero_stage=1)
    state, losses = distributed_weights(DENSE, train, tokens, 2, world, rank, precision="amp_bf16")
    if rank == 0:
        ref = reference_weights(DENSE, train, tokens, 2, micro=MICRO, autocast=True)
        fp32_ref = reference_weights(DENSE, train, tokens, 2, micro=MICRO)
        results["dense_zero1_amp_bf16"] = {"max_abs_diff": max_diff(state, ref), "moved": max_diff(ref, fp32_ref),
                                           "losses": losses}
    # torch.compile'd regions (blocks, and the output end with the chunked, label-smoothed loss) against
    # the eager reference; then blocks checkpointed and compiled (parallelize puts the checkpointing
    # inside the compiled unit) against the same reference.
    for case, fields in (("dense_zero1_compile", {"compile": True, "label_smoothing": 0.1}),
                         ("dense_zero1_compile_activation_ckpt", {"compile": True, "activation_checkpointing": True})):
        case_train = dataclasses.replace(train, **fields)
        state, losses = distributed_weights(DENSE, case_train, tokens, 2, world, rank)
        if rank == 0:
            ref = reference_weights(DENSE, case_train, tokens, 2)
            results[case] = {"max_abs_diff": max_diff(state, ref),
                             "moved": max_diff(ref, reference_weights(DENSE, train, tokens, 0)), "losses": losses}
    results["canonical_saved_world"] = canonical_save(tokens, out / "ckpt_canonical", world, rank)
    canonical_save(tokens, out / "ckpt_canonical_zero3", world, rank, zero=3)
    canonical_save(tokens, out / "ckpt_canonical_ep2", world, rank, MOE_AUX, zero=2, ep_size=world)
    canonical_save(tokens, out / "ckpt_canonical_moe_ep1", world, rank, MOE_AUX, zero=2, ep_size=1)
    canonical_save(tokens, out / "ckpt_canonical_v3_ep2", world, rank, MOE_V3_SEQ, zero=2, ep_size=world)
    canonical_save(tokens, out / "ckpt_canonical_sp2", world, rank, zero=1, sp_size=world)
    # Same world, another layout: ZeRO-2 -> ZeRO-3 (partitioned weights), ep_size 1 -> 2 (experts split);
    # V3's router (its score biases are buffers: canonical.pt carries them) ep_size 2 -> 1 and ZeRO 2 -> 1.
    results["canonical_same_world"] = {
        "zero2_to_zero3": canonical_continue(tokens, out / "ckpt_canonical", world, rank, zero=3),
        "ep1_to_ep2_zero1": canonical_continue(tokens, out / "ckpt_canonical_moe_ep1", world, rank, MOE_AUX, zero=1,
                                               ep_size=world),
        "v3_ep2_to_ep1_zero1": canonical_continue(tokens, out / "ckpt_canonical_v3_ep2", world, rank, MOE_V3_SEQ,
                                                  zero=1),
    }
    results["resume"] = resume_check(tokens, out / "ckpt_dense", world, rank)
    results["resume_ep2"] = resume_check(tokens, out / "ckpt_ep", world, rank, MOE_AUX, zero=2, ep_size=world)
    results["resume_v3_bias"] = resume_check(tokens, out / "ckpt_v3", world, rank, MOE_V3, zero=2)
    results["resume_mla_ep2"] = resume_check(tokens, out / "ckpt_mla_ep", world, rank, MLA_MOE_AUX, zero=2,
                                             ep_size=world)
    try:
        build_engine(MOE, dataclasses.replace(TRAIN, zero_stage=3), OPTIM, ParallelDims(world, world, GLOBAL, MICRO, SEQ),
                     precision="fp32", device=CPU, seed=SEED)
        results["ep_zero3_refused"] = None
    except ValueError as e:
        results["ep_zero3_refused"] = str(e)
    results["expert_counts"] = expert_counts_check(tokens, world, rank)
    import deepspeed.comm.comm as ds_comm  # the backend every engine above started, or found started

    results["deepspeed_backend"] = {"kind": type(ds_comm.cdb).__name__, "shm_op": repr(ds_comm.cdb.shm_comm_op)}
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    encdec(out, rank, world)
    dist.destroy_process_group()


def encdec(out: Path, rank: int, world: int) -> None:
    """An encoder-decoder on span-corrupted blocks: 2 ranks (ZeRO-1 and ZeRO-3) == 1 process. Runs in
    ``main``'s world (its own tokens under ``out``/encdec)."""
    out = out / "encdec"
    tokens = out / "train.tokens.npy"
    if rank == 0:
        out.mkdir()
        rng = np.random.default_rng(0)
        np.save(tokens, rng.integers(10, ENCDEC.vocab_size, size=(64, SEQ + 1), dtype=np.uint16))
    dist.barrier()
    results: dict = {"world_size": world}
    for case, zero in (("encdec_zero1", 1), ("encdec_zero3", 3)):
        train = dataclasses.replace(TRAIN, zero_stage=zero)
        state, losses = distributed_weights(ENCDEC, train, tokens, 2, world, rank, corruption=ENCDEC_CORRUPTION)
        if rank == 0:
            ref = reference_weights(ENCDEC, train, tokens, 2, corruption=ENCDEC_CORRUPTION)
            init = reference_weights(ENCDEC, train, tokens, 0)
            results[case] = {"max_abs_diff": max_diff(state, ref), "moved": max_diff(ref, init), "losses": losses}
    if rank == 0:
        (out / "encdec.json").write_text(json.dumps(results, indent=1))
    dist.barrier()


if __name__ == "__main__":
    if sys.argv[1] == "canonical-resume":
        canonical_resume(Path(sys.argv[2]))
    elif sys.argv[1] == "ep-replicas":
        ep_replicas(Path(sys.argv[2]))
    else:
        main(sys.argv[1])
