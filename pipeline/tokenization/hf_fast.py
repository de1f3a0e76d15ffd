"""A Conduit sentencepiece model as a Hugging Face fast tokenizer (``tokenizer.json``) with the same ids.

``transformers`` can convert a ``tokenizer.model`` at load time (``LlamaTokenizer``), but that
conversion is Llama's, not ours: it puts a ``▁`` after every newline and treats leading spaces
differently, so the exported model would be fed token sequences it never saw in training. This module
builds the fast tokenizer once, at export, with the ``tokenizers`` library, so that a consumer needs
neither ``sentencepiece`` nor ``protobuf``, and ``encode`` equals sentencepiece's ``encode`` exactly.

How sentencepiece encodes (identity normalisation, Conduit's lossless default), and the part of the
``tokenizer.json`` pipeline that does the same:

- normaliser: one ``▁`` is put before the whole text (``add_dummy_prefix``, also before a leading space
  or newline) and every space becomes ``▁``: ``Prepend("▁")`` + ``Replace(" ", "▁")`` over the whole
  text. Nothing is an added token that would cut the text before normalisation (the Llama conversion's
  newline defect), so the prefix goes in once.
- pre-tokenizer: none in sentencepiece, which runs its model over the whole text. The text is cut
  into words ``▁*[^▁]+`` / ``▁+`` only for speed: no piece of the vocabulary holds ``▁`` after another
  character unless it is all ``▁`` (sentencepiece's ``split_by_whitespace`` with
  ``allow_whitespace_only_pieces``; checked on every piece at export), so no piece crosses such a cut
  and the ids are those of the uncut text.
- model, BPE: sentencepiece merges, again and again, the adjacent pair whose concatenation is a piece
  with the highest score (leftmost on ties). The HF BPE model merges the listed pair with the lowest
  rank, so every split ``a + b`` of every piece into two pieces is listed, ranked by the piece's score.
- model, unigram: the same Viterbi search over the same scores (``tokenizers``' Unigram is a port of
  sentencepiece's). sentencepiece keeps control, unknown and byte pieces out of the search; here they
  get a score no path takes (``UNREACHABLE_SCORE``), and a run of characters that are no pieces of
  their own is cut out as a word (no piece holds one; checked), so that such a piece cannot spell it
  either: ``"<unk>"`` with an unknown ``<`` would otherwise beat the unknown node, whose score
  ``tokenizers`` derives from the lowest score in the vocabulary. One difference remains, which no
  ``tokenizer.json`` can remove: sentencepiece adds up the scores of a whole input in float32, so where
  two segmentations tie exactly (the same pieces reordered, in a run of one repeated character) or
  differ by less than float32's resolution at the running total (which grows with the text before
  them), rounding decides; ``tokenizers`` adds in float64, word by word, and keeps the better one (the
  first on an exact tie). BPE sums nothing and is equal everywhere.
- unknown characters: one that is not a piece becomes its UTF-8 byte pieces ``<0xNN>`` in both
  (``byte_fallback``), or without byte fallback a run of them becomes one ``<unk>`` in both.
- special pieces: ``<pad> <unk> <s> </s>`` are special tokens for ``transformers``, but the text
  ``"<unk>"`` is encoded as characters, as sentencepiece does (``split_special_tokens``).
- decoder: ``▁`` -> space, byte pieces -> bytes, and the one leading space of the dummy prefix dropped.

Only what Conduit trains is supported: identity normalisation without whitespace folding, no
user-defined symbols beyond the newline. Anything else raises ``UnsupportedTokenizer`` naming it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from pipeline.tokenization.spm import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SPACE = "\u2581"  # sentencepiece's ▁, what a space is written as inside pieces
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG_JSON = "tokenizer_config.json"
UNREACHABLE_SCORE = -1e9  # below any path of real pieces (scores are log probabilities, > -100)

# sentencepiece_model.proto: ModelProto.SentencePiece.Type and TrainerSpec.ModelType
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_UNIGRAM, _BPE = 1, 2
# Pieces that a cut between words cannot split: all ▁, or at most one ▁ and only in front.
_WORD_PIECE = re.compile(f"{SPACE}+|{SPACE}?[^{SPACE}]+")
_WORD = f"{SPACE}*[^{SPACE}]+|{SPACE}+"


class UnsupportedTokenizer(ValueError):
    """The sentencepiece model uses an option that the ``tokenizer.json`` export cannot reproduce."""


def read_model(path: str | Path) -> sentencepiece_model_pb2.ModelProto:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def unsupported_options(proto: sentencepiece_model_pb2.ModelProto) -> list[str]:
    """What in ``proto`` the export cannot reproduce exactly, as "option (reason)" strings."""
    norm, trainer = proto.normalizer_spec, proto.trainer_spec
    problems = []
    if trainer.model_type not in (_BPE, _UNIGRAM):
        problems.append(f"model_type={trainer.model_type} (only bpe and unigram)")
    if norm.name != "identity" or norm.precompiled_charsmap:
        problems.append(f"normalization={norm.name!r} (only the lossless 'identity')")
    if norm.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces=True (only the lossless default, False)")
    if not norm.add_dummy_prefix or not norm.escape_whitespaces or trainer.treat_whitespace_as_suffix:
        problems.append("add_dummy_prefix / escape_whitespaces off or treat_whitespace_as_suffix on "
                        "(only sentencepiece's defaults)")
    user = [p.piece for p in proto.pieces if p.type == _USER_DEFINED]
    if user != ["\n"]:
        problems.append(f"user-defined symbols {user!r} (only the newline)")
    if any(p.type == _UNUSED for p in proto.pieces):
        problems.append("unused pieces (none expected)")
    chars = _characters(proto)
    uncovered = [p.piece for p in proto.pieces if p.type == _NORMAL and not set(p.piece) <= chars]
    if uncovered:
        problems.append(f"pieces with a character that is no piece of its own, e.g. {uncovered[:3]!r}")
    odd = [p.piece for p in proto.pieces if p.type == _NORMAL and not _WORD_PIECE.fullmatch(p.piece)]
    if odd:
        problems.append(f"pieces with {SPACE} after another character, e.g. {odd[:3]!r} (split_by_whitespace off?)")
    return problems


def _characters(proto: sentencepiece_model_pb2.ModelProto) -> set[str]:
    """The characters that are pieces of their own (normal or user-defined)."""
    return {p.piece for p in proto.pieces if p.type in (_NORMAL, _USER_DEFINED) and len(p.piece) == 1}


def _bpe_merges(proto: sentencepiece_model_pb2.ModelProto, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every ``(a, b)`` with ``a + b`` a normal piece and both halves pieces, best merged piece first."""
    ranked = sorted((p for p in proto.pieces if p.type == _NORMAL), key=lambda p: -p.score)
    merges = []
    for piece in ranked:
        text = piece.piece
        merges.extend((text[:i], text[i:]) for i in range(1, len(text)) if text[:i] in vocab and text[i:] in vocab)
    return merges


