"""configs/smoke_encdec.yaml, shortened, through the six stages in-process on the session's Ray cluster:
an encoder-decoder trained on span-corrupted blocks by 2 DeepSpeed workers, evaluated on its denoising
loss, registered (without a Hugging Face folder, for the reason the version states), and served: text
with sentinels in, the spans that fill them out. Its shard stage is smoke.yaml's (the same data), found
cached in the session smoke run's artifact root (tests/smoke_run.py); its tokenizer reserves sentinels,
so the tokenizer and tokenize stages are its own."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import ORDER, run_pipeline
from pipeline.store.contracts import EVAL_METRICS_FILE, TOKENIZER_FILE, WEIGHTS_FILE
from pipeline.tokenization.spm import load_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_encdec_smoke_trains_evaluates_registers_without_hf_folder_and_fills_sentinels(tmp_path, smoke,
                                                                                       smoke_artifact_root):
    from models.export import load_safetensors

    cfg = load_config(ROOT / "configs" / "smoke_encdec.yaml",
                      [f"run.workdir={tmp_path}", f"run.artifact_root={smoke_artifact_root}", "train.steps=40",
                       "eval.max_batches=2", "eval.max_new_tokens=8"])
    lines: list[str] = []
    result = run_pipeline(cfg, echo=lines.append)
    assert [ln for ln in lines if ": cached" in ln] == [f"shard: cached ({smoke[1].artifacts['shard'].hash})"]
    assert [ln.split(":")[0] for ln in lines if ": done" in ln] == ORDER[1:]

    counts = result.artifacts["train"].manifest["counts"]
    assert counts["final_loss"] < counts["first_loss"] - 0.5, counts
    model = load_safetensors(result.artifacts["train"].path / WEIGHTS_FILE).eval()
    assert model.cfg.arch == "encoder_decoder"

    # The tokenizer reserved the sentinels, each one token.
    sp = load_sentencepiece(str(result.artifacts["tokenizer"].path / TOKENIZER_FILE))
    assert [sp.piece_to_id(f"<extra_id_{k}>") for k in range(3)] == [5, 6, 7]
    assert sp.encode("a <extra_id_1> b").count(6) == 1

    metrics = json.loads((result.artifacts["evaluate"].path / EVAL_METRICS_FILE).read_text())["metrics"]
    assert 0 < metrics["val_bits_per_target_byte"] and metrics["val_loss"] < 6.0, metrics
    assert "val_bits_per_byte" not in metrics  # a next-token number would not mean the same

    # The registered version says why it ships no Hugging Face folder: tokenizer.json cannot reproduce
    # sentencepiece's user-defined sentinels (pipeline.tokenization.hf_fast); the model's MarianMTModel export
    # itself is tested in tests/models/test_encdec_export.py.
    c = tracking.client(result.tracking_uri)
    mv = c.get_model_version_by_alias(cfg.register.model_name, "challenger")
    assert mv.tags["conduit.hf_export"].startswith("not exported:") and "<extra_id_0>" in mv.tags["conduit.hf_export"]
    assert "encoder-decoder" in mv.description

    # Served: the answer is the spans that fill the prompt's sentinels, each after its sentinel, as the
    # decoder targets it was trained on are written (every target starts with <extra_id_0>).
    served = tracking.load_registered_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger")
    out = served.predict(pd.DataFrame({"prompt": ["KING: My <extra_id_0> lord."]}),
                         params={"max_new_tokens": 8, "temperature": 0.0})
    (text,) = out["text"].tolist()
    assert text.startswith("<extra_id_0>") and text.removeprefix("<extra_id_0>").strip(), text
