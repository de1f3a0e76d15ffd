"""The deploy config section, where jobs.deploy looks for the cluster, and the RayService manifest (no
services started)."""

from __future__ import annotations

import yaml
import pytest

from pipeline import cluster
from pipeline.serving import deploy
from pipeline.config import ConfigError, DeploySection, load_config
from tests.servers import ROOT


def test_deploy_section_defaults_overrides_and_bad_values():
    cfg = load_config(None, ["deploy.num_replicas=3", "deploy.port=9000", "deploy.num_gpus_per_replica=0.5"])
    assert (cfg.deploy.num_replicas, cfg.deploy.port, cfg.deploy.num_gpus_per_replica) == (3, 9000, 0.5)
    assert (cfg.deploy.batching, cfg.deploy.max_batch_tokens) == ("continuous", 65536)
    assert deploy.endpoint(cfg.deploy) == "http://127.0.0.1:9000/v1"
    assert deploy.endpoint(DeploySection(route_prefix="/lm")) == "http://127.0.0.1:8000/lm/v1"
    for override, needle in [("deploy.num_replicas=0", "deploy.num_replicas=0 must be >= 1"),
                             ("deploy.port=70000", "deploy.port=70000 must be in 1..65535"),
                             ("deploy.route_prefix=lm", "must start with '/'"),
                             ("deploy.batching=dynamic", "deploy.batching='dynamic' must be 'continuous' or 'static'"),
                             ("deploy.max_batch_tokens=0", "deploy.max_batch_tokens=0 must be >= 1"),
                             ("deploy.replicas=2", "did you mean 'num_replicas'")]:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [override])


def test_the_gcs_address_comes_from_the_flag_the_environment_or_the_env_file(tmp_path, monkeypatch):
    env_file = tmp_path / "env"
    env_file.write_text("RAY_ADDRESS=http://127.0.0.1:8265\nCONDUIT_RAY_GCS_ADDRESS=127.0.0.1:6390\n"
                        "RAY_AUTH_MODE=token\nRAY_AUTH_TOKEN_PATH=/secret/token\n")
    monkeypatch.setenv(cluster.ENV_FILE_VAR, str(env_file))
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(var, "")  # so that monkeypatch removes what apply_auth sets below, afterwards
        monkeypatch.delenv(var)
    assert deploy.resolve_address("10.0.0.1:6379") == "10.0.0.1:6379"
    assert deploy.resolve_address(None) == "127.0.0.1:6390"
    monkeypatch.setenv("RAY_ADDRESS", "http://elsewhere:8265")  # a Jobs API URL is not a GCS address
    assert deploy.resolve_address(None) == "127.0.0.1:6390"
    monkeypatch.setenv("RAY_ADDRESS", "ray-head:6379")
    assert deploy.resolve_address(None) == "ray-head:6379"
    cluster.apply_auth("ray-head:6379")  # not the env file's cluster: its token is not taken
    assert "RAY_AUTH_TOKEN_PATH" not in __import__("os").environ
    cluster.apply_auth("127.0.0.1:6390")  # the env file's GCS address: its token is
    assert __import__("os").environ["RAY_AUTH_TOKEN_PATH"] == "/secret/token"
    env_file.unlink()
    monkeypatch.delenv("RAY_ADDRESS")
    assert deploy.resolve_address(None) is None  # Ray starts in the process


def test_rayservice_manifest_serves_the_champion_with_the_clusters_token():
    (svc,) = list(yaml.safe_load_all((ROOT / "infra" / "k8s" / "rayservice.yaml").read_text()))
    assert svc["kind"] == "RayService" and svc["apiVersion"] == "ray.io/v1"
    (app,) = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "pipeline.serving.app:app_builder" and app["route_prefix"] == "/"
    assert app["args"]["model"].endswith("@champion")
    (dep,) = app["deployments"]
    assert dep["name"] == "ConduitServer" and dep["num_replicas"] >= 1
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(__import__(module, fromlist=[attr]), attr))  # the import path exists
    cluster_cfg = svc["spec"]["rayClusterConfig"]
    assert cluster_cfg["rayVersion"] == "2.60.0"
    pods = [cluster_cfg["headGroupSpec"]] + cluster_cfg["workerGroupSpecs"]
    for group in pods:
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token"
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "conduit-ray-token", "key": "token"}
        assert env["MLFLOW_TRACKING_URI"]["value"].startswith("http://mlflow")
    readme = (ROOT / "infra" / "README.md").read_text()
    assert "rayservice.yaml" in readme


def test_jobs_deploy_refuses_bad_references_and_settings_before_connecting(capsys):
    from jobs import deploy as deploy_cli

    for argv, needle in [(["a@b@c"], "must look like NAME or NAME@ALIAS"), (["name@"], "must look like NAME"),
                         (["name", "--replicas", "0"], "deploy.num_replicas=0 must be >= 1"),
                         (["name", "--port", "99999"], "deploy.port=99999")]:
        assert deploy_cli.main(argv) == 2
        assert needle in capsys.readouterr().err


def test_the_status_line_says_rate_latency_errors_and_batch():
    from jobs.deploy import status_line

    before = {"version": 3, "batches": {"largest": 2}, "completions": {"ok": 10, "errors": 1, "p50_latency_s": 0.5}}
    now = {"version": 3, "batches": {"largest": 6}, "completions": {"ok": 30, "errors": 2, "p50_latency_s": 0.25}}
    assert status_line(now, before, 4.0) == ("v3: 5.0 completions/s, p50 0.25 s, 30 answered, 2 errors, "
                                             "largest batch 6")
    idle = {"version": 1, "batches": {"largest": 0}, "completions": {"ok": 0, "errors": 0, "p50_latency_s": None}}
    assert status_line(idle, None, 2.0) == "v1: 0.0 completions/s, p50 -, 0 answered, 0 errors, largest batch 0"
    on_vllm = {**now, "engine": "vllm"}  # vLLM batches on its own; its ingress counts requests in flight
    assert status_line(on_vllm, before, 4.0).endswith("30 answered, 2 errors, most in flight 6")


def test_jobs_status_lists_a_driver_by_its_job_id_and_a_deployment_as_one():
    from types import SimpleNamespace

    from jobs.status import describe

    def job(sid, entry):
        return SimpleNamespace(submission_id=sid, job_id="02000000", status=SimpleNamespace(value="RUNNING"),
                               entrypoint=entry)

    assert describe(job("raysubmit_x", "python -m jobs.run c.yaml")) == "raysubmit_x\tRUNNING\tpython -m jobs.run c.yaml"
    assert describe(job(None, "python -m jobs.deploy m@champion")) == \
        "deployment (jobs.deploy) 02000000\tRUNNING\tpython -m jobs.deploy m@champion"
    assert describe(job(None, "/repo/jobs/deploy.py m --port 8001")).startswith("deployment (jobs.deploy) 02000000")
    assert describe(job(None, "python train.py")) == "driver 02000000\tRUNNING\tpython train.py"
