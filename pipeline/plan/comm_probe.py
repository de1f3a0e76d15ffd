"""Count the bytes of a real training step's collectives, per rank: what `pipeline.plan.step.collectives`
is checked against.

Run in a gloo world (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
``python -m pipeline.plan.comm_probe OUT.json``. Each case builds the engine as the train stage does
(`pipeline.training.engine.build_engine`), takes one step (its first, which also runs the collectives of
start-up), then counts every collective of a second step by kind: the payload of each call (the tensor
handed to ``torch.distributed``) and the number of calls. The wrappers call the real functions; they are
installed before DeepSpeed starts, since its backend keeps references to the functions it uses.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

# Which argument holds the payload of each counted function: the tensor (or list) whose bytes count.
PAYLOAD_ARG = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather_into_tensor": 0, "all_gather": 0,
               "reduce_scatter_tensor": 1, "reduce_scatter": 1, "all_to_all_single": 1, "all_reduce_coalesced": 0}


class CollectiveCounter:
    """Wraps ``torch.distributed``'s collectives to add up, by function, the bytes and calls while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.sizes: dict[str, list[int]] = defaultdict(list)
        for name, index in PAYLOAD_ARG.items():
            setattr(dist, name, self._wrap(name, index, getattr(dist, name)))

    def _wrap(self, name: str, index: int, real):
        def counted(*args, **kwargs):
            if self.on:
                payload = args[index] if len(args) > index else next(iter(kwargs.values()))
                tensors = payload if isinstance(payload, (list, tuple)) else [payload]
                size = sum(t.numel() * t.element_size() for t in tensors)
                self.bytes[name] += size
                self.calls[name] += 1
                self.sizes[name].append(size)
            return real(*args, **kwargs)

        return counted

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.sizes.clear()


def _case(counter: CollectiveCounter, model_cfg, zero_stage: int, ep_size: int, world: int, rank: int) -> dict:
    from pipeline.config import OptimizerSection, TrainSection
    from pipeline.training.engine import build_engine, train_step
    from pipeline.training.layout import ParallelDims

    from pipeline.plan.validation import COMM_GLOBAL, COMM_MICRO, COMM_SEQ

    seq, global_batch, micro = COMM_SEQ, COMM_GLOBAL, COMM_MICRO
    train = TrainSection(steps=2, global_batch_size=global_batch, micro_batch_size_per_rank=micro,
                         zero_stage=zero_stage, loss_chunk_tokens=0, precision="fp32", compile=False)
    dims = ParallelDims(world, ep_size, global_batch, micro, seq)
    cpu = torch.device("cpu")
    engine, _ = build_engine(model_cfg, train, OptimizerSection(lr=1e-3, warmup_steps=1), dims, precision="fp32",
                             device=cpu, seed=0)
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randint(0, model_cfg.vocab_size, (micro, seq + 1), generator=gen),)
               for _ in range(dims.grad_accum_steps)]
    batches = [(b[:, :-1], b[:, 1:]) for (b,) in batches]
    train_step(engine, batches, cpu)
    counter.reset()
    counter.on = True
    train_step(engine, batches, cpu)
    counter.on = False
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls), "sizes": dict(counter.sizes)}


def main(out_path: str) -> None:
    counter = CollectiveCounter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from pipeline.plan.validation import COMM_CASES, COMM_DENSE, COMM_MOE

    results = {}
    for name, (stage, ep) in COMM_CASES.items():
        cfg = COMM_MOE if ep > 1 else COMM_DENSE
        results[name] = _case(counter, cfg, stage, ep, world, rank)
    every = [None] * world
    dist.all_gather_object(every, results)  # the payloads of all ranks (an all-to-all's differ by rank)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world": world, "ranks": every}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
