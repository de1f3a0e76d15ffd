"""Sentencepiece training and loading, with Conduit's fixed special ids.

Special ids (the same in every Conduit tokenizer, so packed token files and models agree):
    0 <pad>, 1 <unk>, 2 <s> (BOS), 3 </s> (EOS), 4 "\\n" (a newline is one token),
    then ``tokenizer.user_defined_symbols`` in order from id 5 (each always one token).

The default tokenizer is lossless: identity normalisation, no whitespace folding and byte fallback,
so ``decode(encode(x)) == x`` for any string. ``nfkc`` / ``nmt_nfkc`` are explicit, lossy options.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
NUM_SPECIAL = 5  # the four above plus the newline piece


# The longest training sentence, in UTF-8 bytes, that sentencepiece's trainer takes (its
# ``max_sentence_length``, passed explicitly). It skips longer ones without a word (its log is off);
# ``training_lines`` splits lines so that none is longer, and counts the splits.
MAX_SENTENCE_BYTES = 4192


def split_long_line(line: str, max_bytes: int = MAX_SENTENCE_BYTES) -> list[str]:
    """Cut ``line`` into pieces of at most ``max_bytes`` UTF-8 bytes, in order, losing nothing.

    A cut falls before the last space or tab that leaves a non-empty piece (the whitespace starts the
    next piece, as it starts a word's piece in sentencepiece), else at the last character that fits.

    Returns:
        ``[line]`` when it fits, else the pieces (``"".join`` gives ``line`` back).
    """
    data = line.encode("utf-8")
    if len(data) <= max_bytes:
        return [line]
    pieces = []
    start = 0
    while len(data) - start > max_bytes:
        end = start + max_bytes
        while data[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte: back off to the character's start
            end -= 1
        cut = max(data.rfind(b" ", start + 1, end), data.rfind(b"\t", start + 1, end))
        cut = cut if cut > start else end
        pieces.append(data[start:cut].decode("utf-8"))
        start = cut
    pieces.append(data[start:].decode("utf-8"))
    return pieces


def training_lines(docs: Iterable[str], max_bytes: int, tally: dict | None = None) -> Iterator[str]:
    """Lines of ``docs`` in order until ``max_bytes`` of UTF-8 have been yielded.

    Sentencepiece trains on "sentences"; a line is ours, so merges never span a newline, and the
    newline itself is a user-defined symbol. A line longer than ``MAX_SENTENCE_BYTES`` is split
    (``split_long_line``), where sentencepiece would skip it.

    Args:
        docs: documents.
        max_bytes: UTF-8 bytes of training text to yield at most.
        tally: when given, gets ``sentences`` (yielded), ``long_lines_split`` (lines over
            ``MAX_SENTENCE_BYTES``) and ``sentences_from_splits`` (the pieces they became) added.
    """
    tally = {} if tally is None else tally
    for key in ("sentences", "long_lines_split", "sentences_from_splits"):
        tally.setdefault(key, 0)
    seen = 0
    for doc in docs:
        for line in doc.split("\n"):
            if not line:
                continue
            pieces = split_long_line(line)
            if len(pieces) > 1:
                tally["long_lines_split"] += 1
                tally["sentences_from_splits"] += len(pieces)
            for piece in pieces:
                seen += len(piece.encode("utf-8"))
                if seen > max_bytes:
                    return
                tally["sentences"] += 1
                yield piece


def train_sentencepiece(lines: Iterable[str], *, vocab_size: int, model_type: str,
                        character_coverage: float, byte_fallback: bool, normalization: str,
                        num_threads: int, user_defined_symbols: Sequence[str] = ()) -> bytes:
    """Train a sentencepiece model from an iterator of lines and return the serialized model.

    Args:
        lines: training sentences (see ``training_lines``).
        vocab_size, model_type, character_coverage, byte_fallback: as in ``TokenizerSection``.
        normalization: ``identity`` (lossless: no whitespace folding either) or a lossy rule.
        num_threads: trainer threads.
        user_defined_symbols: pieces that are always one token, ids 5, 6, ... in this order.

    Returns:
        The serialized model (the bytes of a ``.model`` file).
    """
    buf = io.BytesIO()
    lossless = normalization == "identity"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        byte_fallback=byte_fallback,
        normalization_rule_name=normalization,
        remove_extra_whitespaces=not lossless,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        pad_id=PAD_ID, unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID,
        user_defined_symbols=["\n", *user_defined_symbols],
        hard_vocab_limit=False,
        max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=num_threads,
        minloglevel=2,
    )
    return buf.getvalue()


def load_sentencepiece(path: str) -> spm.SentencePieceProcessor:
    sp = spm.SentencePieceProcessor(model_file=path)
    if sp.eos_id() != EOS_ID or sp.pad_id() != PAD_ID or sp.piece_to_id("\n") != 4:
        raise ValueError(f"{path}: not a Conduit tokenizer (special ids differ from pad=0 unk=1 bos=2 eos=3 \\n=4)")
    return sp
