"""What the job-control commands (status, logs, stop) share: the address flag and the connection."""

from __future__ import annotations

import argparse
import sys

from pipeline import cluster


def add_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray Jobs API (default: $RAY_ADDRESS, then the infra env file)")


def connect(address: str | None):
    """A JobSubmissionClient, or None after printing why there is none (the caller exits 2)."""
    try:
        return cluster.client(address)
    except cluster.ClusterError as e:  # no address known, nothing answers there, or the token is refused
        print(f"error: {e}", file=sys.stderr)
        return None
