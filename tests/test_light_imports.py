"""Reading and checking a run config imports no torch, Ray, MLflow, DeepSpeed or matplotlib (issue #53):
``jobs.submit`` and ``jobs.run --help`` answer in a fraction of a second, and a bad config is refused as fast.

Each check runs in a fresh interpreter, since this one has imported everything already. A dry run
(``jobs.run --dry-run``: the stage table and the train stage's plan) imports none of them either, once the
machine's CPU speed is kept (`pipeline.plan.hardware.kept_cpu_flops`: a machine's first plan times a matmul
with torch); building, exporting or running a model needs torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "mlflow", "ray", "deepspeed", "matplotlib")

LOAD_AND_CHECK = f"""
import json, sys
from pipeline.config import load_config
from models import PRESETS, get_preset
from models.accounting import param_counts, flops_per_token
from models.families import FAMILIES, family
import pipeline.plan.report, pipeline.sweep.spec

cfg = load_config("configs/smoke.yaml", ["model.preset=debug_moe"])
for name in PRESETS:  # every family and attention kind checked, and counted, without its nn.Module
    param_counts(get_preset(name)), flops_per_token(get_preset(name), 64)
try:  # a rule of the family table, which models.config learns when the table is imported
    load_config("configs/smoke.yaml", ["model.ssm_state_size=32"])
except Exception as e:
    refused = f"{{type(e).__name__}}: {{e}}"
print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules], "refused": refused,
                  "families": sorted(FAMILIES), "arch": family(cfg.model_config()).arch}}))
"""


def run_python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def imported(*args: str) -> set[str]:
    """Every module ``python -X importtime ARGS`` imported (read from its import-time report)."""
    out = run_python("-X", "importtime", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}


def test_a_config_loads_checks_and_is_counted_without_torch():
    out = run_python("-c", LOAD_AND_CHECK)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["heavy"] == []
    assert result["refused"].startswith("ConfigError: model: ssm_state_size is an option of arch 'mamba'")
    assert len(result["families"]) >= 5 and result["arch"] == "decoder"


def test_the_job_commands_parse_their_arguments_without_torch_ray_or_mlflow():
    for command in ("jobs.submit", "jobs.run"):
        modules = imported("-m", command, "--help")
        assert "pipeline.config" in modules, command  # its imports ran: the report is of the command itself
        heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
        assert heavy == [], f"{command} --help imports {heavy[:5]}"
        assert not {"pipeline.runner", "pipeline.stages"} & modules, command


def test_a_dry_run_imports_no_torch_ray_or_mlflow_once_the_cpu_is_measured(tmp_path):
    from pipeline.plan.hardware import CPU_FLOPS_FILE, cpu_model

    (tmp_path / "conduit").mkdir()
    (tmp_path / "conduit" / CPU_FLOPS_FILE).write_text(json.dumps({cpu_model(): 3.0e11}))
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "jobs.run", "configs/smoke.yaml", "--dry-run",
                          f"run.workdir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert {"pipeline.stage_plan", "pipeline.plan.report"} <= modules  # it planned the stages and the training
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == [], f"jobs.run --dry-run imports {heavy[:5]}"
    assert "train      " in out.stdout and "and 0.3 TFLOP/s peak per device" in out.stdout  # the kept figure


def test_what_a_train_stage_hands_its_controller_and_workers_unpickles_without_mlflow_or_torch(tmp_path):
    """Ray Train's controller and every worker unpickle the train function and the run's tracker (the failure
    callback's, the loop config's): neither brings MLflow or torch with it, nor does the train stage's own module
    (a stage task imports just it), nor the launch, nor reading the training's checkpoint record. Only a call on
    the tracker imports MLflow (pipeline.tracking)."""
    import pickle

    from pipeline.stage_tracker import StageTracker
    from pipeline.training.launch import train_worker

    payload = pickle.dumps((train_worker, StageTracker("sqlite:////nowhere/mlflow.db", "run0")))
    code = f"""
