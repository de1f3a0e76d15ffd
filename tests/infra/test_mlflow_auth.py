"""The MLflow server of infra/local with MLflow's basic-auth app: a real server, started the way
``infra/local/up --mlflow-auth`` starts it, refuses a request without a user and password."""

from __future__ import annotations

import importlib.util
import stat

import pytest
import requests

from pipeline import tracking
from tests.infra.local_infra import ROOT
from tests.servers import free_port, stop_tree, wait_http

pytestmark = pytest.mark.slow


def services():
    spec = importlib.util.spec_from_file_location("infra_services", ROOT / "infra" / "local" / "services.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_authenticated_mlflow_server_answers_401_without_credentials(tmp_path):
    svc = services()
    port = free_port()
    proc = svc.start_mlflow(tmp_path, port, tmp_path / svc.TOKEN_FILE, auth=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{uri}/health", proc, tmp_path / "mlflow.log", timeout=300)  # /health stays open
        search = f"{uri}/api/2.0/mlflow/experiments/search?max_results=1"
        anonymous = requests.get(search, timeout=30)
        assert anonymous.status_code == 401, anonymous.text
        assert "Basic" in anonymous.headers.get("WWW-Authenticate", ""), anonymous.headers
        password_file = tmp_path / svc.MLFLOW_PASSWORD_FILE
        assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
        assert requests.get(search, auth=(svc.MLFLOW_ADMIN, "wrong-password"), timeout=30).status_code == 401
        admin = requests.get(search, auth=(svc.MLFLOW_ADMIN, password_file.read_text()), timeout=30)
        assert admin.status_code == 200, admin.text
        assert password_file.read_text() not in (tmp_path / "mlflow.log").read_text()

        # jobs.submit's check before it sends a job with the shell's login (or none)
        good = {"MLFLOW_TRACKING_USERNAME": svc.MLFLOW_ADMIN, "MLFLOW_TRACKING_PASSWORD": password_file.read_text()}
        tracking.check_login(uri, good)
        with pytest.raises(tracking.TrackingUnavailable, match=r"turns away a caller with no login \(HTTP 401\)"):
            tracking.check_login(uri, {})
        wrong = {**good, "MLFLOW_TRACKING_PASSWORD": "wrong-password"}
        with pytest.raises(tracking.TrackingUnavailable, match=r"turns away the user 'admin' \(HTTP 401\)") as e:
            tracking.check_login(uri, wrong)
        assert "wrong-password" not in str(e.value)
    finally:
        stop_tree(proc)
