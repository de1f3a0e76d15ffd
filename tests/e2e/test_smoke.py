"""The whole pipeline on configs/smoke.yaml: real Ray, real DeepSpeed workers, a real MLflow store.

The pipeline runs once per session, as a person runs it: ``python -m jobs.run`` on a terminal (a
pseudo-terminal), on the session's Ray cluster (the ``smoke`` fixture of tests/smoke_run.py, whose
data stages other tests reuse). Its terminal output is checked for what a person reads, and the
artifacts, MLflow runs and registered model it left for everything else. Then configs/smoke_moe.yaml
(a DeepSeek-V3-like MoE with expert parallelism) runs beside it, in-process, reusing its data stages; its training
metrics are checked where users read them, in MLflow.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from models.accounting import flops_per_token
from pipeline import tracking
from pipeline.config import load_config
from pipeline.compat import STATE_API_NOISE
from pipeline.runner import ORDER, PipelineResult, run_pipeline

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MAX_TERMINAL_LINES = 40
WARNING_MARKS = ("Warning:", "warnings.warn", "Traceback")
WORKER_LINE = re.compile(r"\(\S+ pid=\d+\)")  # Ray's prefix of a forwarded worker line


def assert_readable(lines: list[str]) -> Path:
    """A run's terminal output a person can read; returns the log file it names first and last."""
    assert len(lines) <= MAX_TERMINAL_LINES, "\n".join(lines)
    assert not [ln for ln in lines if any(m in ln for m in WARNING_MARKS)], "\n".join(lines)
    assert not [ln for ln in lines if WORKER_LINE.search(ln)], "\n".join(lines)
    first = re.search(r"the full log is in (\S+)$", lines[0])
    assert first and lines[-1] == f"The full log: {first.group(1)}", "\n".join(lines)
    log = Path(first.group(1))
    logged = log.read_text(encoding="utf-8").splitlines()
    stage_lines = [ln for ln in lines if re.match(r"\w+: (running|done|cached)", ln)]
    assert stage_lines and all(ln in logged for ln in stage_lines)
    assert any(WORKER_LINE.search(ln) for ln in logged), "the log lacks the workers' lines"
    return log


def test_all_six_stages_ran_in_order(smoke):
    _, result, lines, _ = smoke
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ORDER
    assert [ln.split(":")[0] for ln in lines if ": done" in ln] == ORDER
    for name in ORDER:
        art = result.artifacts[name]
        assert (art.path / "manifest.json").is_file()
        assert art.path.parent.name == name and art.path.name == art.hash


def test_the_terminal_shows_stages_live_progress_and_a_summary_and_the_log_the_rest(smoke):
    cfg, result, lines, raw = smoke
    log = assert_readable(lines)
    assert log.parent == cfg.workdir() / "logs"
    logged = log.read_text(encoding="utf-8")
    assert "(RayTrainWorker pid=" in logged and "Started a local Ray instance" not in logged  # the session's Ray
    assert STATE_API_NOISE not in logged  # a line per second of training without pipeline.compat' filter
    # The live status, redrawn in place: training's step and loss from rank 0's MLflow metrics.
    statuses = [s for s in raw.split("\r\x1b[K") if s.startswith("train: ")]
    assert any(re.search(rf"step \d+/{cfg.train.steps}, loss \d", s) for s in statuses), statuses[-5:]
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines if ln.split() and ln.split()[0] in ORDER and ":" not in ln}
    assert sorted(rows) == sorted(ORDER) and all(r[0] == "ran" for r in rows.values()), rows
    assert rows["register"][-2:] == ["version", "1"]
    assert f"final loss {result.artifacts['train'].manifest['counts']['final_loss']:.3f}" in " ".join(rows["train"])
    assert "Registered model: models:/conduit-smoke@challenger (version 1)" in lines
    assert any(ln.startswith("Open the MLflow UI:  mlflow ui --backend-store-uri sqlite:") for ln in lines)


def test_training_loss_went_down(smoke):
    _, result, _, _ = smoke
    counts = result.artifacts["train"].manifest["counts"]
    assert counts["final_loss"] < counts["first_loss"] - 0.5, counts
    metrics = result.artifacts["evaluate"].manifest["counts"]
    # Clearly better than the unigram floor on held-out text, not just "trained a bit".
    assert metrics["val_bits_per_byte"] < 0.85 * metrics["unigram_bits_per_byte"], metrics


