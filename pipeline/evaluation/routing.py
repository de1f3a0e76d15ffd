"""Expert load and router entropy of an MoE model over held-out tokens.

``ModelOutput.moe_stats`` holds, per MoE layer, the kept-slot count of every expert and the router's
mean entropy over the batch's tokens; this sums the counts and token-weights the entropy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from models.layers.moe import MoEFeedForward
from pipeline.evaluation.device import on_model


@torch.no_grad()
def routing_stats(model: torch.nn.Module, blocks: np.ndarray, batch_size: int) -> dict[str, np.ndarray]:
    """Expert load and router entropy per MoE layer.

    Args:
        model: an MoE Transformer (``cfg.num_experts > 0``).
        blocks: (n, seq_len+1) token blocks; the inputs (all but the last column) are routed.
        batch_size: blocks per forward pass.

    Returns:
        ``load_share`` (layers, experts): the share of routed slots each expert received, rows sum to 1;
        ``router_entropy`` (layers,): mean entropy of the router's distribution, nats;
        ``score_bias`` (layers, experts): the sigmoid router's selection bias (DeepSeek-V3), only for a
        model that has one.

    Raises:
        ValueError: when the model has no MoE layer.
    """
    model.eval()
    counts, entropy_sum, n_tokens = None, None, 0
    for b in range(0, len(blocks), batch_size):
        x_BT = on_model(model, torch.from_numpy(np.asarray(blocks[b : b + batch_size, :-1]).astype(np.int64)))
        stats = model(x_BT).moe_stats
        if not stats:
            raise ValueError("routing_stats needs an MoE model (model.num_experts > 0); this one has no MoE layer")
        batch_counts = np.stack([s["tokens_per_expert"].double().cpu().numpy() for s in stats])
        batch_entropy = np.array([float(s["router_entropy"]) for s in stats]) * x_BT.numel()
        counts = batch_counts if counts is None else counts + batch_counts
        entropy_sum = batch_entropy if entropy_sum is None else entropy_sum + batch_entropy
        n_tokens += x_BT.numel()
    out = {"load_share": counts / counts.sum(axis=1, keepdims=True), "router_entropy": entropy_sum / n_tokens}
    biases = [m.score_bias for m in model.modules() if isinstance(m, MoEFeedForward) and m.score_bias is not None]
    if biases:
        out["score_bias"] = torch.stack(biases).double().cpu().numpy()
    return out


def routing_metrics(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """Flat MLflow metrics: mean and per-layer router entropy (nats, and as a share of ln E), the
    largest expert's load share over the uniform share, per layer, and the selection bias's range per
    layer where the router has one."""
    n_experts = stats["load_share"].shape[1]
    out = {
        "router_entropy": float(stats["router_entropy"].mean()),
        "router_entropy_normalized": float(stats["router_entropy"].mean() / math.log(n_experts)),
    }
    for i, (h, share) in enumerate(zip(stats["router_entropy"], stats["load_share"])):
        out[f"router_entropy_layer{i}"] = float(h)
        out[f"expert_load_max_over_uniform_layer{i}"] = float(share.max() * n_experts)
    for i, bias in enumerate(stats.get("score_bias", ())):
        out[f"score_bias_range_layer{i}"] = float(bias.max() - bias.min())
    return out
