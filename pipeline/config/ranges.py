"""The allowed range of each numeric config field that no other rule judges, in one table.

A size of zero, a beta of 1 or a negative thread count would otherwise pass loading and fail stages
later (or never: a zero batch trains on nothing). ``pipeline.config.validate`` checks this table
when a config is loaded; each entry is one field, so each message names one field, its value and
its range. Fields judged together with others (batch arithmetic, warmup against steps) stay in
``pipeline.config.validate`` and ``pipeline.config.limits``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# (description of the range, test of a value); None values are "not set" and always allowed.
Range = tuple[str, Callable[[Any], bool]]
AT_LEAST_1: Range = (">= 1", lambda v: v >= 1)
AT_LEAST_0: Range = (">= 0", lambda v: v >= 0)
POSITIVE: Range = ("> 0", lambda v: v > 0)
UNIT_CLOSED: Range = ("in [0, 1]", lambda v: 0 <= v <= 1)
UNIT_HALF_OPEN: Range = ("in [0, 1)", lambda v: 0 <= v < 1)
NON_EMPTY: Range = ("non-empty", lambda v: len(v) > 0)
NON_EMPTY_ITEMS: Range = ("a list of non-empty strings", lambda v: all(v))

RANGES: dict[str, Range] = {
    "run.lock_wait_s": AT_LEAST_0,
    # MLflow filter strings (finding an earlier attempt's runs) quote the name: keep quotes out of it.
    "run.name": ("non-empty, without quotes or backslashes", lambda v: bool(v) and not set(v) & set("'\"\\`")),
    "tokenizer.max_training_bytes": AT_LEAST_1,
    "tokenizer.num_threads": AT_LEAST_1,
    "train.global_batch_size": AT_LEAST_1,
    "optimizer.min_lr_ratio": UNIT_CLOSED,
    "optimizer.weight_decay": AT_LEAST_0,
    "optimizer.beta1": UNIT_HALF_OPEN,
    "optimizer.beta2": UNIT_HALF_OPEN,
    "optimizer.adam_eps": POSITIVE,
    "optimizer.grad_clip": AT_LEAST_0,  # 0 turns clipping off
    "validation.every": AT_LEAST_0,  # 0: no validation during training
    "validation.batches": AT_LEAST_1,
    "validation.early_stop_patience": AT_LEAST_0,
    "parallel.threads_per_worker": AT_LEAST_1,
    "parallel.sequence_parallel_size": AT_LEAST_1,
    "eval.max_batches": AT_LEAST_1,
    "eval.batch_size": AT_LEAST_1,
    "eval.prompts": NON_EMPTY_ITEMS,
    "eval.max_new_tokens": AT_LEAST_1,
    "eval.temperature": AT_LEAST_0,  # 0 is greedy decoding
    "eval.heldout_paths": NON_EMPTY_ITEMS,
    "eval.max_text_tokens": AT_LEAST_1,
    "eval.lambada_max_examples": AT_LEAST_1,
    "eval.attention_sentence": NON_EMPTY,
    "eval.cpus": AT_LEAST_1,
    "eval.threads": AT_LEAST_1,
    "register.model_name": NON_EMPTY,
    "cluster.num_cpus": AT_LEAST_1,
}


def out_of_range(cfg: Any) -> str | None:
    """The first field of ``RANGES`` whose value is outside its range.

    Args:
        cfg: a ``RunConfig`` (typed values, as ``pipeline.config`` builds them).

    Returns:
        None when every field is in range, else a message naming the field, its value and the range.
    """
    for path, (allowed, ok) in RANGES.items():
        section, name = path.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and not ok(value):
            return f"{path}={value!r} must be {allowed}"
    return None
