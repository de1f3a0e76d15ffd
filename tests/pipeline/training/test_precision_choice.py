"""``train.precision: auto`` on a CPU (``pipeline.training.precision_choice``): the rule, the cache, the
timing loop, the micro-step each precision runs, and the choice every rank of a gloo world agrees on."""

from __future__ import annotations

import json

import pytest
import torch

from models import ModelConfig, build_model
from pipeline.training import precision_choice as pc
from pipeline.training.device import resolve_precision
from tests.distributed import run_world


def test_the_rule_takes_bf16_only_at_or_under_the_margin():
    assert pc.MARGIN == 0.95
    assert pc.choose(1.0, 0.95) == "amp_bf16"
    assert pc.choose(1.0, 0.9500001) == "fp32"
    assert pc.choose(1.0, 0.5) == "amp_bf16"
    assert pc.choose(1.0, 1.4) == "fp32"
    assert pc.choose(2.0, 1.9, margin=0.96) == "amp_bf16"
    with pytest.raises(ValueError, match="positive"):
        pc.choose(0.0, 1.0)


def test_auto_is_left_to_the_workers_on_cpu_bf16_on_gpu_and_a_forced_choice_is_kept():
    assert resolve_precision("auto", "cpu") == "auto"
    assert resolve_precision("auto", "cuda") == "bf16"
    for forced in ("fp32", "amp_bf16", "bf16"):
        assert resolve_precision(forced, "cpu") == forced
    with pytest.raises(ValueError, match="fp16 needs a GPU"):
        resolve_precision("fp16", "cpu")


def test_the_cache_keeps_each_machine_and_shape_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "conduit" / "precision.json"
    assert pc.read_cached("m1", "k1", path) is None  # no file
    pc.write_cached(pc.PrecisionChoice("amp_bf16", 2.0, 1.5, "measured", "m1"), "k1", path)
    pc.write_cached(pc.PrecisionChoice("fp32", 1.0, 1.2, "measured", "m1"), "k2", path)
    pc.write_cached(pc.PrecisionChoice("fp32", 3.0, 3.1, "measured", "m2"), "k1", path)
    assert pc.read_cached("m1", "k1", path) == pc.PrecisionChoice("amp_bf16", 2.0, 1.5, "cached", "m1")
    assert pc.read_cached("m1", "k2", path) == pc.PrecisionChoice("fp32", 1.0, 1.2, "cached", "m1")
    assert pc.read_cached("m2", "k1", path).fp32_s == 3.0
    assert pc.read_cached("m2", "k2", path) is None and pc.read_cached("m3", "k1", path) is None
    path.write_text("{not json")
    assert pc.read_cached("m1", "k1", path) is None
    pc.write_cached(pc.PrecisionChoice("fp32", 1.0, 1.2, "measured", "m1"), "k1", path)  # rewritten whole
    assert json.loads(path.read_text()) == {"m1": {"k1": {"precision": "fp32", "fp32_s": 1.0, "amp_bf16_s": 1.2}}}
    path.write_text(json.dumps({"m1": {"k1": {"precision": "fp16", "fp32_s": 1, "amp_bf16_s": 1}}}))
    assert pc.read_cached("m1", "k1", path) is None  # not a candidate


def test_the_shape_key_changes_with_every_part_of_the_shape():
    base = dict(model={"d_model": 64}, micro_batch=4, seq_len=64, threads=1, local_world_size=2, world_size=2,
                compile=False)
    keys = {pc.shape_key(**base)}
    for field, other in [("model", {"d_model": 128}), ("micro_batch", 8), ("seq_len", 128), ("threads", 2),
                         ("local_world_size", 1), ("world_size", 4), ("compile", True)]:
        keys.add(pc.shape_key(**{**base, field: other}))
    assert len(keys) == 8
    assert pc.shape_key(**base) == pc.shape_key(**dict(reversed(list(base.items()))))


def test_the_machine_names_the_cpu_its_bf16_instructions_and_torch():
    machine = pc.machine_id()
    assert f"torch {torch.__version__}" in machine
    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    bf16 = [f for f in pc.BF16_FLAGS if f in flags]
    assert (",".join(bf16) if bf16 else "no-bf16-isa") in machine


def test_timing_interleaves_the_precisions_after_one_untimed_each_and_takes_medians(monkeypatch):
    clock, calls = [0.0], []
    cost = {"fp32": iter([9.0, 1.0, 5.0, 2.0]), "amp_bf16": iter([9.0, 0.5, 0.75, 9.0])}

    def step(precision):
        calls.append(precision)
        clock[0] += next(cost[precision])

    barriers = []
    monkeypatch.setattr(pc.time, "perf_counter", lambda: clock[0])
    medians = pc.time_micro_steps(step, repeats=3, barrier=lambda: barriers.append(len(calls)))
    assert calls == ["fp32", "amp_bf16"] * 4
    assert barriers == [2, 3, 4, 5, 6, 7]  # before each timed call
    assert medians == {"fp32": 2.0, "amp_bf16": 0.75}


