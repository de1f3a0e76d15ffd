"""register: trained weights + tokenizer + metrics -> an MLflow registered model version.

The version is an MLflow pyfunc model (``pipeline.serving.pyfunc.ConduitLM``) that answers prompts with
generated text; it gets the configured alias (``challenger`` by default), tags that lead back to the
data, config, code and metrics it came from (``metric.<name>`` tags are what ``jobs.promote`` gates
on), and a description. Shipped inside the model: ``metrics.json`` and, where the architecture allows
and ``register.hf_export`` is on, a Hugging Face export (``hf/``: config.json, model.safetensors and
the tokenizer as ``tokenizer.json``, equal to the sentencepiece ``tokenizer.model`` shipped beside it)
that ``transformers`` loads as Llama / Mixtral / DeepseekV2 / DeepseekV3 / Mamba without ``sentencepiece`` or ``protobuf``.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from pipeline.tokenization import hf_fast
from pipeline.store.artifacts import code_version, content_hash
from pipeline.config import REPO_ROOT, RunConfig, hash_view
from pipeline.store.contracts import EVAL_METRICS_FILE, HF_DIR, TOKENIZER_FILE, WEIGHTS_FILE, EvalReport, RegisteredModel
from pipeline.stages.stage import Resources, Stage
from pipeline.tokenization.spm import BOS_ID, EOS_ID, PAD_ID
from models.families import family


def hash_config(cfg: RunConfig) -> dict:
    # The registry is where this stage's output lives, so its address is part of the identity.
    return {"register": hash_view(cfg.register), "tracking_uri": cfg.tracking_uri()}


def export_hf(weights: Path, tokenizer: Path, out_dir: Path) -> str | None:
    """Write the Hugging Face export of ``weights`` into ``out_dir``: the model, and the tokenizer as a
    ``tokenizer.json`` that encodes exactly as ``tokenizer`` (``pipeline.tokenization.hf_fast``), beside the
    sentencepiece ``tokenizer.model`` itself.

    Returns:
        None when exported, else why not (the options HF Llama / Mixtral / DeepseekV2 / V3 or the tokenizer
        export cannot express).
    """
    from models.export import hf_unsupported_options, load_safetensors, read_config, save_hf  # torch: here only

    problems = hf_unsupported_options(read_config(weights))
    problems += hf_fast.unsupported_options(hf_fast.read_model(tokenizer))
    if problems:
        return "; ".join(problems)
    model = load_safetensors(weights)
    save_hf(model, model.cfg, out_dir,
            extra_config={"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID})
    shutil.copyfile(tokenizer, out_dir / "tokenizer.model")
    hf_fast.write_hf_tokenizer(tokenizer, out_dir, model.cfg.max_seq_len)
    return None


def version_tags(cfg: RunConfig, inputs: dict, metrics: dict[str, float], hf_note: str | None) -> dict[str, str]:
    """Lineage and metric tags of the new version (metrics at full precision: promote compares them)."""
    return {
        "conduit.train_hash": inputs["train"].hash,
        "conduit.tokenizer_hash": inputs["tokenizer"].hash,
        "conduit.evaluate_hash": inputs["evaluate"].hash,
        "conduit.data_hash": inputs["train"].manifest["inputs"].get("tokenize", ""),
        "conduit.config_hash": content_hash("run_config", 1, hash_view(cfg), {}),
        "conduit.code_version": code_version(),
        "conduit.hf_export": f"artifacts/{HF_DIR}" if hf_note is None else f"not exported: {hf_note}",
        # a continued model (train.init_from, a context extension): the version it started from
        **inputs["train"].manifest["counts"].get("init_from", {}),
        **{f"metric.{k}": repr(float(v)) for k, v in metrics.items()},
    }


def describe(cfg: RunConfig, metrics: dict[str, float]) -> str:
    mc = cfg.model_config()
    if family(mc).seq2seq:
        return (
            f"Conduit encoder-decoder (preset {cfg.model['preset']}, d_model {mc.d_model}, "
            f"{mc.resolved_n_encoder_layers}+{mc.n_layers} layers), trained {cfg.train.steps} steps to restore "
            f"spans (noise density {mc.denoise_noise_density}, mean span {mc.denoise_mean_span_length}) of "
            f"{', '.join(cfg.data.train_paths)}; denoising loss {metrics['val_loss']:.3f}, "
            f"{metrics['val_bits_per_target_byte']:.3f} bits per target byte. Prompts are text with "
            f"<extra_id_k> sentinels; the answer is the spans that fill them."
        )
    parts = [f"validation bits/byte {metrics['val_bits_per_byte']:.3f} "
             f"(unigram baseline {metrics['unigram_bits_per_byte']:.3f})"]
    for key, label in (("heldout_bits_per_byte", "held-out Gutenberg bits/byte"),
                       ("wikitext2_bits_per_byte", "WikiText-2 bits/byte"),
                       ("lambada_accuracy", "LAMBADA accuracy")):
        if key in metrics:
            parts.append(f"{label} {metrics[key]:.3f}")
    return (
        f"Conduit {family(mc).describe(mc)} LM (preset {cfg.model['preset']}, d_model "
        f"{mc.d_model}, {mc.n_layers} layers), trained {cfg.train.steps} steps on "
        f"{', '.join(cfg.data.train_paths)}; " + "; ".join(parts) + "."
    )


def require_finite_loss(cfg: RunConfig, inputs: dict, metrics: dict[str, float]) -> None:
    """Refuse a model whose training diverged: one registered would be served, and promoted by gates that
    compare its metrics (every comparison with a NaN is false).

    Raises:
        ValueError: the validation loss is NaN or infinite; the message names the model, the evaluate and
            train artifacts and the value (the runner reports it as the stage's failure).
    """
    loss = metrics["val_loss"]
    if not math.isfinite(loss):
        raise ValueError(f"model {cfg.register.model_name} is not registered: its validation loss is {loss} "
                         f"(evaluate artifact {inputs['evaluate'].hash} of train artifact {inputs['train'].hash}), "
                         f"not a finite number: its training diverged")


def run(cfg: RunConfig, inputs: dict, out_dir: Path, tracker) -> dict:
    from pipeline import tracking  # mlflow: here only (the stage table loads without it)

    metrics = EvalReport.read(inputs["evaluate"].path).metrics
    require_finite_loss(cfg, inputs, metrics)
    weights = inputs["train"].path / WEIGHTS_FILE
    tokenizer = inputs["tokenizer"].path / TOKENIZER_FILE
    extra = {"metrics": inputs["evaluate"].path / EVAL_METRICS_FILE}
    hf_note = "register.hf_export is false"
    if cfg.register.hf_export:
        hf_note = export_hf(weights, tokenizer, out_dir / HF_DIR)
        if hf_note is None:
            extra[HF_DIR] = out_dir / HF_DIR
    version = tracking.log_and_register_model(
        tracker,
        weights=weights,
        tokenizer=tokenizer,
        model_name=cfg.register.model_name,
        alias=cfg.register.alias,
        tags=version_tags(cfg, inputs, metrics, hf_note),
        description=describe(cfg, metrics),
        code_paths=[str(REPO_ROOT / "models"), str(REPO_ROOT / "pipeline")],
        extra_artifacts=extra,
    )
    return RegisteredModel(
        model_name=cfg.register.model_name, version=version, alias=cfg.register.alias,
        model_uri=f"models:/{cfg.register.model_name}@{cfg.register.alias}", hf_export=hf_note is None,
    ).counts()


# Holds no CPU: it writes files and talks to the MLflow registry.
def disk_need(cfg: RunConfig, inputs: dict, hash_: str) -> list[tuple[str | None, int, str]]:
    """The Hugging Face export: a copy of the weights (the MLflow store's copy is the server's to hold).
    Read from the train manifest's file list: on an object-store root the driver has no copy of them."""
    weights = inputs["train"].manifest.get("files", {}).get(WEIGHTS_FILE, {}).get("bytes", 0)
    return [(None, weights, "the Hugging Face export of the weights")]


STAGE = Stage(name="register", version=2, inputs=("tokenizer", "train", "evaluate"),
              hash_config=hash_config, run=run, resources=Resources(cpus=0), disk_need=disk_need)
