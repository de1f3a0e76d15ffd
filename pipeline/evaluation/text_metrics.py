"""Loss, perplexity and bits per byte of a model on raw text files, with the run's own tokenizer.

Bits per byte (total nats / ln 2 / UTF-8 bytes scored) is comparable across tokenizers; perplexity is
per token of this tokenizer and is not. Each file is one document: it follows an EOS, as documents do
in the packed training stream, and is cut into non-overlapping windows of the evaluation context, so
every token after the first of the window is scored once with the context its window gives it.

A token budget keeps this cheap: ``max_tokens`` is split evenly over the files, and each file
contributes the prefix of its text that those tokens encode; the bytes counted are that prefix's.

Shape legend: B windows in a batch, T window length, V vocab.
"""

from __future__ import annotations

import glob
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.layers.loss import DEFAULT_CHUNK_TOKENS
from pipeline.data.corpora import data_root_hint
from pipeline.evaluation.device import on_model
from pipeline.tokenization.spm import EOS_ID
from pipeline.evaluation import perplexity

IGNORE = -100
_CHARS_PER_TOKEN_BOUND = 16  # a piece of a 512..32k BPE vocabulary is far shorter; bounds the text we encode


@dataclass(frozen=True)
class EncodedText:
    """Token stream of a set of documents (EOS before each) and the UTF-8 bytes its tokens encode."""

    ids: list[list[int]]  # one list per document, starting with EOS
    n_bytes: int
    n_words: int  # whitespace-separated words of the scored text (for word-level perplexity)

    @property
    def n_targets(self) -> int:
        return sum(len(d) - 1 for d in self.ids)


def resolve_files(data_root: Path, patterns: list[str], field: str) -> list[Path]:
    """Files matching ``patterns`` (globs relative to ``data_root``), sorted.

    Raises:
        FileNotFoundError: naming the config field and the pattern that matched nothing, where the data
            root is, how to set it and how to fetch the shipped corpora.
    """
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(Path(p) for p in glob.glob(str(data_root / pattern)) if Path(p).is_file())
        if not matches:
            raise FileNotFoundError(f"{field}: {pattern!r} matches no file (looked at {data_root / pattern})"
                                    f"{data_root_hint(pattern, data_root)}")
        files.extend(matches)
    return files


def encode_prefix(sp, text: str, max_tokens: int) -> tuple[list[int], str]:
    """The first ``max_tokens`` tokens of ``text`` and the text prefix they decode to.

    Sentencepiece splits on whitespace before merging, so the tokens of a long-enough prefix equal the
    first tokens of the whole text, apart from the last word, which is dropped before cutting.

    Returns:
        (ids, prefix): ``sp.decode(ids) == prefix`` and ``text.startswith(prefix)``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1; got {max_tokens}")
    head = text[: max_tokens * _CHARS_PER_TOKEN_BOUND]
    if len(head) < len(text):
        cut = head.rfind(" ")  # never score a word the cut split
        head = head[:cut] if cut > 0 else head
    ids = sp.encode(head)[:max_tokens]
    prefix = sp.decode(ids)
    # A cut inside a byte-fallback character (up to 4 byte pieces) decodes to U+FFFD: drop its bytes.
    for _ in range(3):
        if text.startswith(prefix) or not ids:
            break
        ids = ids[:-1]
        prefix = sp.decode(ids)
    if not text.startswith(prefix):
        raise ValueError(
            "the tokenizer does not round-trip this text (decode(encode(x)) is not a prefix of x); "
            "bits per byte needs a lossless tokenizer (tokenizer.normalization=identity, byte_fallback=true)"
        )
    return ids, prefix


def encode_files(sp, files: list[Path], max_tokens: int) -> EncodedText:
    """Encode each file as one document within a total budget of ``max_tokens`` scored tokens.

    Raises:
        ValueError: when the budget leaves a file no token, or the tokenizer is lossy.
    """
    per_file = max_tokens // len(files)
    if per_file < 1:
        raise ValueError(f"a budget of {max_tokens} tokens cannot cover {len(files)} files")
    docs, n_bytes, n_words = [], 0, 0
    for path in files:
        ids, prefix = encode_prefix(sp, path.read_text(encoding="utf-8"), per_file)
        docs.append([EOS_ID, *ids])
        n_bytes += len(prefix.encode("utf-8"))
        n_words += len(prefix.split())
    return EncodedText(docs, n_bytes, n_words)


def windows(doc_ids: list[list[int]], context: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut each document into windows of ``context`` inputs and their next-token targets.

    Consecutive windows overlap by one token (the last target of one is the first input of the
    next), so each token after a document's first is a target exactly once. Short windows are
    right-padded; their padded targets are ``IGNORE``.

    Returns:
        (inputs, targets), both (n_windows, context) int64.
    """
    inputs, targets = [], []
    for ids in doc_ids:
        for start in range(0, len(ids) - 1, context):
            chunk = ids[start : start + context + 1]
            x = np.full(context, EOS_ID, dtype=np.int64)
            y = np.full(context, IGNORE, dtype=np.int64)
            x[: len(chunk) - 1] = chunk[:-1]
            y[: len(chunk) - 1] = chunk[1:]
            inputs.append(x)
            targets.append(y)
    return np.stack(inputs), np.stack(targets)


@torch.no_grad()
def summed_nll(model: torch.nn.Module, inputs: np.ndarray, targets: np.ndarray, batch_size: int,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[float, int]:
    """Total next-token negative log-likelihood (nats) over the non-ignored targets, and their count.
    The model sums each batch's loss itself, ``chunk_tokens`` tokens at a time (``models.layers.head.LMHead``),
    so a large vocabulary's logits are never all held at once."""
    model.eval()
    total, count = 0.0, 0
    for b in range(0, len(inputs), batch_size):
        x_BT = on_model(model, torch.from_numpy(inputs[b : b + batch_size]))
        y_BT = on_model(model, torch.from_numpy(targets[b : b + batch_size]))
        out = model(x_BT, targets_BT=y_BT, reduction="sum", chunk_tokens=chunk_tokens, ignore_index=IGNORE)
        total += out.loss.item()
        count += int((y_BT != IGNORE).sum())
    return total, count


def text_metrics(model: torch.nn.Module, encoded: EncodedText, context: int, batch_size: int) -> dict[str, float]:
    """Loss (nats/token), token perplexity, bits per byte and word-level perplexity of ``encoded``.

    Args:
        model: the Transformer.
        encoded: documents from ``encode_files``.
        context: window length (the context the model was trained with).
        batch_size: windows per forward pass.

    Returns:
        ``loss``, ``perplexity``, ``bits_per_byte``, ``word_perplexity``, ``tokens``, ``bytes``.
    """
    inputs, targets = windows(encoded.ids, context)
    nll, n = summed_nll(model, inputs, targets, batch_size)
    return {
        "loss": nll / n,
        "perplexity": perplexity(nll / n),
        "bits_per_byte": nll / math.log(2) / encoded.n_bytes,
        "word_perplexity": perplexity(nll / max(encoded.n_words, 1)),
        "tokens": n,
        "bytes": encoded.n_bytes,
    }
