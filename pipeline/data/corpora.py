"""The corpora the shipped configs read: each file's place under the data root, its size and sha256,
and the public source it is made from, pinned to a commit.

Why a table: a clone anywhere has no ``../shared/data`` beside it, and a run would stop at the first
pattern that matches nothing. This table is what ``python -m jobs.fetch_data`` (``make data``) and the
set-up of ``python -m jobs.run`` (``make run``) download, rebuild and check, and what the error of a
missing file points to (``data_root_hint``). It lists exactly the files that ``configs/*.yaml`` read
(``data.train_paths`` and the evaluate stage's ``eval.heldout_paths``, ``eval.wikitext_path`` and
``eval.lambada_path``, defaults included); a test holds it to those configs and to the shared data folder.

Every file comes from a file in a public GitHub repository at a pinned commit (``Source``), either
verbatim or rebuilt from it by a named, deterministic step (``Source.build``): the Gutenberg books by
``pipeline.data.gutenberg.clean_ebook`` from the raw e-books, ``wiki.test.raw`` by
``pipeline.data.wikitext.raw_from_rows`` from the Hugging Face test rows. The file's own sha256 checks
the result either way, so a source that changed, a download cut short and a rebuild that drifted are all
refused by the same check. The full provenance (blobs, processing, licences) is ``README.md`` of the
shared data folder.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.base import DEFAULT_DATA_ROOT, is_uri

DATA_ROOT_ENV = "CONDUIT_DATA_ROOT"  # the config's data root when data.data_root is unset (RunConfig.data_root)
GITHUB_RAW = "https://raw.githubusercontent.com"
# Replaces GITHUB_RAW in every source URL: a mirror of GitHub's raw files (a proxy; the tests' server).
GITHUB_RAW_ENV = "CONDUIT_GITHUB_RAW_URL"
BUILDS = ("verbatim", "gutenberg", "wikitext_rows")  # how a file is made from its source (Source.build)


@dataclass(frozen=True)
class Source:
    """A file in a public GitHub repository at a pinned commit, and how a corpus file is made from it.

    ``build`` is one of ``BUILDS``: ``verbatim`` (the file is the source's bytes), ``gutenberg`` (a raw
    Project Gutenberg e-book, cleaned by ``pipeline.data.gutenberg``), ``wikitext_rows`` (the Hugging Face
    WikiText test rows joined by blank lines, turned back into the original file by
    ``pipeline.data.wikitext``).
    """

    repo: str
    commit: str
    path: str
    build: str = "verbatim"

    def __post_init__(self):
        if self.build not in BUILDS:
            raise ValueError(f"Source.build {self.build!r}: expected one of {BUILDS}")

    def url(self, github_raw: str | None = None) -> str:
        """The source's URL under ``github_raw`` (default: ``$CONDUIT_GITHUB_RAW_URL``, else GitHub's)."""
        base = (github_raw or os.environ.get(GITHUB_RAW_ENV) or GITHUB_RAW).rstrip("/")
        return f"{base}/{self.repo}/{self.commit}/{self.path}"


@dataclass(frozen=True)
class CorpusFile:
    """One file under the data root: ``path`` (POSIX, relative), its ``size`` in bytes and ``sha256``,
    and the ``source`` it is made from."""

    path: str
    size: int
    sha256: str
    source: Source


@dataclass(frozen=True)
class Corpus:
    """A set of files fetched and reported together (``--only NAME``).

    ``title`` says what it is and where it comes from, ``licence`` under what terms, ``read_by`` which
    config fields of the shipped configs read it.
    """

    name: str
    title: str
    licence: str
    read_by: str
    files: tuple[CorpusFile, ...]


GUTENBERG_REPO, GUTENBERG_COMMIT = "RU-ECE/ECE451-Parallel", "c58dca3a6abedd8041057571c247e9a393cc3b4d"


def _books(folder: str, text: str) -> tuple[CorpusFile, ...]:
    """Cleaned Gutenberg books from ``sha256  size  name  source path`` lines (the source path in
    ``GUTENBERG_REPO`` at ``GUTENBERG_COMMIT``)."""
    rows = (line.split() for line in text.strip().splitlines())
    return tuple(CorpusFile(f"{folder}/{name}", int(size), sha,
                            Source(GUTENBERG_REPO, GUTENBERG_COMMIT, source, build="gutenberg"))
                 for sha, size, name, source in rows)


_GUTENBERG_TITLE = ("Project Gutenberg e-books (RU-ECE/ECE451-Parallel at c58dca3), cleaned: the PG header, "
                    "licence and footer, producer credits and illustration tags removed, CRLF to LF")

CORPORA: tuple[Corpus, ...] = (
    Corpus(
        name="tinyshakespeare",
        title="Karpathy's tiny-shakespeare (karpathy/char-rnn data/tinyshakespeare/input.txt, verbatim)",
        licence="the plays are public domain; repository MIT",
        read_by="data.train_paths of configs/smoke*.yaml",
        files=(CorpusFile("tinyshakespeare/input.txt", 1115394,
                          "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
                          Source("karpathy/char-rnn", "6f9487a6fe5b420b7ca9afb0d7c078e37c1d1b4e",
                                 "data/tinyshakespeare/input.txt")),),
    ),
    Corpus(
        name="gutenberg-train",
        title=f"39 public-domain English books: {_GUTENBERG_TITLE}",
        licence="public domain",
        read_by="data.train_paths of configs/demo.yaml, chaos.yaml and gpu_*.yaml",
        files=_books("gutenberg/train", """
