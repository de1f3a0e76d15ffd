"""The accelerators a plan can be made for, and the cluster shape ``NODESxGPUSxTYPE``.

One row per type: its memory, its dense bf16 peak (the figure MFU is quoted against), the bandwidth
between the GPUs of one node (NVLink, one direction; PCIe for the parts without it) and out of a GPU to
other nodes (its share of the node's network, one direction). The figures are NVIDIA's data sheets, for
the SXM part where there are several (H100, H200, H20, A100, B200, V100, and L4, L40S, A10, T4, P100, P4,
K80; the H800 is the H100 with NVLink cut to 400 GB/s both ways, as the DeepSeek-V3 report describes its
cluster: 8 GPUs per node, 400 Gb/s InfiniBand per GPU). Parts without bf16 give their fastest
half-precision peak (V100, T4: fp16 tensor cores; P100: fp16) or, without that either, fp32 (P4, K80).
The network: NVIDIA's reference node (DGX A100: 200 Gb/s per GPU; DGX H100, DGX B200: 400 Gb/s; DGX-1,
the V100's: 4 x 100 Gb/s for 8 GPUs), else 100 Gb/s per GPU. Memory is in bytes as the device reports it
(80 GB parts report 80 GiB less a little; we take the marketed size in GiB for the A100 and the 80 GB
parts and in GB for the others, which report a little more than that, or, with ECC on, about as much).

``ray_names``: the ``accelerator_type:<name>`` resources that say a Ray node has this type. Ray names a
node's GPUs from their NVML name (``NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type``: the model
token, without the memory: "NVIDIA A100-SXM4-80GB" is ``A100``, "Tesla V100-SXM2-32GB" is ``V100``), so
where one name covers parts of several sizes the name is the smallest's: a plan against more memory than
a worker may have would let through a config that then runs out of it. So ``A100`` is the 40 GB A100,
also on nodes of 80 GB ones; ``A100-80G`` (and ``A100-40G``), Ray's names for a label that a node's
operator adds by hand beside Ray's own ``A100``, cannot overrule it: the cluster's resources do not say
which nodes carry which (``from_ray_resources`` takes the least memory named). ``V100`` is the 16 GB
part, ``P100`` the 12 GB one. The types of Ray's table left out: B300, GB200, GB300 and RTX-PRO-6000,
whose data sheets we do not have to hand (a node of them is not judged: ``pipeline.plan.fit``).

``cpu`` is this machine: its memory from the OS and its peak from a short matmul measured here (or
``--cpu-flops``); gloo between processes of one node goes through shared memory. The measurement is kept
per machine (``$XDG_CACHE_HOME/conduit/cpu_flops.json``, by CPU model and cores), so only a machine's first
plan pays for torch and the matmul: a dry run answers in a fraction of a second after that.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pipeline.base import ConfigError
from pipeline import machine_cache

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """One device type.

    Attributes:
        name: as ``--cluster`` spells it.
        memory_bytes: what one device holds.
        peak_flops: dense bf16 (fp32 for ``cpu``) FLOP/s, the denominator of MFU.
        intra_node_bytes_per_s: device-to-device within a node, one direction.
        inter_node_bytes_per_s: one device's share of the node's network, one direction.
        ray_names: the ``accelerator_type:<name>`` resources Ray gives a node of this type (module docstring).
    """

    name: str
    memory_bytes: int
    peak_flops: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    ray_names: tuple[str, ...] = ()

    @property
    def is_gpu(self) -> bool:
        return self.name != "cpu"


GB = 10**9
GPUS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("H100", 80 * GiB, 989e12, 450e9, 50e9, ("H100",)),  # also the PCIe (80 GB) and NVL (94 GB)
    Accelerator("H200", 141 * GB, 989e12, 450e9, 50e9, ("H200",)),
    Accelerator("A100-80G", 80 * GiB, 312e12, 300e9, 25e9, ("A100-80G",)),
    # Ray's own name for every A100, 40 GB or 80 GB: planned as the 40 GB one (module docstring)
    Accelerator("A100-40G", 40 * GiB, 312e12, 300e9, 25e9, ("A100-40G", "A100")),
    Accelerator("L4", 24 * GB, 121e12, 32e9, 12.5e9, ("L4",)),
    Accelerator("H800", 80 * GiB, 989e12, 200e9, 50e9, ("H800",)),
    Accelerator("H20", 96 * GB, 148e12, 450e9, 50e9, ("H20",)),
    Accelerator("B200", 180 * GB, 2250e12, 900e9, 50e9, ("B200",)),  # DGX B200: 1,440 GB for 8
    Accelerator("L40S", 48 * GB, 362e12, 32e9, 12.5e9, ("L40S",)),
    Accelerator("A10G", 24 * GB, 125e12, 32e9, 12.5e9, ("A10G",)),  # AWS's A10: the A10 data sheet's peak
    Accelerator("T4", 16 * GB, 65e12, 16e9, 12.5e9, ("T4",)),
    Accelerator("V100", 16 * GB, 125e12, 150e9, 6.25e9, ("V100",)),  # also the 32 GB part
    Accelerator("P100", 12 * GB, 18.7e12, 16e9, 12.5e9, ("P100",)),  # the 12 GB part is PCIe only
    Accelerator("P4", 8 * GB, 5.5e12, 16e9, 12.5e9, ("P4",)),
    Accelerator("K80", 12 * GB, 4.37e12, 16e9, 12.5e9, ("K80",)),  # one of the board's two GPUs
)}

# gloo over shared memory within this machine, and a 10 GbE link between machines.
CPU_INTRA_NODE, CPU_INTER_NODE = 10e9, 1.25e9


def measure_cpu_flops(seconds: float = 0.3, size: int = 512) -> float:
    """fp32 FLOP/s of a square matmul on this process's threads: the CPU's practical peak."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - start)


