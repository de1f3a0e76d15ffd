"""Evaluation by context length: how well a model uses (or survives) contexts shorter and longer than
it was trained at, the figures a context extension is judged by.

The same held-out text (``eval.heldout_paths``, encoded once) is cut into windows of each length in
``eval.context_lengths`` (``text_metrics.windows``: every token a target exactly once, whatever the
length), so the bits per byte at each length score the same bytes and differ only in how much context
each token had. Within the longest windows, the loss is also averaged by position bucket (positions
[0, 1), [1, 2), [2, 4), ... doubling up to the window): a model that extrapolates badly gets worse in
the buckets past its trained length, one that uses the context gets better. Beside each length, the
KV cache a sequence of that length holds (bf16, ``models.accounting``).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure

from models.accounting import kv_cache_bytes_per_token
from pipeline.evaluation.device import on_model
from pipeline.evaluation.text_metrics import IGNORE, EncodedText, summed_nll, windows

MAX_LOGITS = 1 << 24  # logits held at once when scoring by position (rows x length x vocabulary)


def position_buckets(length: int) -> list[tuple[int, int]]:
    """[0, 1), [1, 2), [2, 4), [4, 8), ... the last ending at ``length``."""
    edges, b = [0, 1], 2
    while b < length:
        edges.append(b)
        b *= 2
    edges.append(length)
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


@torch.no_grad()
def loss_by_position(model: torch.nn.Module, inputs: np.ndarray, targets: np.ndarray,
                     batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Summed next-token NLL (nats, fp32 log-softmax) and target count at each window position."""
    model.eval()
    L = inputs.shape[1]
    rows = max(1, min(batch_size, MAX_LOGITS // (L * model.cfg.vocab_size)))
    nll_L, count_L = np.zeros(L), np.zeros(L, dtype=np.int64)
    for b in range(0, len(inputs), rows):
        x_BT = on_model(model, torch.from_numpy(inputs[b:b + rows]))
        y_BT = on_model(model, torch.from_numpy(targets[b:b + rows]))
        logits_BTV = model(x_BT).logits.float()
        nll_BT = F.cross_entropy(logits_BTV.transpose(1, 2), y_BT, ignore_index=IGNORE, reduction="none")
        nll_L += nll_BT.sum(dim=0).double().cpu().numpy()
        count_L += (y_BT != IGNORE).sum(dim=0).cpu().numpy()
    return nll_L, count_L


def context_metrics(model: torch.nn.Module, encoded: EncodedText, lengths: list[int], batch_size: int) -> dict:
    """Per length L: ``context_bits_per_byte_{L}``, ``context_loss_{L}`` and ``kv_cache_bytes_{L}``; per
    position bucket [a, b) of the longest: ``context_loss_pos_{a}_{b}``.

    Raises:
        ValueError: a length beyond the model's ``max_seq_len``, naming both.
    """
    cfg = model.cfg
    too_long = [L for L in lengths if L > cfg.max_seq_len]
    if too_long:
        raise ValueError(f"eval.context_lengths {too_long} exceed the model's max_seq_len={cfg.max_seq_len}")
    out: dict[str, float] = {}
    per_token = kv_cache_bytes_per_token(cfg)
    for L in sorted(set(lengths)):
        rows = max(1, min(batch_size, batch_size * 512 // L))  # long windows: fewer per forward
        nll, n = summed_nll(model, *windows(encoded.ids, L), rows)
        out[f"context_loss_{L}"] = nll / n
        out[f"context_bits_per_byte_{L}"] = nll / math.log(2) / encoded.n_bytes
        out[f"kv_cache_bytes_{L}"] = per_token * L
    longest = max(lengths)
    nll_L, count_L = loss_by_position(model, *windows(encoded.ids, longest), batch_size)
    for lo, hi in position_buckets(longest):
        n = int(count_L[lo:hi].sum())
        if n:
            out[f"context_loss_pos_{lo}_{hi}"] = float(nll_L[lo:hi].sum() / n)
    return out


def context_figure(metrics: dict, trained_length: int) -> Figure:
    """Bits per byte by context length (left) and loss by position bucket in the longest window (right),
    the trained length marked on both."""
    lengths = sorted(int(k.rsplit("_", 1)[1]) for k in metrics if k.startswith("context_bits_per_byte_"))
    buckets = sorted((int(k.split("_")[3]), int(k.split("_")[4]), v) for k, v in metrics.items()
                     if k.startswith("context_loss_pos_"))
    fig = Figure(figsize=(10, 3.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    left.plot(lengths, [metrics[f"context_bits_per_byte_{L}"] for L in lengths], "o-")
    left.set_xscale("log", base=2)
    left.set_xticks(lengths, [str(L) for L in lengths])
    left.axvline(trained_length, color="grey", linestyle="--", label=f"trained at {trained_length}")
    left.set_xlabel("context length (tokens)")
    left.set_ylabel("held-out bits per byte")
    left.set_title("the same text scored in windows of each length")
    left.legend()
    mids = [math.sqrt(max(lo, 0.5) * hi) for lo, hi, _ in buckets]
    right.plot(mids, [v for _, _, v in buckets], "o-")
    right.set_xscale("log", base=2)
    right.set_xticks(mids, [f"{lo}-{hi}" for lo, hi, _ in buckets], rotation=45, fontsize=7)
    right.axvline(trained_length, color="grey", linestyle="--")
    right.set_xlabel("position in the window")
    right.set_ylabel("loss (nats/token)")
    right.set_title(f"loss by position, windows of {max(lengths)}")
    return fig


__all__ = ["context_figure", "context_metrics", "loss_by_position", "position_buckets"]
