"""The Kubernetes manifests keep MLflow behind a password and a NetworkPolicy (read, not applied)."""

from __future__ import annotations

import yaml

from pipeline.credentials import found_in
from tests.infra.local_infra import ROOT

K8S = ROOT / "infra" / "k8s"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def test_mlflow_requires_a_password_and_no_secret_sits_in_a_uri():
    server = next(d for d in docs("mlflow.yaml") if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    container = server["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(container["args"])
    assert "--app-name basic-auth" in command and "flask-wtf==" in command
    assert found_in(command.replace("${", "{")) is None, command  # the database password is PGPASSWORD
    env = {e["name"]: e for e in container["env"]}
    assert {"PGPASSWORD", "MLFLOW_AUTH_CONFIG_PATH", "MLFLOW_AUTH_ADMIN_PASSWORD",
            "MLFLOW_FLASK_SERVER_SECRET_KEY"} <= set(env)
    assert all("valueFrom" in env[k] for k in ("PGPASSWORD", "MLFLOW_AUTH_ADMIN_PASSWORD"))
    auth_ini = next(d for d in docs("mlflow.yaml") if d["kind"] == "ConfigMap")["data"]["basic_auth.ini"]
    assert found_in(auth_ini) is None and "default_permission = READ" in auth_ini
    for name in ("raycluster.yaml", "rayservice.yaml"):  # the Ray pods log in
        text = (K8S / name).read_text()
        assert "MLFLOW_TRACKING_USERNAME" in text and "key: admin-password" in text, name


def test_network_policies_guard_mlflow_its_stores_and_the_ray_dashboards():
    assert "network-policies.yaml" in yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    guarded = {tuple(sorted(p["spec"]["podSelector"]["matchLabels"].items())): p
               for p in docs("network-policies.yaml") if p["kind"] == "NetworkPolicy"}
    for labels in ({"app": "mlflow"}, {"app": "mlflow-postgres"}, {"app": "minio"}, {"ray.io/is-ray-node": "yes"}):
        policy = guarded[tuple(sorted(labels.items()))]
        assert policy["spec"]["policyTypes"] == ["Ingress"] and all(rule.get("from") for rule in policy["spec"]["ingress"])
    dashboard = [r for r in guarded[(("ray.io/is-ray-node", "yes"),)]["spec"]["ingress"] if "ports" in r]
    assert dashboard == [{"from": [{"podSelector": {"matchLabels": {"conduit.io/ray-client": "true"}}}],
                          "ports": [{"port": 8265}]}]
    submitter = docs("rayjob.yaml")[0]["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    assert submitter["conduit.io/ray-client"] == "true"
