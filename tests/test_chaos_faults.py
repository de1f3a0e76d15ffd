"""The chaos benchmark counts a fault only where it landed (issue #51): a process that ended between
being listed and being killed is logged, not counted towards ``--min-faults`` or the summary."""

from __future__ import annotations

import subprocess
import sys

import psutil

from benchmarks.chaos import kill, landed


def test_a_kill_lands_on_a_live_process_and_not_on_one_already_gone():
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    victims = (psutil.Process(live.pid), psutil.Process(gone.pid))  # listed while both run
    gone.wait()  # then one ends on its own, before the kill
    ok, title = kill(victims[0])
    assert ok and "time.sleep(60)" in title
    assert live.wait(timeout=10) == -9  # it was the kill that ended it
    ok, title = kill(victims[1])
    assert not ok and title == "(gone before the kill: NoSuchProcess)"


def test_only_landed_faults_count():
    faults = [{"kind": "train_worker", "landed": True}, {"kind": "data_task", "landed": False},
              {"kind": "mlflow", "landed": True}]
    assert [f["kind"] for f in landed(faults)] == ["train_worker", "mlflow"]
    assert landed([{"kind": "node"}]) == [{"kind": "node"}]  # a fault log written before the field