def test_short_micro_steps_are_timed_more_often_up_to_the_budget_and_as_many_times_on_every_rank(monkeypatch):
    clock, calls, asked = [0.0], [], []
    monkeypatch.setattr(pc.time, "perf_counter", lambda: clock[0])

    def step(precision):
        calls.append(precision)
        clock[0] += 0.25 if precision == "fp32" else 0.125

    def agree(n):  # another rank wants two more rounds: every rank runs the largest count
        asked.append(n)
        return n + 2

    # the slower's first timed call took 0.25 s: 1.5 s of budget is 6 rounds, above the least 5
    assert pc.time_micro_steps(step, repeats=5, agree=agree, budget_s=1.5, most=30) == {"fp32": 0.25,
                                                                                       "amp_bf16": 0.125}
    assert asked == [6] and calls == ["fp32", "amp_bf16"] * (1 + 8)
    calls.clear(), asked.clear()
    pc.time_micro_steps(step, repeats=5, agree=lambda n: asked.append(n) or n, budget_s=100.0, most=30)
    assert asked == [30] and len(calls) == 2 * 31  # capped at most
    calls.clear(), asked.clear()
    pc.time_micro_steps(step, repeats=5, agree=lambda n: asked.append(n) or n, budget_s=0.1, most=30)
    assert asked == [5] and len(calls) == 2 * 6  # never under the least


def test_the_micro_step_is_the_training_forward_and_backward_in_each_precision():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(64, (2, 16))
    y = torch.randint(64, (2, 16))
    grads = {}
    dtypes = []
    # the blocks' projections (the LM head hands the loss fp32 logits in either precision)
    hooks = [m.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    orig_zero = model.zero_grad

    def keep(set_to_none=True):
        grads["w"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        orig_zero(set_to_none=set_to_none)

    model.zero_grad = keep
    step = pc.micro_step(model, (x, y), torch.device("cpu"), loss_chunk_tokens=0)
    step("fp32")
    assert dtypes and set(dtypes) == {torch.float32}
    fp32_grads = grads["w"]
    assert all(p.grad is None for p in model.parameters())  # zeroed: the engine's model starts clean
    model.zero_grad = orig_zero
    out = model(x, targets_BT=y, chunk_tokens=0)
    (out.loss + out.aux_loss).backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, fp32_grads[name]), name  # the plain training forward and backward
    model.zero_grad(set_to_none=True)
    model.zero_grad = keep
    dtypes.clear()
    step("amp_bf16")
    assert len(dtypes) == 2 * 7 and set(dtypes) == {torch.bfloat16}  # every block's matmuls in bf16
    assert all(g.dtype == torch.float32 for g in grads["w"].values())  # fp32 weights' gradients
    for h in hooks:
        h.remove()


def test_every_rank_gets_one_choice_from_rank_zeros_cache_or_the_mean_of_their_measurements(tmp_path):
    run_world("tests.pipeline.training.precision_dist", str(tmp_path), world_size=2, timeout=300)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for case in ("measured", "cached", "other_key"):
        a, b = dict(r0[case]), dict(r1[case])
        a.pop("cache"), b.pop("cache")
        assert {k: v for k, v in a.items() if k != "measured"} == {k: v for k, v in b.items() if k != "measured"}
    # measured: the mean of rank 0's (1.0, 0.5) and rank 1's (2.0, 1.5) -> 1.5 / 1.0: bf16 at 0.67 of fp32
    assert r0["measured"] | {"cache": None} == {"choice": "amp_bf16", "fp32_s": 1.5, "amp_bf16_s": 1.0,
                                                 "source": "measured", "measured": 1, "cache": None}
    assert r1["measured"]["measured"] == 1
    assert r0["measured"]["cache"] == {"m": {"key": {"precision": "amp_bf16", "fp32_s": 1.5, "amp_bf16_s": 1.0}}}
    # cached: rank 0's entry (2.0 / 1.0, amp_bf16), and nobody measured
    assert r0["cached"]["measured"] == r1["cached"]["measured"] == 0
    assert (r1["cached"]["choice"], r1["cached"]["fp32_s"], r1["cached"]["amp_bf16_s"], r1["cached"]["source"]) \
        == ("amp_bf16", 2.0, 1.0, "cached")
    # another shape's entry is not this one's: measured, and added beside it
    assert r0["other_key"]["measured"] == r1["other_key"]["measured"] == 1 and r0["other_key"]["source"] == "measured"
    assert set(r0["other_key"]["cache"]["m"]) == {"another-key", "key"}
