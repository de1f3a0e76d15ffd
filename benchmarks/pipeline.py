"""Wall time of the whole smoke pipeline split by stage, and the fixed costs under it, measured apart.

Pipeline: ``python -m jobs.run configs/smoke.yaml run.workdir=<fresh temporary folder>`` (embedded
Ray, a sqlite MLflow store in the workdir, nothing cached), then the same command again (every stage
cached: what is left is pure fixed cost). Per stage: the manifest's ``seconds`` (the stage body), the
``conduit.seconds`` tag of its MLflow child run (the same number, read back), and the child run's
duration (the body plus the Ray task's scheduling, worker process and imports); what the stages leave
of the wall time is the driver's own start-up (imports, ``ray.init``, MLflow store, parent run).

Fixed costs, each in a fresh process, ``--repeats`` times interleaved:
- Ray start: ``import ray`` and ``ray.init`` of a new local cluster (and its shutdown).
- MLflow: a real ``mlflow server`` on a fresh sqlite store until ``/health`` answers; the sqlite
  store's first open (tables and migrations) through ``pipeline.tracking`` and a later reopen.
- DeepSpeed: ``import deepspeed`` and the CPU shared-memory collective op (``build_shm_op``) loaded
  from the cache the pipeline uses (``TORCH_EXTENSIONS_DIR``, ~/.cache/conduit/torch_extensions:
  already built, so this is the cached load); and once (unless ``--no-cold-op-build``) built from
  scratch into an empty folder (what the first run on a new machine pays).
- Ray Train worker group: ``fit`` of Conduit's trainer (``pipeline.training.ray_train``) on a do-nothing function on ``--workers`` workers
  (worker actors, gloo process group, teardown), in a Ray started beforehand.

Prints tables and writes ``benchmarks/results/pipeline.json``.

Storage (``--storage``, instead of the above): each config of ``--storage-configs`` (smoke and demo) run
fresh on a local artifact root and on an S3 root (a moto server started here, as the tests use), one
after the other. Per stage: the body's seconds on each root, and on S3 the bytes and seconds of the
upload (MLflow tags ``conduit.uploaded_bytes`` / ``conduit.upload_seconds`` of the stage run) and of a
cold fetch of the artifact into an empty scratch folder (what a stage on a fresh node pays to read it),
and their ratio to the body. Writes ``benchmarks/results/pipeline_storage.json``.

    .venv/bin/python benchmarks/pipeline.py --storage [--storage-configs smoke demo] [--overrides ...]

    .venv/bin/python benchmarks/pipeline.py [--repeats 3] [--pipeline-repeats 2] [--no-cold-op-build]
        [--overrides train.steps=20 ...] [--skip-pipeline]
    # small, to check that it runs (about 2 minutes):
    .venv/bin/python benchmarks/pipeline.py --repeats 1 --pipeline-repeats 1 --no-cold-op-build \
        --overrides train.steps=20 optimizer.warmup_steps=2 eval.max_batches=2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, summary, write_result
from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import ORDER, make_plan, resolve, worker_env

SMOKE = ROOT / "configs" / "smoke.yaml"
BIN = Path(sys.executable).parent
# Child processes get a quiet environment of their own: no telemetry, and no $RAY_ADDRESS or
# $MLFLOW_TRACKING_URI that would point them at a running cluster or server instead of fresh ones.
CHILD_ENV = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")} | {
    "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
    "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}

# Child programs: each prints one JSON line of seconds. `T()` is a perf_counter lap timer.
_LAP = """import json, os, sys, time
_t = [time.perf_counter()]
def T():
    _t.append(time.perf_counter())
    return _t[-1] - _t[-2]
"""
RAY_START = _LAP + """
import ray
imp = T()
ray.init(address="local", num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False)
init = T()
ray.shutdown()
print(json.dumps({"import_s": imp, "init_s": init, "shutdown_s": T()}))
"""
SQLITE_OPEN = _LAP + """
from pipeline import tracking
imp = T()
tracking.ensure_experiment(sys.argv[1], "bench")
print(json.dumps({"import_s": imp, "open_s": T()}))
"""
DEEPSPEED_OP = _LAP + """
os.environ["DS_ACCELERATOR"] = "cpu"
import deepspeed
imp = T()
from deepspeed.comm.torch import build_shm_op
op = build_shm_op()
print(json.dumps({"import_s": imp, "op_s": T(), "op_loaded": op is not None}))
"""
WORKER_GROUP = _LAP + """
import ray, ray.train
from ray.train.torch import TorchConfig
from pipeline.runner import worker_env
from pipeline.training.ray_train import trainer_class
ray.init(address="local", num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False,
         runtime_env={"env_vars": worker_env()})
