"""Run by ``test_precision_choice`` in a 2-process gloo world: ``decide`` as the training workers call it.

Cases, each with its own cache file ($XDG_CACHE_HOME set per case by this module):
    measured   an empty cache: each rank "measures" its own times (rank r: fp32 1.0 + r, amp_bf16 0.5 + r);
               every rank must get the mean over ranks and the same choice, and only rank 0 writes the cache
    cached     rank 0's cache holds an entry for the key: no rank measures, every rank gets rank 0's entry
    other_key  the cache holds an entry for another shape only: the ranks measure
Each rank writes ``rank<r>.json`` into the folder given.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.training import precision_choice as pc


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    results = {}
    for case in ("measured", "cached", "other_key"):
        os.environ["XDG_CACHE_HOME"] = str(out / case)
        if rank == 0 and case in ("cached", "other_key"):
            pc.write_cached(pc.PrecisionChoice("amp_bf16", 2.0, 1.0, "measured", "m"),
                            "key" if case == "cached" else "another-key")
        dist.barrier()
        calls = []

        def measure() -> dict[str, float]:
            calls.append(1)
            return {"fp32": 1.0 + rank, "amp_bf16": 0.5 + rank}

        choice = pc.decide("m", "key", measure, rank, world, cpu)
        dist.barrier()
        results[case] = {"choice": choice.precision, "fp32_s": choice.fp32_s, "amp_bf16_s": choice.amp_bf16_s,
                         "source": choice.source, "measured": len(calls),
                         "cache": json.loads(pc.cache_path().read_text()) if pc.cache_path().exists() else None}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
