"""Print a Ray job's status and message, or with no id every job on the cluster.

    python -m jobs.status [JOB_ID] [--address http://HOST:8265]

With an id: prints PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED; exits 1 when the job failed or was
stopped, else 0. Without: one line per job, ``id  status  entrypoint``.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import add_address, connect


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.status", description=__doc__.splitlines()[0])
    p.add_argument("job_id", nargs="?", help="a submission id (raysubmit_...); none lists every job")
    add_address(p)
    args = p.parse_args(argv)
    jc = connect(args.address)
    if jc is None:
        return 2
    if args.job_id is None:
        for job in jc.list_jobs():
            print(f"{job.submission_id}\t{job.status.value}\t{job.entrypoint}")
        return 0
    info = jc.get_job_info(args.job_id)
    status = str(info.status.value)
    print(status)
    if info.message:
        print(info.message, file=sys.stderr)
    return 1 if status in ("FAILED", "STOPPED") else 0


if __name__ == "__main__":
    sys.exit(main())