def test_precision_auto_timed_both_precisions_on_the_workers_and_cached_its_choice(smoke):
    """smoke.yaml leaves train.precision at auto: on a CPU the two workers timed its micro-steps in fp32
    and in bf16 autocast, chose by the rule, tagged the run with the times, recorded the choice beside the
    weights and in the stage's summary, and cached it for this machine and shape."""
    from pipeline.store.contracts import read_train_precision
    from pipeline.training import compile_choice as cc
    from pipeline.training import precision_choice as pc
    from pipeline.training.engine import local_threads

    cfg, result, _, _ = smoke
    assert cfg.train.precision == "auto" and cfg.parallel.device in ("auto", "cpu")
    train = result.artifacts["train"]
    record = read_train_precision(train.path)
    auto = record["auto"]
    fp32_s = float(auto["precision.auto.fp32_micro_step_s"])
    bf16_s = float(auto["precision.auto.amp_bf16_micro_step_s"])
    assert fp32_s > 0 and bf16_s > 0
    assert record["precision"] == auto["precision"] == pc.choose(fp32_s, bf16_s) == train.manifest["counts"]["precision"]
    assert auto["precision.auto"] in ("measured", "cached") and auto["precision.auto.machine"] == pc.machine_id()
    tags = tracking.client(result.tracking_uri).get_run(train_run_id(result)).data.tags
    assert {k: tags[k] for k in auto} == auto
    # compile auto: first the bound, from the eager micro-step the precision choice timed
    assert cfg.train.compile == "auto"
    eager = float(auto[f"precision.auto.{record['precision']}_micro_step_s"])
    micro_steps = cfg.train.global_batch_size // (cfg.train.micro_batch_size_per_rank * cfg.parallel.num_workers)
    if not cc.worth_measuring(eager, micro_steps, cfg.train.steps):
        # as on an idle machine: 150 steps of smoke's model cannot repay compiling even at half the step saved
        assert record["compile"] is False and auto["compile.auto"] == "bound"
        assert float(auto["compile.auto.eager_micro_step_s"]) == eager
    else:  # a loaded machine timed a step long enough to pass the bound: the measured times decide
        assert auto["compile.auto"] in ("measured", "cached")
        on, _ = cc.pays(*(float(auto[f"compile.auto.{k}"]) for k in ("eager_micro_step_s", "compiled_micro_step_s",
                                                                      "compile_s")), micro_steps, cfg.train.steps)
        assert record["compile"] is on
    p = cfg.parallel
    key = pc.shape_key(cfg.model_config().to_dict(), cfg.train.micro_batch_size_per_rank, cfg.tokenize.seq_len,
                       local_threads(p.num_workers, p.threads_per_worker), p.num_workers, p.num_workers,
                       cfg.train.compile)
    cached = pc.read_cached(pc.machine_id(), key)
    assert cached is not None and cached.precision == record["precision"], (cached, record)


def test_a_forced_precision_is_trained_in_without_timing_anything(smoke):
    """train.precision=amp_bf16 given: the workers train in it, time no fp32 and cache nothing. The MoE
    smoke model (MLA, DeepSeek-V3's router, experts split over the 2 workers): the expert outputs come
    back in bf16 under autocast and are combined into the fp32 tokens (this failed before auto chose bf16)."""
    import math

    from pipeline.store.contracts import read_train_metrics, read_train_precision
    from pipeline.training import precision_choice as pc

    dense_cfg, _, _, _ = smoke
    cache = pc.cache_path()
    before = cache.read_bytes() if cache.exists() else None
    cfg = load_config(ROOT / "configs" / "smoke_moe.yaml", [f"run.workdir={dense_cfg.run.workdir}", "train.steps=5",
                                                        "train.precision=amp_bf16", "validation.every=0",
                                                        "optimizer.warmup_steps=1"])
    result = run_pipeline(cfg, until="train", echo=lambda line: None)
    train = result.artifacts["train"]
    record = read_train_precision(train.path)
    assert record["precision"] == "amp_bf16" and record["compile"] is False
    assert not any(k.startswith("precision.auto") for k in record["auto"])
    assert record["auto"]["compile.auto"] == "bound"  # 5 steps: compile auto stays off, nothing compiled
    assert train.manifest["counts"]["precision"] == "amp_bf16"
    tags = tracking.client(result.tracking_uri).get_run(train_run_id(result)).data.tags
    assert tags["precision"] == "amp_bf16" and not any(k.startswith("precision.auto") for k in tags)
    assert (cache.read_bytes() if cache.exists() else None) == before
    assert cfg.parallel.ep_size == 2 and cfg.model_config().num_experts
    losses = read_train_metrics(train.path)
    assert len(losses) == 5 and all(math.isfinite(h["loss"]) for h in losses)


