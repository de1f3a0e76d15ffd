"""What a request to a served model may ask for: sampling values and sizes, checked before any work.

One place for the rules that both doors share: the OpenAI API of the Ray Serve deployment
(``pipeline.serving.openai_api``, where a problem becomes a 400 naming the field) and the MLflow pyfunc model
(``pipeline.inference.generator``, where it becomes a ``PromptError``, which MLflow's server answers with a
400). Pure Python: no torch, no Ray.

Why each bound:
- a temperature that is NaN or infinite reaches ``torch.multinomial`` as NaN probabilities (a server
  error); one just above 0 divides the logits into overflow (inf - inf = NaN after the softmax's
  shift). Zero means greedy; otherwise ``MIN_TEMPERATURE`` is far from overflow for any logit a
  float32 model produces and already samples almost greedily.
- a request's work grows with its prompts, so their number and the body's bytes are capped; a
  prompt's characters are checked against the model's context before the tokenizer reads it all
  (``max_prompt_chars``).
"""

from __future__ import annotations

import math
from typing import Any

MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
MAX_PROMPTS = 64  # prompts in one request (each is generated n times)
MAX_REQUEST_BYTES = 1 << 20  # a request body; larger is a 413 before it is parsed


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def temperature_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not a temperature (0 for greedy, else in [MIN_TEMPERATURE, MAX_TEMPERATURE]), or None."""
    if not _is_number(value) or not math.isfinite(value):
        return f"{name} must be a finite number; got {value!r}"
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        return f"{name}={value!r} must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]"
    return None


def top_p_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not a nucleus threshold in (0, 1], or None."""
    if not _is_number(value) or not math.isfinite(value):
        return f"{name} must be a finite number; got {value!r}"
    if not 0 < value <= 1:
        return f"{name}={value!r} must be in (0.0, 1.0]"
    return None


def token_count_problem(name: str, value: Any, hi: int = 1 << 20) -> str | None:
    """Why ``value`` is not a whole number of tokens in [1, hi], or None (2.0 is refused: not an integer)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return f"{name} must be an integer; got {value!r}"
    if not 1 <= value <= hi:
        return f"{name}={value!r} must be in [1, {hi}]"
    return None


def prompt_count_problem(name: str, count: int) -> str | None:
    """Why ``count`` prompts are too many for one request, or None."""
    if count > MAX_PROMPTS:
        return f"{name} takes at most {MAX_PROMPTS} prompts per request; got {count}"
    return None


def max_prompt_chars(max_seq_len: int, longest_piece_chars: int) -> int:
    """The most characters a prompt that fits in ``max_seq_len`` tokens can have.

    Every token covers at most ``longest_piece_chars`` characters of the text (sentencepiece's
    pieces, with its space symbol standing for one space, and byte fallback for characters outside
    the vocabulary), so a longer prompt has more tokens than the context holds, whatever they are: it
    can be refused without tokenizing it.
    """
    return max_seq_len * longest_piece_chars
