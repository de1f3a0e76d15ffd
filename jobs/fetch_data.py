"""Fetch the corpora the shipped configs read into the data root, each checked against its sha256.

    python -m jobs.fetch_data [--root DIR] [--config CONFIG | --only NAME ...] [--mirror URL_OR_DIR] [--verify]

``make data`` runs it. The data root is ``--root``, else ``$CONDUIT_DATA_ROOT``, else ``../shared/data``
beside the checkout where it exists, else ``data/`` in it: where a run looks when ``data.data_root`` is
unset. A file in place with its checksum is skipped; a missing one is downloaded from its public source,
pinned to a commit (and rebuilt, for the Gutenberg books and ``wiki.test.raw``), or from ``--mirror`` (a
copy of a complete data folder); ``--verify`` downloads nothing. ``--config`` selects the files that
config reads. The table of files, sources and checksums is ``pipeline.data.corpora``.
Exits 0 when every selected file is in place with its checksum, 1 otherwise (naming each file that is
not, and why), 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.data.corpora import CORPORA, default_data_root, files_named
from pipeline.data.fetch import fetch, mirror_base, verify


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.fetch_data", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, help="the data root (default: $CONDUIT_DATA_ROOT, else the run's default)")
    p.add_argument("--mirror", help="an http(s):// or file:// URL or a folder laid out like the data root; "
                                    "replaces every public source")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--only", nargs="+", metavar="NAME", choices=[c.name for c in CORPORA],
                       help=f"these corpora only: {', '.join(c.name for c in CORPORA)}")
    which.add_argument("--config", help="the files this config reads (its data.train_paths and eval paths)")
    p.add_argument("--verify", action="store_true", help="check the files in place; download nothing")
    args = p.parse_args(argv)
    try:
        mirror = mirror_base(args.mirror) if args.mirror else None
    except ValueError as e:
        p.error(str(e))
    wanted = None
    if args.config:
        from pipeline.config import load_config
        from pipeline.errors import EXPECTED_ERRORS, main_exit_code

        try:
            cfg = load_config(args.config)
        except EXPECTED_ERRORS as e:
            return main_exit_code(e)
        wanted = {f.path for pattern in cfg.data_patterns() for f in files_named(pattern)}
    root = (args.root.expanduser().resolve() if args.root else default_data_root())
    print(f"data root: {root}" + (f"; mirror: {mirror}" if mirror else ""))
    bad = 0
    for corpus in (c for c in CORPORA if not args.only or c.name in args.only):
        files = [f for f in corpus.files if wanted is None or f.path in wanted]
        if not files:
            continue
        outcomes = verify(files, root) if args.verify else fetch(files, root, mirror, progress=sys.stderr.isatty())
        counts: dict[str, int] = {}
        for o in outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        print(f"{corpus.name}: " + ", ".join(f"{n} {status}" for status, n in counts.items()))
        for o in outcomes:
            if not o.ok:
                print(f"  {o.status}: {o.detail}")
        bad += sum(not o.ok for o in outcomes)
    sys.stdout.flush()
    if bad:
        print(f"error: {bad} file(s) not in place with their checksum (above)", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