def test_validation_during_training_is_logged_and_equals_one_process_on_the_final_weights(smoke):
    """smoke.yaml validates every validation.every steps on 2 workers; at the last step the weights are
    the registered ones, so one process here must get the loss the two ranks reduced (in fp32: what
    precision auto chooses for smoke's model, whose bf16 micro-step is about 1.5x slower than fp32's,
    benchmarks/precision_auto.py)."""
    import torch

    from models.export import load_safetensors
    from pipeline.data.token_blocks import TokenBlocks
    from pipeline.store.contracts import WEIGHTS_FILE
    from pipeline.training.layout import ParallelDims
    from pipeline.training.validation import validation_loss

    from pipeline.store.contracts import read_train_precision

    cfg, result, _, _ = smoke
    t, va = cfg.train, cfg.validation
    assert va.every and cfg.parallel.num_workers == 2
    assert read_train_precision(result.artifacts["train"].path)["precision"] == "fp32"
    c = tracking.client(result.tracking_uri)
    train_run = result.artifacts["train"]
    (run,) = c.search_runs([c.get_run(result.run_id).info.experiment_id],
                           f"tags.`conduit.stage` = 'train' and tags.mlflow.parentRunId = '{result.run_id}'")
    logged = {int(m.step): m.value for m in c.get_metric_history(run.info.run_id, "val_loss")}
    assert sorted(logged) == list(range(va.every, t.steps + 1, va.every))
    assert {int(k): v for k, v in train_run.manifest["counts"]["val_losses"].items()} == logged
    model = load_safetensors(str(train_run.path / WEIGHTS_FILE))
    blocks = TokenBlocks.of(result.artifacts["tokenize"].path, "validation")
    dims = ParallelDims(1, 1, t.global_batch_size, t.micro_batch_size_per_rank, cfg.tokenize.seq_len)
    one = validation_loss(model, blocks, dims, 0, va.batches, torch.device("cpu"), all_reduce=None)
    assert one == pytest.approx(logged[t.steps], rel=1e-5)


def test_mlflow_holds_parent_nested_runs_and_metrics(smoke):
    cfg, result, _, _ = smoke
    c = tracking.client(result.tracking_uri)
    parent = c.get_run(result.run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.params["train.steps"] == str(cfg.train.steps)
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}'")
    by_stage = {r.data.tags["conduit.stage"]: r for r in children}
    assert sorted(by_stage) == sorted(ORDER)
    for name, run in by_stage.items():
        assert run.data.tags["conduit.hash"] == result.artifacts[name].hash
        assert parent.data.tags[f"conduit.artifact.{name}"] == result.artifacts[name].hash
    assert by_stage["train"].data.tags["conduit.input.tokenize"] == result.artifacts["tokenize"].hash
    losses = c.get_metric_history(by_stage["train"].info.run_id, "loss")
    assert [m.step for m in losses] == list(range(cfg.train.log_every, cfg.train.steps + 1, cfg.train.log_every))
    assert "val_perplexity" in by_stage["evaluate"].data.metrics
    # MLflow's system metrics of the training node, sampled every second over the run, and the experiment
    # marked as a model-training one (MLflow 3's UI opens it with runs and charts, not as GenAI).
    cpu = c.get_metric_history(by_stage["train"].info.run_id, "system/cpu_utilization_percentage")
    # (a curve: two samples at least, as many as the run lasted; on a fast machine the smoke steps take ~4 s, which
    # at the 2 s the config once asked gave a single sample in one CI run)
    assert len(cpu) >= 2 and all(0 <= m.value <= 100 for m in cpu) and max(m.value for m in cpu) > 0, cpu
    assert all(b.timestamp - a.timestamp >= 750 for a, b in zip(cpu, cpu[1:])), cpu  # every second, not faster
    assert c.get_run(by_stage["train"].info.run_id).data.metrics["system/system_memory_usage_megabytes"] > 0
    assert c.get_experiment(parent.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # The progress metrics the driver's status line reads: evaluate's sets, tokenize's documents.
    scored = [m.value for m in c.get_metric_history(by_stage["evaluate"].info.run_id, "sets_scored")]
    assert len(scored) >= 2 and sorted(scored) == list(range(1, len(scored) + 1)), scored
    splits = result.artifacts["tokenize"].manifest["counts"]["splits"]
    assert by_stage["tokenize"].data.metrics["documents_tokenized"] == sum(s["documents"] for s in splits.values())
    # The train run's Datasets: the token artifact it read, with its counts (mlflow.log_input).
    (dataset,) = c.get_run(by_stage["train"].info.run_id).inputs.dataset_inputs
    tokens = result.artifacts["tokenize"]
    assert dataset.dataset.digest == tokens.hash and dataset.tags[0].value == "training"
    profile = json.loads(dataset.dataset.profile)
    assert profile["source_paths"] == cfg.data.train_paths
    assert profile["documents"]["train"] == tokens.manifest["counts"]["splits"]["train"]["documents"] > 0


def test_evaluate_scores_the_held_out_text_by_context_length(smoke):
    """smoke.yaml's eval.context_lengths [32, 64, 128] (trained at 64): the stage's window of 64 gives its
    held-out bits per byte again; the trained model's loss falls with the context a token has; the
    picture is in MLflow."""
    cfg, result, _, _ = smoke
    metrics = result.artifacts["evaluate"].manifest["counts"]
    assert metrics["context_bits_per_byte_64"] == pytest.approx(metrics["heldout_bits_per_byte"], rel=1e-9)
    assert {f"context_bits_per_byte_{L}" for L in (32, 128)} <= set(metrics)
    assert metrics["kv_cache_bytes_128"] == 2 * metrics["kv_cache_bytes_64"] > 0
    assert metrics["context_loss_pos_0_1"] > metrics["context_loss_pos_32_64"]  # context helps a trained model
    c = tracking.client(result.tracking_uri)
    parent = c.get_run(result.run_id)
    runs = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}'")
    (run,) = [r for r in runs if r.data.tags["conduit.stage"] == "evaluate"]
    assert "plots/context_length.png" in [a.path for a in c.list_artifacts(run.info.run_id, "plots")]


