"""The train stage's memory preflight: refuse, before any worker starts, a config whose planned peak per
GPU exceeds the GPUs' memory, naming the largest term and the cheapest change that fits.

It judges GPU clusters only: the device type is read from the ``accelerator_type:<name>`` resource Ray
gives each GPU node (`pipeline.plan.hardware.from_ray_resources`), and the world is the run's
``parallel.num_workers``. A cluster without GPUs is not judged here (a CPU run's memory is the machine's
RAM, checked elsewhere), nor is one whose GPU type is not in the table (its memory is unknown).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.config import ConfigError, RunConfig
from pipeline.plan.hardware import Cluster, from_ray_resources
from pipeline.plan.report import plan, refusal


def check_memory_fits(cfg: RunConfig, resources: Mapping[str, float]) -> None:
    """Refuse ``cfg`` on a Ray cluster with ``resources`` when its planned peak does not fit a GPU.

    Raises:
        ConfigError: the planned peak, the largest term and the cheapest change that fits.
    """
    if float(resources.get("GPU", 0.0)) < 1 or cfg.parallel.device == "cpu":
        return
    device = from_ray_resources(dict(resources))
    if device is None:
        return
    cluster = Cluster(nodes=1, per_node=cfg.parallel.num_workers, device=device)
    planned = plan(cfg, cluster)
    if not planned.fits:
        raise ConfigError(f"train preflight: {refusal(planned)} (python -m jobs.plan shows every term)")
