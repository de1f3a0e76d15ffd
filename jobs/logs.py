"""Print a Ray job's logs so far, or with --follow stream them until it ends.

    python -m jobs.logs JOB_ID [--follow] [--address http://HOST:8265]
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import add_address, connect
from pipeline import cluster


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.logs", description=__doc__.splitlines()[0])
    p.add_argument("job_id")
    p.add_argument("--follow", action="store_true", help="stream until the job ends; exit with its status")
    add_address(p)
    args = p.parse_args(argv)
    jc = connect(args.address)
    if jc is None:
        return 2
    if args.follow:
        return cluster.exit_code(cluster.follow(jc, args.job_id))
    sys.stdout.write(jc.get_job_logs(args.job_id))
    return 0


if __name__ == "__main__":
    sys.exit(main())