b823b584de2c19e91ee967cd897f704e94dc2ce4436bbf33aff6b866e4316c82   150392  pg00011_alices_adventures_in_wonderland.txt  data/books/11-0.txt
75bc106d2bdf4d8e2e204d2f50f88f7adcbac8e3c7c6bab76e11bfec007139b4   224558  pg00023_narrative_of_the_life_of_frederick_douglass.txt  data/books/pg23.txt
985934d138d307677a94805b85d60c609ffbe9124e548b6a9011b818994dbdf9   340443  pg00036_war_of_the_worlds.txt  data/books/36-0.txt
563458477046db6704c5fdfb3ec27a3517a6642b61ca8a3f48d0083b7c4c24fa    69928  pg00041_legend_of_sleepy_hollow.txt  data/books/41-0.txt
7f85e2db760c0d25d8eb63d1fca6b546e3aabfc8ea6f2fa0d898c7d2972dffca   141060  pg00043_strange_case_of_dr_jekyll_and_mr_hyde.txt  data/books/43-0.txt
a99a9b818637e2804cf1e504397176d9b5ab17242e5e992c0e2d11922da02de7   575951  pg00045_anne_of_green_gables.txt  data/books/Anne-of-Green-Gables.txt
7540c11a68e20eb7124efeb50656fb86a44a726f8a27e7181be38276e9a37648   208339  pg00055_wonderful_wizard_of_oz.txt  data/books/pg55.txt
abaf900959a5c3123f609d6b43963a7891849a7c9775849745ec6ad59314e2b9   584583  pg00076_adventures_of_huckleberry_finn.txt  data/books/76-0.txt
4c6a60c76064570ace205d984885c55d44446034f4a99013d3e41b21f980aeff   768517  pg00098_tale_of_two_cities.txt  data/books/98-0.txt
315e9818574c97482a43ff63a42c468e1c4ea672045807f63b73011874ead445   686326  pg00108_return_of_sherlock_holmes.txt  data/pg108.txt
21a4491cf5ef1132712ee12fb31ec8ad2063721bd9e430d0e737c3d12735449e   369195  pg00120_treasure_island.txt  data/books/120-0.txt
9802fa845607192904eb6db35ac9bd31b527beb0f7e9db6d104330f50998002f   597748  pg00128_arabian_nights_entertainments.txt  data/books/pg128.txt
171372ca7d44e6e4b0e3a13b8df04e98342b9b1d6fe1c9582f52c97072995ddc  1812595  pg00145_middlemarch.txt  data/books/145-0.txt
01ffc107eb6889c0255279f98707d04c5e2a480a7ed15b49b17cbd9014b7f3ff   891426  pg00158_emma.txt  data/books/158-0.txt
172c9b611cc32c883c8d42fd6eb2ce5acfba1483a7ff7e6942ba383bfdd2b2e8   673680  pg00161_sense_and_sensibility.txt  data/books/pg161.txt
fb5d1304854187e79a4077bf52797741808485d0eb3f9b411f6d351f25275c3e   433689  pg00174_picture_of_dorian_gray.txt  data/books/pg174.txt
c38be5afef69349a678c933897578a4624e7cb2e77e388ceeef79973237cb879  1034770  pg00203_uncle_toms_cabin.txt  data/books/203-0.txt
5e807c1537aa81344c965ed31fcf672ecf77a45394b57580ba59f674dbef492a   210944  pg00219_heart_of_darkness.txt  data/books/219-0.txt
0931714eb46ff9b8fbb757384d20f029f4d948933aca0885cce8b9747064c6d2   244158  pg00244_a_study_in_scarlet.txt  data/books/244-0.txt
b4f2aefebde0eda5ee3105a389c4602969aac6c4769651c9a6de932c0ae8ef71   368376  pg00308_three_men_in_a_boat.txt  data/books/308-0.txt
4d7c2d6d2f9f1c4ac690d49be196781665511c2b51ac7b5b26a9585aa156f300   845386  pg00345_dracula.txt  data/books/pg345.txt
5c205a4a9c0986a179344fb154262e0641eecccda6193dc1199122bd5ef06c0f   623899  pg00521_robinson_crusoe.txt  data/pg521.txt
d347fc3f2131d9beb0c77e4de3b74bc7d336e1b5758526b55bbb7200db76a166  1975087  pg00766_david_copperfield.txt  data/books/766-0.txt
0f714531ae01b5cdcbb93ae3f9b04112ccab262cf2c8a37078164b58233530a3   649746  pg00768_wuthering_heights.txt  data/books/pg768.txt
864cddf5addb4ecdea06bdabe098e811c90f2c4cc23fae5c58423270c60d908d   582752  pg00829_gullivers_travels.txt  data/books/829-0.txt
f48a324a2ed4b8c94c0bedca8a30dc92be94b8764603ba01d182a14c9cc3ba9a   581656  pg00834_memoirs_of_sherlock_holmes.txt  data/pg834.txt
4ad8a6934253e3ef675f7f50c06c420dcf5a308125bbb4fad5788713f6e94d6b   854986  pg00940_last_of_the_mohicans.txt  data/books/940-0.txt
2236550c131d380700cb23d7181a075b0bd8de7fc36c9a0dc2ab31c3d5ae474f  2705472  pg01184_count_of_monte_cristo.txt  data/books/1184-0.txt
ecf3e8affdce06895f97455b551240a66055747fccb77724fdf427e1c59eddec  1029858  pg01260_jane_eyre.txt  data/books/pg1260.txt
45e34c0aa9fa0059bbd2d3298b5c12d7555d2600ab67bf731bdc1fc24ac9df3a   691844  pg01342_pride_and_prejudice.txt  data/books/Pride_and_Prejudice_JaneAusten.txt
1165c85720d090c86017c3d4117fef7d1dabee846ff722d0fcd394e11a75533a  2008247  pg01399_anna_karenina.txt  data/books/Anna_Karenina_LeoTolstoy.txt
e276db2f350ffa0fdc25ee7a031618e1f9d9c5b9f76a6c2ef58675aaa049735d  1009542  pg01400_great_expectations.txt  data/books/Great_Expectations_CharlesDickens.txt
f758e2692eec0e22b9a042ec72593ed7147058d0c1e7974bbb0c1b0c2944dea8   575782  pg01661_adventures_of_sherlock_holmes.txt  data/pg1661.txt
3af5e1a801d3d68e903170a284b72b10ecfa9655e3ef615533408b065d33d007   530951  pg02591_grimms_fairy_tales.txt  data/books/2591-0.txt
f9f69033551cd5738479929c0012c033a9c9865f78f65cf542c55099c1fb016c  3273321  pg02600_war_and_peace.txt  data/books/2600-0.txt
c42ee4d2c576aa6bbeae17fed91bc0be0db976e3f333901fc1b3fd81add4388c  1234083  pg02701_moby_dick.txt  data/books/2701-0.txt
2e7cd1a8fb3682472dea8acd40f66d18805319058ac95c4592317918c90a7398  1110699  pg03176_innocents_abroad.txt  data/books/3176-0.txt
4b4e9296fa0641b4fbb77f92552a0a1a4221976eb6cb72c78fc3b3e27602af83  1171341  pg06688_mill_on_the_floss.txt  data/books/6688-0.txt
e20d3f1766c55ae733b0a3b6a4bf97abfe1510fc2da77378df1eb132b9551453   492905  pg25344_scarlet_letter.txt  data/books/25344-0.txt
"""),
    ),
    Corpus(
        name="gutenberg-heldout",
        title=f"5 further books, held out from training: {_GUTENBERG_TITLE}",
        licence="public domain",
        read_by="eval.heldout_paths (its default), every shipped config but smoke_moe.yaml and smoke_encdec.yaml",
        files=_books("gutenberg/heldout", """