T()
def noop(config):
    pass
fits = []
for i in range(int(sys.argv[3])):
    trainer_class()(noop, train_loop_config={}, torch_config=TorchConfig(backend="gloo"),
                 scaling_config=ray.train.ScalingConfig(num_workers=int(sys.argv[2])),
                 run_config=ray.train.RunConfig(name=f"noop{i}", storage_path=sys.argv[4])).fit()
    fits.append(T())
ray.shutdown()
print(json.dumps({"fit_s": fits}))
"""


def child(program: str, *argv: str, env: dict | None = None) -> dict:
    """Run ``program`` in a fresh interpreter (from the repository root); its last stdout line, parsed."""
    done = subprocess.run([sys.executable, "-c", program, *argv], cwd=ROOT, env={**CHILD_ENV, **(env or {})},
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"child exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def mlflow_server_start(work: Path) -> float:
    """Seconds from launching ``mlflow server`` on a fresh sqlite store until ``/health`` answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
           "--artifacts-destination", str(work / "mlartifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    log = (work / "mlflow.log").open("w")
    started = time.perf_counter()
    # Its own session, so that the server and the workers it forks stop together (killpg below).
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=CHILD_ENV, cwd=work,
                            start_new_session=True)
    try:
        while time.perf_counter() - started < 180:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}: see {work / 'mlflow.log'}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            time.sleep(0.1)
        raise RuntimeError("mlflow server did not answer /health within 180 s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


def fixed_costs(args: argparse.Namespace, tmp: Path) -> dict:
    raw: dict[str, list] = {"ray": [], "mlflow_server_s": [], "sqlite_first": [], "sqlite_reopen": [],
                            "deepspeed_cached": []}
    for r in range(args.repeats):  # interleaved: one of each per repeat
        raw["ray"].append(child(RAY_START, str(args.ray_cpus)))
        raw["mlflow_server_s"].append(mlflow_server_start(Path(tempfile.mkdtemp(dir=tmp))))
        uri = f"sqlite:///{tempfile.mkdtemp(dir=tmp)}/mlflow.db"
        raw["sqlite_first"].append(child(SQLITE_OPEN, uri))
        raw["sqlite_reopen"].append(child(SQLITE_OPEN, uri))
        raw["deepspeed_cached"].append(child(DEEPSPEED_OP, env=worker_env() | {"TORCH_EXTENSIONS_DIR": args.ext_dir}))
        print(f"fixed costs {r + 1}/{args.repeats}: ray.init {raw['ray'][-1]['init_s']:.1f}s  mlflow server "
              f"{raw['mlflow_server_s'][-1]:.1f}s  sqlite first open {raw['sqlite_first'][-1]['open_s']:.1f}s  "
              f"deepspeed import {raw['deepspeed_cached'][-1]['import_s']:.1f}s", flush=True)
    if not all(d["op_loaded"] for d in raw["deepspeed_cached"]):
        raise RuntimeError("DeepSpeed's shm op is not compatible here: build_shm_op() returned None")
    costs = {
        "import ray": summary([d["import_s"] for d in raw["ray"]]),
        "ray.init (new local cluster)": summary([d["init_s"] for d in raw["ray"]]),
        "ray.shutdown": summary([d["shutdown_s"] for d in raw["ray"]]),
        "mlflow server until /health (fresh sqlite)": summary(raw["mlflow_server_s"]),
        "import pipeline.tracking (mlflow)": summary([d["import_s"] for d in raw["sqlite_first"]]),
        "sqlite store first open (creates tables)": summary([d["open_s"] for d in raw["sqlite_first"]]),
        "sqlite store reopen (new process)": summary([d["open_s"] for d in raw["sqlite_reopen"]]),
        "import deepspeed": summary([d["import_s"] for d in raw["deepspeed_cached"]]),
        "deepspeed shm op load (cached build)": summary([d["op_s"] for d in raw["deepspeed_cached"]]),
    }
    if args.cold_op_build:
        cold = child(DEEPSPEED_OP, env=worker_env() | {"TORCH_EXTENSIONS_DIR": tempfile.mkdtemp(dir=tmp)})
        costs["deepspeed shm op build (cold, once)"] = summary([cold["op_s"]])
    group = child(WORKER_GROUP, str(args.ray_cpus), str(args.workers), str(args.repeats), tempfile.mkdtemp(dir=tmp))
    costs[f"Ray Train worker group start + stop ({args.workers} workers)"] = summary(group["fit_s"])
    return costs


def smoke_overrides(args: argparse.Namespace, work: Path) -> list[str]:
    """The workdir and its own sqlite store (whatever $MLFLOW_TRACKING_URI says), then the user's."""
    return [f"run.workdir={work}", f"tracking.uri=sqlite:///{work / 'mlflow.db'}", *args.overrides]


def run_pipeline(args: argparse.Namespace, work: Path, label: str) -> float:
    """Wall seconds of ``python -m jobs.run configs/smoke.yaml`` into ``work``."""
    log = work.parent / f"{work.name}-{label}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run([sys.executable, "-m", "jobs.run", str(SMOKE), *smoke_overrides(args, work)],
                              cwd=ROOT, env=CHILD_ENV, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"jobs.run exited with {done.returncode}:\n{log.read_text()[-3000:]}")
    print(f"pipeline {label}: {seconds:.1f}s", flush=True)
    return seconds