CPU_FLOPS_FILE = "cpu_flops.json"


def cpu_model() -> str:
    """This machine's CPU as the kept measurement knows it: its model name and the cores this process may use."""
    name = ""
    try:
        name = next((line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.partition(":")[0].strip() == "model name"), "")
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name or 'unknown cpu'} | {cores} cores"


def cpu_flops_path() -> Path:
    return machine_cache.cache_dir() / CPU_FLOPS_FILE


def kept_cpu_flops() -> float:
    """`measure_cpu_flops` of this machine, measured once and kept (module docstring); an unreadable file is
    measured again and rewritten."""
    path, machine = cpu_flops_path(), cpu_model()
    value = machine_cache.read(path).get(machine)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    value = measure_cpu_flops()
    try:
        machine_cache.update(path, (machine,), value)
    except OSError:  # a read-only home: measured again next time
        pass
    return value


def cpu(flops: float | None = None) -> Accelerator:
    """This machine as an accelerator: its RAM, and ``flops`` (this machine's kept measurement when None)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Accelerator("cpu", memory, flops if flops is not None else kept_cpu_flops(), CPU_INTRA_NODE,
                       CPU_INTER_NODE)


def accelerator(name: str, cpu_flops: float | None = None) -> Accelerator:
    """The row of ``name`` (``cpu`` measured here, or at ``cpu_flops``).

    Raises:
        ConfigError: an unknown type, naming the known ones.
    """
    if name == "cpu":
        return cpu(cpu_flops)
    if name not in GPUS:
        raise ConfigError(f"--cluster: unknown device type {name!r}; known: {', '.join([*GPUS, 'cpu'])}")
    return GPUS[name]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``per_node`` devices of one type."""

    nodes: int
    per_node: int
    device: Accelerator

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def describe(self) -> str:
        return f"{self.nodes}x{self.per_node}x{self.device.name} ({self.world} devices)"

    def with_device(self, **changes) -> "Cluster":
        return replace(self, device=replace(self.device, **changes))


_SHAPE = re.compile(r"^(\d+)x(\d+)x(.+)$")


def parse_cluster(text: str, cpu_flops: float | None = None) -> Cluster:
    """``NODESxGPUSxTYPE``, e.g. ``8x8xH100`` or ``1x2xcpu``.

    Raises:
        ConfigError: naming ``--cluster`` and what is wrong (the shape, a zero count, the type).
    """
    match = _SHAPE.match(text.strip())
    if not match:
        raise ConfigError(f"--cluster {text!r}: write NODESxGPUSxTYPE, e.g. 8x8xH100 or 1x2xcpu")
    nodes, per_node = int(match.group(1)), int(match.group(2))
    if nodes < 1 or per_node < 1:
        raise ConfigError(f"--cluster {text!r}: nodes and devices per node must be >= 1")
    return Cluster(nodes, per_node, accelerator(match.group(3), cpu_flops))


def from_ray_resources(resources: dict[str, float]) -> Accelerator | None:
    """The GPU type a Ray cluster reports (its ``accelerator_type:<name>`` resources; of several, the one
    with the least memory, where a worker may land), or None when it names none we know (then no device
    memory is known to plan against)."""
    named = [gpu for gpu in GPUS.values()
             if any(resources.get(f"accelerator_type:{n}", 0) > 0 for n in gpu.ray_names)]
    return min(named, key=lambda gpu: gpu.memory_bytes) if named else None
