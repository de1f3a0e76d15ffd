"""Text in, text out: a trained model plus its tokenizer, as evaluate and the served model use them.

A decoder continues each prompt. An encoder-decoder, trained to restore dropped spans, reads a prompt
with sentinels where text is missing (``"The <extra_id_0> sat on the <extra_id_1>."``) and returns the
spans that fill them, each after its sentinel (``"<extra_id_0> cat<extra_id_1> mat"``), as T5 does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models.export import load_safetensors
from models.families.encdec.model import generate_encdec
from models.generate import generate
from pipeline.serving import request_limits
from pipeline.data.span_corruption import DECODER_START_ID
from pipeline.tokenization.spm import EOS_ID, load_sentencepiece
from models.families import family


class PromptError(ValueError):
    """A request the model cannot answer (missing field, wrong type, too long); a client error."""


def prompts_from_input(model_input: Any) -> list[str]:
    """Accept what MLflow hands to ``predict``: a DataFrame with a ``prompt`` column, a list or a str.

    Raises:
        PromptError: naming the missing column or the value of the wrong type.
    """
    if hasattr(model_input, "columns"):  # a pandas DataFrame
        if "prompt" not in model_input.columns:
            raise PromptError(f"the input needs a 'prompt' column; got columns {list(model_input.columns)}")
        values = model_input["prompt"].tolist()
    elif isinstance(model_input, dict):
        if "prompt" not in model_input:
            raise PromptError(f"the input needs a 'prompt' field; got {sorted(model_input)}")
        values = model_input["prompt"]
        values = values if isinstance(values, list) else [values]
    elif isinstance(model_input, str):
        values = [model_input]
    elif isinstance(model_input, list):
        values = model_input
    else:
        raise PromptError(f"prompts must be strings; got {type(model_input).__name__}")
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise PromptError(f"prompt {i} must be a string; got {type(v).__name__} {v!r}")
    too_many = request_limits.prompt_count_problem("prompt", len(values))
    if too_many is not None:
        raise PromptError(too_many)
    return values


def longest_piece_chars(sp: Any) -> int | None:
    """The most characters of text one token of ``sp`` stands for (control and byte pieces stand
    for none or part of one; the space symbol for one space). None for a tokenizer without byte
    fallback: its unknown token stands for a whole run of unknown characters, of any length."""
    pieces = range(sp.get_piece_size())
    if not any(sp.is_byte(i) for i in pieces):
        return None
    return max(len(sp.id_to_piece(i)) for i in pieces if not (sp.is_control(i) or sp.is_byte(i) or sp.is_unknown(i)))


class TextGenerator:
    """A model and its tokenizer. Each prompt is decoded as the start of a new document: it follows
    an EOS, as every document after the first does in the packed training stream."""

    def __init__(self, model: torch.nn.Module, sp: Any):
        self.model = model.eval()
        self.sp = sp
        self.max_seq_len = model.cfg.max_seq_len
        longest = longest_piece_chars(sp)
        # None: no bound by characters (see longest_piece_chars); the request size limit still holds.
        self.max_prompt_chars = None if longest is None else request_limits.max_prompt_chars(self.max_seq_len, longest)

    def check_prompt_length(self, index: int, prompt: str) -> None:
        """Refuse a prompt that cannot fit the context by its characters alone, before tokenizing it.

        Raises:
            PromptError: naming the prompt, its characters and the most the context can hold.
        """
        if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
            raise PromptError(
                f"prompt {index} is {len(prompt)} characters; the model's context is {self.max_seq_len} tokens, "
                f"which hold at most {self.max_prompt_chars} characters of text"
            )

    @classmethod
    def from_files(cls, weights: str | Path, tokenizer: str | Path) -> "TextGenerator":
        return cls(load_safetensors(str(weights)), load_sentencepiece(str(tokenizer)))

    @torch.no_grad()
    def generate(self, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.8,
                 top_p: float = 1.0, seed: int = 0) -> list[str]:
        """Continue each prompt; returns only the generated continuation.

        Raises:
            PromptError: a prompt that leaves no room in the model's context, or bad sampling params.
        """
        for problem in (request_limits.token_count_problem("max_new_tokens", max_new_tokens),
                        request_limits.temperature_problem("temperature", temperature),
                        request_limits.top_p_problem("top_p", top_p)):
            if problem is not None:
                raise PromptError(problem)
        for i, prompt in enumerate(prompts):
            self.check_prompt_length(i, prompt)
        out = []
        gen = torch.Generator().manual_seed(seed)
        if family(self.model.cfg).seq2seq:
            return [self._fill_spans(i, p, max_new_tokens, temperature, top_p, gen) for i, p in enumerate(prompts)]
        for i, prompt in enumerate(prompts):
            ids = [EOS_ID] + self.sp.encode(prompt)
            if len(ids) >= self.max_seq_len:
                raise PromptError(
                    f"prompt {i} is {len(ids) - 1} tokens; the model's context is {self.max_seq_len} tokens "
                    "and needs room for at least one new token"
                )
            budget = min(max_new_tokens, self.max_seq_len - len(ids))
            ids_BT = torch.tensor([ids], dtype=torch.long)
            new_BT = generate(
                self.model, ids_BT, max_new_tokens=budget, temperature=temperature,
                top_p=None if top_p >= 1.0 else top_p, eos_id=EOS_ID, generator=gen,
            )
            new_ids = [t for t in new_BT[0, len(ids):].tolist() if t != EOS_ID]
            out.append(self.sp.decode(new_ids))
        return out

    def _fill_spans(self, index: int, prompt: str, max_new_tokens: int, temperature: float, top_p: float,
                    gen: torch.Generator) -> str:
        """An encoder-decoder's answer to one prompt: the encoder reads it (after an EOS, as documents
        follow one in training blocks), the decoder writes sentinels and spans until EOS or the budget."""
        ids = [EOS_ID] + self.sp.encode(prompt)
        if len(ids) > self.max_seq_len:
            raise PromptError(f"prompt {index} is {len(ids) - 1} tokens; the model's encoder reads at most "
                              f"{self.max_seq_len - 1}")
        budget = min(max_new_tokens, self.max_seq_len - 1)  # the decoder's start token takes one position
        new_BT = generate_encdec(
            self.model, torch.tensor([ids], dtype=torch.long), decoder_start_id=DECODER_START_ID,
            max_new_tokens=budget, eos_id=EOS_ID, temperature=temperature,
            top_p=None if top_p >= 1.0 else top_p, generator=gen,
        )
        return self.sp.decode([t for t in new_BT[0].tolist() if t != EOS_ID])
