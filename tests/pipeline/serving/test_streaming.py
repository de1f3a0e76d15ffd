"""A streamed choice's text: multi-byte characters never split between events, stop sequences never half
sent, and the concatenated events equal the whole text (a real byte-fallback sentencepiece model)."""

from __future__ import annotations

import pytest

from pipeline.serving.streaming import INCOMPLETE, ChoiceText, text_pieces
from pipeline.tokenization.spm import load_sentencepiece, train_sentencepiece, training_lines


@pytest.fixture(scope="module")
def sp(tmp_path_factory, data_root):
    text = (data_root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:100_000]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    path.write_bytes(train_sentencepiece(training_lines(text.split("\n\n"), 10**9), vocab_size=400, model_type="bpe",
                                         character_coverage=1.0, byte_fallback=True, normalization="identity",
                                         num_threads=1))
    return load_sentencepiece(str(path))


def _stream(sp, ids, stop=()):
    choice = ChoiceText(sp, stop)
    events = []
    for t in ids:
        events.append(choice.add(t))
        if choice.stopped:
            break
    events.append(choice.finish())
    return choice, events


def test_multibyte_characters_arrive_whole_and_the_events_join_to_the_text(sp):
    text = "Ay, my lord — naïve 東京 😀 KING:"  # the Shakespeare tokenizer has no piece for most of these
    ids = sp.encode(text)
    assert any(sp.is_byte(i) for i in ids) and sp.decode(ids) == text
    choice, events = _stream(sp, ids)
    assert "".join(events) == text and choice.text == text and choice.kept == len(ids)
    assert not any(INCOMPLETE in e for e in events)
    assert "😀" in events  # its four byte tokens: one event with the whole character
    assert events.count("") >= 3  # the first three bytes of the emoji were held
    pieces = text_pieces(sp, ids)
    assert len(pieces) == len(ids) and "".join(pieces) == text


def test_a_stop_sequence_is_held_until_known_and_cuts_the_text(sp):
    text = "First Citizen: Before we proceed any further, hear me speak."
    ids = sp.encode(text)
    choice, events = _stream(sp, ids, stop=("proceed any", "xyz"))
    assert "".join(events) == "First Citizen: Before we " and choice.stopped
    assert not any("proc" in e for e in events)  # the stop sequence's start was never sent
    assert sp.decode(ids[:choice.kept]).startswith("First Citizen: Before we proceed any")
    assert not sp.decode(ids[:choice.kept - 1]).startswith("First Citizen: Before we proceed any")
    with pytest.raises(ValueError, match="stop sequence"):
        choice.add(ids[0])
    # a held prefix that turns out not to be the stop sequence is sent after all
    choice, events = _stream(sp, sp.encode("Before we part"), stop=("pardon",))
    assert "".join(events) == "Before we part" and not choice.stopped


def test_a_decoding_that_is_not_prefix_stable_is_an_error_not_silence():
    """ChoiceText._send's 'cannot happen' branch returned "" (the choice's text then silently lost its
    changed part); it is a tokenizer bug, raised so the request fails with a 500 and says why."""

    class Unstable:  # decodes [1] as "ab" but [1, 2] as "ac..."
        def decode(self, ids):
            return "ab" if len(ids) == 1 else "ac" + "x" * len(ids)

    choice = ChoiceText(Unstable(), (), incremental=True)
    assert choice.add(1) == "ab"
    with pytest.raises(RuntimeError, match="not prefix-stable"):
        choice.add(2)
