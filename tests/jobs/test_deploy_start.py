"""jobs.deploy's start, on the session's Ray and MLflow server, with Conduit's engine (no vLLM needed): the
engine ``auto`` chooses on CPU and GPU replicas, a vLLM start that cannot begin (its task cancelled, the
version tagged failed, no application left behind), and promotions sent while a deployment starts (waited
for, then rolled over; one that never finishes starting fails the promotion, naming it). The same race on
vLLM: tests/jobs/test_deploy_vllm.py. The module's tests run in file order on one registered model."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import pytest
import requests

from jobs import deploy as deploy_cli, promote
from pipeline import tracking
from pipeline.config import DeploySection
from pipeline.serving import deploy
from tests.jobs.test_deploy import _register_better
from tests.jobs.test_promote_serve import _register_with
from tests.servers import free_port

pytestmark = pytest.mark.slow
MODEL_NAME = "conduit-test-deploy-start"  # this module's registered model (tests/jobs/conftest.py: tiny_run)
APP = f"conduit-{MODEL_NAME}"
CPU_RULE = ("auto: on CPU replicas Conduit's engine answers faster than vLLM below hidden size 768 "
            "(LlamaForCausalLM of hidden size 64 here): benchmarks/RESULTS.md, serve_vllm")


@pytest.fixture(scope="module")
def serve_port(tiny_run, ray_cluster):
    """v1 as champion, and the port of the module's Serve HTTP proxy (Serve shut down after the module)."""
    assert promote.main([MODEL_NAME, "--tracking-uri", tiny_run.uri]) == 0
    yield free_port()
    from ray import serve

    deploy_cli.main([MODEL_NAME, "--down", "--tracking-uri", tiny_run.uri])
    serve.shutdown()


def test_auto_chooses_the_engine_measured_faster_on_the_replicas_hardware(tiny_run, tmp_path):
    """CPU replicas: Conduit's engine at this width (decided before vLLM's interpreter is looked for: none
    is needed); GPU replicas: vLLM. ``engine: vllm`` serves or refuses by what vLLM supports."""
    uri = tiny_run.uri
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    cpu = deploy.choose_engine(DeploySection(vllm_python=missing), uri, MODEL_NAME, 1)
    assert (cpu.engine, cpu.reason) == ("conduit", CPU_RULE)
    gpu = deploy.choose_engine(DeploySection(num_gpus_per_replica=1, vllm_python=""), uri, MODEL_NAME, 1)
    assert (gpu.engine, gpu.reason) == ("vllm", "auto: vLLM on GPU replicas; vLLM serves LlamaForCausalLM on GPU")
    on_gpu = deploy.choose_engine(DeploySection(engine="vllm", num_gpus_per_replica=1, vllm_python=""), uri,
                                  MODEL_NAME, 1)
    assert (on_gpu.engine, on_gpu.reason) == ("vllm", "deploy.engine is vllm; vLLM serves LlamaForCausalLM on GPU")
    with pytest.raises(deploy.DeployError, match=re.escape(
            f"deploy.engine is vllm, but vLLM cannot serve {MODEL_NAME} v1 here: LlamaForCausalLM on CPU: attention "
            "head size 16 is not one of vLLM's CPU kernels'")):
        deploy.choose_engine(DeploySection(engine="vllm", vllm_python=""), uri, MODEL_NAME, 1)


def test_a_vllm_start_that_times_out_is_cancelled_tagged_failed_and_leaves_no_application(tiny_run, serve_port,
                                                                                           tmp_path):
    """The vLLM interpreter answers jobs.deploy's check but cannot run Ray's worker on the node, so the task
    that would run serve.run never starts: at the timeout the task is cancelled, the error says what did not
    start, the version is tagged failed, and no application is left to start later."""
    import ray

    fake = tmp_path / "python"  # exits 0: "vllm is importable" to the check, a worker that dies to Ray
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    # GPU replicas: vLLM serves the tiny model's head size 16 there (the task itself asks for no GPU)
    section = DeploySection(engine="vllm", vllm_python=str(fake), num_gpus_per_replica=1, port=serve_port)
    gcs = ray.get_runtime_context().gcs_address
    with pytest.raises(deploy.DeployError) as e:
        deploy.deploy(section, tiny_run.uri, MODEL_NAME, "champion", gcs, start_timeout_s=5)
    assert str(e.value) == (f"vLLM deployment of {MODEL_NAME} v1 did not start within 5 s (the Ray task that runs "
                            f"serve.run in {fake}): GetTimeoutError; the task was cancelled; {APP} removed")
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(e.value.__cause__.task, timeout=30)
    assert deploy.app_status(MODEL_NAME) == "NOT_DEPLOYED"
    tags = tracking.get_version(tiny_run.uri, MODEL_NAME, 1).tags
    assert tags["deploy.status"] == "failed" and tags["deploy.error"] == f"DeployError: {e.value}"
    assert deploy.served_version(tiny_run.uri, MODEL_NAME) is None