def stage_split(args: argparse.Namespace, work: Path) -> tuple[dict, list[float]]:
    """Per stage of the fresh run: manifest seconds, MLflow tag and child-run duration; and every
    parent run's duration (oldest first)."""
    cfg = resolve(load_config(SMOKE, smoke_overrides(args, work)))
    c = tracking.client(cfg.tracking_uri())
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    parents = [(r.info.end_time - r.info.start_time) / 1e3 for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = {r.data.tags["conduit.stage"]: r for r in runs if "conduit.stage" in r.data.tags}
    stages = {}
    for item in make_plan(cfg):
        manifest = json.loads((item.path / "manifest.json").read_text())
        run = children[item.stage]
        stages[item.stage] = {"stage_s": manifest["seconds"], "mlflow_tag_s": float(run.data.tags["conduit.seconds"]),
                              "mlflow_run_s": (run.info.end_time - run.info.start_time) / 1e3}
    return stages, parents


def pipeline_runs(args: argparse.Namespace, tmp: Path) -> dict:
    fresh, cached, splits, parents = [], [], [], []
    for r in range(args.pipeline_repeats):  # interleaved: fresh, cached, fresh, cached, ...
        work = tmp / f"smoke-{r}"
        fresh.append(run_pipeline(args, work, "fresh"))
        cached.append(run_pipeline(args, work, "cached"))
        split, durations = stage_split(args, work)
        splits.append(split)
        parents.append(durations)
        shutil.rmtree(work)
    stages = {name: {k: summary([s[name][k] for s in splits]) for k in splits[0][name]} for name in ORDER}
    in_stages = [sum(s[n]["mlflow_run_s"] for n in ORDER) for s in splits]
    return {
        "wall_fresh_s": summary(fresh), "wall_cached_s": summary(cached), "stages": stages,
        "stage_runs_total_s": summary(in_stages),
        "outside_stages_s": summary([w - s for w, s in zip(fresh, in_stages)]),
        "parent_run_fresh_s": summary([p[0] for p in parents]), "parent_run_cached_s": summary([p[1] for p in parents]),
        "overrides": args.overrides,
    }


def start_s3() -> tuple[object, str]:
    """A moto S3 server on a free local port and a fresh bucket on it: ``(server, artifact root URI)``."""
    import pyarrow.fs as pafs
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", allow_bucket_creation=True) \
        .create_dir("conduit-bench")
    return server, f"s3://conduit-bench/art?endpoint_override=127.0.0.1:{port}&scheme=http"


def storage_run(config: Path, work: Path, root: str | None, overrides: list[str]) -> dict:
    """One fresh run of ``config``; per stage: body seconds and, on an object store, upload and cold-fetch
    bytes and seconds."""
    from pipeline.store.backends import ObjectStore

    extra = [f"run.workdir={work}", f"tracking.uri=sqlite:///{work / 'mlflow.db'}",
             *([f"run.artifact_root={root}"] if root else []), *overrides]
    env = CHILD_ENV | {"CONDUIT_SCRATCH_DIR": str(work / "scratch"), "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_EC2_METADATA_DISABLED": "true"}
    started = time.perf_counter()
    with (work.parent / f"{work.name}.log").open("w") as f:
        done = subprocess.run([sys.executable, "-m", "jobs.run", str(config), *extra], cwd=ROOT, env=env,
                              stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"jobs.run exited with {done.returncode}: see {work.parent / f'{work.name}.log'}")
    cfg = resolve(load_config(config, extra))
    c = tracking.client(cfg.tracking_uri())
    exp = c.get_experiment_by_name(cfg.tracking.experiment)
    runs = {r.data.tags["conduit.stage"]: r for r in c.search_runs([exp.experiment_id])
            if "conduit.stage" in r.data.tags}
    stages = {}
    for item in make_plan(cfg):
        tags = runs[item.stage].data.tags
        if root is None:
            manifest = json.loads((Path(item.path) / "manifest.json").read_text())
            stages[item.stage] = {"body_s": manifest["seconds"]}
            continue
        cold = ObjectStore(root, scratch=work / "cold-node")
        art = cold.load(item.stage, item.hash)
        cold.fetch(art)
        stages[item.stage] = {
            "body_s": art.manifest["seconds"],
            "artifact_bytes": sum(f["bytes"] for f in art.manifest["files"].values()),
            "upload_bytes": int(tags["conduit.uploaded_bytes"]), "upload_s": float(tags["conduit.upload_seconds"]),
            "cold_fetch_bytes": cold.transfer.fetched_bytes, "cold_fetch_s": cold.transfer.fetch_seconds,
        }
    return {"wall_s": wall, "stages": stages}


def storage_costs(args: argparse.Namespace, tmp: Path) -> dict:
    server, root = start_s3()
    out = {}
    try:
        for name in args.storage_configs:
            config = ROOT / "configs" / f"{name}.yaml"
            local = storage_run(config, tmp / f"{name}-local", None, args.overrides)
            print(f"{name} on a local root: {local['wall_s']:.1f}s", flush=True)
            s3 = storage_run(config, tmp / f"{name}-s3", root.replace("/art?", f"/{name}?"), args.overrides)
            print(f"{name} on an S3 root: {s3['wall_s']:.1f}s", flush=True)
            out[name] = {"local": local, "s3": s3}
    finally:
        server.stop()
    return {"storage": out, "overrides": args.overrides}


def print_storage(result: dict) -> None:
    for name, r in result["storage"].items():
        loc, s3 = r["local"], r["s3"]
        print(f"\n{name}: wall {loc['wall_s']:.1f}s on a local root, {s3['wall_s']:.1f}s on S3 (moto)")
        print(f"{'stage':<10} {'body local':>10} {'body s3':>8} {'MB up':>7} {'up s':>6} {'MB fetch':>8} "
              f"{'fetch s':>7} {'(up+fetch)/body':>15}")
        for stage, b in s3["stages"].items():
            moved = b["upload_s"] + b["cold_fetch_s"]
            print(f"{stage:<10} {loc['stages'][stage]['body_s']:>10.2f} {b['body_s']:>8.2f} "
                  f"{b['upload_bytes'] / 1e6:>7.2f} {b['upload_s']:>6.2f} {b['cold_fetch_bytes'] / 1e6:>8.2f} "
                  f"{b['cold_fetch_s']:>7.2f} {moved / max(b['body_s'], 1e-9):>15.3f}")


COMPUTING_STAGES = ("tokenize", "train", "evaluate")  # the stages whose bodies compute (not just copy or register)
MAX_TRANSFER_SHARE = 0.10  # upload + cold fetch against the body of a computing stage


def storage_rows_and_checks(result: dict) -> dict:
    """Flat ``rows`` (one per config and stage) and ``checks`` (transfers against the body of each
    computing stage) for benchmarks/report.py."""
    rows, checks = [], []
    for name, r in result["storage"].items():
        for stage, b in r["s3"]["stages"].items():
            share = (b["upload_s"] + b["cold_fetch_s"]) / max(b["body_s"], 1e-9)
            rows.append({"config": name, "stage": stage, "body s (local root)": r["local"]["stages"][stage]["body_s"],
                         "body s (S3 root)": b["body_s"], "MB uploaded": b["upload_bytes"] / 1e6,
                         "upload s": b["upload_s"], "MB fetched (cold)": b["cold_fetch_bytes"] / 1e6,
                         "fetch s": b["cold_fetch_s"], "(upload + fetch) / body": share})
            if stage in COMPUTING_STAGES:
                checks.append({"name": f"{name} {stage}: (upload + cold fetch) / body", "measured": share,
                               "target": MAX_TRANSFER_SHARE, "op": "<", "format": "percent"})
        checks.append({"name": f"{name}: wall on S3 / wall on a local root",
                       "measured": r["s3"]["wall_s"] / r["local"]["wall_s"], "target": None, "op": "<"})
    return {"rows": rows, "checks": checks}


def fmt(s: dict) -> str:
    return f"{s['median']:>8.2f} {s['min']:>7.2f}-{s['max']:<7.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="repeats of each fixed cost")
    p.add_argument("--pipeline-repeats", type=int, default=2, help="fresh + cached pipeline pairs")
    p.add_argument("--overrides", nargs="*", default=[], help="extra config overrides for the smoke pipeline")
    p.add_argument("--ray-cpus", type=int, default=os.cpu_count(), help="logical CPUs of the fixed-cost Rays")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers of the worker-group start-up")
    p.add_argument("--cold-op-build", action=argparse.BooleanOptionalAction, default=True,
                   help="also build DeepSpeed's shm op once into an empty folder (compiles C++)")
    p.add_argument("--skip-pipeline", action="store_true", help="fixed costs only")
    p.add_argument("--storage", action="store_true",
                   help="only the local-root against S3-root comparison (see the module docstring)")
    p.add_argument("--storage-configs", nargs="+", default=["smoke", "demo"], help="configs/<name>.yaml to compare")
    args = p.parse_args()
    if args.storage:
        tmp = Path(tempfile.mkdtemp(prefix="conduit-bench-storage-"))
        try:
            result = storage_costs(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print_storage(result)
        result.update(storage_rows_and_checks(result))
        print(f"wrote {write_result('pipeline_storage', result)}")
        return
    args.ext_dir = worker_env()["TORCH_EXTENSIONS_DIR"]
    # With no build there yet, the first "cached" load builds it: say so rather than mislabel it.
    op_was_cached = (Path(args.ext_dir) / "deepspeed_shm_comm").is_dir()
    if not op_was_cached:
        print(f"note: no DeepSpeed shm op in {args.ext_dir} yet; the first cached-load repeat builds it")

    tmp = Path(tempfile.mkdtemp(prefix="conduit-bench-pipeline-"))
    try:
        costs = fixed_costs(args, tmp)
        pipe = None if args.skip_pipeline else pipeline_runs(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nfixed costs, each in a fresh process ({args.repeats} repeats; Ray with {args.ray_cpus} CPUs)")
    print(f"{'what':<48} {'median s':>8} {'range':>15}")
    for name, s in costs.items():
        print(f"{name:<48} {fmt(s)}")
    result = {"fixed_costs": costs, "repeats": args.repeats, "ray_cpus": args.ray_cpus,
              "torch_extensions_dir": args.ext_dir, "op_was_cached": op_was_cached, "cold_op_build": args.cold_op_build}
    if pipe is not None:
        result["pipeline"] = pipe
        extra = f" {' '.join(args.overrides)}" if args.overrides else ""
        print(f"\nsmoke pipeline (configs/smoke.yaml{extra}), {args.pipeline_repeats} fresh + cached pair(s)")
        print(f"{'stage':<26} {'body s':>8} {'range':>15} {'run s':>8} {'range':>15}")
        for name, s in pipe["stages"].items():
            print(f"{name:<26} {fmt(s['stage_s'])} {fmt(s['mlflow_run_s'])}")
        print(f"{'all stage runs':<26} {'':>24} {fmt(pipe['stage_runs_total_s'])}")
        print(f"{'outside the stages':<26} {'':>24} {fmt(pipe['outside_stages_s'])}")
        print(f"{'wall, fresh workdir':<26} {'':>24} {fmt(pipe['wall_fresh_s'])}")
        print(f"{'wall, all stages cached':<26} {'':>24} {fmt(pipe['wall_cached_s'])}")
        print("body: the stage function (manifest seconds = MLflow conduit.seconds tag); run: its MLflow child "
              "run, the Ray task's scheduling, process and imports included")
    print(f"wrote {write_result('pipeline', result)}")


if __name__ == "__main__":
    main()