def test_registered_model_generates_text(smoke):
    cfg, result, _, _ = smoke
    c = tracking.client(result.tracking_uri)
    mv = c.get_model_version_by_alias(cfg.register.model_name, "challenger")
    assert mv.tags["conduit.train_hash"] == result.artifacts["train"].hash
    model = tracking.load_registered_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger")
    out = model.predict(pd.DataFrame({"prompt": ["Once upon a time", "KING:"]}), params={"max_new_tokens": 12, "temperature": 0.0})
    texts = out["text"].tolist()
    assert len(texts) == 2 and all(isinstance(t, str) and t.strip() for t in texts), texts


def test_lm_eval_scores_the_registered_hf_export_as_the_evaluate_stage(smoke, tmp_path):
    """lm-evaluation-harness on the registered version's hf/ folder, over the evaluate stage's own
    held-out text (multi-line Gutenberg prefixes, with blank lines) and window: the same bits per byte.

    lm-eval's rolling windows equal the stage's (``prefix_token_id`` = EOS, documents start after one;
    disjoint windows of ``max_length`` = ``tokenize.seq_len``), except that lm-eval gives each document's
    last, partial window the full context before it: hence 1%, not exact. A tokenizer that differs from
    training's (the Llama conversion put a ``▁`` after every blank line) is 10% off on such text.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    from pipeline.evaluation.lm_eval_task import write_rolling_task
    from pipeline.evaluation.text_metrics import encode_prefix, resolve_files
    from pipeline.store.contracts import HF_DIR, TOKENIZER_FILE
    from pipeline.tokenization.spm import EOS_ID, load_sentencepiece

    cfg, result, _, _ = smoke
    metrics = result.artifacts["evaluate"].manifest["counts"]
    sp = load_sentencepiece(str(result.artifacts["tokenizer"].path / TOKENIZER_FILE))
    files = resolve_files(cfg.data_root(), cfg.eval.heldout_paths, "eval.heldout_paths")
    per_file = cfg.eval.max_text_tokens // len(files)
    texts = [encode_prefix(sp, f.read_text(encoding="utf-8"), per_file)[1] for f in files]
    assert sum(len(t.encode("utf-8")) for t in texts) == metrics["heldout_bytes"]  # the stage's text, exactly
    assert all("\n\n" in t for t in texts)
    local = tracking.download_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger", tmp_path)
    write_rolling_task(tmp_path / "tasks", "conduit_heldout", texts)
    out = lm_eval.simple_evaluate(
        model="hf", model_args={"pretrained": str(local / "artifacts" / HF_DIR), "dtype": "float32",
                                "max_length": cfg.tokenize.seq_len, "prefix_token_id": EOS_ID},
        tasks=["conduit_heldout"], task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
        batch_size=cfg.eval.batch_size, device="cpu")
    bits_per_byte = out["results"]["conduit_heldout"]["bits_per_byte,none"]
    assert bits_per_byte == pytest.approx(metrics["heldout_bits_per_byte"], rel=0.01)


def test_rerun_skips_every_stage_and_force_reruns_downstream(smoke, ray_cluster):
    ray = ray_cluster
    cfg, first, _, _ = smoke
    lines: list[str] = []
    again = run_pipeline(cfg, echo=lines.append)
    assert lines == [f"{n}: cached ({first.artifacts[n].hash})" for n in ORDER]
    assert {n: a.hash for n, a in again.artifacts.items()} == {n: a.hash for n, a in first.artifacts.items()}

    # From the command line, its output a pipe (as in `ray job submit`'s log): evaluate and register rerun.
    forced = subprocess.run([sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={cfg.run.workdir}",
                             "--force", "evaluate"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address})
    assert forced.returncode == 0 and forced.stderr == "", forced.stderr
    lines = forced.stdout.splitlines()
    assert "\r" not in forced.stdout  # no status redrawn in place: plain lines
    log = assert_readable(lines)
    assert "(conduit.register pid=" in log.read_text(encoding="utf-8")
    assert [ln.split(":")[0] for ln in lines if ": cached" in ln] == ["shard", "tokenizer", "tokenize", "train"]
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["evaluate", "register"]
    assert "Registered model: models:/conduit-smoke@challenger (version 2)" in lines


def test_cli_dry_run_and_only(smoke):
    cfg, first, _, _ = smoke
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={cfg.run.workdir}"]
    out = subprocess.run(cmd + ["--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ORDER:
        assert f"{name:<10} {first.artifacts[name].hash:<17} cached" in out.stdout
    forced = subprocess.run(cmd + ["--dry-run", "--only", "evaluate", "--force", "evaluate"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    rows = {ln.split()[0]: ln.split()[2] for ln in forced.stdout.split("\n\n")[0].splitlines()[1:]}
    assert rows == {"shard": "cached", "tokenizer": "cached", "tokenize": "cached", "train": "cached",
                    "evaluate": "run", "register": "cached"}


def test_dense_mfu_is_the_accounting_formula_over_the_logged_tokens_per_s_and_peak(smoke):
    """MFU as MLflow holds it, every logged step: tokens_per_s x models.accounting's FLOPs per token
    over the cluster's peak (the run's tags), and a fraction of that peak."""
    cfg, result, _, _ = smoke
    check_mfu(cfg, result)


def check_mfu(cfg, result) -> None:
    c = tracking.client(result.tracking_uri)
    run = c.get_run(train_run_id(result))
    flops = flops_per_token(cfg.model_config(), cfg.tokenize.seq_len)["total"]
    assert run.data.tags["mfu.flops_per_token"] == str(flops)
    peak = float(run.data.tags["mfu.peak_flops"])
    steps = list(range(cfg.train.log_every, cfg.train.steps + 1, cfg.train.log_every))
    mfu, tps = (metric_by_step(c, run.info.run_id, name) for name in ("mfu", "tokens_per_s"))
    assert sorted(mfu) == sorted(tps) == steps
    for step in steps:
        assert 0 < mfu[step] < 1, (step, mfu[step])
        assert mfu[step] == tps[step] * flops / peak, (step, mfu[step], tps[step], flops, peak)


def train_run_id(result: PipelineResult) -> str:
    c = tracking.client(result.tracking_uri)
    parent = c.get_run(result.run_id)
    (train,) = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}' "
                                                          "and tags.conduit.stage = 'train'")
    return train.info.run_id


def metric_by_step(c, run_id: str, name: str) -> dict[int, float]:
    history = c.get_metric_history(run_id, name)
    by_step = {m.step: m.value for m in history}
    assert len(by_step) == len(history), f"{name} logged twice at one step"
    return by_step


@pytest.fixture(scope="module")
def smoke_moe(smoke):
    """configs/smoke_moe.yaml on the session's Ray, in the smoke run's workdir: its data stages are the
    same as smoke.yaml's and are reused from that run; train (2 workers, ep_size 2), evaluate and
    register run for the MoE model. In fp32: the router is replayed here in fp32 and must count exactly what
    the workers counted, and precision auto's timing of this tiny model lies near its margin (a loaded CI
    machine once chose amp_bf16 for it)."""
    dense_cfg, dense, _, _ = smoke
    cfg = load_config(ROOT / "configs" / "smoke_moe.yaml", [f"run.workdir={dense_cfg.run.workdir}",
                                                        "train.precision=fp32"])
    lines: list[str] = []
    result = run_pipeline(cfg, echo=lines.append)
    return cfg, result, lines, dense


def test_moe_pipeline_walks_all_six_stages(smoke_moe):
    cfg, result, lines, dense = smoke_moe
    data_stages = ["shard", "tokenizer", "tokenize"]
    assert [ln for ln in lines if ": cached" in ln] == [f"{n}: cached ({dense.artifacts[n].hash})" for n in data_stages]
    assert [ln.split(":")[0] for ln in lines if ": done" in ln] == ["train", "evaluate", "register"]
    assert sorted(result.artifacts) == sorted(ORDER)
    train = result.artifacts["train"]
    assert train.manifest["run_config"]["parallel"]["ep_size"] == 2 and cfg.model_config().num_experts == 8
    assert train.manifest["counts"]["final_loss"] < train.manifest["counts"]["first_loss"]


def test_moe_registered_model_loads_and_generates(smoke_moe):
    cfg, result, _, _ = smoke_moe
    c = tracking.client(result.tracking_uri)
    mv = c.get_model_version_by_alias(cfg.register.model_name, "challenger")
    assert mv.tags["conduit.train_hash"] == result.artifacts["train"].hash
    model = tracking.load_registered_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger")
    out = model.predict(pd.DataFrame({"prompt": ["Once upon a time"]}),
                        params={"max_new_tokens": 6, "temperature": 0.0})
    (text,) = out["text"].tolist()
    assert isinstance(text, str) and text.strip(), text


def test_moe_registered_hf_folder_is_deepseek_v3_with_our_logits(smoke_moe, tmp_path):
    """The V3 twin's registered version ships a DeepseekV3ForCausalLM whose logits are the trained model's,
    with the selection biases the balancing left at the last step (as training logged them)."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    from models.export import load_safetensors
    from pipeline.store.contracts import HF_DIR, WEIGHTS_FILE

    cfg, result, _, _ = smoke_moe
    c = tracking.client(result.tracking_uri)
    mv = c.get_model_version_by_alias(cfg.register.model_name, "challenger")
    assert mv.tags["conduit.hf_export"] == f"artifacts/{HF_DIR}"
    local = tracking.download_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger", tmp_path)
    hf = DeepseekV3ForCausalLM.from_pretrained(local / "artifacts" / HF_DIR, dtype=torch.float32).eval()
    model = load_safetensors(result.artifacts["train"].path / WEIGHTS_FILE).eval()
    biases = [b.ffn.score_bias for b in model.layers]
    run_id, last = train_run_id(result), cfg.train.steps
    for i, bias in enumerate(biases):
        assert bias.min().item() == metric_by_step(c, run_id, f"score_bias_min/l{i}")[last]
        assert bias.max().item() == metric_by_step(c, run_id, f"score_bias_max/l{i}")[last]
    assert any(bias.abs().max() > 0 for bias in biases)  # six steps of balancing moved them
    for layer, bias in zip(hf.model.layers, biases, strict=True):
        torch.testing.assert_close(layer.mlp.gate.e_score_correction_bias, bias, atol=0, rtol=0)
    x = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)


