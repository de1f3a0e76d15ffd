"""``train.compile: auto`` (``pipeline.training.compile_choice`` and ``autotune``): the bound that skips
compiling short runs, the payback rule, the timing order, the cache, and one real decision on a model
compiled by inductor, the way the training workers make it."""

from __future__ import annotations

import json

import pytest
import torch

from models import ModelConfig
from pipeline.config import load_config
from pipeline.training import autotune
from pipeline.training import compile_choice as cc
from pipeline.training import precision_choice as pc
from pipeline.training.layout import ParallelDims

CPU = torch.device("cpu")


def test_the_bound_measures_only_where_half_of_every_step_could_repay_the_least_compile_time():
    assert (cc.MAX_SAVED, cc.MIN_COMPILE_S) == (0.5, 5.0)
    # 0.5 x 0.0625 s x 2 micro-steps x 80 steps = 5 s: not more than 5 s, so not worth compiling to find out
    assert not cc.worth_measuring(0.0625, 2, 80)
    assert cc.worth_measuring(0.0625, 2, 81)
    assert cc.worth_measuring(0.2, 2, 1400)  # the demo's scale


def test_compile_pays_where_the_time_saved_over_the_run_exceeds_the_compile_time():
    assert cc.pays(0.5, 0.25, 20.0, 2, 40) == (False, 20.0)  # 0.25 x 2 x 40 = 20: not more than 20
    assert cc.pays(0.5, 0.25, 20.0, 2, 41) == (True, 20.5)
    assert cc.pays(0.10, 0.11, 0.0, 2, 10**6)[0] is False  # slower compiled: never


def test_a_short_run_decides_without_measuring_or_reading_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def measure():
        raise AssertionError("nothing is compiled for a run the bound rules out")

    choice = cc.decide("m", "k", 0.01, 2, 100, measure, rank=0, world=1, device=CPU)
    assert choice == cc.CompileChoice(False, "bound", 0.01)
    assert choice.tags()["compile.auto"] == "bound" and "compile.auto.compile_s" not in choice.tags()
    assert not cc.cache_path().exists()


def test_measured_times_are_cached_and_each_run_decides_by_its_own_steps(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return {"eager": 0.2, "compiled": 0.15, "compile": 30.0}

    long = cc.decide("m", "k", 0.2, 2, 1000, measure, rank=0, world=1, device=CPU)  # saves 0.05 x 2 x 1000 = 100 s
    assert (long.compile, long.reason, long.saved_s) == (True, "measured", pytest.approx(100.0))
    assert json.loads(cc.cache_path().read_text()) == {
        "m": {"k": {"eager_s": 0.2, "compiled_s": 0.15, "compile_s": 30.0}}}
    short = cc.decide("m", "k", 0.2, 2, 200, measure, rank=0, world=1, device=CPU)  # saves 20 s < 30 s
    assert (short.compile, short.reason, short.saved_s) == (False, "cached", pytest.approx(20.0))
    assert len(calls) == 1


def test_timing_runs_eager_then_the_compile_then_both_interleaved(monkeypatch):
    clock, calls = [0.0], []
    cost = {"eager": iter([1.0, 4.0, 2.0, 3.0]), "compiled": iter([20.0, 1.0, 0.5, 0.25])}

    def step(kind):
        calls.append(kind)
        clock[0] += next(cost[kind])

    monkeypatch.setattr(cc.time, "perf_counter", lambda: clock[0])
    assert cc.time_compile(step, repeats=3) == {"eager": 3.0, "compiled": 0.5, "compile": 20.0}
    assert calls == ["eager", "compiled"] + ["eager", "compiled"] * 3


@pytest.mark.slow
def test_a_long_run_compiles_a_copy_times_it_and_a_second_run_reads_the_cache(tmp_path, monkeypatch):
    """autotune on one worker, a forced fp32, compile auto, a small model: the bound lets it measure (10^6
    steps), inductor compiles a copy (its cache in the test's folder), and the choice follows the rule
    on the times it reports; the same shape again reads them from the cache and compiles nothing."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cfg = load_config("configs/smoke.yaml", [f"run.workdir={tmp_path}", "train.steps=1000000",
                                            "train.precision=fp32"])
    model_cfg = cfg.model_config()
    t = cfg.train
    dims = ParallelDims(1, 1, t.global_batch_size, t.micro_batch_size_per_rank, cfg.tokenize.seq_len)
    g = torch.Generator().manual_seed(0)
    batch = tuple(torch.randint(model_cfg.vocab_size, (t.micro_batch_size_per_rank, cfg.tokenize.seq_len),
                                generator=g) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = autotune.decide(cfg, model_cfg, None, dims, CPU, 0, 1, 1, "fp32", micro_batch=batch)
        second = autotune.decide(cfg, model_cfg, None, dims, CPU, 0, 1, 1, "fp32", micro_batch=batch)
    finally:
        torch.set_num_threads(threads)
    c = first.compile_choice
    assert first.precision == "fp32" and first.precision_choice is None and c.reason == "measured"
    assert c.compile_s > c.compiled_s > 0 and c.eager_s > 0
    assert (first.compile, c.saved_s) == cc.pays(c.eager_s, c.compiled_s, c.compile_s, dims.grad_accum_steps,
                                                   t.steps)
    assert any((tmp_path / "cache" / "conduit" / "inductor").iterdir())  # inductor's cache, kept for later runs
    s = second.compile_choice
    assert s.reason == "cached" and (s.eager_s, s.compiled_s, s.compile_s) == (c.eager_s, c.compiled_s, c.compile_s)
    assert second.compile == first.compile
    assert first.record() == {"precision": "fp32", "compile": first.compile, "auto": c.tags()}
    assert autotune.resolved_train(t, first).compile is first.compile
