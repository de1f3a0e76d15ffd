"""A completion's text as its tokens arrive: what can be sent now, and where a stop sequence cuts it.

Sentencepiece joins pieces (a token's text depends on what precedes it) and a character outside the
vocabulary arrives as several byte tokens, so text is taken from decoding all the tokens so far, and
sent only as far as it is final:

- while the decoded text ends in U+FFFD (the bytes of a character not all there yet) nothing is sent:
  a multi-byte character is never split between events;
- text that could be the start of a stop sequence is held until it is known not to be one;
- once a stop sequence appears, the text before it is sent and the choice is over (its generation is
  stopped; the tokens counted are those up to the one that completed the stop sequence).

Concatenated, what ``add`` and ``finish`` return is the choice's text: the decoded tokens, cut before
the first stop sequence. No Ray and no model here: ``pipeline.serving.app`` feeds it.
"""

from __future__ import annotations

from typing import Any

from pipeline.serving.openai_api import apply_stop

INCOMPLETE = "\ufffd"  # what sentencepiece decodes the bytes of an incomplete character to


def _hold_for_stop(text: str, stop: tuple[str, ...]) -> int:
    """How many characters at the end of ``text`` could begin one of ``stop``."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class ChoiceText:
    """One choice's text, token by token.

    Args:
        sp: the sentencepiece processor.
        stop: stop sequences.
        incremental: False when only the whole text is wanted (``add`` then returns "" and decodes
            nothing unless there are stop sequences to find; ``finish`` returns the text).

    Attributes:
        ids: the tokens added so far.
        sent: the text returned so far.
        stopped: a stop sequence has appeared (add nothing more).
        kept: tokens that count (all of them, or those up to the stop sequence).
    """

    def __init__(self, sp: Any, stop: tuple[str, ...] = (), incremental: bool = True):
        self.sp, self.stop = sp, stop
        # Without a stop sequence and for a caller that waits for the end, nothing is decoded before it.
        self.incremental = incremental or bool(stop)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False
        self.kept = 0

    def _text(self) -> str:
        """The decoded tokens, cut before the first stop sequence (and ``stopped`` set if there is one)."""
        text, cut = apply_stop(self.sp.decode(self.ids), self.stop)
        self.stopped = self.stopped or cut
        return text

    def _send(self, final: str) -> str:
        if not final.startswith(self.sent):  # sentencepiece's decoding is prefix-stable: a bug if not
            raise RuntimeError(f"the choice's text {final!r} no longer starts with what was already sent "
                               f"({self.sent!r}): the tokenizer's decoding is not prefix-stable")
        piece = final[len(self.sent):]
        self.sent = final
        return piece

    def add(self, token: int) -> str:
        """Add the next token; returns the text that is final now ("" while held)."""
        if self.stopped:
            raise ValueError("the choice has met a stop sequence; it takes no more tokens")
        self.ids.append(token)
        self.kept = len(self.ids)
        if not self.incremental:
            return ""
        text = self._text()
        if self.stopped:
            return self._send(text)
        safe = text.rstrip(INCOMPLETE) if text.endswith(INCOMPLETE) else text
        safe = safe[:len(safe) - _hold_for_stop(safe, self.stop)]
        if self.sent.startswith(safe):  # nothing more is final yet
            return ""
        return self._send(safe)

    def finish(self) -> str:
        """The text still held when the choice ends (its last token came)."""
        return self._send(self._text())

    @property
    def text(self) -> str:
        return self.sent


def text_pieces(sp: Any, ids: list[int]) -> list[str]:
    """The text each token adds as it extends the decoded text (a token that only starts a character
    adds "", the one that completes it the whole character); concatenated they are ``sp.decode(ids)``."""
    choice = ChoiceText(sp)
    pieces = [choice.add(t) for t in ids]
    if pieces:
        pieces[-1] += choice.finish()
    return pieces


__all__ = ["ChoiceText", "INCOMPLETE", "text_pieces"]
