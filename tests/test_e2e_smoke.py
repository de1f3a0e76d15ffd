"""The whole pipeline on configs/smoke.yaml: real Ray, real DeepSpeed workers, a real MLflow store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import ORDER, run_pipeline

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, ray_cluster):
    work = tmp_path_factory.mktemp("smoke")
    cfg = load_config(ROOT / "configs" / "smoke.yaml", [f"run.workdir={work}"])
    lines: list[str] = []
    result = run_pipeline(cfg, echo=lines.append)
    return cfg, result, lines


def test_all_six_stages_ran_in_order(smoke):
    _, result, lines = smoke
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ORDER
    assert [ln.split(":")[0] for ln in lines if ": done" in ln] == ORDER
    for name in ORDER:
        art = result.artifacts[name]
        assert (art.path / "manifest.json").is_file()
        assert art.path.parent.name == name and art.path.name == art.hash


def test_training_loss_went_down(smoke):
    _, result, _ = smoke
    counts = result.artifacts["train"].manifest["counts"]
    assert counts["final_loss"] < counts["first_loss"] - 0.5, counts
    metrics = result.artifacts["evaluate"].manifest["counts"]
    # Clearly better than the unigram floor on held-out text, not just "trained a bit".
    assert metrics["val_bits_per_byte"] < 0.85 * metrics["unigram_bits_per_byte"], metrics


def test_mlflow_holds_parent_nested_runs_and_metrics(smoke):
    cfg, result, _ = smoke
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
    # The train run's Datasets: the token artifact it read, with its counts (mlflow.log_input).
    (dataset,) = c.get_run(by_stage["train"].info.run_id).inputs.dataset_inputs
    tokens = result.artifacts["tokenize"]
    assert dataset.dataset.digest == tokens.hash and dataset.tags[0].value == "training"
    profile = json.loads(dataset.dataset.profile)
    assert profile["source_paths"] == cfg.data.train_paths
    assert profile["documents"]["train"] == tokens.manifest["counts"]["splits"]["train"]["documents"] > 0


def test_registered_model_generates_text(smoke):
    cfg, result, _ = smoke
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
    from pipeline.stage_io import HF_DIR, TOKENIZER_FILE
    from pipeline.text import EOS_ID, load_sentencepiece

    cfg, result, _ = smoke
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


def test_rerun_skips_every_stage_and_force_reruns_downstream(smoke):
    cfg, first, _ = smoke
    lines: list[str] = []
    again = run_pipeline(cfg, echo=lines.append)
    assert lines == [f"{n}: cached ({first.artifacts[n].hash})" for n in ORDER]
    assert {n: a.hash for n, a in again.artifacts.items()} == {n: a.hash for n, a in first.artifacts.items()}

    lines = []
    forced = run_pipeline(cfg, force=("evaluate",), echo=lines.append)
    assert [ln.split(":")[0] for ln in lines if ": cached" in ln] == ["shard", "tokenizer", "tokenize", "train"]
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["evaluate", "register"]
    assert forced.artifacts["register"].manifest["counts"]["version"] == 2


def test_cli_dry_run_and_only(smoke):
    cfg, first, _ = smoke
    cmd = [sys.executable, "-m", "jobs.run", "configs/smoke.yaml", f"run.workdir={cfg.run.workdir}"]
    out = subprocess.run(cmd + ["--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for name in ORDER:
        assert f"{name:<10} {first.artifacts[name].hash:<17} cached" in out.stdout
    forced = subprocess.run(cmd + ["--dry-run", "--only", "evaluate", "--force", "evaluate"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    rows = {ln.split()[0]: ln.split()[2] for ln in forced.stdout.splitlines()[1:]}
    assert rows == {"shard": "cached", "tokenizer": "cached", "tokenize": "cached", "train": "cached",
                    "evaluate": "run", "register": "cached"}
