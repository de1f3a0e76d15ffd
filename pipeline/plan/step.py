"""The step: its compute at a stated MFU, its collectives and their time, and what a run costs.

Compute: the model's training FLOPs per token (`models.accounting.flops_per_token`, PaLM's 6 N + attention)
times the tokens a rank processes in a step, at ``mfu`` of the device's peak; activation checkpointing
runs the forward twice, so its time grows by forward / total of the model's FLOPs at the same hardware
efficiency (MFU, by its definition, counts the model's FLOPs only).

Collectives per rank and step (payload: the bytes of the tensor handed to the call, as counted at
``torch.distributed``): every rank reduces the gradients of what it holds, dense parameters over all
ranks and experts over their expert-data-parallel group (world / ep_size):

    stage 0: one all-reduce of all gradients (at the step's last micro-batch)
    stage 1: the same all-reduce, then an all-gather of the updated weights (each rank stepped its part;
             skipped for a group of one rank, whose part is everything)
    stage 2: the gradients reduced every micro-batch (an all-reduce of each bucket, as DeepSpeed's
             stage 2 does without reduce-scatter), then the all-gather of the updated weights
    stage 3: per micro-batch a reduce-scatter of the gradients, and an all-gather of the weights in
             forward (kept for backward while the weights gathered in between stay under
             ``stage3_max_reuse_distance``, else gathered again), except the tensors smaller than
             ``stage3_param_persistence_threshold``, which stay whole and are gathered once per step
             after the update
    norms:   two all-reduces of one number per group for the gradient norm and the overflow check
             (4 bytes at stages 0-2, 8 at stage 3), as DeepSpeed 0.19 makes them
    ep_size > 1: per MoE layer and micro-batch the routed counts (num_experts int64) and four
             all-to-alls (dispatch and combine, forward and backward) of the k routed copies of every
             token, d_model wide; the combine returns what was received, so a rank's payload equals k
             copies of its tokens when routing is balanced, and the world's mean always does.

Time on the wire: a ring all-reduce sends 2 (n-1)/n of its payload, an all-gather or reduce-scatter
(n-1)/n of its output or input, an all-to-all (n-1)/n of its input; at the intra-node bandwidth when the
group's ranks share a node (an expert's replicas are ep_size ranks apart), else at the network's. Gradient reduction can hide under the backward only where
DeepSpeed overlaps it (``overlap_comm``, on by default at stage 3); the all-to-alls sit between the
router and the experts and are never hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.accounting import flops_per_token
from pipeline.plan.hardware import Cluster
from pipeline.plan.memory import ModelShape, Setup


@dataclass(frozen=True)
class Collective:
    """One kind of collective in a step: its payload per rank and step, its group, and whether it can hide
    under compute."""

    name: str
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all
    payload: int
    group: int
    hidden: bool
    stride: int = 1  # the distance between the group's ranks (an expert's replicas are ep_size apart)

    def within_node(self, per_node: int) -> bool:
        """Whether the group's ranks share a node (groups are aligned blocks of consecutive or strided ranks)."""
        return self.group * self.stride <= per_node

    def wire_bytes(self) -> float:
        n = self.group
        share = 2 * (n - 1) / n if self.kind == "all_reduce" else (n - 1) / n
        return self.payload * share


def grad_accum(setup: Setup) -> int:
    return setup.global_batch // (setup.dp_size * setup.micro_batch)


def _moe_tokens(setup: Setup) -> int:
    """Routed token copies one rank sends through its all-to-alls per micro-batch, over all MoE layers."""
    cfg = setup.model
    return cfg.num_moe_layers * cfg.moe_top_k * setup.tokens


def _zero3_weights(setup: Setup, shape: ModelShape) -> list[Collective]:
    """ZeRO-3's weight all-gathers: the small tensors once per step, the others once per micro-batch, or twice
    when the weights gathered between a tensor's forward and backward use (at most all the others, twice)
    exceed ``stage3_max_reuse_distance``, so DeepSpeed releases it after the forward."""
    threshold = setup.zero_option("stage3_param_persistence_threshold")
    whole = sum(n for n in shape.dense_sizes if n < threshold)
    partitioned = shape.dense - whole
    uses = 1 if 2 * partitioned <= setup.zero_option("stage3_max_reuse_distance") else 2
    wb, accum = setup.weight_bytes, grad_accum(setup)
    return [Collective("dense weights kept whole (after the update)", "all_gather", whole * wb, setup.world, False),
            Collective("dense weights (forward" + (")" if uses == 1 else " and backward)"), "all_gather",
                       uses * partitioned * wb * accum, setup.world, True)]