def test_a_promotion_fails_naming_a_deployment_that_never_finishes_starting(tiny_run, serve_port, monkeypatch,
                                                                            capsys):
    """v1's deployment is recorded as starting (by a jobs.deploy that died before it started): the
    promotion waits for it, then exits 1 naming the application, the cluster and what to run. A start that
    fails while a promotion waits for it: exit 1, saying that nothing serves the alias."""
    import ray

    uri = tiny_run.uri
    gcs = ray.get_runtime_context().gcs_address
    v2 = _register_better(tiny_run, "start-v2")
    section = DeploySection(port=serve_port)
    tracking.set_version_tags(uri, MODEL_NAME, 1, {
        "deploy.status": "starting", "deploy.app": APP, "deploy.alias": "champion", "deploy.ray_address": gcs,
        "deploy.endpoint": deploy.endpoint(section), "deploy.settings": json.dumps(dataclasses.asdict(section)),
        "deploy.at": "2026-01-01T00:00:00+00:00"})
    monkeypatch.setattr(deploy, "START_TIMEOUT_S", 3.0)
    assert promote.main([MODEL_NAME, "--version", str(v2), "--tracking-uri", uri]) == 1
    out, err = capsys.readouterr()
    assert f"promoted {MODEL_NAME} v{v2} to @champion; previous: v1" in out
    assert (f"{APP} on the Ray cluster at {gcs} is starting v1: waiting for it (at most 3 s) to roll it to v{v2}"
            in out)
    assert (f"error: @champion now points at v{v2}, but the deployment that served v1 did not follow: '{APP}' on "
            f"the Ray cluster at {gcs} is still starting v1 (deploy.status=starting since 2026-01-01T00:00:00+00:00) "
            f"after 3 s; if its jobs.deploy is gone, deploy again or take it down with: python -m jobs.deploy "
            f"{MODEL_NAME} --down --address {gcs}") in err
    tracking.set_version_tags(uri, MODEL_NAME, 1, {"deploy.status": "down"})  # the dead deployment, taken down

    # A start that fails while the promotion waits for it: the promotion says that nothing serves the alias.
    tracking.set_version_tags(uri, MODEL_NAME, v2, {
        "deploy.status": "starting", "deploy.app": APP, "deploy.alias": "champion", "deploy.ray_address": gcs,
        "deploy.endpoint": deploy.endpoint(section), "deploy.settings": json.dumps(dataclasses.asdict(section)),
        "deploy.at": "2026-01-01T00:00:00+00:00"})
    fails = threading.Timer(1.0, tracking.set_version_tags, (uri, MODEL_NAME, v2, {
        "deploy.status": "failed", "deploy.error": "DeployError: the replica raised"}))
    fails.start()
    assert promote.main([MODEL_NAME, "--rollback", "--reason", "back while it starts", "--tracking-uri", uri]) == 1
    fails.join()
    err = capsys.readouterr().err
    assert (f"error: @champion now points at v1, but the deployment that served v{v2} did not follow: '{APP}' was "
            f"starting v{v2} when @champion moved, but it did not start (deploy.status=failed: DeployError: the "
            "replica raised); nothing serves @champion") in err
    assert tracking.model_aliases(uri, MODEL_NAME)["champion"] == 1


def test_a_promotion_sent_while_the_deployment_starts_rolls_it_once_it_runs(tiny_run, serve_port, capsys):
    """jobs.deploy NAME@champion starts; while Serve deploys it, jobs.promote --force moves @champion. The
    promotion waits for the deployment to run, rolls it, and says so; it serves the new champion."""
    uri = tiny_run.uri
    started = tracking.model_aliases(uri, MODEL_NAME)["champion"]
    base = json.loads((tiny_run.arts["evaluate"].path / "metrics.json").read_text())["metrics"]
    new = _register_with(tiny_run, "start-race", heldout_bits_per_byte=base["heldout_bits_per_byte"] - 1.0)
    result = {}

    def jobs_deploy():
        result["rc"] = deploy_cli.main([f"{MODEL_NAME}@champion", "--tracking-uri", uri, "--port", str(serve_port),
                                        "--replicas", "1", "--cpus", "1"])

    thread = threading.Thread(target=jobs_deploy)
    thread.start()
    deadline = time.monotonic() + 300
    while deploy.app_status(MODEL_NAME) != "DEPLOYING":  # Serve has the application; its replica starts
        assert thread.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.05)
    assert promote.main([MODEL_NAME, "--version", str(new), "--force", "--reason", "promoted while it starts",
                         "--tracking-uri", uri]) == 0
    thread.join(timeout=300)
    assert result == {"rc": 0}
    out = capsys.readouterr().out
    assert f"serving {MODEL_NAME} v{started} (@champion)" in out  # what jobs.deploy started
    assert f"promoted {MODEL_NAME} v{new} to @champion; previous: v{started}" in out  # its gates pass
    assert re.search(rf"^deployment {APP} rolled over to v{new} \(RUNNING\) at \S+, after waiting \d+ s for it to "
                     r"start$", out, re.M), out
    assert f"engine: conduit ({CPU_RULE})" in out
    base = f"http://127.0.0.1:{serve_port}/v1"
    assert requests.get(f"{base}/models", timeout=30).json()["data"][0]["conduit_version"] == new
    tags = {v: tracking.get_version(uri, MODEL_NAME, v).tags for v in (started, new)}
    assert tags[new]["deploy.status"] == "running" and tags[started]["deploy.status"] == "replaced"
    assert tracking.model_aliases(uri, MODEL_NAME)["champion"] == new and deploy.app_status(MODEL_NAME) == "RUNNING"
