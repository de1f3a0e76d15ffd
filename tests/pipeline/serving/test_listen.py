"""Servers listen on 127.0.0.1 unless a setting says otherwise, and then Conduit says so."""

from __future__ import annotations

from jobs import serve
from pipeline.config import RunConfig, load_config
from pipeline.serving.listen import is_loopback
from pipeline.runner import local_ray_options


def test_loopback_addresses():
    assert all(is_loopback(h) for h in ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
    assert not any(is_loopback(h) for h in ["0.0.0.0", "::", "10.0.0.5", "mlflow.internal", ""])


def test_every_listening_default_is_loopback():
    cfg = RunConfig()
    assert is_loopback(cfg.cluster.dashboard_host) and is_loopback(cfg.deploy.host)
    assert is_loopback(serve.parse_args(["m@champion", "--port", "5001"]).host)


def test_the_embedded_ray_dashboard_follows_cluster_dashboard_host_and_warns_beyond_loopback(capsys):
    quiet = local_ray_options(load_config(None, ["cluster.include_dashboard=true"]))
    assert quiet["dashboard_host"] == "127.0.0.1" and quiet["include_dashboard"]
    assert capsys.readouterr().err == ""
    exposed = local_ray_options(load_config(None, ["cluster.include_dashboard=true", "cluster.dashboard_host=0.0.0.0"]))
    assert exposed["dashboard_host"] == "0.0.0.0"
    err = capsys.readouterr().err
    assert "warning: the embedded Ray's dashboard and Jobs API listens on 0.0.0.0 (cluster.dashboard_host)" in err
    local_ray_options(load_config(None, ["cluster.dashboard_host=0.0.0.0"]))  # no dashboard started: nothing listens
    assert capsys.readouterr().err == ""
