"""The data stages at scale: shard and tokenize wall time and the largest process's peak memory.

The corpus is the Gutenberg training books ``--scale`` times over (8 by default, about 260 MB): copy k
of a book has `` <k>`` appended to every paragraph, so no copy is a duplicate that the shard stage
would drop. ``python -m jobs.run configs/demo.yaml --until tokenize`` runs on it with an embedded
Ray (a fresh workdir, nothing cached) while every process of its tree (the driver, Ray's own
processes, the stage tasks and the read and write tasks they start) is sampled for its resident
memory every ``--interval`` seconds. Per stage: the manifest's seconds; per process role (its title,
which Ray sets to ``ray::<task>``): the peak RSS, largest first. Shared pages (Ray's object store
mapped into a task) count in the RSS of every process that touches them.

``--before-repo`` first runs another checkout's ``jobs.run`` (the commit before a change, say from
``git worktree add /tmp/before <commit>``) with the same sampling, so before and after are measured
the same way, one after the other.

    .venv/bin/python benchmarks/data_stages.py [--scale 8] [--before-repo PATH] [--overrides ...]

Prints a table and writes ``benchmarks/results/data_stages.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_result  # noqa: E402
from pipeline.config import DEFAULT_DATA_ROOT  # noqa: E402


def scaled_corpus(source: Path, k: int, out: Path) -> tuple[int, int]:
    """``k`` distinct copies of every book under ``source``; returns (files, bytes) written."""
    out.mkdir(parents=True, exist_ok=True)
    files = n_bytes = 0
    for book in sorted(source.glob("*.txt")):
        text = book.read_text(encoding="utf-8")
        for copy in range(k):
            marked = text if copy == 0 else re.sub(r"\n\n", f" {copy}\n\n", text)
            data = marked.encode("utf-8")
            (out / f"{copy:02d}-{book.name}").write_bytes(data)
            files, n_bytes = files + 1, n_bytes + len(data)
    return files, n_bytes


def role(proc: psutil.Process) -> str:
    """A process's role: Ray's title for its workers (``ray::conduit.shard.read[3]`` -> ``ray::conduit.shard.read``)."""
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return "?"
    title = " ".join(cmd) if cmd else proc.name()
    if title.startswith("ray::"):
        return re.sub(r"\[\d+\]|\[[^\]]*parquet\]", "", title.split()[0])
    for name in ("jobs.run", "raylet", "gcs_server", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if name in title:
            return name
    return Path(cmd[0]).name if cmd else proc.name()


def sample(root_pid: int, interval: float, stop: threading.Event, peaks: dict[str, int]) -> None:
    """Peak RSS per role over the process tree of ``root_pid`` until ``stop``."""
    root = psutil.Process(root_pid)
    while not stop.is_set():
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                rss = p.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            r = role(p)
            peaks[r] = max(peaks.get(r, 0), rss)
        stop.wait(interval)


def measure(repo: Path, label: str, scale: int, interval: float, overrides: list[str]) -> dict:
    """One run of ``jobs.run --until tokenize`` from ``repo`` on the scaled corpus, sampled."""
    with tempfile.TemporaryDirectory(prefix="conduit-data-scale-") as tmp:
        tmp = Path(tmp)
        files, n_bytes = scaled_corpus(Path(DEFAULT_DATA_ROOT) / "gutenberg" / "train", scale, tmp / "data" / "books")
        work = tmp / "work"
        cmd = [sys.executable, "-m", "jobs.run", "configs/demo.yaml", "--until", "tokenize", f"run.workdir={work}",
               f"data.data_root={tmp / 'data'}", "data.train_paths=[books/*.txt]", *overrides]
        peaks: dict[str, int] = {}
        stop = threading.Event()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": str(repo)})
        sampler = threading.Thread(target=sample, args=(proc.pid, interval, stop, peaks))
        sampler.start()
        out, _ = proc.communicate()
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            sys.exit(f"jobs.run ({label}) failed ({proc.returncode}):\n{out[-3000:]}")
        seconds = {}
        for stage in ("shard", "tokenizer", "tokenize"):
            (manifest,) = (work / "artifacts" / stage).glob("*/manifest.json")
            seconds[stage] = json.loads(manifest.read_text())["seconds"]
    top = sorted(peaks.items(), key=lambda kv: -kv[1])
    print(f"{label}: {files} files, {n_bytes / 1e6:.0f} MB of text (Gutenberg x{scale}); "
          f"jobs.run --until tokenize in {wall:.0f} s")
    print(f"{'stage':<10} {'seconds':>8}")
    for stage, sec in seconds.items():
        print(f"{stage:<10} {sec:>8.1f}")
    print(f"{'process':<40} {'peak RSS MiB':>12}")
    for name, rss in top[:8]:
        print(f"{name:<40} {rss / 2**20:>12.0f}")
    return {"label": label, "repo": str(repo), "files": files, "text_bytes": n_bytes, "wall_s": wall,
            "stage_seconds": seconds, "peak_rss_bytes": dict(top),
            "largest_process": {"role": top[0][0], "rss_bytes": top[0][1]}}


def shard_peak(run: dict) -> int:
    """The largest process of the shard stage: its own task, or a read or write task it started."""
    return max(v for k, v in run["peak_rss_bytes"].items() if k.startswith("ray::conduit.shard"))


TOKENIZE_ROLES = ("ray::conduit.tokenize", "ray::MapWorker", "ray::ReadParquet")  # older commits: Ray Data's


def tokenize_peak(run: dict) -> int:
    """The largest process of the tokenize stage: its task, the tasks it started (or Ray Data's workers)."""
    return max(v for k, v in run["peak_rss_bytes"].items() if k.startswith(TOKENIZE_ROLES))


def compare(before: dict, after: dict) -> list[dict]:
    """Ratios, this checkout over before (reported, no target: the issue asks for both numbers)."""
    return [
        {"name": "tokenize stage: seconds, this checkout / before", "target": None, "op": "<=",
         "format": "ratio", "measured": after["stage_seconds"]["tokenize"] / before["stage_seconds"]["tokenize"]},
        {"name": "tokenize stage: largest process peak RSS, this checkout / before", "target": None, "op": "<=",
         "format": "ratio", "measured": tokenize_peak(after) / tokenize_peak(before)},
        {"name": "shard stage: largest process peak RSS, this checkout / before", "target": None, "op": "<=",
         "format": "ratio", "measured": shard_peak(after) / shard_peak(before)},
        {"name": "whole run: largest process peak RSS, this checkout / before", "target": None, "op": "<=",
         "format": "ratio", "measured": after["largest_process"]["rss_bytes"] / before["largest_process"]["rss_bytes"]},
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--before-repo", type=Path, help="another checkout (the commit before a change), run first")
    ap.add_argument("--interval", type=float, default=0.2)
    # Four logical CPUs on two cores, as the tests run.
    ap.add_argument("--overrides", nargs="*", default=["data.num_shards=16", "cluster.num_cpus=4"])
    args = ap.parse_args()
    runs = []
    if args.before_repo:
        runs.append(measure(args.before_repo, "before", args.scale, args.interval, args.overrides))
    runs.append(measure(ROOT, "this checkout", args.scale, args.interval, args.overrides))
    checks = compare(runs[0], runs[1]) if len(runs) == 2 else []
    path = write_result("data_stages", {"scale": args.scale, "overrides": args.overrides, "runs": runs,
                                       "checks": checks})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