def test_moe_evaluation_has_the_expert_load_plot_and_routing_metrics(smoke_moe):
    cfg, result, _, _ = smoke_moe
    c = tracking.client(result.tracking_uri)
    parent = c.get_run(result.run_id)
    (run,) = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.run_id}' "
                                                        "and tags.conduit.stage = 'evaluate'")
    assert "plots/expert_load.png" in [a.path for a in c.list_artifacts(run.info.run_id, "plots")]
    layers = cfg.model_config().n_layers
    routing = ["router_entropy", "router_entropy_normalized", *(f"router_entropy_layer{i}" for i in range(layers)),
               *(f"expert_load_max_over_uniform_layer{i}" for i in range(layers))]
    metrics = result.artifacts["evaluate"].manifest["counts"]
    for name in routing:
        assert run.data.metrics[name] == metrics[name], name
    assert 0 < metrics["router_entropy_normalized"] <= 1
    E = cfg.model_config().num_experts
    assert all(1 <= metrics[f"expert_load_max_over_uniform_layer{i}"] <= E for i in range(layers))
    # The evaluated weights hold the biases training ended with (its last logged range).
    run_id, last = train_run_id(result), cfg.train.steps
    for i in range(layers):
        assert metrics[f"score_bias_range_layer{i}"] == pytest.approx(
            metric_by_step(c, run_id, f"score_bias_range/l{i}")[last], abs=1e-7)


