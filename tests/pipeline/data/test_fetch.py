"""Fetching corpus files (``pipeline.data.fetch``) from a mirror served here: a local HTTP server over a
temporary folder holding copies of two small shared files. Nothing here reaches the network."""

from __future__ import annotations

import functools
import hashlib
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pipeline.data.corpora import CORPORA
from pipeline.data.fetch import fetch, mirror_base, source_of, verify

FILES = {f.path: f for c in CORPORA for f in c.files}
# The two smallest files of the table (70 kB and 158 kB): enough to stream in several reads of a socket.
SMALL = [FILES["gutenberg/train/pg00041_legend_of_sleepy_hollow.txt"],
         FILES["gutenberg/heldout/pg00046_a_christmas_carol.txt"]]


class Mirror:
    """A folder laid out like a data root, served over HTTP on 127.0.0.1; ``requests`` lists the paths
    asked for."""

    def __init__(self, folder: Path):
        self.folder, self.requests = folder, []
        requests = self.requests

        class Handler(SimpleHTTPRequestHandler):
            def log_message(self, *args):
                requests.append(self.path)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(folder)))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/data"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def file(self, path: str) -> Path:
        return self.folder / "data" / path


@pytest.fixture
def mirror(tmp_path, data_root, monkeypatch):
    for var in ("no_proxy", "NO_PROXY"):  # a proxy in the environment must not see 127.0.0.1
        monkeypatch.setenv(var, "127.0.0.1")
    m = Mirror(tmp_path / "mirror")
    for f in SMALL:
        m.file(f.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_root / f.path, m.file(f.path))
    m.thread.start()
    yield m
    m.server.shutdown()
    m.server.server_close()


def leftovers(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_fetches_into_an_empty_root_checked_and_a_second_run_downloads_nothing(tmp_path, mirror):
    root = tmp_path / "root"
    assert [o.status for o in fetch(SMALL, root, mirror_base(mirror.url))] == ["fetched", "fetched"]
    for f in SMALL:
        assert hashlib.sha256((root / f.path).read_bytes()).hexdigest() == f.sha256
    assert leftovers(root) == sorted(f.path for f in SMALL)  # no part file
    asked = list(mirror.requests)
    assert len(asked) == 2
    assert [o.status for o in fetch(SMALL, root, mirror_base(mirror.url))] == ["present", "present"]
    assert mirror.requests == asked
    assert all(o.ok for o in verify(SMALL, root))


@pytest.mark.parametrize("corrupt", [
    lambda b: b[:1000] + bytes([b[1000] ^ 1]) + b[1001:],  # one bit flipped: same size, other digest
    lambda b: b + b"more",  # longer than the table says: reading stops there
])
def test_a_corrupted_mirror_file_is_named_and_leaves_nothing(tmp_path, mirror, corrupt):
    f = SMALL[0]
    bad = corrupt(mirror.file(f.path).read_bytes())
    mirror.file(f.path).write_bytes(bad)
    root = tmp_path / "root"
    (outcome,) = fetch([f], root, mirror_base(mirror.url))
    assert outcome.status == "failed" and not outcome.ok
    assert outcome.detail.startswith(f"{f.path}: the copy from {mirror.url}/{f.path} has ")
    assert f"expected sha256 {f.sha256} ({f.size} bytes); nothing was written to {root / f.path}" in outcome.detail
    if len(bad) == f.size:
        assert f"sha256 {hashlib.sha256(bad).hexdigest()} ({f.size} bytes)" in outcome.detail
    else:
        assert f"has more than {f.size} bytes" in outcome.detail
    assert leftovers(root) == []


def test_an_unreachable_file_is_named_and_leaves_nothing(tmp_path, mirror):
    f = SMALL[0]
    mirror.file(f.path).unlink()
    root = tmp_path / "root"
    (outcome,) = fetch([f], root, mirror_base(mirror.url))
    assert outcome.status == "failed"
    assert f"{f.path}: downloading {mirror.url}/{f.path} failed: HTTP Error 404" in outcome.detail
    assert leftovers(root) == []


def test_a_folder_mirror_and_the_files_without_a_public_copy(tmp_path, data_root, mirror):
    root = tmp_path / "root"
    # No mirror: the Gutenberg books have no URL, so nothing is tried, and the reason is given.
    assert [(o.status, o.detail) for o in fetch(SMALL[:1], root)] == [
        ("no source", f"{root / SMALL[0].path} is missing and there is no public copy of these bytes; "
                      "fetch it from a mirror (a copy of a complete data folder)")]
    assert leftovers(root) == []
    # A plain folder is a mirror too (read through a file:// URL).
    folder = mirror_base(str(mirror.folder / "data"))
    assert folder.startswith("file://") and source_of(SMALL[0], folder) == f"{folder}/{SMALL[0].path}"
    assert [o.status for o in fetch(SMALL, root, folder)] == ["fetched", "fetched"]
    assert mirror.requests == []


def test_a_wrong_file_in_place_is_reported_and_kept(tmp_path, mirror):
    root = tmp_path / "root"
    f = SMALL[1]
    (root / f.path).parent.mkdir(parents=True)
    (root / f.path).write_text("somebody's own text")
    (outcome,) = fetch([f], root, mirror_base(mirror.url))
    assert outcome.status == "mismatch"
    own = hashlib.sha256("somebody's own text".encode()).hexdigest()
    assert outcome.detail.startswith(f"{root / f.path} has sha256 {own} (19 bytes), expected {f.sha256}")
    assert f"({f.size} bytes); left as it is: remove it to fetch it again" in outcome.detail
    assert (root / f.path).read_text() == "somebody's own text" and mirror.requests == []
    assert [o.status for o in verify(SMALL, root)] == ["missing", "mismatch"]


def test_a_mirror_is_a_url_or_an_existing_folder(tmp_path):
    assert mirror_base("https://example.org/data/") == "https://example.org/data"
    assert mirror_base(str(tmp_path)) == tmp_path.resolve().as_uri()
    with pytest.raises(ValueError, match=r"--mirror 'ftp://x': expected an http\(s\):// or file:// URL"):
        mirror_base("ftp://x")
    with pytest.raises(ValueError, match="or an existing folder"):
        mirror_base(str(tmp_path / "nope"))
