"""The device table and the cluster shape."""

from __future__ import annotations

import json

import pytest

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
    ("1x8xh100", "unknown device type 'h100'; known: H100, H200, A100-80G, L4, H800, cpu"),
])
def test_bad_cluster_names_the_flag(text, message):
    with pytest.raises(ConfigError, match="--cluster") as e:
        parse_cluster(text)
    assert message in str(e.value)


def test_this_cpu_is_measured():
    assert 1e8 < measure_cpu_flops(seconds=0.05, size=128) < 1e14


def test_ray_accelerator_types():
    assert from_ray_resources({"GPU": 8.0, "accelerator_type:A100-80G": 8.0}) is GPUS["A100-80G"]
    assert from_ray_resources({"GPU": 8.0, "accelerator_type:A100-40G": 8.0}) is None  # not in the table
    assert from_ray_resources({"GPU": 16.0, "accelerator_type:H100": 8.0, "accelerator_type:L4": 8.0}) is GPUS["L4"]


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
