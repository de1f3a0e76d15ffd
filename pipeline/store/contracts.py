"""What one stage writes and another reads: artifact file names and the manifest counts that cross stages.

Each name or record here has one writer (the stage in its section heading) and readers elsewhere (a
later stage, the training workers, ``jobs``). Both sides import it from here, so neither repeats a
file name or a count's key as a string literal. What a stage keeps to itself (the shard stage's
per-input counts, the training checkpoints' layout file) stays in that stage.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.store.artifacts import Artifact, write_json_atomic

# Ray Train's checkpoint folders under a run: checkpoint_<date>_<time>, in time order (the train stage reads
# them before its trainer starts, the workers when they choose where to resume).
CHECKPOINT_PREFIX = "checkpoint_"

# ---- shard: documents in parquet shards, per split --------------------------------------------------
SPLITS = ("train", "validation", "test")  # test only when data.test_fraction > 0


def shard_file_name(split: str, index: int) -> str:
    """The name of shard ``index`` of ``split`` (``train-00003.parquet``)."""
    return f"{split}-{index:05d}.parquet"


def shard_files(artifact_path: Path, split: str) -> list[Path]:
    """The shard files of ``split`` in order (empty for a split the artifact does not have)."""
    return sorted(Path(artifact_path).glob(f"{split}-*.parquet"))


@dataclass(frozen=True)
class SplitSizes:
    """Documents and UTF-8 bytes of text per split: the ``documents`` and ``bytes`` of the shard counts."""

    documents: dict[str, int]
    bytes: dict[str, int]

    @classmethod
    def of(cls, shard: Artifact) -> SplitSizes:
        """The sizes a finished shard artifact recorded."""
        counts = shard.manifest["counts"]
        return cls(documents=counts["documents"], bytes=counts["bytes"])

    def counts(self) -> dict[str, dict[str, int]]:
        """The entries these sizes are under in the shard manifest's counts."""
        return dataclasses.asdict(self)


# ---- tokenizer: a sentencepiece model ---------------------------------------------------------------
TOKENIZER_FILE = "tokenizer.model"

# ---- tokenize: packed token blocks per split, and their index -----------------------------------------
TOKEN_INDEX_FILE = "index.json"


def tokens_file(split: str, shard: int) -> str:
    """Token shard ``shard`` of ``split``: ``(n_blocks, seq_len + 1)`` token ids (``train.tokens.00003.npy``).

    Shard ``k`` < the number of document shards holds the blocks of document shard ``k``; the last
    (``k`` = that number) holds the blocks joined from every shard's leftover tail (``pipeline.data.packing``).
    A shard with no blocks has no file. Read them through ``pipeline.data.token_blocks.TokenBlocks``.
    """
    return f"{split}.tokens.{shard:05d}.npy"


def docs_file(split: str, shard: int) -> str:
    """The same shape as ``tokens_file``: the index (in shard order) of the document each token came from."""
    return f"{split}.docs.{shard:05d}.npy"


@dataclass(frozen=True)
class SplitTokens:
    """One split's token blocks. ``bytes`` is the split's text (bits per byte divides by it);
    ``tokens_in_documents`` counts ids without BOS/EOS; ``shards`` is the number of blocks in each
    token shard, in order (0: no file): global block ``g`` is row ``g - sum(shards[:k])`` of the shard
    ``k`` it falls in."""

    blocks: int
    tokens: int
    dropped_tail_tokens: int
    documents: int
    bytes: int
    tokens_in_documents: int
    shards: list[int]


@dataclass(frozen=True)
class TokenIndex:
    """``index.json`` of the tokenize artifact (also the base of its manifest counts)."""

    seq_len: int
    dtype: str
    vocab_size: int
    add_bos: bool
    splits: dict[str, SplitTokens]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write(self, tokens_dir: Path) -> None:
        """Write ``index.json`` into the tokenize artifact (atomically)."""
        write_json_atomic(Path(tokens_dir) / TOKEN_INDEX_FILE, self.to_dict())

    @classmethod
    def read(cls, tokens_dir: Path) -> TokenIndex:
        """Read ``index.json`` of a tokenize artifact."""
        raw = json.loads((Path(tokens_dir) / TOKEN_INDEX_FILE).read_text(encoding="utf-8"))
        return cls(**{**raw, "splits": {s: SplitTokens(**v) for s, v in raw["splits"].items()}})


