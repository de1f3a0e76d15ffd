"""The stranger's first command: ``make run`` on a copy of the repository in a folder with no ``../shared``
beside it. Its set-up fetches the demo's corpora from their public sources (played by a local server, in
the sources' own formats: raw e-books, the WikiText rows, the verbatim LAMBADA file) into the clone's own
``data/`` folder, each byte for byte the shared file, and the run goes on to shard them."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess

import pytest

from pipeline.base import REPO_ROOT
from pipeline.config import load_config
from pipeline.data.corpora import GITHUB_RAW_ENV, files_named
from pipeline.data.fetch import STAGING
from tests.corpus_sources import SourceServer, url_path

pytestmark = pytest.mark.slow


def copy_checkout(dest):
    """The checkout's files as a clone of it would hold them (tracked, and new files git does not ignore)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO_ROOT, check=True,
                            capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        if (REPO_ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / name, dest / name)


def test_make_run_on_a_clone_anywhere_fetches_the_demos_data_then_runs(tmp_path, data_root):
    clone = tmp_path / "anywhere" / "conduit"
    copy_checkout(clone)
    assert not (clone.parent.parent / "shared").exists() and not (clone / "data").exists()
    cfg = load_config(REPO_ROOT / "configs" / "demo.yaml")
    files = list({f.path: f for p in cfg.data_patterns() for f in files_named(p)}.values())
    assert len(files) == 39 + 5 + 1 + 1  # the training books, the held-out ones, WikiText-2, LAMBADA
    env = {k: v for k, v in os.environ.items()
           if k not in ("CONDUIT_DATA_ROOT", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    with SourceServer() as server:
        for f in files:
            server.serve(f, (data_root / f.path).read_bytes())
        env.update({GITHUB_RAW_ENV: server.url, "no_proxy": "127.0.0.1", "NO_PROXY": "127.0.0.1"})
        venv = REPO_ROOT / ".venv"
        done = subprocess.run(
            ["make", "--no-print-directory", "-o", f"{venv}/.installed", "run", f"VENV={venv}",
             f"ARGS=--until shard run.workdir={tmp_path / 'work'}"],
            cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    root = clone / "data"
    assert (f"data: 46 file(s) the config reads are not under the data root {root}; fetching them from their "
            "public sources (make data)\ndata: 46 file(s) fetched and checked\n") in done.stdout, out
    assert "shard      ran" in done.stdout, out
    assert sorted(server.requests) == sorted(url_path(f) for f in files)
    for f in files:  # the shared folder's bytes, so the demo trains here exactly as it does beside it
        assert hashlib.sha256((root / f.path).read_bytes()).hexdigest() == f.sha256, f.path
    assert not (root / STAGING).exists()
