"""evaluate: a trained model -> validation loss, perplexity, bits per byte, samples (``metrics.json``).

Bits per byte makes models with different tokenizers comparable: the mean next-token loss (nats)
times tokens per UTF-8 byte of the split, over ln 2. A unigram model fitted on the training tokens
(add-one smoothing) is the floor any trained model must clear, and is reported beside it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from models.export import load_safetensors
from models.loss import lm_loss
from pipeline.artifacts import write_json_atomic
from pipeline.config import RunConfig, hash_view
from pipeline.generation import TextGenerator
from pipeline.stages.tokenizer import MODEL_FILE
from pipeline.stages.train import WEIGHTS_FILE
from pipeline.text import load_sentencepiece

NAME = "evaluate"
VERSION = 1
INPUTS = ("tokenizer", "tokenize", "train")
METRICS_FILE = "metrics.json"


def hash_config(cfg: RunConfig) -> dict:
    return {"eval": hash_view(cfg.eval)}


@torch.no_grad()
def validation_loss(model: torch.nn.Module, blocks: np.ndarray, batch_size: int, max_batches: int) -> tuple[float, int]:
    """Mean next-token loss (nats) over the first ``max_batches`` batches of blocks, and the token count."""
    model.eval()
    total, count = 0.0, 0
    for b in range(min(max_batches, math.ceil(len(blocks) / batch_size))):
        block = torch.from_numpy(blocks[b * batch_size : (b + 1) * batch_size].astype(np.int64))
        logits = model(block[:, :-1]).logits
        n = block[:, 1:].numel()
        total += lm_loss(logits.float(), block[:, 1:]).item() * n
        count += n
    return total / count, count


def unigram_loss(train_blocks: np.ndarray, eval_targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) of an add-one-smoothed unigram model of the training tokens."""
    counts = np.bincount(np.asarray(train_blocks).reshape(-1), minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_targets).reshape(-1)].mean())


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    tok_dir = inputs["tokenize"].path
    index = json.loads((tok_dir / "index.json").read_text())
    val = index["splits"]["validation"]
    tokens_per_byte = val["tokens"] / val["bytes"]
    model = load_safetensors(str(inputs["train"].path / WEIGHTS_FILE))
    blocks = np.load(tok_dir / "validation.tokens.npy", mmap_mode="r")
    loss, n_tokens = validation_loss(model, blocks, cfg.eval.batch_size, cfg.eval.max_batches)
    evaluated = blocks[: math.ceil(n_tokens / (blocks.shape[1] - 1)), 1:]
    uni = unigram_loss(np.load(tok_dir / "train.tokens.npy", mmap_mode="r"), evaluated, model.cfg.vocab_size)
    metrics = {
        "val_loss": loss,
        "val_perplexity": math.exp(loss),
        "val_bits_per_byte": loss * tokens_per_byte / math.log(2),
        "val_tokens_evaluated": n_tokens,
        "unigram_val_loss": uni,
        "unigram_bits_per_byte": uni * tokens_per_byte / math.log(2),
    }
    sp = load_sentencepiece(str(inputs["tokenizer"].path / MODEL_FILE))
    samples = TextGenerator(model, sp).generate(
        cfg.eval.prompts, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature
    )
    write_json_atomic(out_dir / METRICS_FILE, {"metrics": metrics, "samples": dict(zip(cfg.eval.prompts, samples))})
    tracker.log_metrics(metrics)
    tracker.log_table({"prompt": cfg.eval.prompts, "continuation": samples}, "samples.json")
    tracker.log_artifact(out_dir / METRICS_FILE)
    return metrics