def _gradients(setup: Setup, what: str, P: int, n: int, overlap: bool, stride: int) -> list[Collective]:
    accum, gb, wb = grad_accum(setup), setup.weight_bytes, setup.weight_bytes
    if setup.zero_stage == 3:
        return [Collective(f"{what} gradients", "reduce_scatter", P * gb * accum, n, overlap, stride)]
    per_step = accum if setup.zero_stage == 2 else 1
    out = [Collective(f"{what} gradients", "all_reduce", P * gb * per_step, n, overlap, stride)]
    if setup.zero_stage in (1, 2) and n > 1:
        out.append(Collective(f"{what} updated weights", "all_gather", P * wb, n, False, stride))
    return out


def collectives(setup: Setup, shape: ModelShape) -> list[Collective]:
    """The step's collectives on one rank (module docstring); none on a world of one."""
    if setup.world == 1:
        return []
    overlap = setup.zero_option("overlap_comm")
    overlap = setup.zero_stage == 3 if overlap is None else bool(overlap)
    groups = [("dense", shape.dense, setup.world, 1)]
    if shape.experts:  # an expert's replicas: ranks ep_size apart (the ep groups are consecutive blocks)
        groups.append(("experts", shape.experts, setup.world // setup.ep_size, setup.ep_size))
    out = _zero3_weights(setup, shape) if setup.zero_stage == 3 else []
    for what, P, n, stride in groups:
        out += _gradients(setup, what, P, n, overlap, stride)
    scalar = 8 if setup.zero_stage == 3 else 4
    out.append(Collective("gradient norm and overflow", "all_reduce", 2 * scalar * len(groups), setup.world, False))
    if setup.ep_size > 1 and setup.model.num_experts:
        cfg, accum = setup.model, grad_accum(setup)
        counts = cfg.num_moe_layers * cfg.num_experts * 8 * accum
        payload = 4 * _moe_tokens(setup) * cfg.d_model * setup.activation_bytes * accum
        out.append(Collective("expert all-to-all", "all_to_all", payload + counts, setup.ep_size, False))
    if setup.sp_size > 1:
        out.append(_ulysses(setup))
    return out


def _ulysses(setup: Setup) -> Collective:
    """Sequence parallelism's all-to-alls (not measured here): per attention layer and micro-batch, the
    queries, keys, values and output exchanged before and after the attention core, forward and backward
    (and the forward's again when checkpointed recomputes it); key/value heads fewer than the ranks are
    sent as copies, one per rank."""
    cfg, sp = setup.model, setup.sp_size
    width = 2 * cfg.n_heads * cfg.head_dim + 2 * max(cfg.resolved_num_kv_heads, sp) * cfg.head_dim
    passes = 3 if setup.checkpointing else 2
    payload = passes * cfg.n_layers * width * setup.tokens * setup.activation_bytes * grad_accum(setup)
    return Collective("sequence-parallel all-to-all", "all_to_all", payload, sp, False)


@dataclass(frozen=True)
class StepTime:
    """One optimizer step on the cluster, in seconds, and what follows from it."""

    compute_s: float
    comm_s: float
    exposed_comm_s: float
    step_s: float
    tokens_per_s: float
    flops_per_token: int

    def run_time(self, steps: int) -> float:
        return steps * self.step_s


def step_time(setup: Setup, shape: ModelShape, cluster: Cluster, mfu: float) -> StepTime:
    """Compute at ``mfu``, communication at the cluster's bandwidths, and the exposed part (module docstring)."""
    flops = flops_per_token(setup.model, setup.seq_len)
    tokens_per_rank = setup.global_batch * setup.seq_len / setup.world
    recompute = 1 + (flops["forward"] / flops["total"] if setup.checkpointing else 0)
    compute = flops["total"] * tokens_per_rank * recompute / (cluster.device.peak_flops * mfu)
    comm = exposed = 0.0
    for c in collectives(setup, shape):
        bandwidth = (cluster.device.intra_node_bytes_per_s if c.within_node(cluster.per_node)
                     else cluster.device.inter_node_bytes_per_s)
        seconds = c.wire_bytes() / bandwidth
        comm += seconds
        exposed += 0.0 if c.hidden else seconds
    backward = compute * 2 / 3  # the share of a step's compute a hidden collective can overlap
    hidden_total = comm - exposed
    exposed += max(0.0, hidden_total - backward)
    step = compute + exposed
    return StepTime(compute_s=compute, comm_s=comm, exposed_comm_s=exposed, step_s=step,
                    tokens_per_s=setup.global_batch * setup.seq_len / step, flops_per_token=flops["total"])
