"""The runner's failure path on the session's Ray, with a real sqlite MLflow store and three toy stages.

``a -> b -> c``: each writes its output and appends its name to ``ran.log`` in the workdir; ``b``
writes a partial file and raises while ``fail_b`` exists there. What is checked is the runner's
contract: a stage that raises leaves no manifest and a FAILED MLflow run (and a FAILED parent), the
next run redoes the unsealed folder from scratch and skips what is sealed, and ``force`` reruns a
stage and everything after it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline import tracking
from pipeline.store.artifacts import is_complete
from pipeline.config import RunConfig, load_config
from pipeline.runner import StageFailed, run_pipeline
from pipeline.stages import Stage, in_order


def toy_hash_config(cfg: RunConfig) -> dict:
    return {"seed": cfg.run.seed}


def toy_body(name: str, cfg: RunConfig, inputs: dict, out_dir: Path) -> dict:
    with open(cfg.workdir() / "ran.log", "a", encoding="utf-8") as log:
        log.write(name + "\n")
    text = "".join((a.path / "out.txt").read_text() for a in inputs.values()) + name
    (out_dir / "out.txt").write_text(text)
    return {"chars": len(text)}


def run_a(cfg, inputs, out_dir, tracker):
    return toy_body("a", cfg, inputs, out_dir)


def run_b(cfg, inputs, out_dir, tracker):
    if (cfg.workdir() / "fail_b").exists():
        (out_dir / "partial.txt").write_text("half")
        raise RuntimeError("b broke on purpose")
    return toy_body("b", cfg, inputs, out_dir)


def run_c(cfg, inputs, out_dir, tracker):
    return toy_body("c", cfg, inputs, out_dir)


def discard_b(cfg, hash_):
    """b's resumable state (as train's checkpoints are): the runner discards it only when b is forced."""
    with open(cfg.workdir() / "discarded.log", "a", encoding="utf-8") as log:
        log.write(f"b {hash_}\n")


TOY = in_order([
    Stage(name="a", version=1, inputs=(), hash_config=toy_hash_config, run=run_a),
    Stage(name="b", version=1, inputs=("a",), hash_config=toy_hash_config, run=run_b, discard_state=discard_b),
    Stage(name="c", version=1, inputs=("b",), hash_config=toy_hash_config, run=run_c),
])


def runs_by_stage(uri: str, run_id: str) -> dict[str, list]:
    """The pipeline run's nested stage runs, oldest first, by stage name."""
    c = tracking.client(uri)
    parent = c.get_run(run_id)
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'",
                             order_by=["attributes.start_time ASC"])
    out: dict[str, list] = {}
    for r in children:
        out.setdefault(r.data.tags["conduit.stage"], []).append(r)
    return out


def test_a_failed_stage_is_redone_and_force_reruns_what_follows(tmp_path, ray_cluster):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(None, [f"run.workdir={tmp_path / 'work'}", f"tracking.uri={uri}", "tracking.experiment=toy"])
    work = cfg.workdir()
    work.mkdir()
    (work / "fail_b").touch()
    c = tracking.client(uri)

    lines: list[str] = []
    with pytest.raises(StageFailed, match=r"stage b failed: RuntimeError\('b broke on purpose'\)") as e:
        run_pipeline(cfg, echo=lines.append, stages=TOY)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert [ln.split(":")[0] for ln in lines] == ["a", "a", "b"]  # a ran and finished, b started, c never
    root = work / "artifacts"
    (a_dir,), (b_dir,) = (root / "a").iterdir(), (root / "b").iterdir()
    assert is_complete(a_dir) and not is_complete(b_dir)  # b raised: no manifest
    assert (b_dir / "partial.txt").exists() and not (root / "c").exists()
    exp = c.get_experiment_by_name("toy")
    (parent,) = c.search_runs([exp.experiment_id], "tags.mlflow.runName = 'conduit'")
    assert parent.info.status == "FAILED"
    first = runs_by_stage(uri, parent.info.run_id)
    assert {k: [r.info.status for r in v] for k, v in first.items()} == {"a": ["FINISHED"], "b": ["FAILED"]}
    failed = first["b"][0]
    assert failed.data.tags["conduit.error"] == "RuntimeError: b broke on purpose"
    error_txt = c.download_artifacts(failed.info.run_id, "error.txt", str(tmp_path))
    trace = Path(error_txt).read_text()
    assert ", in run_b\n" in trace and trace.endswith("RuntimeError: b broke on purpose") and "\x1b" not in trace

    (work / "fail_b").unlink()
    lines = []
    result = run_pipeline(cfg, echo=lines.append, stages=TOY)
    assert lines[0] == f"a: cached ({a_dir.name})"
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["b", "c"]
    assert result.artifacts["b"].path == b_dir and is_complete(b_dir)
    assert sorted(p.name for p in b_dir.iterdir()) == ["manifest.json", "out.txt"]  # the partial file is gone
    assert (result.artifacts["c"].path / "out.txt").read_text() == "abc"
    assert c.get_run(result.run_id).info.status == "FINISHED"
    second = runs_by_stage(uri, result.run_id)
    assert {k: [r.info.status for r in v] for k, v in second.items()} == {"b": ["FINISHED"], "c": ["FINISHED"]}

    lines = []
    forced = run_pipeline(cfg, force=("b",), echo=lines.append, stages=TOY)
    assert [ln.split(":")[0] for ln in lines if ": cached" in ln] == ["a"]
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["b", "c"]
    assert {n: a.hash for n, a in forced.artifacts.items()} == {n: a.hash for n, a in result.artifacts.items()}
    assert forced.artifacts["b"].manifest["finished_at"] > result.artifacts["b"].manifest["finished_at"]
    assert (work / "ran.log").read_text().split() == ["a", "b", "c", "b", "c"]  # b's failed try logs nothing
    # Only the forced run discarded b's resumable state; the rerun after the failure kept it to resume.
    assert (work / "discarded.log").read_text().split() == ["b", b_dir.name]

    # A cached artifact whose file was truncated behind the manifest's back is found and rebuilt
    # (alone: c's cached artifact still matches its own manifest).
    listed = forced.artifacts["b"].manifest["files"]
    assert set(listed) == {"out.txt"} and listed["out.txt"]["bytes"] == 2
    (b_dir / "out.txt").write_text("a")
    lines = []
    healed = run_pipeline(cfg, echo=lines.append, stages=TOY)
    assert any(ln.startswith(f"b: the cached artifact is damaged ({b_dir / 'out.txt'} has 1 bytes, the manifest "
                             "says 2)") for ln in lines), lines
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["b"]
    assert (healed.artifacts["b"].path / "out.txt").read_text() == "ab"
    assert (work / "ran.log").read_text().split() == ["a", "b", "c", "b", "c", "b"]

    # Altered at the same size: only the sha256 tells, and it is named the same way; c is kept.
    (b_dir / "out.txt").write_text("zz")
    lines = []
    altered = run_pipeline(cfg, echo=lines.append, stages=TOY)
    assert lines[1] == f"b: the cached artifact is damaged ({b_dir / 'out.txt'} does not match its sha256 in the " \
                       "manifest); rebuilding it", lines
    assert [ln.split(":")[0] for ln in lines if ": running" in ln] == ["b"]
    assert f"c: cached ({healed.artifacts['c'].hash})" in lines
    assert altered.artifacts["c"].manifest == healed.artifacts["c"].manifest
    assert (altered.artifacts["b"].path / "out.txt").read_text() == "ab"
    assert (work / "ran.log").read_text().split() == ["a", "b", "c", "b", "c", "b", "b"]
