"""``StageTracker``: a picklable handle on one MLflow run (``pipeline.tracking`` has the rest of the MLflow side).

Apart from ``pipeline.tracking`` because of who unpickles one: every process a stage hands it to, among them
Ray Train's controller (whose failure callback holds the train stage's tracker and calls it only on a
failure) and the training workers of rank > 0 (which never call it). Here it imports no MLflow, so those
processes do not pay for importing it (about 1.2 CPU-seconds each); a call imports ``pipeline.tracking``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


_MAX_PARAM_LEN = 6000  # MLflow's limit on a param value is 6000 characters
_LOGGED_ARTIFACTS = "mlflow.loggedArtifacts"  # the run tag that lists its tables (the UI's artifact view)


def _client(uri: str, patient: bool):
    """``pipeline.tracking.client``, looked up at each call (MLflow is imported on the first)."""
    from pipeline import tracking

    return tracking.client(uri, patient)


@dataclass(frozen=True)
class StageTracker:
    """A picklable handle on one MLflow run, usable from any process (Ray tasks, Train workers), and
    where else its stage reports progress: ``train_callbacks``, Ray Train callbacks of the train
    stage's trainer (a sweep trial's report to Ray Tune; ``pipeline.sweep``)."""

    uri: str
    run_id: str
    train_callbacks: tuple = ()
    patient: bool = True  # its calls wait out an MLflow restart (``PatientClient``); the outbox's do not

    def impatient(self) -> StageTracker:
        """This run's tracker whose calls fail at once when the server is down (for a caller that retries)."""
        return dataclasses.replace(self, patient=False)

    def log_params(self, params: dict[str, Any]) -> None:
        from pipeline.tracking import Param  # mlflow's, as tracking imports it

        items = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in params.items()]
        c = _client(self.uri, self.patient)
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            c.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from pipeline.tracking import Metric  # mlflow's, as tracking imports it

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step or 0) for k, v in metrics.items()]
        _client(self.uri, self.patient).log_batch(self.run_id, metrics=items)

    def log_metric_records(self, records: list[tuple[str, float, int, int]]) -> None:
        """Metrics measured earlier: ``(name, value, timestamp ms, step)`` each, in one batch
        (what ``pipeline.training.outbox`` delivers)."""
        from pipeline.tracking import Metric  # mlflow's, as tracking imports it

        _client(self.uri, self.patient).log_batch(self.run_id, metrics=[Metric(k, v, ts, step) for k, v, ts, step in records])

    def logged_steps(self, key: str) -> list[int]:
        """The steps at which the run holds metric ``key``."""
        return [m.step for m in _client(self.uri, self.patient).get_metric_history(self.run_id, key)]

    def set_tags(self, tags: dict[str, Any]) -> None:
        from pipeline.tracking import RunTag  # mlflow's, as tracking imports it

        _client(self.uri, self.patient).log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_text(self, text: str, artifact_file: str) -> None:
        _client(self.uri, self.patient).log_text(self.run_id, text, artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        _client(self.uri, self.patient).log_artifact(self.run_id, str(local_path), artifact_path)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        _client(self.uri, self.patient).log_dict(self.run_id, data, artifact_file)

    def log_table(self, data: dict[str, list], artifact_file: str) -> None:
        """``data`` (column -> values) as the run's table ``artifact_file``, in the file and tag that
        ``MlflowClient.log_table`` writes. Written whole: that one appends to a table the run already has,
        so a retry after a lost answer would hold its rows twice."""
        import pandas as pd

        c = _client(self.uri, self.patient)
        c.log_text(self.run_id, pd.DataFrame(data).to_json(orient="split", index=False, date_format="iso"),
                   artifact_file)
        logged = json.loads(c.get_run(self.run_id).data.tags.get(_LOGGED_ARTIFACTS, "[]"))
        if {"path": artifact_file, "type": "table"} not in logged:
            c.set_tag(self.run_id, _LOGGED_ARTIFACTS, json.dumps([*logged, {"path": artifact_file, "type": "table"}]))

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        _client(self.uri, self.patient).log_figure(self.run_id, figure, artifact_file)

    def log_input_dataset(self, name: str, source: str, digest: str, context: str,
                          profile: dict[str, Any] | None = None) -> None:
        """Record a dataset the stage read or wrote (``mlflow.log_input``: the run's Datasets column and
        panel in the UI).

        Args:
            name: the dataset's name.
            source: where it lives (a path or URI).
            digest: what identifies its content (Conduit's artifact hash).
            context: what the run did with it (``training``, ``evaluation``).
            profile: counts and provenance, shown as the dataset's profile (JSON).
        """
        from pipeline import tracking

        tracking.log_input(_client(self.uri, self.patient), self.run_id, name, source, digest, context, profile)
