"""Download the corpus files of ``pipeline.data.corpora`` into a data root, rebuilt where they are rebuilt,
each checked against its sha256.

Why this way: a download that fails, is cut short or brings other bytes must never leave a file under
the name the pipeline reads, or a later run would train on it. pooch (``pooch.retrieve``) streams each
download to a temporary file in the staging folder ``<root>/.fetching`` and moves it into place there
only when it is complete (and, for a verbatim file, when its sha256 is the table's); a rebuilt file is
made from that source in memory, checked, written to the staging folder and renamed in. So a file
appears under its name only with its checksum, and an interrupted fetch leaves nothing under a name the
pipeline reads; the next run skips the files already in place. A file in place with the right checksum is left
alone (a second run downloads nothing); one with a wrong checksum is reported and never overwritten:
it may be somebody's own data.

A mirror (an ``http(s)://`` or ``file://`` URL, or a local folder laid out like the data root) replaces
every source: a copy of a complete data folder, read verbatim. ``$CONDUIT_GITHUB_RAW_URL`` instead
replaces GitHub's raw-file host in every source URL (a proxy of it; the tests' local server), and the
files are still rebuilt from their sources.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pipeline.data.corpora import CorpusFile, files_named

CHUNK_BYTES = 1 << 20
STAGING = ".fetching"  # under the data root: downloads in flight and sources awaiting their rebuild
TIMEOUT_S = 60  # per blocking read, not for the whole file


class FetchError(RuntimeError):
    """A file could not be downloaded or rebuilt, or its bytes do not match the table; the message names
    the file, where it came from and, for a mismatch, the expected and the found sha256."""


@dataclass(frozen=True)
class Outcome:
    """What became of one file. ``status`` is one of:

    - ``present``: already in place with the right checksum; ``fetched``: downloaded (and rebuilt) now;
    - ``missing`` (verify only), ``mismatch`` (in place with a wrong checksum, left as it is), ``failed``
      (the download or the rebuild failed, or brought other bytes).

    ``detail`` says why for every status but the first two; ``source`` is where the file was (or was to
    be) downloaded from.
    """

    file: CorpusFile
    status: str
    detail: str = ""
    source: str = ""

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


def source_of(file: CorpusFile, mirror: str | None = None) -> str:
    """Where ``file`` is downloaded from: the mirror (a URL prefix from ``mirror_base``) with the file's
    path under it, else its source's URL."""
    if mirror is not None:
        return f"{mirror}/{urllib.parse.quote(file.path)}"
    return file.source.url()


def builder(file: CorpusFile, mirror: str | None = None) -> Callable[[bytes], bytes] | None:
    """The function that makes ``file`` from its downloaded source, or None where the download is the
    file (a verbatim source, or any file read from a mirror)."""
    if mirror is not None or file.source.build == "verbatim":
        return None
    if file.source.build == "gutenberg":
        from pipeline.data.gutenberg import BOOK_RULES, BookRules, clean_ebook

        rules = BOOK_RULES.get(Path(file.path).name, BookRules())
        return lambda raw: clean_ebook(raw, rules)
    from pipeline.data.wikitext import raw_from_rows

    return raw_from_rows


def _copy_local(url: str, output_file: str, pooch=None) -> None:
    """A pooch downloader for ``file://`` URLs (a folder mirror): copies the file."""
    with urllib.request.urlopen(url) as source, open(output_file, "wb") as out:
        shutil.copyfileobj(source, out, CHUNK_BYTES)


def _retrieve(url: str, known_sha256: str | None, staged: Path, label: str, progress: bool) -> Path:
    """``url`` into ``staged`` through ``pooch.retrieve`` (a complete, checked file or nothing); a file
    already staged there is reused when it has ``known_sha256`` (any staged file when that is None)."""
    import pooch
    from tqdm import tqdm

    pooch.get_logger().setLevel("WARNING")  # its "Downloading ..." lines: the progress bar says it
    bar = tqdm(desc=label, unit="B", unit_scale=True, leave=False) if progress else False
    downloader = (_copy_local if url.startswith("file://")
                  else pooch.HTTPDownloader(progressbar=bar, timeout=TIMEOUT_S))
    try:
        return Path(pooch.retrieve(url, f"sha256:{known_sha256}" if known_sha256 else None, fname=staged.name,
                                   path=staged.parent, downloader=downloader))
    finally:
        if bar:
            bar.close()


