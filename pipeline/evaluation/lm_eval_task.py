"""A local lm-evaluation-harness perplexity task over texts on disk: nothing comes from a hub.

``write_rolling_task`` writes ``<name>.jsonl`` (one ``{"text": ...}`` document a line) and ``<name>.yaml``
(a ``loglikelihood_rolling`` task reading that file through the ``json`` builder of ``datasets``)
into one folder, which ``lm_eval --include_path FOLDER --tasks NAME`` (or ``TaskManager(include_path=...)``)
picks up. The task reports ``bits_per_byte``, ``byte_perplexity`` and ``word_perplexity`` of each
document, scored in disjoint windows of the model's ``max_length``, as Conduit's evaluate stage scores
its held-out text (``pipeline.evaluation.text_metrics``). docs/hf-export.md says how
to run it on a registered version.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def write_rolling_task(folder: str | Path, name: str, texts: list[str]) -> Path:
    """Write the task ``name`` over ``texts`` (one document each) into ``folder``.

    Returns:
        The task's YAML file.

    Raises:
        ValueError: when ``texts`` is empty or holds an empty document.
    """
    if not texts or not all(texts):
        raise ValueError(f"task {name!r} needs at least one document, and no empty one")
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with data.open("w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    task = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "loglikelihood_rolling",
        "doc_to_text": "",
        "doc_to_target": "text",  # a field of the document: the text as it is
        "metric_list": [{"metric": m} for m in ("bits_per_byte", "byte_perplexity", "word_perplexity")],
        "metadata": {"version": 1.0},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
    return path
