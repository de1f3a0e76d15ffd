"""Stop a Ray job (SIGTERM to its driver, then SIGKILL; its tasks and Train workers go with it).

    python -m jobs.stop JOB_ID [--wait SECONDS] [--address http://HOST:8265]

Exits 0 once the job is STOPPED (or had already ended), 1 if it is still running after --wait.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import add_address, connect
from pipeline import cluster


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.stop", description=__doc__.splitlines()[0])
    p.add_argument("job_id")
    p.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a terminal status")
    add_address(p)
    args = p.parse_args(argv)
    jc = connect(args.address)
    if jc is None:
        return 2
    jc.stop_job(args.job_id)
    try:
        status = cluster.wait_terminal(jc, args.job_id, args.wait)
    except cluster.ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