def download(file: CorpusFile, root: Path, mirror: str | None = None, progress: bool = False) -> str:
    """Bring ``file`` to its place under ``root``: download its source (or the mirror's copy), rebuild it
    where it is rebuilt, check it, and only then rename it in (see the module docstring).

    Returns:
        the URL it came from.

    Raises:
        FetchError: the download failed, or the file (as downloaded or as rebuilt) has another sha256
            than the table's; its place is not written and no partial file is left.
    """
    import requests

    url, build = source_of(file, mirror), builder(file, mirror)
    dest, staging = root / file.path, root / STAGING
    staged = staging / ("sources" if build else "files") / file.path.replace("/", "__")
    part = staging / "files" / (staged.name + ".part")  # a rebuilt file before its rename into place
    nothing = f"nothing was written to {dest}"
    try:
        got = _retrieve(url, None if build else file.sha256, staged, file.path, progress)
        if build:
            data = build(got.read_bytes())
            found = hashlib.sha256(data).hexdigest()
            if found != file.sha256:
                raise FetchError(f"{file.path}: rebuilt from {url} ({file.source.build}), it has sha256 {found} "
                                 f"({len(data)} bytes), expected {file.sha256} ({file.size} bytes); {nothing}")
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(data)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, dest)
    except ValueError as e:  # pooch's refusal of a download with another sha256 (it is deleted); a bad source
        raise FetchError(f"{file.path}: the copy from {url} was refused: {e}; {nothing}") from e
    except (OSError, requests.RequestException) as e:  # no network, HTTP errors, a cut connection, the disk
        raise FetchError(f"{file.path}: downloading {url} failed: {e}; {nothing}") from e
    finally:
        part.unlink(missing_ok=True)
        if build:
            staged.unlink(missing_ok=True)  # used or refused: a refused source is downloaded again next time
        _remove_empty(staging)
    return url


def _remove_empty(folder: Path) -> None:
    """``folder`` and its subfolders, where they hold no file (the staging folder once nothing is in flight)."""
    if not folder.is_dir():
        return
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    if not any(folder.iterdir()):
        folder.rmdir()


def _check_in_place(file: CorpusFile, dest: Path) -> Outcome:
    found = sha256_of(dest)
    if found == file.sha256:
        return Outcome(file, "present")
    return Outcome(file, "mismatch", f"{dest} has sha256 {found} ({dest.stat().st_size} bytes), expected "
                                     f"{file.sha256} ({file.size} bytes); left as it is: remove it to fetch it again")


def fetch_file(file: CorpusFile, root: Path, mirror: str | None = None, progress: bool = False) -> Outcome:
    """Bring ``file`` into ``root`` unless it is there with its checksum (see the module docstring).

    Args:
        mirror: a URL prefix from ``mirror_base`` that replaces the file's source, or None.
    """
    dest = root / file.path
    if dest.is_file():
        return _check_in_place(file, dest)
    try:
        return Outcome(file, "fetched", source=download(file, root, mirror, progress))
    except FetchError as e:
        return Outcome(file, "failed", str(e), source=source_of(file, mirror))


def fetch(files: Iterable[CorpusFile], root: Path, mirror: str | None = None,
          progress: bool = False) -> list[Outcome]:
    """``fetch_file`` for each of ``files`` in turn; one file's failure does not stop the others."""
    return [fetch_file(f, root, mirror, progress) for f in files]


def verify(files: Iterable[CorpusFile], root: Path) -> list[Outcome]:
    """Check the files in ``root`` against their checksums; download nothing."""
    return [_check_in_place(f, root / f.path) if (root / f.path).is_file()
            else Outcome(f, "missing", f"{root / f.path} is missing") for f in files]


def missing_files(patterns: Iterable[str], root: Path) -> list[CorpusFile]:
    """The files of the shipped corpora that ``patterns`` (a config's data patterns) name and that are not
    under ``root``, each once, in the order the patterns name them. A pattern outside the shipped corpora names none: the stage
    that reads it says what is wrong with it."""
    named = {f.path: f for p in patterns for f in files_named(p)}
    return [f for f in named.values() if not (root / f.path).is_file()]


def fetch_for_run(patterns: Iterable[str], root: Path, say: Callable[[str], None],
                  progress: bool = False) -> str | None:
    """A run's set-up: fetch the files of the shipped corpora that ``patterns`` name and ``root`` lacks.

    Args:
        patterns: the run's data patterns (``RunConfig.data_patterns``).
        say: where the lines that say what is fetched go.

    Returns:
        None when every such file is in place (then nothing was downloaded and nothing said), else one
        error message: the files that could not be fetched, from where, why the first failed, and the
        commands that fetch them.
    """
    missing = missing_files(patterns, root)
    if not missing:
        return None
    say(f"data: {len(missing)} file(s) the config reads are not under the data root {root}; "
        "fetching them from their public sources (make data)")
    failed = [o for o in fetch(missing, root, progress=progress) if not o.ok]
    if not failed:
        say(f"data: {len(missing)} file(s) fetched and checked")
        return None
    names = ", ".join(o.file.path for o in failed[:3]) + (f" and {len(failed) - 3} more" if len(failed) > 3 else "")
    hosts = sorted({o.source.split("/", 3)[2] if "://" in o.source else o.source for o in failed})
    return (f"{len(failed)} file(s) the config reads are not under the data root {root} and could not be fetched "
            f"from {', '.join(hosts)}: {names}. The first failure: {failed[0].detail}. Fetch them with `make data` "
            "once the network is reachable, or from a copy of a complete data folder with `make data MIRROR=URL_OR_DIR`; "
            "or point data.data_root (or $CONDUIT_DATA_ROOT) at a folder that holds them")