def build_tokenizer(proto: sentencepiece_model_pb2.ModelProto) -> Tokenizer:
    """The fast tokenizer that encodes as ``proto`` does (see the module docstring).

    Raises:
        UnsupportedTokenizer: naming every option of ``proto`` it cannot reproduce.
    """
    problems = unsupported_options(proto)
    if problems:
        raise UnsupportedTokenizer("cannot export the tokenizer to tokenizer.json: " + "; ".join(problems))
    byte_fallback = proto.trainer_spec.byte_fallback
    cut = None
    if proto.trainer_spec.model_type == _BPE:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
        model = models.BPE(vocab=vocab, merges=_bpe_merges(proto, vocab), unk_token=proto.pieces[UNK_ID].piece,
                           fuse_unk=True, byte_fallback=byte_fallback, ignore_merges=False)
    else:
        reachable = (_NORMAL, _USER_DEFINED)
        scores = [(p.piece, p.score if p.type in reachable else UNREACHABLE_SCORE) for p in proto.pieces]
        model = models.Unigram(scores, unk_id=UNK_ID, byte_fallback=byte_fallback)
        # A run of characters no piece covers is a word of its own, so an unreachable piece that spells
        # one ("<unk>" with "<" unknown) cannot win over the unknown node's lower score.
        known = "".join(f"\\x{{{ord(c):x}}}" for c in sorted(_characters(proto)))
        cut = pre_tokenizers.Split(Regex(f"[^{known}]+"), behavior="isolated")
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    words = pre_tokenizers.Split(Regex(_WORD), behavior="isolated")
    tok.pre_tokenizer = words if cut is None else pre_tokenizers.Sequence([words, cut])
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def write_hf_tokenizer(model_file: str | Path, out_dir: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for ``AutoTokenizer.from_pretrained(out_dir)``.

    Args:
        model_file: the Conduit sentencepiece model (``tokenizer.model``).
        out_dir: the Hugging Face export folder (exists).
        model_max_length: the model's context, in tokens.

    Raises:
        UnsupportedTokenizer: when the model uses an option the export cannot reproduce.
    """
    proto = read_model(model_file)
    out_dir = Path(out_dir)
    build_tokenizer(proto).save(str(out_dir / TOKENIZER_JSON))
    pieces = {name: proto.pieces[i].piece for name, i in
              (("pad_token", PAD_ID), ("unk_token", UNK_ID), ("bos_token", BOS_ID), ("eos_token", EOS_ID))}
    (out_dir / TOKENIZER_CONFIG_JSON).write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",  # tokenizer.json as it is: no conversion, no Llama rules
        "model_max_length": model_max_length,
        **pieces,
        "add_bos_token": False, "add_eos_token": False,
        "split_special_tokens": True,  # "<s>" in a text is characters, as in sentencepiece
        "clean_up_tokenization_spaces": False,  # decode gives the text back
        "conduit_note": f"ids: pad={PAD_ID} unk={UNK_ID} bos={BOS_ID} eos={EOS_ID}; documents start after an EOS; "
                        "equal to the sentencepiece model Conduit trained with",
    }, indent=2))
