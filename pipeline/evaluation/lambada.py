"""LAMBADA (OpenAI version): predict the last word of a passage from the rest of it.

Accuracy counts an example as right only when greedy decoding produces every token of the target
word. With teacher forcing that is one forward pass: greedy decoding produces the word exactly when
the argmax at each target position is that target token (at the first wrong argmax greedy decoding
diverges). Perplexity is per target word, as lm-evaluation-harness reports it: exp of the mean over
examples of the word's total negative log-likelihood, which does not depend on the tokenizer.

Tokens: the context follows an EOS, as a document does in training. Sentencepiece splits on
whitespace before merging, so the context's tokens followed by the tokens of the word (whose dummy
"▁" prefix is the space between them) are exactly the tokens of "context word".

Shape legend: B examples in a batch, T positions, V vocab.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.evaluation.device import on_model
from pipeline.tokenization.spm import EOS_ID
from pipeline.evaluation import perplexity


@dataclass(frozen=True)
class Example:
    context_ids: list[int]  # starts with EOS
    target_ids: list[int]


def load_examples(path: Path, sp, max_examples: int) -> list[Example]:
    """The first ``max_examples`` examples of a LAMBADA jsonl file, tokenized.

    Raises:
        ValueError: naming the line of a malformed example.
    """
    if max_examples < 1:
        raise ValueError(f"eval.lambada_max_examples must be >= 1; got {max_examples}")
    out = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(out) == max_examples:
                break
            row = json.loads(line)
            if not isinstance(row.get("context"), str) or not isinstance(row.get("continuation"), str):
                raise ValueError(f"{path}:{line_no}: needs string fields 'context' and 'continuation'; got {sorted(row)}")
            word = row["continuation"].strip()
            out.append(Example([EOS_ID, *sp.encode(row["context"].rstrip())], sp.encode(word)))
    return out


def score_targets(logits_TV: torch.Tensor, target_ids: list[int]) -> tuple[bool, float]:
    """Greedy hit and total NLL (nats) of the target tokens, given logits at the positions that predict them.

    Args:
        logits_TV: (len(target_ids), V) logits; row i predicts target_ids[i].
        target_ids: the target word's tokens.

    Returns:
        (every argmax equals its target, summed negative log-likelihood).
    """
    targets_T = torch.tensor(target_ids, dtype=torch.long, device=logits_TV.device)
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    nll = -logp_TV.gather(1, targets_T[:, None]).sum().item()
    return bool((logits_TV.argmax(dim=-1) == targets_T).all()), nll


@torch.no_grad()
def lambada_metrics(model: torch.nn.Module, examples: list[Example], context: int, batch_size: int) -> dict[str, float]:
    """Last-word accuracy and target-word perplexity.

    Args:
        model: the Transformer.
        examples: from ``load_examples``.
        context: the longest sequence fed to the model; longer passages keep their last tokens.
        batch_size: examples per forward pass (right-padded; causal attention ignores the padding).

    Returns:
        ``accuracy``, ``perplexity``, ``examples``.
    """
    model.eval()
    hits, nll_total = 0, 0.0
    for b in range(0, len(examples), batch_size):
        batch = examples[b : b + batch_size]
        seqs = [(ex.context_ids + ex.target_ids)[:-1][-context:] for ex in batch]
        T = max(len(s) for s in seqs)
        x_BT = torch.full((len(seqs), T), EOS_ID, dtype=torch.long)
        for i, s in enumerate(seqs):
            x_BT[i, : len(s)] = torch.tensor(s)
        logits_BTV = model(on_model(model, x_BT)).logits
        for i, (ex, s) in enumerate(zip(batch, seqs)):
            n = len(ex.target_ids)
            hit, nll = score_targets(logits_BTV[i, len(s) - n : len(s)], ex.target_ids)
            hits += hit
            nll_total += nll
    return {
        "accuracy": hits / len(examples),
        "perplexity": perplexity(nll_total / len(examples)),
        "examples": len(examples),
    }
