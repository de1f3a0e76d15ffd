"""evaluate: a trained model -> held-out and benchmark metrics, samples and pictures (``metrics.json``).

Bits per byte makes models with different tokenizers comparable: the mean next-token loss (nats)
times tokens per UTF-8 byte of the split, over ln 2. A unigram model fitted on the training tokens
(add-one smoothing) is the floor any trained model must clear, and is reported beside it.

Beyond the validation split (``pipeline.evaluation``): bits per byte and perplexity on held-out
Gutenberg books and WikiText-2 ``wiki.test.raw``, LAMBADA last-word accuracy and perplexity (with
GPT-2 117M's published numbers beside ours), word-order sensitivity, an attention heatmap grid and,
for MoE models, expert load and router entropy. An encoder-decoder (model.arch encoder_decoder) is scored
on what it was trained for instead: the denoising loss and bits per target byte of span-corrupted
validation blocks (``pipeline.evaluation.denoising``), and its samples fill the sentinels of the prompts. The scoring runs on a GPU when the cluster has one
(``eval.device``; bf16 autocast, batches grown to fit memory), else on ``eval.cpus`` CPUs with
``eval.threads`` torch threads (``pipeline.evaluation.device``). ``metrics.json`` holds ``metrics`` (flat numbers, which
register copies into version tags and promote gates on), ``samples`` and ``references``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np

from pipeline.config import RunConfig, hash_view
from pipeline.store.contracts import TOKENIZER_FILE, WEIGHTS_FILE, EvalReport, TokenIndex
from pipeline.stages.stage import Resources, Stage
from pipeline.evaluation import perplexity

# The body's libraries (torch, the evaluation sets, matplotlib) are imported where it runs: the stage table,
# read by a dry run or by another stage's task, loads without them.
if TYPE_CHECKING:
    import torch


def hash_config(cfg: RunConfig) -> dict:
    return {"eval": hash_view(cfg.eval)}


def unigram_loss(train_blocks: np.ndarray | Iterable[np.ndarray], eval_targets: np.ndarray, vocab_size: int) -> float:
    """Cross-entropy (nats) of an add-one-smoothed unigram model of the training tokens (one array of
    them, or several: the token shards, counted one at a time)."""
    parts = [train_blocks] if isinstance(train_blocks, np.ndarray) else train_blocks
    counts = np.ones(vocab_size, dtype=np.float64)
    for part in parts:
        counts += np.bincount(np.asarray(part).reshape(-1), minlength=vocab_size)
    logp = np.log(counts / counts.sum())
    return float(-logp[np.asarray(eval_targets).reshape(-1)].mean())


def benchmark_metrics(cfg: RunConfig, model: torch.nn.Module, sp,
                      on_scored: Callable[[], None] = lambda: None, batch_size: int | None = None) -> dict[str, float]:
    """Held-out Gutenberg, WikiText-2 and LAMBADA metrics, each skipped when its config path is null;
    ``on_scored`` is called after each set; ``batch_size`` defaults to ``eval.batch_size``.

    Raises:
        ValueError: naming the ``eval.*`` field with a bad value; FileNotFoundError for missing data.
    """
    from pipeline.data.corpora import data_root_hint
    from pipeline.evaluation import lambada, text_metrics

    e, root, context = cfg.eval, cfg.data_root(), cfg.tokenize.seq_len
    batch_size = batch_size or e.batch_size
    if e.max_text_tokens < 1:
        raise ValueError(f"eval.max_text_tokens={e.max_text_tokens} must be >= 1")
    out: dict[str, float] = {}
    text_sets = {"heldout": (e.heldout_paths, "eval.heldout_paths"),
                 "wikitext2": ([e.wikitext_path] if e.wikitext_path else [], "eval.wikitext_path")}
    for prefix, (patterns, field_name) in text_sets.items():
        if not patterns:
            continue
        files = text_metrics.resolve_files(root, patterns, field_name)
        encoded = text_metrics.encode_files(sp, files, e.max_text_tokens)
        m = text_metrics.text_metrics(model, encoded, context, batch_size)
        out.update({f"{prefix}_{k}": float(v) for k, v in m.items()})
        on_scored()
    if e.lambada_path:
        path = root / e.lambada_path
        if not path.is_file():
            raise FileNotFoundError(f"eval.lambada_path: {path} is not a file"
                                    f"{data_root_hint(e.lambada_path, root)}")
        examples = lambada.load_examples(path, sp, e.lambada_max_examples)
        out.update({f"lambada_{k}": float(v) for k, v in lambada.lambada_metrics(model, examples, context, batch_size).items()})
        on_scored()
    return out


def log_pictures(cfg: RunConfig, model: torch.nn.Module, sp, routing_stats: dict | None, tracker) -> None:
    """Log the attention heatmap grid and, for MoE models (``routing_stats`` from the scoring), the
    expert-load heatmap."""
    from models.families import family
    from pipeline.evaluation import plots

    if not family(model.cfg).draws_attention:  # no decoder-only attention map, no experts
        return
    weights, labels = plots.attention_maps(model, sp, cfg.eval.attention_sentence)
    tracker.log_figure(plots.attention_figure(weights, labels), "plots/attention_heatmaps.png")
    if routing_stats is not None:
        tracker.log_figure(plots.expert_load_figure(routing_stats["load_share"], routing_stats["router_entropy"],
                                                    routing_stats.get("score_bias")), "plots/expert_load.png")


def task_resources(cfg: RunConfig, inputs: dict) -> Resources:
    """What the runner reserves for the evaluate task on the running Ray cluster (``resources_on``)."""
    import ray

    return resources_on(cfg, ray.cluster_resources().get("GPU", 0))


def resources_on(cfg: RunConfig, gpus_in_cluster: float) -> Resources:
    """One GPU (and a CPU) when the evaluation runs on a GPU (``eval.device``), else ``eval.cpus`` CPUs.

    Raises:
        ValueError: ``eval.device=cuda`` on a cluster without GPUs.
    """
    from pipeline.evaluation.device import eval_device

    if eval_device(cfg.eval.device, gpus_in_cluster) == "cuda":
        return Resources(cpus=1, gpus=1)
    return Resources(cpus=cfg.eval.cpus)


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    import torch

    from models.export import load_safetensors
    from models.families import family
    from pipeline.data import span_corruption
    from pipeline.data.token_blocks import TokenBlocks
    from pipeline.evaluation import context_length, denoising, references
    from pipeline.evaluation.device import autocast, eval_device, eval_precision, fit_batch_size
    from pipeline.inference.generator import TextGenerator
    from pipeline.tokenization.spm import load_sentencepiece

    tok_dir = inputs["tokenize"].path
    val = TokenIndex.read(tok_dir).splits["validation"]
    tokens_per_byte = val.tokens / val.bytes
    device = eval_device(cfg.eval.device)
    precision = eval_precision(cfg.eval.precision, device)
    if device == "cpu":
        torch.set_num_threads(cfg.eval.threads or cfg.eval.cpus)
    model = load_safetensors(str(inputs["train"].path / WEIGHTS_FILE)).to(device)
    evaluated = TokenBlocks.of(tok_dir, "validation").head(cfg.eval.max_batches * cfg.eval.batch_size)
    batch_size = cfg.eval.batch_size
    if device == "cuda" and cfg.eval.fit_gpu_batch:
        batch_size = fit_batch_size(model, cfg.tokenize.seq_len, batch_size, limit=len(evaluated))
    with autocast(device, precision):
        if family(model.cfg).seq2seq:
            sp = load_sentencepiece(str(inputs["tokenizer"].path / TOKENIZER_FILE))
            metrics = denoising.denoising_metrics(model, evaluated, span_corruption.for_run(cfg), batch_size, sp)
            tracker.log_metrics({"sets_scored": 1}, step=1)
            stats = None
        else:
            metrics, stats = _score(cfg, model, evaluated, batch_size, tok_dir, tokens_per_byte, inputs, tracker)
    tracker.set_tags({"conduit.eval_device": device, "conduit.eval_precision": precision,
                      "conduit.eval_batch_size": batch_size})
    model = model.to("cpu")  # pictures and samples: small, and sampling draws from a CPU generator
    sp = load_sentencepiece(str(inputs["tokenizer"].path / TOKENIZER_FILE))
    log_pictures(cfg, model, sp, stats, tracker)
    if cfg.eval.context_lengths and not family(model.cfg).seq2seq:
        tracker.log_figure(context_length.context_figure(metrics, cfg.tokenize.seq_len), "plots/context_length.png")
    samples = TextGenerator(model, sp).generate(
        cfg.eval.prompts, max_new_tokens=cfg.eval.max_new_tokens, temperature=cfg.eval.temperature
    )
    table = references.reference_table(metrics)
    report = EvalReport(metrics=metrics, samples=dict(zip(cfg.eval.prompts, samples)),
                        references={"gpt2_117m": table, "text": references.format_table(table)})
    report_file = report.write(out_dir)
    tracker.log_metrics(metrics)
    tracker.log_table({"prompt": cfg.eval.prompts, "continuation": samples}, "samples.json")
    tracker.log_table(table, "references.json")
    tracker.log_artifact(report_file)
    return metrics


def _score(cfg: RunConfig, model: torch.nn.Module, evaluated: np.ndarray, batch_size: int, tok_dir: Path,
           tokens_per_byte: float, inputs: dict, tracker) -> tuple[dict[str, float], dict | None]:
    """Every number that needs a pass of the model over text: validation, word order, the benchmarks and,
    for an MoE model, routing (whose statistics are returned too, for the picture)."""
    from pipeline.data.token_blocks import TokenBlocks
    from pipeline.evaluation import context_length, routing, text_metrics, word_order
    from pipeline.tokenization.spm import load_sentencepiece

    # One pass gives the validation loss (the text as written) and the word-order control beside it.
    order = word_order.word_order_metrics(model, evaluated, batch_size, cfg.run.seed)
    loss, n_tokens = order["word_order_loss"], evaluated[:, 1:].size
    uni = unigram_loss(TokenBlocks.of(tok_dir, "train").shard_arrays(), evaluated[:, 1:], model.cfg.vocab_size)
    scored = itertools.count(1)

    def one_more_set_scored() -> None:  # the driver's status line reads it
        n = next(scored)
        tracker.log_metrics({"sets_scored": n}, step=n)

    one_more_set_scored()  # the validation blocks
    metrics = {
        "val_loss": loss,
        "val_perplexity": perplexity(loss),
        "val_bits_per_byte": loss * tokens_per_byte / math.log(2),
        "val_tokens_evaluated": n_tokens,
        "unigram_val_loss": uni,
        "unigram_bits_per_byte": uni * tokens_per_byte / math.log(2),
    }
    sp = load_sentencepiece(str(inputs["tokenizer"].path / TOKENIZER_FILE))
    metrics.update(order)
    metrics.update(benchmark_metrics(cfg, model, sp, on_scored=one_more_set_scored, batch_size=batch_size))
    if cfg.eval.context_lengths:
        files = text_metrics.resolve_files(cfg.data_root(), cfg.eval.heldout_paths, "eval.heldout_paths")
        encoded = text_metrics.encode_files(sp, files, cfg.eval.max_text_tokens)
        metrics.update(context_length.context_metrics(model, encoded, cfg.eval.context_lengths, batch_size))
        one_more_set_scored()
    stats = routing.routing_stats(model, evaluated, batch_size) if model.cfg.num_experts else None
    if stats is not None:
        metrics.update(routing.routing_metrics(stats))
    return metrics, stats


STAGE = Stage(name="evaluate", version=2, inputs=("tokenizer", "tokenize", "train"), hash_config=hash_config, run=run,
              resources_for=task_resources)
