"""infra/local/up and down, and jobs.submit / status / logs / stop, against a real two-node Ray cluster
and MLflow server on 127.0.0.1.

infra/local/up (with an empty HOME, as on a new machine) starts a head and a second node (its own CPUs
and a custom resource) plus an MLflow server; the first service test checks what up wrote and that the
jobs CLIs find the cluster through it; the smoke pipeline is submitted once with STRICT_SPREAD, so it
also proves that training ranks on two nodes train correctly; the last test brings everything down
with infra/local/down and checks that exactly up's processes stopped. MLflow is checked through its
REST API, Ray through the CLIs. Everything runs as subprocesses; the fixture's down stops what is left
when a test fails.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from pipeline import cluster
from pipeline.config import load_config
from pipeline.runner import ORDER
from tests.infra.local_infra import RAY, ROOT, UP, clean_env, down, jobs_cli, run, up, wait_for
from tests.servers import free_port, listening_addresses, stop_tree, wait_http

SMALL = ["train.steps=40", "eval.max_batches=2", "eval.max_text_tokens=512", "eval.lambada_max_examples=16",
         "eval.max_new_tokens=4", "eval.context_lengths=[]", "parallel.placement_strategy=STRICT_SPREAD",
         "cluster.shared_storage=true"]


@dataclass
class Services:
    state_dir: Path
    env: dict[str, str]
    workdir: Path
    home: Path  # the empty HOME up ran with

    @property
    def address(self) -> str:
        return self.env["RAY_ADDRESS"]

    @property
    def mlflow(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"] + "/api/2.0/mlflow"

    @property
    def auth(self) -> dict[str, str]:
        """What ``. outputs/infra/env`` gives a user's shell for the plain Ray CLI: the auth mode and
        where the cluster's token is."""
        return {k: self.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")}

    def cli(self, module: str, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        """A jobs CLI that finds the cluster through the env file, as a user's shell would."""
        return jobs_cli(module, *args, timeout=timeout, CONDUIT_INFRA_ENV=str(self.state_dir / "env"), **env)

    def job_ids(self) -> list[str]:
        listed = self.cli("status")
        assert listed.returncode == 0, listed.stderr
        return [ln.split("\t")[0] for ln in listed.stdout.splitlines()]

    def status(self, job_id: str) -> str:
        return self.cli("status", job_id).stdout.strip()

    def wait_for_line(self, job_id: str, text: str, timeout: float) -> None:
        """Follow the job's log (one ``jobs.logs --follow``, not a poll) until a line holds ``text``."""
        cmd = [sys.executable, "-m", "jobs.logs", job_id, "--follow"]
        follow = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=clean_env(CONDUIT_INFRA_ENV=str(self.state_dir / "env")))
        timer = threading.Timer(timeout, follow.kill)
        timer.start()
        try:
            seen = []
            for line in follow.stdout:
                seen.append(line)
                if text in line:
                    return
            raise AssertionError(f"{job_id}'s log ended (or {timeout} s passed) without {text!r}:\n"
                                 + "".join(seen[-30:]))
        finally:
            timer.cancel()
            follow.kill()
            follow.wait()

    def train_workers(self) -> list[dict]:
        """The cluster's Ray Train workers (actors of class ``RayTrainWorker``), with the node each ran on."""
        out = run([RAY, "list", "actors", "--address", self.address, "--format", "json", "--limit", "10000",
                   "--detail"], timeout=120, **self.auth)
        assert out.returncode == 0, out.stderr
        return [a for a in json.loads(out.stdout) if a["class_name"] == "RayTrainWorker"]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """infra/local/up's services, started with an empty HOME as on a new machine (the cluster's token
    is Conduit's own). The module's last test brings them down and checks what down stopped; this
    teardown is a no-op then, and stops them only when that test did not run."""
    state = tmp_path_factory.mktemp("infra")
    empty_home = tmp_path_factory.mktemp("home")
    try:
        env = up(state, "--num-cpus", "2", "--worker-nodes", "1", "--worker-cpus", "2", HOME=str(empty_home))
        yield Services(state, env, tmp_path_factory.mktemp("work"), empty_home)
    finally:
        stopped = down(state)
        assert stopped.returncode == 0, stopped.stderr


@dataclass
class AuthMlflow:
    """An MLflow server that asks for a login (MLflow's basic-auth app, as ``infra/local/up
    --mlflow-auth`` starts it), beside the cluster: the cluster's nodes do not have its password."""

    uri: str
    login: dict[str, str]

    @property
    def api(self) -> str:
        return self.uri + "/api/2.0/mlflow"

    @property
    def auth(self) -> tuple[str, str]:
        return self.login["MLFLOW_TRACKING_USERNAME"], self.login["MLFLOW_TRACKING_PASSWORD"]


@pytest.fixture(scope="module")
def auth_mlflow(tmp_path_factory):
    svc = infra_services()
    state = tmp_path_factory.mktemp("auth_mlflow")
    port = free_port()
    proc = svc.start_mlflow(state, port, state / svc.TOKEN_FILE, auth=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{uri}/health", proc, state / "mlflow.log", timeout=300)
        yield AuthMlflow(uri, {"MLFLOW_TRACKING_USERNAME": svc.MLFLOW_ADMIN,
                               "MLFLOW_TRACKING_PASSWORD": (state / svc.MLFLOW_PASSWORD_FILE).read_text()})
    finally:
        stop_tree(proc)


@pytest.fixture(scope="module")
def smoke_job(services, auth_mlflow):
    """The smoke pipeline, submitted and followed, logging to the MLflow server that asks for a login,
    with that login in the submitting shell only; returns (job id, jobs.submit's output)."""
    done = services.cli("submit", "configs/smoke.yaml", *SMALL, f"run.workdir={services.workdir}",
                        "--tracking-uri", auth_mlflow.uri, "--follow", timeout=900, **auth_mlflow.login)
    job_id = done.stdout.splitlines()[0] if done.stdout else "(no job id printed)"
    assert done.returncode == 0, f"{job_id} did not succeed:\n{done.stdout[-5000:]}\n{done.stderr[-3000:]}"
    return job_id, done.stdout


def infra_services():
    """infra/local/services.py (a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("infra_services", ROOT / "infra" / "local" / "services.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- without services ------------------------------------------------------------------------------
def test_job_spec_pins_locations_and_ships_the_repo_without_bulk(tmp_path, monkeypatch):
    monkeypatch.delenv("CONDUIT_DATA_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(ROOT / "configs" / "smoke.yaml", ["run.artifact_root=arts", "train.steps=30"])
    overrides, env = cluster.pin_locations(cfg)
    assert overrides == [f"run.workdir={tmp_path / 'outputs' / 'smoke'}", f"run.artifact_root={tmp_path / 'arts'}"]
    assert env == {"CONDUIT_DATA_ROOT": str(cfg.data_root())} and cfg.data_root().is_absolute()
    spec = cluster.job_spec("configs/smoke.yaml", ["train.steps=30", *overrides], env, ["--only", "train"])
    assert spec.entrypoint.startswith("python -m jobs.run configs/smoke.yaml train.steps=30 run.workdir=")
    assert spec.entrypoint.endswith("--only train")
    assert spec.runtime_env["working_dir"] == str(ROOT)
    assert {"/.venv", "/.git", "/outputs"} <= set(spec.runtime_env["excludes"])
    assert spec.runtime_env["env_vars"]["RAY_JOB_SUBMISSION_ID"] == spec.submission_id
    # worker_env() keys must stay out: the driver's ray.init(runtime_env) sets them, and Ray refuses to merge
    assert not {"HF_HUB_OFFLINE", "TORCH_EXTENSIONS_DIR"} & set(spec.runtime_env["env_vars"])


def test_a_sweep_file_is_submitted_as_jobs_sweep_and_a_bad_one_sends_nothing(tmp_path, capsys):
    from jobs import submit
    from pipeline.sweep.spec import is_sweep_file

    sweep = ROOT / "configs" / "sweeps" / "smoke_lr.yaml"
    assert is_sweep_file(sweep) and not is_sweep_file(ROOT / "configs" / "smoke.yaml")
    spec = cluster.job_spec("configs/sweeps/smoke_lr.yaml", ["train.steps=30"], {}, module="jobs.sweep")
    assert spec.entrypoint == "python -m jobs.sweep configs/sweeps/smoke_lr.yaml train.steps=30"
    # refused here, naming the field, before any cluster is asked (no address is even resolved)
    assert submit.main([str(sweep), "optimizer.lrr=0.1", "--address", "http://127.0.0.1:9"]) == 2
    assert "lrr" in capsys.readouterr().err
    assert submit.main([str(sweep), "--only", "train", "--address", "http://127.0.0.1:9"]) == 2
    assert "a sweep's trials run up to evaluate" in capsys.readouterr().err


def test_repo_relative_refuses_configs_that_do_not_travel(tmp_path):
    assert cluster.repo_relative(ROOT / "configs" / "smoke.yaml") == "configs/smoke.yaml"
    with pytest.raises(cluster.ClusterError, match="outside the repository"):
        cluster.repo_relative(tmp_path / "x.yaml")
    with pytest.raises(cluster.ClusterError, match="under outputs/"):
        cluster.repo_relative(ROOT / "outputs" / "x.yaml")


def test_address_and_env_file_precedence(tmp_path, monkeypatch):
    env_file = tmp_path / "env"
    env_file.write_text("# c\nRAY_ADDRESS=http://127.0.0.1:1\nMLFLOW_TRACKING_URI=http://127.0.0.1:2\n")
    monkeypatch.setenv("CONDUIT_INFRA_ENV", str(env_file))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cluster.resolve_address(None) == "http://127.0.0.1:1"
    assert cluster.resolve_address("http://h:8265") == "http://h:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://env:8265")
    assert cluster.resolve_address(None) == "http://env:8265"
    assert cluster.resolve_tracking_uri(None, load_config(None)) == "http://127.0.0.1:2"
    env_file.write_text("not a pair\n")
    with pytest.raises(cluster.ClusterError, match=r"env:1: expected KEY=value"):
        cluster.read_env_file(env_file)


def test_k8s_manifests_parse_and_name_what_the_readme_promises():
    import yaml

    kinds = {}
    for path in sorted((ROOT / "infra" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"] if "metadata" in doc else path.name)
    assert {"RayCluster", "RayJob", "PersistentVolumeClaim", "Deployment", "StatefulSet", "Kustomization"} <= set(kinds)
    assert {"mlflow-postgres", "minio"} <= set(kinds["StatefulSet"]) and "mlflow" in kinds["Deployment"]


# ---- against real services -------------------------------------------------------------------------
@pytest.mark.slow
def test_up_answers_and_writes_env_and_the_clis_find_the_cluster_by_it(services, tmp_path):
    """infra/local/up (run with an empty HOME): both services answer, the env file names them and
    where the cluster's own token is, and the jobs CLIs need nothing else. First of the module's
    service tests: no job has been submitted yet."""
    env, state_dir = services.env, services.state_dir
    assert env["RAY_ADDRESS"].startswith("http://127.0.0.1:") and env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
    assert env["RAY_AUTH_MODE"] == "token"
    assert requests.get(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=10).status_code == 200
    # Bound as announced: the MLflow server and the Ray dashboard (with the Jobs API) on loopback only.
    for url in (env["MLFLOW_TRACKING_URI"], env["RAY_ADDRESS"]):
        assert listening_addresses(int(url.rsplit(":", 1)[1].split("/")[0])) == {"127.0.0.1"}, url
    # The token is the cluster's own: in the state dir, readable by this user only, never in HOME,
    # and the env file says where it is, not what it is.
    token_path = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert token_path.parent == state_dir and stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text()
    assert len(token) == 64 and token not in (state_dir / "env").read_text()
    assert not (services.home / ".ray").exists(), list(services.home.rglob("*"))
    # The jobs CLIs find the cluster and its token through the env file alone (no --address, no
    # RAY_ADDRESS, no RAY_AUTH_MODE, another empty HOME).
    client_home = tmp_path / "client-home"
    client_home.mkdir()
    listed = jobs_cli("status", CONDUIT_INFRA_ENV=str(state_dir / "env"), HOME=str(client_home))
    assert listed.returncode == 0 and listed.stdout == "", listed.stderr
    # Without the token, or with a wrong one: exit 2 and a sentence that says where tokens come from.
    no_env_file = str(tmp_path / "no-env")
    missing = jobs_cli("status", "--address", env["RAY_ADDRESS"], CONDUIT_INFRA_ENV=no_env_file,
                       HOME=str(client_home), RAY_AUTH_MODE="token")
    (tmp_path / "wrong").write_text("0" * 64)
    wrong = jobs_cli("status", CONDUIT_INFRA_ENV=str(state_dir / "env"), HOME=str(client_home),
                     RAY_AUTH_TOKEN_PATH=str(tmp_path / "wrong"))
    for out in (missing, wrong):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"the Ray cluster at {env['RAY_ADDRESS']} refused this client's token" in out.stderr, out.stderr
        assert "RAY_AUTH_TOKEN_PATH" in out.stderr and token not in out.stderr + out.stdout
    again = run([UP, "--state-dir", state_dir], timeout=60)
    assert again.returncode == 1 and "run infra/local/down" in again.stderr, again.stderr


@pytest.mark.slow
def test_a_bad_config_fails_at_submit_time_and_sends_nothing(services, tmp_path):
    before = services.job_ids()
    typo = services.cli("submit", "configs/smoke.yaml", "trian.steps=3")
    assert typo.returncode == 2 and "unknown key 'trian'" in typo.stderr and "'train'" in typo.stderr, typo.stderr
    bad = ROOT / "configs" / "smoke.yaml"
    yaml_typo = tmp_path / "bad.yaml"
    yaml_typo.write_text(bad.read_text().replace("  steps: 150", "  stesp: 150"))
    nested = services.cli("submit", str(yaml_typo))
    assert nested.returncode == 2 and "unknown key train.'stesp'" in nested.stderr, nested.stderr
    outside = tmp_path / "ok.yaml"
    outside.write_text(bad.read_text())
    refused = services.cli("submit", str(outside))
    assert refused.returncode == 2 and "outside the repository" in refused.stderr, refused.stderr
    assert services.job_ids() == before


@pytest.mark.slow
def test_plain_ray_job_submit_runs_jobs_run_with_the_venv_python(services, data_root):
    entry = "python -c 'import sys; print(\"prefix=\" + sys.prefix)' && python -m jobs.run configs/smoke.yaml --dry-run"
    job_id = f"plain_{uuid.uuid4().hex[:12]}"
    out = run([RAY, "job", "submit", "--address", services.address, "--working-dir", ".", "--no-wait",
               "--submission-id", job_id, "--runtime-env-json",
               json.dumps({"env_vars": {"CONDUIT_DATA_ROOT": str(data_root.resolve())}}),
               "--", "sh", "-c", entry], timeout=180, **services.auth)
    assert out.returncode == 0, out.stderr
    followed = services.cli("logs", job_id, "--follow", timeout=300)
    assert followed.returncode == 0, followed.stdout[-3000:]
    assert f"prefix={ROOT / '.venv'}" in followed.stdout
    assert all(f"{name:<10}" in followed.stdout for name in ORDER)


@pytest.mark.slow
def test_a_local_artifact_root_on_two_nodes_is_refused_before_any_stage(services, tmp_path):
    """The smoke config without ``cluster.shared_storage``, run for real on the two-node cluster: the job's driver
    connects, counts two nodes, and stops before any stage with the path and what to use instead."""
    work = tmp_path / "local_root"
    done = services.cli("submit", "configs/smoke.yaml", *[o for o in SMALL if o != "cluster.shared_storage=true"],
                        f"run.workdir={work}", "--follow", timeout=300)
    assert done.returncode == 1 and "FAILED" in done.stderr, (done.stdout[-3000:], done.stderr[-3000:])
    assert f"the Ray cluster has 2 nodes but run.artifact_root={work / 'artifacts'} is a local path" in done.stdout
    assert "set cluster.shared_storage=true" in done.stdout
    assert not any(f"{name:<10} done" in done.stdout for name in ORDER)
    assert not (work / "artifacts" / "shard").exists()  # no stage began


@pytest.mark.slow
def test_smoke_job_succeeds_and_status_and_logs_say_so(services, smoke_job):
    job_id, output = smoke_job
    assert job_id.startswith("raysubmit_")
    assert "Registered model: models:/conduit-smoke" in output
    assert services.status(job_id) == "SUCCEEDED"
    logs = services.cli("logs", job_id)
    assert logs.returncode == 0 and "register: done" in logs.stdout
    assert (services.workdir / "artifacts" / "register").is_dir(), "artifacts must persist outside the job's working_dir"


@pytest.mark.slow
def test_mlflow_server_holds_the_parent_run_named_after_the_job_its_stages_and_the_model(auth_mlflow, smoke_job):
    """The job logged in with the submitter's login, which reached its driver, its stage tasks and its
    training workers on both nodes (the train run's per-step losses come from a worker)."""
    job_id, _ = smoke_job
    api, auth = auth_mlflow.api, auth_mlflow.auth
    exp = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": "conduit"}, timeout=30, auth=auth).json()
    exp_id = exp["experiment"]["experiment_id"]
    parents = requests.post(f"{api}/runs/search", timeout=30, auth=auth, json={
        "experiment_ids": [exp_id], "filter": f"attributes.run_name = '{job_id}'"}).json().get("runs", [])
    assert len(parents) == 1, f"no parent run named {job_id}"
    parent = parents[0]
    assert parent["info"]["status"] == "FINISHED"
    assert {"key": "conduit.ray_job_id", "value": job_id} in parent["data"]["tags"]
    children = requests.post(f"{api}/runs/search", timeout=30, auth=auth, json={
        "experiment_ids": [exp_id], "filter": f"tags.mlflow.parentRunId = '{parent['info']['run_id']}'"}).json()["runs"]
    by_stage = {c["info"]["run_name"]: c for c in children}
    assert sorted(by_stage) == sorted(ORDER)
    mv = requests.get(f"{api}/registered-models/alias", params={"name": "conduit-smoke", "alias": "challenger"},
                      timeout=30, auth=auth).json()["model_version"]
    assert mv["run_id"] == by_stage["register"]["info"]["run_id"]
    losses = requests.get(f"{api}/metrics/get-history", timeout=30, auth=auth, params={
        "run_id": by_stage["train"]["info"]["run_id"], "metric_key": "loss"}).json()["metrics"]
    losses = [m["value"] for m in sorted(losses, key=lambda m: m["step"])]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_the_login_is_in_no_runtime_env_listing_or_log_and_a_missing_one_sends_nothing(services, auth_mlflow,
                                                                                      smoke_job, tmp_path):
    job_id, _ = smoke_job
    password = auth_mlflow.login["MLFLOW_TRACKING_PASSWORD"]
    listed = run([RAY, "job", "list", "--address", services.address], timeout=120, **services.auth)
    assert listed.returncode == 0 and job_id in listed.stdout, listed.stderr
    assert password not in listed.stdout and "conduit_job_login" not in listed.stdout
    assert "_ray_pkg_" in listed.stdout  # the login package, by its content hash only
    logs = services.cli("logs", job_id)
    assert logs.returncode == 0 and password not in logs.stdout
    before = services.job_ids()
    refused = services.cli("submit", "configs/smoke.yaml", f"run.workdir={tmp_path}", "--tracking-uri",
                           auth_mlflow.uri)
    assert refused.returncode == 2, refused.stderr
    assert f"the MLflow server at {auth_mlflow.uri} turns away a caller with no login (HTTP 401)" in refused.stderr
    assert "MLFLOW_TRACKING_USERNAME" in refused.stderr
    assert services.job_ids() == before


@pytest.mark.slow
def test_training_ranks_ran_on_both_nodes(services, smoke_job):
    workers = services.train_workers()
    assert len(workers) == 2 and all(w["state"] == "DEAD" for w in workers), workers  # the run has ended
    assert len({w["node_id"] for w in workers}) == 2, f"both ranks on one node: {workers}"


@pytest.mark.slow
def test_a_sweep_job_logs_in_with_the_submitters_login_too(services, auth_mlflow, smoke_job):
    """A sweep submitted the same way: its Tune trial and that trial's training worker log in too."""
    done = services.cli("submit", "tests/jobs/sweep_login.yaml", f"run.workdir={services.workdir}",
                        "cluster.shared_storage=true",
                        "--tracking-uri", auth_mlflow.uri, "--follow", timeout=600, **auth_mlflow.login)
    assert done.returncode == 0, f"{done.stdout[-5000:]}\n{done.stderr[-3000:]}"
    api, auth = auth_mlflow.api, auth_mlflow.auth
    exp_id = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": "conduit"}, timeout=30,
                          auth=auth).json()["experiment"]["experiment_id"]
    trials = requests.post(f"{api}/runs/search", timeout=30, auth=auth, json={
        "experiment_ids": [exp_id], "filter": "tags.`conduit.sweep_trial` = 'trial_000'"}).json()["runs"]
    assert len(trials) == 1 and trials[0]["info"]["status"] == "FINISHED", trials
    stages = requests.post(f"{api}/runs/search", timeout=30, auth=auth, json={
        "experiment_ids": [exp_id], "filter": f"tags.mlflow.parentRunId = '{trials[0]['info']['run_id']}'"}).json()
    train = next(r for r in stages["runs"] if r["info"]["run_name"] == "train")
    val = requests.get(f"{api}/metrics/get-history", timeout=30, auth=auth, params={
        "run_id": train["info"]["run_id"], "metric_key": "val_loss"}).json()["metrics"]
    assert sorted(m["step"] for m in val) == [3, 6]  # logged by the trial's training worker


@pytest.mark.slow
def test_stop_ends_a_long_job_and_frees_its_workers(services, smoke_job):
    started = services.cli("submit", "configs/smoke.yaml", *SMALL, "train.steps=100000", "train.compile=false", "--only", "train",
                           f"run.workdir={services.workdir}", "--tracking-uri", services.env["MLFLOW_TRACKING_URI"])
    assert started.returncode == 0, started.stderr
    job_id = started.stdout.strip()
    services.wait_for_line(job_id, "train: running", 300)
    stopped = services.cli("stop", job_id, "--wait", "120", timeout=180)
    assert stopped.returncode == 0 and stopped.stdout.strip() == "STOPPED", stopped.stdout + stopped.stderr
    assert services.status(job_id) == "STOPPED"
    wait_for(lambda: not [w for w in services.train_workers() if w["state"] == "ALIVE"], 120,
             "the stopped job's training workers to end")


@pytest.mark.slow
def test_down_stops_exactly_what_up_started(services):
    """Last of the module: infra/local/down stops exactly the processes up started (by pid and by the
    cluster's own temp dir), and nothing else; a second down has nothing to stop."""
    env, state_dir = services.env, services.state_dir
    token_path = Path(env["RAY_AUTH_TOKEN_PATH"])
    ray_pids = [int(p) for p in env["CONDUIT_RAY_PIDS"].split(",")]
    mlflow_pid = int(env["CONDUIT_MLFLOW_PID"])
    assert len(ray_pids) >= 4 and _alive([*ray_pids, mlflow_pid]) == [*ray_pids, mlflow_pid]
    mlflow_family = [c.pid for c in psutil.Process(mlflow_pid).children(recursive=True)]
    # A process that looks like Ray by name but is not this cluster's (as another person's would be).
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "raylet", "gcs_server"])
    try:
        done = down(state_dir)
        assert done.returncode == 0, done.stderr
        assert "ray: stopped" in done.stdout and f"server pid {mlflow_pid}" in done.stdout, done.stdout
        assert _alive([*ray_pids, mlflow_pid, *mlflow_family]) == []
        assert not (state_dir / "env").exists() and not Path(env["CONDUIT_RAY_TEMP_DIR"]).exists()
        assert not token_path.exists()
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{env['MLFLOW_TRACKING_URI']}/health", timeout=5)
        assert bystander.poll() is None, "down stopped a process that was not this cluster's"
    finally:
        bystander.kill()
        bystander.wait()
    assert "nothing to stop" in down(state_dir).stdout


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
