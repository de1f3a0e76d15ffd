"""File-backed, resumable loader of packed token blocks (the tokenize artifact's token shards).

The global order of samples does not depend on the number of ranks: sample ``i`` of the run is
block ``perm_e[i % n]`` of epoch ``e = i // n``, where ``perm_e`` is a permutation seeded by
``(seed, e)``. Optimizer step ``s`` consumes samples ``[s*G, (s+1)*G)`` (G = global batch size);
inside it, micro step ``m`` of rank ``r`` takes the ``micro``-sized slice at offset
``(m * dp + r) * micro`` (dp: the data-parallel ranks; r: this rank's). One rank with accumulation and two without it see
the same global batch; the ranks of a sequence-parallel group share their r and each takes its own positions. The
only state is the number of samples consumed, so a restored loader
continues exactly where the saved one stopped.

Each rank reads only the blocks of its own micro-batches (``TokenBlocks.take``): memory-mapped pages
of the local shards, or ranged reads of the shards in an object store. Over an epoch a rank reads
``1/world_size`` of the split, plus each shard's header once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.data.token_blocks import TokenBlocks
from pipeline.training.layout import ParallelDims


class BlockLoader:
    """Serves each rank its micro-batches of one optimizer step at a time.

    Args:
        tokens: the split's blocks, or a single ``(n_blocks, seq_len + 1)`` .npy file (memory-mapped).
        dims: batch arithmetic.
        rank: this process's rank in ``[0, dims.world_size)``. With sequence parallelism (``dims.sp_size``
            > 1) the ranks of a group read their data-parallel rank's sequences, each its own consecutive
            ``seq_len / sp_size`` positions of them (``dims.sp_rank``).
        seed: shuffling seed; epoch ``e`` uses ``(seed, e)``.
    """

    def __init__(self, tokens: TokenBlocks | str | Path, dims: ParallelDims, rank: int, seed: int):
        self.blocks = tokens if isinstance(tokens, TokenBlocks) else TokenBlocks.from_npy(tokens)
        if self.blocks.width != dims.seq_len + 1:
            raise ValueError(
                f"{tokens}: blocks of shape {self.blocks.shape}, expected (n, seq_len+1={dims.seq_len + 1})"
            )
        if not 0 <= rank < dims.world_size:
            raise ValueError(f"rank={rank} outside world_size={dims.world_size}")
        self.dims, self.rank, self.seed = dims, rank, seed
        self.consumed = 0  # samples of the global stream consumed so far (all ranks together)
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.blocks)

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._perm_cache = (epoch, rng.permutation(len(self.blocks)))
        return self._perm_cache[1]

    def global_indices(self, start: int, count: int) -> np.ndarray:
        """Block indices of global samples ``[start, start+count)``."""
        n = len(self.blocks)
        out = np.empty(count, dtype=np.int64)
        for k, i in enumerate(range(start, start + count)):
            out[k] = self._perm(i // n)[i % n]
        return out

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches ``(inputs_BT, targets_BT)`` for the next optimizer step."""
        d = self.dims
        out = []
        width = d.seq_len // d.sp_size
        first = d.sp_rank(self.rank) * width  # this rank's positions of each sequence
        for m in range(d.grad_accum_steps):
            offset = self.consumed + (m * d.dp_size + d.dp_rank(self.rank)) * d.micro_batch_size_per_rank
            idx = self.global_indices(offset, d.micro_batch_size_per_rank)
            block = torch.from_numpy(self.blocks.take(idx).astype(np.int64))
            out.append((block[:, first:first + width].contiguous(), block[:, first + 1:first + width + 1].contiguous()))
        self.consumed += d.global_batch_size
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed, "num_blocks": len(self.blocks)}

    def load_state_dict(self, state: dict) -> None:
        if state["num_blocks"] != len(self.blocks):
            raise ValueError(
                f"loader state is for {state['num_blocks']} blocks; this token file has {len(self.blocks)}"
            )
        self.seed, self.consumed = state["seed"], state["consumed"]
