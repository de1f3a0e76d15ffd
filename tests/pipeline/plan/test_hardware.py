"""The device table and the cluster shape."""

from __future__ import annotations

import json

import pytest

from ray._private.accelerators.nvidia_gpu import NvidiaGPUAcceleratorManager
from ray.util.accelerators import accelerators as ray_accelerators  # Ray's whole table

from pipeline.config import ConfigError
from pipeline.plan import hardware
from pipeline.plan.hardware import GPUS, from_ray_resources, measure_cpu_flops, parse_cluster


def test_parse_cluster():
    c = parse_cluster("16x8xH800")
    assert (c.nodes, c.per_node, c.world, c.device) == (16, 8, 128, GPUS["H800"])
    cpu = parse_cluster("1x2xcpu", cpu_flops=3e11)
    assert cpu.device.peak_flops == 3e11 and cpu.device.memory_bytes > 2**30 and not cpu.device.is_gpu


@pytest.mark.parametrize("text,message", [
    ("0x8xH100", "nodes and devices per node must be >= 1"),
    ("8xH100", "write NODESxGPUSxTYPE"),
    ("1x8xh100", "unknown device type 'h100'; known: H100, H200, A100-80G, A100-40G, L4, H800, H20, B200, L40S, "
                 "A10G, T4, V100, P100, P4, K80, cpu"),
])
def test_bad_cluster_names_the_flag(text, message):
    with pytest.raises(ConfigError, match="--cluster") as e:
        parse_cluster(text)
    assert message in str(e.value)


def test_this_cpu_is_measured():
    assert 1e8 < measure_cpu_flops(seconds=0.05, size=128) < 1e14


# (NVML's name of a device, as Ray's detection reads it; Ray's constant for it; the row planned against,
# with the memory of the vendor's data sheet: where Ray gives parts of several sizes one name, the smallest)
NVML_DEVICES = [
    ("NVIDIA A100-SXM4-40GB", ray_accelerators.NVIDIA_A100, "A100-40G", 40 * 2**30),
    ("NVIDIA A100-PCIE-40GB", ray_accelerators.NVIDIA_A100, "A100-40G", 40 * 2**30),
    ("NVIDIA A100-SXM4-80GB", ray_accelerators.NVIDIA_A100, "A100-40G", 40 * 2**30),  # Ray: "A100" too
    ("NVIDIA A100 80GB PCIe", ray_accelerators.NVIDIA_A100, "A100-40G", 40 * 2**30),
    ("NVIDIA H100 80GB HBM3", ray_accelerators.NVIDIA_H100, "H100", 80 * 2**30),
    ("NVIDIA H100 PCIe", ray_accelerators.NVIDIA_H100, "H100", 80 * 2**30),
    ("NVIDIA H100 NVL", ray_accelerators.NVIDIA_H100, "H100", 80 * 2**30),  # 94 GB; the name is the SXM's too
    ("NVIDIA H200", ray_accelerators.NVIDIA_H200, "H200", 141 * 10**9),
    ("NVIDIA H200 NVL", ray_accelerators.NVIDIA_H200, "H200", 141 * 10**9),
    ("NVIDIA H20", ray_accelerators.NVIDIA_H20, "H20", 96 * 10**9),
    ("NVIDIA H800", "H800", "H800", 80 * 2**30),  # not among Ray's constants; its detection names it so
    ("NVIDIA B200", ray_accelerators.NVIDIA_B200, "B200", 180 * 10**9),
    ("NVIDIA L4", ray_accelerators.NVIDIA_L4, "L4", 24 * 10**9),
    ("NVIDIA L40S", ray_accelerators.NVIDIA_L40S, "L40S", 48 * 10**9),
    ("NVIDIA A10G", ray_accelerators.NVIDIA_TESLA_A10G, "A10G", 24 * 10**9),
    ("Tesla T4", ray_accelerators.NVIDIA_TESLA_T4, "T4", 16 * 10**9),
    ("Tesla V100-SXM2-16GB", ray_accelerators.NVIDIA_TESLA_V100, "V100", 16 * 10**9),
    ("Tesla V100-SXM2-32GB", ray_accelerators.NVIDIA_TESLA_V100, "V100", 16 * 10**9),
    ("Tesla V100-PCIE-16GB", ray_accelerators.NVIDIA_TESLA_V100, "V100", 16 * 10**9),
    ("Tesla P100-PCIE-12GB", ray_accelerators.NVIDIA_TESLA_P100, "P100", 12 * 10**9),
    ("Tesla P100-SXM2-16GB", ray_accelerators.NVIDIA_TESLA_P100, "P100", 12 * 10**9),
    ("Tesla P4", ray_accelerators.NVIDIA_TESLA_P4, "P4", 8 * 10**9),
    ("Tesla K80", ray_accelerators.NVIDIA_TESLA_K80, "K80", 12 * 10**9),
]
# Ray's NVIDIA types that the table leaves out (no data sheet to hand): a node of them is not judged.
NOT_IN_THE_TABLE = {ray_accelerators.NVIDIA_B300, ray_accelerators.NVIDIA_GB200, ray_accelerators.NVIDIA_GB300,
                    ray_accelerators.NVIDIA_RTX_PRO_6000}