def test_moe_training_metrics_in_mlflow_every_step(smoke_moe):
    """The train run holds, at every step: mfu (the accounting formula), tokens/s, the load-balancing
    (aux) and z losses, and per layer each expert's token count summed over both ranks.

    The counts are checked against the router itself: at step 1 every rank still has the initial
    weights (the seed's), so the same model, built here, routes the step's micro-batches of both
    ranks (the run's loader, the workers' micro-batch shapes and thread count) and must count
    exactly what MLflow holds: a rank's counts left out of the sum, a micro-batch missed or counted
    twice, or a window that is not one step would all show here. At every step each layer's
    counts add up to the global batch's tokens x top_k (dropless: every slot is kept), and the
    logged shares are those counts over that total.
    """
    from pipeline.store.contracts import read_train_precision

    cfg, result, _, _ = smoke_moe
    check_mfu(cfg, result)
    # the router here runs in fp32, as the workers did (the fixture sets it)
    assert read_train_precision(result.artifacts["train"].path)["precision"] == "fp32"
    c = tracking.client(result.tracking_uri)
    run_id = train_run_id(result)
    steps = list(range(1, cfg.train.steps + 1))
    model_cfg = cfg.model_config()
    E, layers = model_cfg.num_experts, model_cfg.n_layers
    logged = {}
    for name in ("tokens_per_s", "moe_load_balance_loss", "moe_z_loss"):
        logged[name] = metric_by_step(c, run_id, name)
        assert sorted(logged[name]) == steps and all(v > 0 for v in logged[name].values()), (name, logged[name])
    counts = {(i, j): metric_by_step(c, run_id, f"expert_tokens/l{i}/e{j}") for i in range(layers) for j in range(E)}
    shares = {(i, j): metric_by_step(c, run_id, f"expert_load/l{i}/e{j}") for i in range(layers) for j in range(E)}
    slots = cfg.train.global_batch_size * cfg.tokenize.seq_len * model_cfg.moe_top_k
    for step in steps:
        for i in range(layers):
            layer = [counts[i, j][step] for j in range(E)]
            assert sum(layer) == slots and all(v == int(v) for v in layer), (step, i, layer)
            assert [shares[i, j][step] for j in range(E)] == [v / slots for v in layer], (step, i)
    routed, losses = router_at_first_step(cfg, result.artifacts["tokenize"].path)
    assert [[counts[i, j][1] for j in range(E)] for i in range(layers)] == routed
    # The aux-loss-free paper's max violation per layer at every step, from the logged counts; and the
    # selection bias after step 1's update: rate * sign(mean load - load) of those same counts.
    rate = model_cfg.moe_bias_update_rate
    for i in range(layers):
        violation = metric_by_step(c, run_id, f"max_violation/l{i}")
        for step in steps:
            layer = [counts[i, j][step] for j in range(E)]
            assert violation[step] == pytest.approx(max(layer) / (sum(layer) / E) - 1, rel=1e-12), (step, i)
        first = [rate * ((sum(routed[i]) / E > n) - (sum(routed[i]) / E < n)) for n in routed[i]]
        assert metric_by_step(c, run_id, f"score_bias_min/l{i}")[1] == pytest.approx(min(first), abs=1e-9)
        assert metric_by_step(c, run_id, f"score_bias_max/l{i}")[1] == pytest.approx(max(first), abs=1e-9)
        ranges = metric_by_step(c, run_id, f"score_bias_range/l{i}")
        assert sorted(ranges) == steps and all(ranges[s] <= 2 * rate * s + 1e-9 for s in steps), ranges
    # The losses are float64 means of the same float32 values, summed in another order.
    for name, value in losses.items():
        assert logged[name][1] == pytest.approx(value, rel=1e-12, abs=0), name


