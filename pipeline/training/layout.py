"""ParallelDims: the one owner of world size, parallel degrees and batch arithmetic."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import limits


@dataclass(frozen=True)
class ParallelDims:
    """World layout and batch sizes of one training run.

    Every rank is a data-parallel rank for the dense parameters. With expert parallelism the
    ``ep_size`` ranks of one expert-parallel group split the experts between them, and each
    expert's replicas form an expert-data-parallel group of ``world_size // ep_size`` ranks. With
    sequence parallelism the ``sp_size`` consecutive ranks of one group read the same sequences, each a
    shard of their positions (``pipeline.training.sequence_parallel``): the data-parallel degree, which
    the batch arithmetic divides by, is ``world_size // sp_size``. DeepSpeed, which averages gradients
    over every rank, counts each rank's shards as samples (``ds_train_batch_size``).

    Args:
        world_size: number of training processes.
        ep_size: expert-parallel degree (1: every rank holds every expert).
        global_batch_size: sequences per optimizer step over all ranks.
        micro_batch_size_per_rank: sequences in one forward/backward on one rank.
        seq_len: tokens per sequence.
        sp_size: sequence-parallel degree (1: each rank holds its sequences whole).

    Raises:
        ValueError: the sizes break a limit of ``pipeline.config.limits`` (its message names every factor).
    """

    world_size: int
    ep_size: int
    global_batch_size: int
    micro_batch_size_per_rank: int
    seq_len: int
    sp_size: int = 1

    def __post_init__(self) -> None:
        # The limits config validation checks (pipeline.config.limits); here for callers without a config.
        limits.require(limits.layout_sizes(self.world_size, self.ep_size, self.micro_batch_size_per_rank))
        limits.require(limits.ep_divides_workers(self.ep_size, self.world_size))
        limits.require(limits.sequence_parallel(self.sp_size, self.world_size, self.ep_size, self.seq_len))
        limits.require(limits.global_batch(self.global_batch_size, self.world_size, self.micro_batch_size_per_rank,
                                           self.sp_size))

    @property
    def dp_size(self) -> int:
        """Ranks that read different sequences (every rank, unless sequence-parallel groups share them)."""
        return self.world_size // self.sp_size

    def dp_rank(self, rank: int) -> int:
        """Which data-parallel rank ``rank`` is (the ranks of one sequence-parallel group share it)."""
        return rank // self.sp_size

    def sp_rank(self, rank: int) -> int:
        """Which shard of each sequence ``rank`` holds."""
        return rank % self.sp_size

    @property
    def ds_train_batch_size(self) -> int:
        """DeepSpeed's ``train_batch_size``: micro-batch x accumulation x every rank (it knows no sequence
        groups; a rank's shards count as its samples)."""
        return self.micro_batch_size_per_rank * self.grad_accum_steps * self.world_size

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size

    @property
    def grad_accum_steps(self) -> int:
        return self.global_batch_size // (self.dp_size * self.micro_batch_size_per_rank)

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch_size * self.seq_len

    def describe(self) -> str:
        return (
            f"world {self.world_size} (ep {self.ep_size}, expert-dp {self.expert_dp_size}"
            f"{f', sp {self.sp_size}' if self.sp_size > 1 else ''}); "
            f"global batch {self.global_batch_size} seq x {self.seq_len} tok = {self.global_batch_tokens} tok "
            f"= {self.micro_batch_size_per_rank}/rank x {self.dp_size} data-parallel ranks x {self.grad_accum_steps} accum"
        )


def check_split(eval_batches: int, global_batch_size: int, n_blocks: int) -> None:
    """Raises ValueError when the validation split is smaller than the subset."""
    need = eval_batches * global_batch_size
    if n_blocks < need:
        raise ValueError(
            f"validation.batches={eval_batches} asks for {need} validation blocks (x train.global_batch_size="
            f"{global_batch_size}) but the validation split has {n_blocks}: lower validation.batches or raise "
            "data.validation_fraction"
        )
