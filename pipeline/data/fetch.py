"""Download corpus files into a data root, each checked against its sha256 (``pipeline.data.corpora``).

Why this way: a download that fails or brings the wrong bytes must never leave a file under the name
the pipeline reads, or a later run would train on it. So each missing file is streamed to
``<name>.part`` beside its place, hashed while it is written, and renamed in only when size and sha256
match; otherwise the part file is removed and the error names the file, the source and both digests.
A file already in place with the right checksum is left alone (a second run downloads nothing); one
with a wrong checksum is reported and never overwritten: it may be somebody's own data.

A mirror (an ``http(s)://`` or ``file://`` URL, or a local folder laid out like the data root) replaces
every file's public URL: a copy of a complete data folder supplies the corpora that have no public
copy, and tests serve one from a temporary folder, so they never touch the network.
"""

from __future__ import annotations

import hashlib
import os
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pipeline.data.corpora import CorpusFile

CHUNK_BYTES = 1 << 20
PROGRESS_MIN_BYTES = 1 << 20  # a progress bar only for downloads long enough to wait for
TIMEOUT_S = 60  # per blocking read, not for the whole file


class FetchError(RuntimeError):
    """A file could not be downloaded, or its bytes do not match the table; the message names the file,
    where it came from and, for a mismatch, the expected and the found sha256."""


@dataclass(frozen=True)
class Outcome:
    """What became of one file. ``status`` is one of:

    - ``present``: already in place with the right checksum; ``fetched``: downloaded and checked now;
    - ``missing`` (verify only), ``no source`` (no public URL and no mirror), ``mismatch`` (in place
      with a wrong checksum, left as it is), ``failed`` (the download failed or brought other bytes).

    ``detail`` says why for every status but the first two.
    """

    file: CorpusFile
    status: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("present", "fetched")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def mirror_base(mirror: str) -> str:
    """``mirror`` as a URL prefix: an http(s) or file URL as given, a local folder as a file URL.

    Raises:
        ValueError: neither such a URL nor an existing folder.
    """
    scheme = urllib.parse.urlsplit(mirror).scheme
    if scheme in ("http", "https", "file"):
        return mirror.rstrip("/")
    if "://" not in mirror and Path(mirror).expanduser().is_dir():
        return Path(mirror).expanduser().resolve().as_uri()
    raise ValueError(f"--mirror {mirror!r}: expected an http(s):// or file:// URL or an existing folder")


def source_of(file: CorpusFile, mirror: str | None) -> str | None:
    """Where ``file`` is downloaded from: the mirror (a URL prefix from ``mirror_base``) with the file's
    path under it, else its public URL (None when it has none)."""
    if mirror is not None:
        return f"{mirror}/{urllib.parse.quote(file.path)}"
    return file.url


def _check_in_place(file: CorpusFile, dest: Path) -> Outcome:
    found = sha256_of(dest)
    if found == file.sha256:
        return Outcome(file, "present")
    return Outcome(file, "mismatch", f"{dest} has sha256 {found} ({dest.stat().st_size} bytes), expected "
                                     f"{file.sha256} ({file.size} bytes); left as it is: remove it to fetch it again")


def download(file: CorpusFile, url: str, dest: Path, progress: bool = False) -> None:
    """Stream ``url`` to ``dest``'s part file and rename it to ``dest`` once its bytes match ``file``.

    Raises:
        FetchError: the download failed, or brought more bytes than ``file.size`` or another sha256;
            no part file is left behind and ``dest`` is not written.
    """
    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    h, n = hashlib.sha256(), 0
    bar = tqdm(total=file.size, unit="B", unit_scale=True, desc=file.path,
               disable=not progress or file.size < PROGRESS_MIN_BYTES)
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, part.open("wb") as out:
            while chunk := response.read(CHUNK_BYTES):
                n += len(chunk)
                if n > file.size:  # a wrong file (an error page, another version): stop reading it
                    break
                h.update(chunk)
                out.write(chunk)
                bar.update(len(chunk))
        if n != file.size or h.hexdigest() != file.sha256:
            got = f"more than {file.size} bytes" if n > file.size else f"sha256 {h.hexdigest()} ({n} bytes)"
            raise FetchError(f"{file.path}: the copy from {url} has {got}, expected sha256 {file.sha256} "
                             f"({file.size} bytes); nothing was written to {dest}")
        os.replace(part, dest)
    except OSError as e:  # urllib's URLError and HTTPError are OSErrors, as are timeouts and disk errors
        raise FetchError(f"{file.path}: downloading {url} failed: {e}; nothing was written to {dest}") from e
    finally:
        bar.close()
        part.unlink(missing_ok=True)


def fetch_file(file: CorpusFile, root: Path, mirror: str | None = None, progress: bool = False) -> Outcome:
    """Bring ``file`` into ``root`` unless it is there with its checksum (see the module docstring).

    Args:
        mirror: a URL prefix from ``mirror_base`` that replaces the file's public URL, or None.
    """
    dest = root / file.path
    if dest.is_file():
        return _check_in_place(file, dest)
    url = source_of(file, mirror)
    if url is None:
        return Outcome(file, "no source", f"{dest} is missing and there is no public copy of these bytes; "
                                          "fetch it from a mirror (a copy of a complete data folder)")
    try:
        download(file, url, dest, progress)
    except FetchError as e:
        return Outcome(file, "failed", str(e))
    return Outcome(file, "fetched")


def fetch(files: Iterable[CorpusFile], root: Path, mirror: str | None = None,
          progress: bool = False) -> list[Outcome]:
    """``fetch_file`` for each of ``files`` in turn; one file's failure does not stop the others."""
    return [fetch_file(f, root, mirror, progress) for f in files]


def verify(files: Iterable[CorpusFile], root: Path) -> list[Outcome]:
    """Check the files in ``root`` against their checksums; download nothing."""
    return [_check_in_place(f, root / f.path) if (root / f.path).is_file()
            else Outcome(f, "missing", f"{root / f.path} is missing") for f in files]
