"""Print a Ray job's status and message, or with no id every job on the cluster.

    python -m jobs.status [JOB_ID] [--address http://HOST:8265]

With an id: prints PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED; exits 1 when the job failed or was
stopped, else 0. Without: one line per job, ``id  status  entrypoint``. A process connected to the
cluster as a driver (not submitted) has no submission id: it is listed by its Ray job id, and a
``jobs.deploy`` driver as the deployment it holds.
"""

from __future__ import annotations

import argparse
import sys

from jobs._cli import add_address, connect


def describe(job) -> str:
    """``id  status  entrypoint`` of a listed job; a driver (no submission id) by its Ray job id."""
    if job.submission_id is not None:
        return f"{job.submission_id}\t{job.status.value}\t{job.entrypoint}"
    entry = job.entrypoint or ""  # a driver's command line; ``-m jobs.deploy`` shows as .../jobs/deploy.py
    kind = "deployment (jobs.deploy)" if "jobs.deploy" in entry or "jobs/deploy.py" in entry else "driver"
    return f"{kind} {job.job_id}\t{job.status.value}\t{job.entrypoint}"


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
            print(describe(job))
        return 0
    info = jc.get_job_info(args.job_id)
    status = str(info.status.value)
    print(status)
    if info.message:
        print(info.message, file=sys.stderr)
    return 1 if status in ("FAILED", "STOPPED") else 0


if __name__ == "__main__":
    sys.exit(main())
