"""The public sources of the shipped corpora, played by a local HTTP server (nothing reaches the network).

``SourceServer`` answers as GitHub's raw-file host does (``/<owner>/<repo>/<commit>/<path>``), from bytes
a test gives it; ``$CONDUIT_GITHUB_RAW_URL`` pointed at it makes ``pipeline.data.fetch`` download from it.
It can cut a file short once (a dropped connection) and lists what it was asked for.

The files it serves are written here in the sources' own formats from the cleaned files of the shared
data folder: a Project Gutenberg e-book around a cleaned book (``as_raw_ebook``: BOM, the PG header and
licence, the START and END markers, producer credits, an illustration tag, CRLF line ends, trailing
spaces), and the Hugging Face WikiText rows joined by blank lines around ``wiki.test.raw``
(``as_wikitext_rows``, CRLF). Rebuilding them must give the cleaned files' bytes back.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from pipeline.data.corpora import CORPORA, CorpusFile

PG_HEADER = """\ufeffThe Project Gutenberg eBook of {title}

This ebook is for the use of anyone anywhere in the United States and
most other parts of the world at no cost and with almost no restrictions
whatsoever. You may copy it, give it away or re-use it under the terms
of the Project Gutenberg License included with this ebook or online
at www.gutenberg.org.

Title: {title}

Release date: June 25, 2008 [eBook #{number}]

Language: English

*** START OF THE PROJECT GUTENBERG EBOOK {upper} ***

"""
PG_FOOTER = """

*** END OF THE PROJECT GUTENBERG EBOOK {upper} ***



Updated editions will replace the previous one--the old editions will
be renamed.
"""


def as_raw_ebook(clean: bytes, title: str = "A Book", number: int = 1) -> bytes:
    """A Project Gutenberg e-book whose cleaning gives ``clean`` back: the header and START marker before
    it, the END marker and the licence after it, CRLF line ends."""
    text = (PG_HEADER.format(title=title, number=number, upper=title.upper()) + clean.decode("utf-8")
            + PG_FOOTER.format(upper=title.upper()))
    return text.replace("\n", "\r\n").encode("utf-8")


def as_wikitext_rows(raw: bytes) -> bytes:
    """``wiki.test.raw``'s lines as the Hugging Face rows (an empty line, ``" \\n"``, as ``""``) joined by
    blank lines, with CRLF line ends, as the public copy holds them."""
    rows = ["" if line == " \n" else line for line in raw.decode("utf-8").splitlines(keepends=True)]
    return "\n\n".join(rows).replace("\n", "\r\n").encode("utf-8")


def in_source_format(file: CorpusFile, clean: bytes) -> bytes:
    """What ``file``'s source holds, given the file's own bytes ``clean``."""
    build = file.source.build
    if build == "gutenberg":
        return as_raw_ebook(clean, title=Path(file.path).stem.split("_", 1)[1].replace("_", " ").title(),
                            number=int(Path(file.path).stem[2:7]))
    if build == "wikitext_rows":
        return as_wikitext_rows(clean)
    return clean


def url_path(file: CorpusFile) -> str:
    s = file.source
    return f"/{s.repo}/{s.commit}/{s.path}"


class SourceServer:
    """GitHub's raw-file host on 127.0.0.1: ``files`` maps a URL path to its bytes. ``url`` is the base to set
    as ``$CONDUIT_GITHUB_RAW_URL``; ``requests`` lists the paths asked for; a path in ``cut_once`` is sent
    only in half (its full length announced) the first time it is asked for."""

    def __init__(self, files: dict[str, bytes] | None = None):
        self.files: dict[str, bytes] = dict(files or {})
        self.requests: list[str] = []
        self.cut_once: set[str] = set()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.path in server.cut_once:
                    server.cut_once.discard(self.path)
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def serve(self, file: CorpusFile, clean: bytes) -> None:
        """Serve ``file``'s source, written in its format from the file's own bytes ``clean``."""
        self.files[url_path(file)] = in_source_format(file, clean)

    def __enter__(self) -> SourceServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def all_files() -> dict[str, CorpusFile]:
    return {f.path: f for c in CORPORA for f in c.files}