# ---- train: consolidated weights and rank 0's metric history ----------------------------------------
WEIGHTS_FILE = "model.safetensors"
TRAIN_METRICS_FILE = "train_metrics.json"  # a list: one dict of metrics (with "step") per logged step


def write_train_metrics(out_dir: Path, history: list[dict[str, float]]) -> None:
    """Rank 0 of the training workers writes its logged metrics into the train artifact."""
    write_json_atomic(Path(out_dir) / TRAIN_METRICS_FILE, history)


def read_train_metrics(train_dir: Path) -> list[dict[str, float]]:
    """The train artifact's metric history, oldest logged step first."""
    return json.loads((Path(train_dir) / TRAIN_METRICS_FILE).read_text(encoding="utf-8"))


INIT_DIGEST_TAG = "conduit.init_weights_sha256"  # train.init_from: the weights rank 0 started from (state_digest)


def state_digest(state: dict) -> str:
    """The sha256 of a model state (``{name: tensor}``): each name and its tensor's dtype, shape and bytes,
    in name order. Two states have one digest only when every tensor is the same, bit for bit."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


TRAIN_STARTS_FILE = "train_starts.json"  # the step each start of the worker group began at: [0, 40, ...]


def write_train_starts(out_dir: Path, starts: list[int]) -> None:
    """Rank 0 records where training started and where each restart resumed (from a checkpoint)."""
    write_json_atomic(Path(out_dir) / TRAIN_STARTS_FILE, starts)


def read_train_starts(train_dir: Path) -> list[int]:
    """The steps the worker group (re)started at, first start first."""
    return json.loads((Path(train_dir) / TRAIN_STARTS_FILE).read_text(encoding="utf-8"))


TRAIN_PRECISION_FILE = "train_precision.json"  # the precision trained in, and how train.precision auto chose it


def write_train_precision(out_dir: Path, precision: dict) -> None:
    """Rank 0 records the precision the run trained in: {"precision": ..., and, where ``auto`` measured or
    read the cache, its micro-step times and source (``pipeline.training.precision_choice``)}."""
    write_json_atomic(Path(out_dir) / TRAIN_PRECISION_FILE, precision)


def read_train_precision(train_dir: Path) -> dict | None:
    """The precision record, or None for an artifact from before it was written."""
    path = Path(train_dir) / TRAIN_PRECISION_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else None


# ---- evaluate: metrics, samples and reference numbers -------------------------------------------------
EVAL_METRICS_FILE = "metrics.json"


@dataclass(frozen=True)
class EvalReport:
    """``metrics.json``: flat ``metrics`` (register copies them into version tags; promote gates on
    them), generated ``samples`` by prompt, and published ``references`` beside ours."""

    metrics: dict[str, float]
    samples: dict[str, str]
    references: dict[str, Any]

    def write(self, out_dir: Path) -> Path:
        """Write ``metrics.json`` into the evaluate artifact (atomically); returns its path."""
        path = Path(out_dir) / EVAL_METRICS_FILE
        write_json_atomic(path, dataclasses.asdict(self))
        return path

    @classmethod
    def read(cls, evaluate_dir: Path) -> EvalReport:
        """Read ``metrics.json`` of an evaluate artifact."""
        return cls(**json.loads((Path(evaluate_dir) / EVAL_METRICS_FILE).read_text(encoding="utf-8")))


# ---- register: an MLflow model version ----------------------------------------------------------------
HF_DIR = "hf"  # the Hugging Face export, shipped inside the registered model under artifacts/


@dataclass(frozen=True)
class RegisteredModel:
    """The register stage's manifest counts: which model version it made and where it points."""

    model_name: str
    version: int
    alias: str
    model_uri: str
    hf_export: bool

    @classmethod
    def of(cls, register: Artifact) -> RegisteredModel:
        """What a finished register artifact registered."""
        return cls(**register.manifest["counts"])

    def counts(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
