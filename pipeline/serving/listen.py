"""Where Conduit's servers listen: this machine only (127.0.0.1) unless a setting says otherwise,
and then a warning says what is now reachable from other machines.

The settings: ``cluster.dashboard_host`` (the embedded Ray's dashboard and Jobs API, when
``cluster.include_dashboard``), ``deploy.host`` (Ray Serve's HTTP proxy), ``jobs.serve --host`` (MLflow's
scoring server). None of these servers asks who is calling except the Ray dashboard (token auth), so a
non-loopback address belongs behind a firewall or a NetworkPolicy (infra/k8s/network-policies.yaml).
"""

from __future__ import annotations

import ipaddress
import sys

LOOPBACK_NAMES = {"localhost", "ip6-localhost"}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for 0.0.0.0, :: and every other address or name."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it resolves to some interface other machines may reach


def exposure_warning(what: str, host: str, setting: str) -> str | None:
    """The warning for ``what`` listening on ``host`` (None on loopback), naming the setting that chose it."""
    if is_loopback(host):
        return None
    return (f"warning: {what} listens on {host} ({setting}), reachable from other machines; it asks no "
            f"password. Use 127.0.0.1 unless a firewall or NetworkPolicy limits who reaches it")


def warn_if_exposed(what: str, host: str, setting: str) -> None:
    """Print ``exposure_warning`` to stderr when ``host`` is not loopback."""
    message = exposure_warning(what, host, setting)
    if message is not None:
        print(message, file=sys.stderr, flush=True)