def _ray_node(nvml_name: str, gpus: float = 8.0) -> dict[str, float]:
    """The resources Ray's own detection gives a node of ``gpus`` devices named ``nvml_name``."""
    return {"CPU": 64.0, "GPU": gpus,
            f"accelerator_type:{NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(nvml_name)}": 1.0}


@pytest.mark.parametrize("nvml_name,ray_type,row,memory", NVML_DEVICES)
def test_every_gpu_rays_detection_names_is_planned_against_its_smallest_memory(nvml_name, ray_type, row, memory):
    assert NvidiaGPUAcceleratorManager._gpu_name_to_accelerator_type(nvml_name) == ray_type
    device = from_ray_resources(_ray_node(nvml_name))
    assert device is not None, f"{ray_type} is not in the table: the preflight would check nothing"
    assert (device.name, device.memory_bytes) == (row, memory)


def test_every_nvidia_type_of_rays_table_is_in_the_table_or_named_as_left_out():
    ray_types = {v for k, v in vars(ray_accelerators).items() if k.startswith("NVIDIA_")}
    ours = {n for gpu in GPUS.values() for n in gpu.ray_names}
    assert ray_types - ours == NOT_IN_THE_TABLE
    for left_out in NOT_IN_THE_TABLE:
        assert from_ray_resources({"GPU": 8.0, f"accelerator_type:{left_out}": 1.0}) is None


def test_ray_accelerator_types_of_a_cluster():
    def planned(resources: dict[str, float]) -> str | None:
        device = from_ray_resources(resources)
        return None if device is None else device.name

    a100_80g_labelled = {**_ray_node("NVIDIA A100-SXM4-80GB"),
                         f"accelerator_type:{ray_accelerators.NVIDIA_A100_80G}": 1.0}
    # Ray's own A100 beside the hand-added A100-80G: the cluster's resources cannot say that every A100 is one
    assert planned(a100_80g_labelled) == "A100-40G"
    assert planned({"GPU": 8.0, f"accelerator_type:{ray_accelerators.NVIDIA_A100_80G}": 1.0}) == "A100-80G"
    assert planned({"GPU": 8.0, f"accelerator_type:{ray_accelerators.NVIDIA_A100_40G}": 1.0}) == "A100-40G"
    h100_and_l4 = {"GPU": 16.0, "accelerator_type:H100": 1.0, "accelerator_type:L4": 1.0}  # a worker may land on an L4
    assert planned(h100_and_l4) == "L4"
    assert from_ray_resources(_ray_node("NVIDIA GeForce RTX 4090")) is None  # "GeForce-RTX-4090": memory unknown


def test_the_cpu_is_measured_once_per_machine_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measured = []
    monkeypatch.setattr(hardware, "measure_cpu_flops", lambda: measured.append(1) or 2.5e11)
    assert hardware.cpu().peak_flops == 2.5e11 and len(measured) == 1
    assert hardware.cpu().peak_flops == 2.5e11 and len(measured) == 1  # read back, not measured again
    this_machine = hardware.cpu_model()
    kept = json.loads((tmp_path / "conduit" / hardware.CPU_FLOPS_FILE).read_text())
    assert kept == {this_machine: 2.5e11}
    assert hardware.cpu(1e12).peak_flops == 1e12 and len(measured) == 1  # --cpu-flops: no measurement at all
    (tmp_path / "conduit" / hardware.CPU_FLOPS_FILE).write_text("{cut sho")  # unreadable: measured again
    assert hardware.cpu().peak_flops == 2.5e11 and len(measured) == 2
    monkeypatch.setattr(hardware, "cpu_model", lambda: "another cpu | 64 cores")  # another machine: its own
    assert hardware.cpu().peak_flops == 2.5e11 and len(measured) == 3
    assert json.loads((tmp_path / "conduit" / hardware.CPU_FLOPS_FILE).read_text()) == {
        this_machine: 2.5e11, "another cpu | 64 cores": 2.5e11}
