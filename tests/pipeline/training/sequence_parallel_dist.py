"""Run by ``test_sequence_parallel`` in a 2-process gloo world: sequence parallelism (sp = 2, DeepSpeed's
``DistributedAttention``) against one process on the same batch.

For each model case, with activation checkpointing off and on, every rank computes the reference itself
(the whole sequence, plainly, on its own copy of the model), then trains a second copy with the sequence
split over the two ranks: the loss (mean of the ranks' shard means), every gradient (averaged over the
ranks, as data-parallel gradients are) and the weights after three steps must equal the reference's.
Each rank writes ``rank<r>.json``: the largest differences per case.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from models import ModelConfig, build_model
from pipeline.training.parallelize import apply_activation_checkpointing
from pipeline.training.sequence_parallel import install, shard

BASE = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, max_seq_len=64)
CASES = {
    "mha": BASE,
    "gqa": BASE.replace(num_kv_heads=2),
    "mqa": BASE.replace(num_kv_heads=1),  # fewer key/value heads than ranks: DeepSpeed's uneven exchange
    "yarn": BASE.replace(num_kv_heads=2, rope_scaling_type="yarn", rope_scaling=4.0, rope_original_max_seq_len=16),
    "learned": BASE.replace(pos_encoding="learned"),
    "tied_gelu_layernorm": BASE.replace(tie_embeddings=True, ffn="gelu", norm="layernorm", bias=True),
    # mixtures of experts: the balancing loss (a product of statistics over the tokens) and the z-loss
    "moe": BASE.replace(num_kv_heads=2, num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01),
    # DeepSeek-V3's sigmoid router with its per-sequence balance loss
    "moe_v3_sequence_aux": BASE.replace(num_experts=8, moe_top_k=2, moe_router="sigmoid", moe_n_group=4,
                                        moe_topk_group=2, moe_routed_scaling_factor=2.0, moe_aux_loss_coef=0.05,
                                        moe_aux_loss_scope="sequence"),
    # multi-head latent attention: per-head keys and values from the latent, its own softmax scale (YaRN's)
    "mla": BASE.replace(attention="mla", kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                        v_head_dim=16),
    "mla_yarn_moe": BASE.replace(attention="mla", kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=16, rope_scaling_type="yarn", rope_scaling=4.0, rope_original_max_seq_len=16,
                                 rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0, num_experts=4, moe_top_k=2,
                                 moe_shared_experts=1),
}
STEPS = 3


def _steps(model, ids, targets, offset=0, sp_group=None):
    """Three SGD steps with momentum; the first step's loss and gradients (averaged over the group when
    split). Not Adam: it divides each gradient by its own running size, so where a gradient is about 1e-8
    float32's rounding (2e-8 here, between any two orders of summation) moves a weight by a sizeable part
    of the learning rate, in the single process and the split one alike."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for step in range(STEPS):
        opt.zero_grad()
        out = model(ids, targets_BT=targets, position_offset=offset)
        loss = out.loss + out.aux_loss  # what training backpropagates (aux: 0 for a dense model)
        loss.backward()
        if sp_group is not None:
            world = dist.get_world_size(sp_group)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=sp_group)
            loss /= world
            for p in model.parameters():
                dist.all_reduce(p.grad, group=sp_group)
                p.grad /= world
        if step == 0:
            first = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return first


def _case(cfg: ModelConfig, checkpointing: bool, rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reference = build_model(cfg)
    split = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(cfg.vocab_size, (2, 32), generator=g)
    targets = torch.randint(cfg.vocab_size, (2, 32), generator=g)
    if checkpointing:
        apply_activation_checkpointing(reference)
        apply_activation_checkpointing(split)
    ref_loss, ref_grads = _steps(reference, ids, targets)
    assert install(split, cfg, dist.group.WORLD) == cfg.n_layers
    ids_s, offset = shard(ids, rank, world)
    targets_s, _ = shard(targets, rank, world)
    sp_loss, sp_grads = _steps(split, ids_s, targets_s, offset, dist.group.WORLD)
    weights = dict(split.named_parameters())
    return {
        "loss": abs(sp_loss - ref_loss),
        "grad": max((sp_grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "weights": max((weights[n] - p).abs().max().item() for n, p in reference.named_parameters()),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
    }


def main(out: Path) -> None:
    import deepspeed

    deepspeed.init_distributed("gloo")  # DeepSpeed's exchange runs on its own communication backend
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {f"{name}/{'ckpt' if ckpt else 'plain'}": _case(cfg, ckpt, rank, world)
               for name, cfg in CASES.items() for ckpt in (False, True)}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