import json, pickle, sys
import pipeline.stages.train, pipeline.training.launch
from pipeline.config import load_config
from pipeline.training.checkpoint.record import CheckpointRecord
fn, tracker = pickle.loads({payload!r})
cfg = load_config("configs/smoke.yaml", ["run.workdir={tmp_path}"])
assert CheckpointRecord(pipeline.stages.train.checkpoint_place(cfg, "0123456789abcdef")).entries == []
print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules], "fn": fn.__module__, "run": tracker.run_id}}))
"""
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"heavy": [], "fn": "pipeline.training.launch", "run": "run0"}


def test_the_lazy_names_of_models_resolve_to_the_modules_that_define_them():
    import models
    from models.families.decoder.model import Transformer
    from models.layers.attention import KVCache
    from models.layers.base import ModelOutput

    assert (models.Transformer, models.KVCache, models.ModelOutput) == (Transformer, KVCache, ModelOutput)
    assert all(getattr(models, name) is not None for name in models.__all__)
    with pytest.raises(AttributeError, match="NotAName"):
        models.NotAName


BUILD_WITHOUT_DYNAMO = """
import hashlib, json, sys
import torch
import models.layers.base
from models import PRESETS, build_model


class RunInitialisers(torch.overrides.TorchFunctionMode):  # the constructors' initialisers run on meta
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


if sys.argv[1] == "run":
    models.layers.base.SkipInitOnMeta = RunInitialisers
# every family; the MoE preset last: its experts wrap their grouped matmul in torch.compiler.disable when
# built (before any compile of the model), which imports dynamo
debug = sorted((name for name in PRESETS if name.startswith("debug")), key=lambda name: name == "debug_moe")
weights = {}
for name in debug:
    if name == "debug_moe":
        dynamo = "torch._dynamo" in sys.modules
    torch.manual_seed(0)
    for key, value in build_model(name).state_dict().items():
        weights[f"{name}.{key}"] = hashlib.sha256(value.detach().contiguous().view(-1).view(torch.uint8)
                                                  .numpy().tobytes()).hexdigest()
print(json.dumps({"families": len(debug), "dynamo_before_moe": dynamo, "weights": weights}))
"""


def test_a_model_is_built_without_importing_dynamo_and_to_the_same_weights():
    """Building on the meta device skips the constructors' initialisers there (`SkipInitOnMeta`): on meta
    tensors they would import torch._dynamo (about a CPU-second in each process that builds a model: an
    evaluation, an export, a server; a training worker's torch optimizer imports it anyway). The weights,
    all set by init_weights after to_empty, are bit for bit those of a build that runs them."""
    results = {}
    for mode in ("skip", "run"):
        out = run_python("-c", BUILD_WITHOUT_DYNAMO, mode)
        assert out.returncode == 0, out.stderr[-2000:]
        results[mode] = json.loads(out.stdout.splitlines()[-1])
    skip, run = results["skip"], results["run"]
    assert skip["families"] == 6 and len(skip["weights"]) > 100
    assert skip["weights"] == run["weights"]
    assert (skip["dynamo_before_moe"], run["dynamo_before_moe"]) == (False, True)


def test_the_driver_places_each_stage_without_importing_torch():
    """The driver computes where each stage's task goes (its resources) while its status and log threads run;
    importing torch there crashed a Ray job's driver with a segfault as the evaluate stage started (its
    device module imported torch at its top). None of it imports torch now."""
    code = f"""
import json, sys
from pipeline.config import load_config
from pipeline.stages import evaluate, train
cfg = load_config("configs/smoke.yaml")
placed = [evaluate.resources_on(cfg, 0).cpus, train.resources_on(cfg, "cpu", free_by_node=lambda: [4.0]).cpus]
print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules], "placed": placed}}))
"""
    out = run_python("-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"heavy": [], "placed": [1, 0]}
