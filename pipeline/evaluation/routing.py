"""Expert load and router entropy of an MoE model over held-out tokens.

``ModelOutput.moe_stats`` holds, per MoE layer, the kept-slot count of every expert and the router's
mean entropy over the batch's tokens; this sums the counts and token-weights the entropy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

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
        ``router_entropy`` (layers,): mean entropy of the router's distribution, nats.

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
    return {"load_share": counts / counts.sum(axis=1, keepdims=True), "router_entropy": entropy_sum / n_tokens}


def routing_metrics(stats: dict[str, np.ndarray]) -> dict[str, float]:
    """Flat MLflow metrics: mean and per-layer router entropy (nats, and as a share of ln E) and the
    largest expert's load share over the uniform share, per layer."""
    n_experts = stats["load_share"].shape[1]
    out = {
        "router_entropy": float(stats["router_entropy"].mean()),
        "router_entropy_normalized": float(stats["router_entropy"].mean() / math.log(n_experts)),
    }
    for i, (h, share) in enumerate(zip(stats["router_entropy"], stats["load_share"])):
        out[f"router_entropy_layer{i}"] = float(h)
        out[f"expert_load_max_over_uniform_layer{i}"] = float(share.max() * n_experts)
    return out
