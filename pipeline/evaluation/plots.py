"""Pictures for the MLflow run: attention heatmaps and MoE expert load.

Figures are built with ``matplotlib.figure.Figure`` (the Agg renderer, no pyplot and no display), so
they are safe in Ray workers and tests; the evaluate stage hands them to ``StageTracker.log_figure``.
"""

from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from pipeline.tokenization.spm import EOS_ID

MAX_ATTENTION_TOKENS = 32  # beyond this the token labels are unreadable


@torch.no_grad()
def attention_maps(model: torch.nn.Module, sp, sentence: str) -> tuple[np.ndarray, list[str]]:
    """Attention weights of every layer and head for ``sentence`` (after an EOS, as a document starts).

    Args:
        model: the Transformer; its explicit attention path returns the weights.
        sp: its sentencepiece processor.
        sentence: the text to look at; cut to ``MAX_ATTENTION_TOKENS`` tokens.

    Returns:
        (weights (layers, heads, T, T), token labels of length T).

    Raises:
        ValueError: when the sentence encodes to no token.
    """
    ids = sp.encode(sentence)
    if not ids:
        raise ValueError(f"eval.attention_sentence={sentence!r} encodes to no token")
    ids = [EOS_ID, *ids][: min(MAX_ATTENTION_TOKENS, model.cfg.max_seq_len)]
    model.eval()
    out = model(torch.tensor([ids]), return_attention=True)
    weights = torch.stack([a[0].float() for a in out.attentions]).numpy()
    labels = [sp.id_to_piece(i).replace("\u2581", "_") for i in ids]
    return weights, labels


def attention_figure(weights: np.ndarray, labels: list[str]) -> Figure:
    """A grid of heatmaps, one row per layer and one column per head (query down, key across)."""
    n_layers, n_heads, T, _ = weights.shape
    fig = Figure(figsize=(2.6 * n_heads + 1, 2.6 * n_layers + 0.6), layout="constrained")
    axes = fig.subplots(n_layers, n_heads, squeeze=False)
    for layer in range(n_layers):
        for head in range(n_heads):
            ax = axes[layer, head]
            ax.imshow(weights[layer, head], vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            ticks = range(T)
            ax.set_xticks(ticks, labels if layer == n_layers - 1 else [""] * T, rotation=90, fontsize=5)
            ax.set_yticks(ticks, labels if head == 0 else [""] * T, fontsize=5)
    fig.suptitle("attention weights (rows: query token, columns: key token)")
    return fig


def expert_load_figure(load_share: np.ndarray, router_entropy: np.ndarray, score_bias: np.ndarray | None = None) -> Figure:
    """Heatmap of the share of routed tokens each expert received, one row per MoE layer; beside it, for a
    sigmoid router (DeepSeek-V3), its selection bias per layer and expert (red pushes an expert up, blue
    down: the balancing's answer to the load on the left)."""
    n_layers, n_experts = load_share.shape
    panels = 1 if score_bias is None else 2
    fig = Figure(figsize=(1.0 + 0.6 * n_experts * panels, 1.2 + 0.5 * n_layers), layout="constrained")
    axes = fig.subplots(1, panels, squeeze=False)[0]
    ax = axes[0]
    image = ax.imshow(load_share, cmap="magma", vmin=0.0, aspect="auto")
    for layer in range(n_layers):
        for expert in range(n_experts):
            ax.text(expert, layer, f"{load_share[layer, expert]:.2f}", ha="center", va="center", fontsize=7, color="cyan")
    ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)])
    ax.set_yticks(range(n_layers), [f"MoE layer {i}\nH={h:.2f}" for i, h in enumerate(router_entropy)])
    ax.set_xlabel("expert")
    ax.set_title(f"share of routed tokens per expert (uniform = {1 / n_experts:.2f}); H = router entropy, nats")
    fig.colorbar(image, ax=ax)
    if score_bias is not None:
        ax = axes[1]
        scale = max(float(np.abs(score_bias).max()), 1e-12)
        image = ax.imshow(score_bias, cmap="coolwarm", vmin=-scale, vmax=scale, aspect="auto")
        for layer in range(n_layers):
            for expert in range(n_experts):
                ax.text(expert, layer, f"{score_bias[layer, expert]:+.3f}", ha="center", va="center", fontsize=6)
        ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)])
        ax.set_yticks(range(n_layers), [f"MoE layer {i}" for i in range(n_layers)])
        ax.set_xlabel("expert")
        ax.set_title("router selection bias (added to choose, not to weigh)")
        fig.colorbar(image, ax=ax)
    return fig
