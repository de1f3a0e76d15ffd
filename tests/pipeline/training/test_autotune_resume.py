"""A resumed run keeps what its checkpoint trained in (``autotune._kept``), and the checkpoint carries it
(``checkpoint.precision_record``); the whole path through a 2-worker run continued by one worker from S3 is
``test_fault_tolerance.py::test_resume_on_one_worker_from_a_checkpoint_on_s3``."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.config import load_config
from pipeline.training import autotune
from pipeline.training import compile_choice as cc
from pipeline.training import precision_choice as pc
from pipeline.training.checkpoint import precision_record
from pipeline.training.checkpoint.manager import PRECISION_FILE
from pipeline.training.layout import ParallelDims

CPU = torch.device("cpu")


def _measured_record(precision="amp_bf16", compile_=True) -> dict:
    choice = pc.PrecisionChoice(precision, 0.2, 0.15, "measured", "cpu-x")
    c_choice = cc.CompileChoice(compile_, "measured", 0.15, 0.1, 20.0, 50.0)
    return autotune.Decided(precision, compile_, choice, c_choice).record()


def _decide(tmp_path, overrides, precision, resumed):
    """``decide`` on one worker, with no micro-batch to time: it must not measure anything."""
    cfg = load_config("configs/smoke.yaml", [f"run.workdir={tmp_path}", *overrides])
    t = cfg.train
    dims = ParallelDims(1, 1, t.global_batch_size, t.micro_batch_size_per_rank, cfg.tokenize.seq_len)
    return autotune.decide(cfg, cfg.model_config(), None, dims, CPU, 0, 1, 1, precision, resumed=resumed), t


def test_a_resumed_run_keeps_the_precision_and_compile_its_checkpoint_trained_in(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    record = _measured_record()
    decided, t = _decide(tmp_path, [], "auto", record)
    assert (decided.precision, decided.compile) == ("amp_bf16", True)
    assert decided.precision_choice is None and decided.compile_choice is None  # nothing measured
    tags = decided.tags()
    assert tags["precision.auto"] == "checkpoint" and tags["compile.auto"] == "checkpoint"
    # the measured times travel on, so the run resumed from it still says what the choice was made from
    assert tags["precision.auto.bf16_speedup"] == record["auto"]["precision.auto.bf16_speedup"]
    assert tags["compile.auto.compile_s"] == record["auto"]["compile.auto.compile_s"]
    # and its own checkpoints carry the same choice to the next resume
    assert autotune._kept(decided.record(), "auto", t).precision == "amp_bf16"
    assert not (tmp_path / "cache").exists()  # no cache read or written


def test_a_setting_given_in_the_config_wins_over_the_checkpoint(tmp_path):
    decided, _ = _decide(tmp_path, ["train.compile=false"], "fp32", _measured_record())
    assert (decided.precision, decided.compile) == ("fp32", False)
    assert decided.tags() == {"precision": "fp32", "compile": "false"}  # neither auto: nothing kept to say


def test_zero3_turns_a_kept_compile_off(tmp_path):
    decided, _ = _decide(tmp_path, ["train.zero_stage=3"], "auto", _measured_record())
    assert (decided.precision, decided.compile) == ("amp_bf16", False)
    assert decided.tags()["compile.auto"] == "zero3"


@pytest.mark.parametrize("record", [
    {"precision": "bf16", "compile": True},  # a GPU run's pure bf16: auto on a CPU does not choose it
    {"precision": "fp32"},  # a record without the compile (compile auto must then choose)
], ids=["gpu-bf16", "no-compile"])
def test_what_auto_could_not_have_chosen_here_is_chosen_afresh(record):
    train = load_config("configs/smoke.yaml").train
    assert autotune._kept(record, "auto", train) is None
    assert autotune._kept(None, "auto", train) is None


def test_the_checkpoint_record_is_read_from_its_folder_or_is_none(tmp_path):
    import ray.train

    folder = tmp_path / "checkpoint_000001"
    folder.mkdir()
    ckpt = ray.train.Checkpoint(str(folder))
    assert precision_record(ckpt) is None  # written before the record was kept
    assert precision_record(None) is None
    (folder / PRECISION_FILE).write_text(json.dumps(_measured_record()))
    assert precision_record(ckpt) == _measured_record()


# ---- threads = the CPUs Ray reserved (the whole path: tests/e2e/test_shared_node.py) ----------------------

@pytest.mark.parametrize("configured,workers,free,strategy,cpus", [
    (None, 1, [2.0], "PACK", 2),  # a lone one-worker run takes its node
    (None, 2, [2.0], "PACK", 1),  # two workers split it
    (None, 1, [0.0], "PACK", 1),  # nothing free: one, and wait for it
    (None, 3, [8.0], "PACK", 2),  # whole CPUs
    (None, 2, [1.0, 3.0], "PACK", 1),  # 2 each would not place (1 + 3: one bundle of 2 only)
    (None, 2, [4.0, 4.0], "PACK", 4),  # one worker a node
    (None, 2, [1.0, 3.0], "STRICT_SPREAD", 1),  # one per node: the smaller node decides
    (None, 2, [4.0, 4.0], "STRICT_PACK", 2),  # both on one node
    (3, 2, [1.0], "PACK", 3),  # parallel.threads_per_worker is what it reserves
])
def test_a_worker_reserves_what_the_free_cpus_place_for_every_worker(configured, workers, free, strategy, cpus):
    from pipeline.training.device import worker_cpus

    assert worker_cpus(configured, workers, free, strategy) == cpus


def test_a_worker_runs_as_many_threads_as_it_reserved_at_most_its_share_of_the_cores(monkeypatch):
    from pipeline.training import engine

    monkeypatch.setattr(engine.os, "cpu_count", lambda: 8)
    assert engine.local_threads(2, None, reserved=2.0) == 2  # reserved 2 of 8 cores
    assert engine.local_threads(2, None, reserved=8.0) == 4  # a cluster declaring more CPUs than cores
    assert engine.local_threads(1, None, reserved=1.0) == 1
    assert engine.local_threads(2, None) == 4  # outside Ray: the cores split over the workers
    assert engine.local_threads(2, 3, reserved=1.0) == 3  # the configured number