1d3bab58b84e515d81909882cddfe4b1d296db26e78d2b9c19d7089c265618b2   262814  pg00016_peter_pan.txt  data/books/16-0.txt
0f1a72e660967efc708b580fb066c02b2ab5aa49f6f5f0c57a07053f60a60e0c   181454  pg00035_time_machine.txt  data/books/35-0.txt
9a17e3fa751c44022b9f9b282ca3551780b6c7385aea8ac162a59d773de2e3cd   158416  pg00046_a_christmas_carol.txt  data/books/46-0.txt
76671568ede2867a31bd96ab556ddf7592241d5007f87e4a1f7b69c7db290bd2   399522  pg00074_adventures_of_tom_sawyer.txt  data/books/74-0.txt
7fef0c75f1c6273e668d3907b56906f5534fe5a2a8befe9277705efcaf04d8fb   360814  pg02852_hound_of_the_baskervilles.txt  data/books/2852-0.txt
"""),
    ),
    Corpus(
        name="wikitext-2",
        title=("WikiText-2 raw test set, wiki.test.raw of wikitext-2-raw-v1.zip (Merity et al. 2016), rebuilt "
               "from the Hugging Face test rows (Deathnetworks/rotorquant wikitext-test.txt)"),
        licence="CC BY-SA 3.0 (text from English Wikipedia)",
        read_by="eval.wikitext_path (its default), every shipped config but smoke_moe.yaml and smoke_encdec.yaml",
        files=(CorpusFile("wikitext-2/wiki.test.raw", 1290590,
                          "173c87a53759e0201f33e0ccf978e510c2042d7f2cb78229d9a50d79b9e7dd08",
                          Source("Deathnetworks/rotorquant", "c5be50f038e68e35740efdf4c6f5d65d61c2485b",
                                 "wikitext-test.txt", build="wikitext_rows")),),
    ),
    Corpus(
        name="lambada",
        title="LAMBADA test set, OpenAI version (mosaicml/llm-foundry lambada_openai.jsonl, verbatim)",
        licence="CC BY 4.0 (Paperno et al. 2016); repository Apache-2.0",
        read_by="eval.lambada_path (its default), every shipped config but smoke_moe.yaml and smoke_encdec.yaml",
        files=(CorpusFile("lambada/lambada_openai_test.jsonl", 1895241,
                          "411bfbe5b9054346b6a19299c0242670adbefb9162efd958593cbc0290b8c9dc",
                          Source("mosaicml/llm-foundry", "8c8dd48f72168c5d51e2f7b151595892a8fba43d",
                                 "scripts/eval/local_data/language_understanding/lambada_openai.jsonl")),),
    ),
)


def default_data_root() -> Path:
    """The data root a run uses when ``data.data_root`` is unset: ``$CONDUIT_DATA_ROOT``, else
    ``DEFAULT_DATA_ROOT`` (``../shared/data`` beside the checkout where it exists, else ``data/`` in it:
    the rule of ``RunConfig.data_root``)."""
    return Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT).expanduser().resolve()


def corpus_for(pattern: str) -> Corpus | None:
    """The shipped corpus whose files ``pattern`` (a file, folder or glob relative to the data root) names."""
    return next((c for c in CORPORA if files_named(pattern, c.files)), None)


def files_named(pattern: str, files: tuple[CorpusFile, ...] | None = None) -> list[CorpusFile]:
    """The files of ``files`` (default: every shipped corpus's) that ``pattern`` names: a file, a folder
    or a glob relative to the data root; none for an absolute path or a URI."""
    if is_uri(pattern) or Path(pattern).is_absolute():
        return []
    folder = pattern.rstrip("/") + "/"
    pool = files if files is not None else [f for c in CORPORA for f in c.files]
    return [f for f in pool if fnmatch.fnmatchcase(f.path, pattern) or f.path.startswith(folder)]


def data_root_hint(pattern: str, data_root: Path) -> str:
    """What to add to a "matches no file" error about ``pattern``: where the data root is, how to set
    it, and how to fill it (``make data``, README.md "Data"); empty for an absolute path or a URI, which
    do not lie under the data root.

    Returns:
        ``""`` or a text that starts with ``"; "``, to append to the error's message.
    """
    if is_uri(pattern) or Path(pattern).is_absolute():
        return ""
    where = (f"; the data root is {data_root} (set it with data.data_root or ${DATA_ROOT_ENV}; the default "
             f"is ../shared/data beside the checkout where it exists, else data/ in it)")
    corpus = corpus_for(pattern)
    if corpus is None:
        return f"{where}. `make data` fetches the corpora the shipped configs read (README.md, \"Data\")"
    return (f"{where}. {pattern!r} is the shipped corpus {corpus.name!r}, {corpus.title}: `make data` fetches "
            f"it from its public source and checks its sha256 (README.md, \"Data\")")