def router_at_first_step(cfg, tokens_dir: Path) -> tuple[list[list[int]], dict[str, float]]:
    """Per layer, the tokens the initial model's router sends to each expert over step 1's
    micro-batches of every rank, as the training workers were given them; and the load-balancing
    and z losses of those forwards, each the mean over micro-batches and layers."""
    import torch

    from models import build_model
    from pipeline.data.token_blocks import TokenBlocks
    from pipeline.training.loader import BlockLoader
    from pipeline.training.engine import local_threads, seed_everything
    from pipeline.training.layout import ParallelDims

    t, p = cfg.train, cfg.parallel
    dims = ParallelDims(p.num_workers, p.ep_size, t.global_batch_size, t.micro_batch_size_per_rank,
                        cfg.tokenize.seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(local_threads(p.num_workers, p.threads_per_worker))  # as each worker computed
    try:
        seed_everything(cfg.run.seed)  # what build_engine does before it builds the model
        model = build_model(cfg.model_config())
        total, stats = None, []
        with torch.no_grad():
            for rank in range(p.num_workers):
                loader = BlockLoader(TokenBlocks.of(tokens_dir, "train"), dims, rank, seed=cfg.run.seed)
                for x_BT, _ in loader.next_step():
                    layers = model(x_BT).moe_stats
                    stats += layers
                    layer_counts = torch.stack([s["tokens_per_expert"] for s in layers])
                    total = layer_counts if total is None else total + layer_counts
    finally:
        torch.set_num_threads(threads)
    losses = {f"moe_{key}": sum(float(s[key]) for s in stats) / len(stats) for key in ("load_balance_loss", "z_loss")}
    return total.tolist(), losses


def test_a_context_extension_continues_the_registered_model_into_a_new_version(smoke, tmp_path):
    """configs/smoke_extend.yaml from the smoke run's registered version: the data stages it can reuse
    are reused, tokenize runs at 128, two workers train it splitting every sequence between them (sequence
    parallelism), training starts from that version's weights (its first loss is
    the parent's level, not a random model's), evaluate scores up to 256, and the new version names its
    parent and exports YaRN in its HF config."""
    import json

    from models.export import load_hf
    from pipeline.store.contracts import HF_DIR

    dense_cfg, dense, _, _ = smoke
    parent = tracking.version_by_alias(dense.tracking_uri, dense_cfg.register.model_name, "challenger")
    ref = f"models:/{dense_cfg.register.model_name}/{parent.version}"
    cfg = load_config(ROOT / "configs" / "smoke_extend.yaml",
                      [f"run.workdir={dense_cfg.run.workdir}", f"train.init_from={ref}"])
    result = run_pipeline(cfg, echo=lambda line: None)
    for stage in ("shard", "tokenizer"):
        assert result.artifacts[stage].hash == dense.artifacts[stage].hash  # reused
    assert result.artifacts["tokenize"].hash != dense.artifacts["tokenize"].hash
    train = result.artifacts["train"].manifest["counts"]
    assert train["init_from"]["conduit.init_from"] == ref
    assert train["init_from"]["conduit.init_from_train_hash"] == dense.artifacts["train"].hash
    parent_train = dense.artifacts["train"].manifest["counts"]
    assert train["first_loss"] < parent_train["first_loss"] - 1.0  # it started trained
    # ... from exactly the parent version's weights: rank 0's model before its first step, by digest,
    # against the weights the registry holds for that version (downloaded here, apart from the stage)
    import tempfile

    from models.export import load_safetensors
    from pipeline.store.contracts import INIT_DIGEST_TAG, WEIGHTS_FILE, state_digest

    with tempfile.TemporaryDirectory() as tmp:
        registered = load_safetensors(str(tracking.download_weights(dense.tracking_uri, ref, tmp))).state_dict()
    train_tags = tracking.client(result.tracking_uri).get_run(train_run_id(result)).data.tags
    assert train_tags["sequence_parallel_size"] == "2"  # the two workers split each sequence (the config's)
    started_from = train_tags[INIT_DIGEST_TAG]
    assert started_from == state_digest(registered)
    trained = load_safetensors(str(result.artifacts["train"].path / WEIGHTS_FILE)).state_dict()
    assert started_from != state_digest(trained)  # and then trained on
    metrics = result.artifacts["evaluate"].manifest["counts"]
    assert {f"context_bits_per_byte_{L}" for L in (64, 128, 256)} <= set(metrics)
    child = tracking.version_by_alias(result.tracking_uri, cfg.register.model_name, "challenger")
    assert child.tags["conduit.init_from"] == ref and child.tags["conduit.train_hash"] == result.artifacts["train"].hash
    hf_dir = tracking.download_model(result.tracking_uri, f"models:/{cfg.register.model_name}/{child.version}",
                                     tmp_path) / "artifacts" / HF_DIR
    rope = json.loads((hf_dir / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 64)
    assert load_hf(hf_dir).cfg.rope == cfg.model_config().rope
    # a finished train artifact by its hash gives the same weights and names itself
    import torch

    from pipeline.stages.train import parent_state

    by_hash = load_config(ROOT / "configs" / "smoke_extend.yaml",
                          [f"run.workdir={dense_cfg.run.workdir}", f"train.init_from=train:{dense.artifacts['train'].hash}"])
    state, tags = parent_state(by_hash, result.artifacts["tokenize"])
    registered, _ = parent_state(cfg, result.artifacts["tokenize"])
    assert state.keys() == registered.keys() and all(torch.equal(state[k], registered[k]) for k in state)
    assert tags == {"conduit.init_from": f"train:{dense.artifacts['train'].hash}",
                    "conduit.init_from_train_hash": dense.artifacts["train"].hash}
    # a version whose architecture differs is refused before any worker starts, naming the field
    wider = load_config(ROOT / "configs" / "smoke_extend.yaml",
                        [f"run.workdir={dense_cfg.run.workdir}", f"train.init_from={ref}", "model.d_model=96"])
    with pytest.raises(Exception, match=r"d_model: 64 -> 96"):
        run_pipeline(wider, echo=lambda line: None)
