"""Published reference numbers, printed beside ours so a reader sees the scale.

GPT-2 117M zero-shot (Radford et al. 2019, Table 3), as listed in ../shared/data/README.md. The
WikiText-2 perplexity there is word-level on the raw test set with GPT-2's detokenisation; ours is
word-level over whitespace words of the scored prefix without detokenisation, so compare loosely.
"""

from __future__ import annotations

GPT2_117M = {
    "wikitext2_word_perplexity": 29.41,
    "lambada_accuracy": 0.4599,
    "lambada_perplexity": 35.13,
}

NOTES = {
    "wikitext2_word_perplexity": "GPT-2: detokenised raw test set; ours: whitespace words of the scored prefix",
    "lambada_accuracy": "greedy decoding must produce the whole target word",
    "lambada_perplexity": "per target word: exp(mean word NLL)",
}


def reference_table(metrics: dict[str, float]) -> dict[str, list]:
    """Columns ``metric``, ``ours``, ``gpt2_117m``, ``note`` for the reference metrics we measured."""
    rows = [k for k in GPT2_117M if k in metrics]
    return {
        "metric": rows,
        "ours": [float(metrics[k]) for k in rows],
        "gpt2_117m": [GPT2_117M[k] for k in rows],
        "note": [NOTES[k] for k in rows],
    }


def format_table(table: dict[str, list]) -> str:
    """The reference table as aligned text (for logs and the metrics.json reader)."""
    lines = [f"{'metric':<28} {'ours':>12} {'GPT-2 117M':>12}  note"]
    for m, ours, ref, note in zip(table["metric"], table["ours"], table["gpt2_117m"], table["note"]):
        lines.append(f"{m:<28} {ours:>12.4g} {ref:>12.4g}  {note}")
    return "\n".join(lines)
