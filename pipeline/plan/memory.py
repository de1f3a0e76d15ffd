"""Memory of one training rank, term by term, before anything is allocated.

Model states (bytes per parameter P that a rank holds; N the data-parallel ranks its partition is
spread over: the world for dense parameters, world / ep_size for experts, whose P is already divided
by ep_size). With 16-bit weights (bf16, fp16) they follow DeepSpeed's own estimators
(``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_model_states_mem_needs``):

    stage 0: weights 2P, gradients 2P, optimizer 16P (fp32 master, Adam m and v, fp32 gradients)
    stage 1: weights 2P, gradients 2P, optimizer 16P/N
    stage 2: weights 2P, gradients 2P/N, optimizer 16P/N
             (= DeepSpeed's 2P + 18P/N; stage 1 keeps every 16-bit gradient, 2P(N-1)/N more, and has
             no estimator of its own)
    stage 3: weights 2P/N, gradients 2P/N, optimizer 16P/N, and the largest layer gathered whole
             (4 bytes per parameter of it), which is DeepSpeed's 4 L + 18P/N plus the 16-bit gradient
             partition 2P/N its estimator leaves out
    offload_optimizer: the optimizer and the fp32 gradients live on the CPU: stage 1-2 keep the
             weights (2P, DeepSpeed's estimate), stage 3 the weight partition (DeepSpeed's 4 L + 2P/N);
             stage 3 also keeps its gradient partition on the CPU then (DeepSpeed 0.19's
             ``grad_partitions_flat_buffer`` lives on the optimizer's device);
    offload_params (stage 3): the weights' partition lives on the CPU too (DeepSpeed's 4 L).

With fp32 weights (fp32, amp_bf16) weights and gradients take 4 bytes, stage 0 steps torch's AdamW
(m and v: 8P) and stages 1-3 keep an fp32 partition copy beside m and v (12P/N).

Activations, the loss's buffers and the micro-step's peak are `pipeline.plan.activations`'. DeepSpeed's
own buffers come from the generated config (`pipeline.training.ds_config`): the gradient bucket of
stages 1-2 and the prefetch bucket of stage 3 (`deepspeed_buffers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig

# DeepSpeed 0.19's defaults of the zero_optimization keys the generated config leaves out
# (deepspeed.runtime.zero.config.DeepSpeedZeroConfig; a test reads them there).
DS_ZERO_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                    "stage3_prefetch_bucket_size": 50_000_000, "contiguous_gradients": True,
                    "overlap_comm": None, "stage3_param_persistence_threshold": 100_000,
                    "stage3_max_reuse_distance": 1_000_000_000}


@dataclass(frozen=True)
class Setup:
    """What a plan is about: the model and the layout of one training step.

    Attributes:
        precision: resolved ("bf16", "fp16", "fp32" or "amp_bf16").
        sp_size: sequence-parallel degree (DeepSpeed-Ulysses, `pipeline.training.sequence_parallel`).
        zero_stage: the stage the engine runs (`pipeline.training.ds_config.engine_zero_stage`).
        zero: the generated DeepSpeed config's ``zero_optimization`` section.
    """

    model: ModelConfig
    seq_len: int
    micro_batch: int
    global_batch: int
    world: int
    ep_size: int
    zero_stage: int
    precision: str
    offload_optimizer: bool
    offload_params: bool
    checkpointing: bool
    chunk_tokens: int
    zero: dict
    sp_size: int = 1

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank (its shard of each sequence under sequence parallelism)."""
        return self.micro_batch * self.seq_len // self.sp_size

    @property
    def dp_size(self) -> int:
        """Ranks that read different sequences: the batch arithmetic divides by it (ZeRO still partitions
        over every rank: DeepSpeed counts each rank's shards as its samples)."""
        return self.world // self.sp_size

    @property
    def weight_bytes(self) -> int:
        return 2 if self.precision in ("bf16", "fp16") else 4

    @property
    def activation_bytes(self) -> int:
        return 2 if self.precision in ("bf16", "fp16") else 4

    def zero_option(self, key: str):
        value = self.zero.get(key, DS_ZERO_DEFAULTS[key])
        return int(value) if isinstance(value, float) else value


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts the memory terms need, from the family's module listing (`models.tensors`).

    Attributes:
        dense: parameters every rank holds (everything but routed experts under expert parallelism).
        experts: with ep_size > 1, routed-expert parameters of one rank (the model's / ep_size); else 0.
        largest_layer: the most parameters one module holds directly (what ZeRO-3 gathers at once).
        blocks: per layer, its parameters on one rank.
        dense_sizes: the size of every dense parameter tensor (ZeRO-3 keeps the small ones whole).
    """

    dense: int
    experts: int
    largest_layer: int
    blocks: tuple[int, ...]
    dense_sizes: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.dense + self.experts


def model_shape(cfg: ModelConfig, ep_size: int) -> ModelShape:
    """Count ``cfg``'s parameters from its family's module listing (`models.tensors`: what the built model
    holds, without torch), experts split over ``ep_size``."""
    from models.families import family

    modules = family(cfg).modules(cfg)
    # Experts are a group of their own only under expert parallelism (DeepSpeed's MoE groups); with
    # ep_size 1 they are parameters like any other (pipeline.training.engine).
    split = ep_size > 1

    def on_rank(m) -> int:
        return 0 if m.tied else sum(m.sizes) // ep_size if split and m.experts else sum(m.sizes)

    experts = sum(sum(m.sizes) for m in modules if split and m.experts) // ep_size
    blocks: dict[str, int] = {}
    for m in modules:
        stack, _, rest = m.path.partition(".")
        if stack in ("encoder_layers", "layers") and rest:
            key = f"{stack}.{rest.partition('.')[0]}"
            blocks[key] = blocks.get(key, 0) + on_rank(m)
    # in the order the family counts them: the encoder's layers, then the (decoder's) layers
    order = sorted(blocks, key=lambda k: (k.startswith("layers"), int(k.rpartition(".")[2])))
    sizes = tuple(sorted(n for m in modules if not m.tied and not (split and m.experts) for n in m.sizes))
    return ModelShape(dense=sum(on_rank(m) for m in modules) - experts, experts=experts,
                      largest_layer=max(sum(m.sizes) for m in modules), blocks=tuple(blocks[k] for k in order),
                      dense_sizes=sizes)


def _states_16bit(P: float, N: float, stage: int, offload: bool) -> dict[str, float]:
    """DeepSpeed's mixed-precision model states of P parameters partitioned over N ranks (module docstring)."""
    if stage == 0:
        return {"weights": 2 * P, "gradients": 2 * P, "optimizer": 16 * P}
    if stage in (1, 2):
        if offload:
            return {"weights": 2 * P}
        return {"weights": 2 * P, "gradients": 2 * P if stage == 1 else 2 * P / N, "optimizer": 16 * P / N}
    if offload:  # the gradient partition lives with the optimizer, on the CPU
        return {"weights": 2 * P / N}
    return {"weights": 2 * P / N, "gradients": 2 * P / N, "optimizer": 16 * P / N}


def _states_32bit(P: float, N: float, stage: int, offload: bool) -> dict[str, float]:
    """fp32 weights: 4-byte weights and gradients, AdamW's m and v, and at stages 1-3 DeepSpeed's fp32 copy."""
    if stage == 0:
        return {"weights": 4 * P, "gradients": 4 * P, "optimizer": 8 * P}
    if stage in (1, 2):
        states = {"weights": 4 * P, "gradients": 4 * P if stage == 1 else 4 * P / N}
    elif offload:  # stage 3: the gradient partition lives with the optimizer, on the CPU
        return {"weights": 4 * P / N}
    else:
        states = {"weights": 4 * P / N, "gradients": 4 * P / N}
    if not offload:
        states["optimizer"] = 12 * P / N
    return states


def model_states(setup: Setup, shape: ModelShape) -> dict[str, int]:
    """Weights, gradients and optimizer states of one rank (and ZeRO-3's gathered layer), in bytes (module
    docstring)."""
    states = _states_16bit if setup.weight_bytes == 2 else _states_32bit
    out: dict[str, float] = {}
    for P, N in ((shape.dense, setup.world), (shape.experts, setup.world // setup.ep_size)):
        for term, value in states(P, N, setup.zero_stage, setup.offload_optimizer).items():
            out[term] = out.get(term, 0.0) + value
    if setup.zero_stage == 3:
        if setup.offload_params:
            out["weights"] = 0.0
        out["gathered_layer"] = 2 * setup.weight_bytes * shape.largest_layer
    return {term: round(value) for term, value in out.items()}


def optimizer_on_cpu(setup: Setup, shape: ModelShape) -> int:
    """Bytes the offloaded optimizer (and gradient partitions) take in the node's CPU memory, per rank: at
    stage 3 the gradient partition too (``_states_16bit``)."""
    if not setup.offload_optimizer:
        return 0
    per_param = (16 if setup.weight_bytes == 2 else 12) + (setup.weight_bytes if setup.zero_stage == 3 else 0)
    return round(per_param * (shape.dense + shape.experts * setup.ep_size) / setup.world)


def deepspeed_buffers(setup: Setup, shape: ModelShape) -> int:
    """The buffers DeepSpeed allocates beyond the model states, from the generated config: stages 1-2 with
    contiguous gradients reduce through a bucket of ``reduce_bucket_size`` elements (no more than the
    gradients it reduces); stage 3 prefetches up to ``stage3_prefetch_bucket_size`` parameters."""
    if setup.zero_stage in (1, 2) and setup.zero_option("contiguous_gradients"):
        return min(setup.zero_option("reduce_bucket_size"), shape.total) * setup.weight_bytes
    if setup.zero_stage == 3:
        return min(setup.zero_option("stage3_prefetch_bucket_size"), shape.total) * setup.weight_bytes
    return 0
