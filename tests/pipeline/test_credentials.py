"""No secret reaches MLflow params, a manifest, a log line or a Ray runtime env: a credential in any
URI of the config is refused at load, and URIs from the environment or a flag before they are used."""

from __future__ import annotations

import dataclasses
import json
import os
import typing

import pytest

from jobs import serve
from pipeline import cluster, credentials, tracking
from pipeline.config import ConfigError, RunConfig, config_from_dict
from pipeline.credentials import CredentialsInUri, found_in, redact

SECRET = "s3cr3tVALUE"
WITH_CREDENTIALS = [
    f"postgresql://mlflow:{SECRET}@db.internal:5432/mlflow",
    f"s3://AKIAEXAMPLE:{SECRET}@bucket/checkpoints",
    f"s3://bucket/corpus/*.txt?endpoint_override=minio:9000&secret_key={SECRET}",
    f"https://user:{SECRET}@mlflow.example.com",
    f"gs://bucket/x?token={SECRET}",
]


def string_fields(cls=RunConfig, prefix: str = "") -> dict[str, bool]:
    """Every field of the config schema that holds free text (where a URI can go): dotted name ->
    whether it is a list. Read from the dataclasses, so a new field is covered without editing this."""
    out: dict[str, bool] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, name = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hint):
            out.update(string_fields(hint, f"{name}."))
            continue
        args = typing.get_args(hint)
        if hint is str or (str in args and type(None) in args):
            out[name] = False
        elif typing.get_origin(hint) is list and args == (str,):
            out[name] = True
    return out


def test_the_schema_walk_finds_the_uri_fields():
    fields = string_fields()
    assert {"tracking.uri", "checkpoint.resume_from", "checkpoint.storage", "run.artifact_root", "run.workdir",
            "data.data_root", "data.train_paths", "eval.heldout_paths", "cluster.address"} <= set(fields)
    assert fields["data.train_paths"] and not fields["tracking.uri"]


@pytest.mark.parametrize("field", sorted(string_fields()))
def test_a_credential_in_any_uri_field_is_refused_naming_the_field(field):
    *sections, name = field.split(".")
    is_list = string_fields()[field]
    for uri in WITH_CREDENTIALS:
        raw = {name: [uri] if is_list else uri}
        for section in reversed(sections):  # data.quality.language.languages -> {data: {quality: {...}}}
            raw = {section: raw}
        with pytest.raises(ConfigError) as e:
            config_from_dict(raw)
        message = str(e.value)
        assert f"{field}{'[0]' if is_list else ''} has credentials in its URI" in message, message
        assert SECRET not in message and "in the environment instead" in message


def test_user_names_and_plain_uris_are_not_secrets():
    for ok in ["hdfs://alice@namenode/corpus", "s3://bucket/x?endpoint_override=minio:9000&scheme=http",
               "http://127.0.0.1:5000", "sqlite:////tmp/mlflow.db", "Once upon a time: user:pass"]:
        assert found_in(ok) is None, ok
    config_from_dict({"tracking": {"uri": "http://127.0.0.1:5000"}, "checkpoint": {"resume_from": "s3://b/ckpt"}})
    assert redact(f"at postgresql://mlflow:{SECRET}@db/x and s3://b/k?scheme=http&secret_key={SECRET}") == \
        "at postgresql://mlflow:***@db/x and s3://b/k?scheme=http&secret_key=***"


def test_credentials_from_the_environment_or_a_flag_are_refused_before_use(monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", WITH_CREDENTIALS[0])
    with pytest.raises(ConfigError, match=r"\$MLFLOW_TRACKING_URI has credentials") as e:
        RunConfig().tracking_uri()  # what the runner resolves into the logged config
    assert SECRET not in str(e.value)
    with pytest.raises(CredentialsInUri, match="the MLflow tracking URI has credentials"):
        tracking.client(WITH_CREDENTIALS[3])  # every MLflow call passes here, before any connection
    with pytest.raises(cluster.ClusterError, match="environment variable MLFLOW_TRACKING_URI has credentials"):
        cluster.job_spec("configs/smoke.yaml", [], {"MLFLOW_TRACKING_URI": WITH_CREDENTIALS[0]})  # a runtime env
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert serve.main(["m@champion", "--port", "5001", "--tracking-uri", WITH_CREDENTIALS[3]]) == 2
    out = capsys.readouterr()
    assert "has credentials in its URI" in out.err and SECRET not in out.out + out.err


# ---- an MLflow login, carried to a submitted job -------------------------------------------------
LOGIN_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def test_the_submitters_login_comes_from_its_shell_or_the_env_files_password_file(tmp_path, monkeypatch):
    for key in LOGIN_VARS:
        monkeypatch.delenv(key, raising=False)
    password = tmp_path / "mlflow_admin_password"
    password.write_text(SECRET)
    env_file = tmp_path / "env"
    env_file.write_text("MLFLOW_TRACKING_URI=http://127.0.0.1:5999\nMLFLOW_TRACKING_USERNAME=admin\n"
                        f"CONDUIT_MLFLOW_PASSWORD_FILE={password}\n")
    monkeypatch.setenv("CONDUIT_INFRA_ENV", str(env_file))
    # the env file's server: its user and password file
    assert cluster.mlflow_login("http://127.0.0.1:5999") == {"MLFLOW_TRACKING_USERNAME": "admin",
                                                              "MLFLOW_TRACKING_PASSWORD": SECRET}
    # another server never gets the env file's password
    assert cluster.mlflow_login("http://mlflow.example.com") == {}
    # the shell's own login comes first
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "alices-password")
    assert cluster.mlflow_login("http://127.0.0.1:5999") == {"MLFLOW_TRACKING_USERNAME": "alice",
                                                              "MLFLOW_TRACKING_PASSWORD": "alices-password"}
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")
    password.unlink()
    with pytest.raises(cluster.ClusterError, match="CONDUIT_MLFLOW_PASSWORD_FILE=.*cannot be read"):
        cluster.mlflow_login("http://127.0.0.1:5999")


def test_the_login_travels_as_a_package_never_in_the_jobs_env_vars(tmp_path, monkeypatch):
    login = {"MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": SECRET}
    package = credentials.job_login_package(tmp_path / "pkg", login)
    assert (package / "login.json").stat().st_mode & 0o777 == 0o600
    spec = cluster.job_spec("configs/smoke.yaml", [], {"CONDUIT_DATA_ROOT": "/data"}, login_package=package)
    assert spec.runtime_env["py_modules"] == [str(package)]
    assert SECRET not in json.dumps(spec.runtime_env) and SECRET not in spec.entrypoint
    with pytest.raises(cluster.ClusterError, match="MLFLOW_TRACKING_PASSWORD would be shown by `ray job list`"):
        cluster.job_spec("configs/smoke.yaml", [], {"MLFLOW_TRACKING_PASSWORD": SECRET})

    # In the job's processes (the package on the import path, as Ray puts it): the submitter's login
    # replaces the node's, and only once.
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setattr(credentials, "_login_applied", False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "the-nodes-service-token")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "service")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert credentials.apply_job_login() == ["MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME"]
    assert {k: os.environ.get(k) for k in LOGIN_VARS} == {**login, "MLFLOW_TRACKING_TOKEN": None}
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "changed-later")
    assert credentials.apply_job_login() == [] and os.environ["MLFLOW_TRACKING_USERNAME"] == "changed-later"


def test_without_a_package_nothing_changes(monkeypatch):
    monkeypatch.setattr(credentials, "_login_applied", False)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "service")
    assert credentials.apply_job_login() == []
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "service"
