"""configs/smoke_mamba.yaml, smoke_mamba2.yaml and smoke_hybrid.yaml, shortened, through the six stages
in-process on the session's Ray cluster: a Mamba (Mamba-2, hybrid attention + Mamba-2) model trained by 2
DeepSpeed workers, evaluated, registered with its Hugging Face export, and served by the registered version. Its data stages are smoke.yaml's (the same data and tokenizer): they
are found cached in the session smoke run's artifact root (tests/smoke_run.py)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from pipeline import tracking
from pipeline.config import load_config
from pipeline.runner import ORDER, run_pipeline
from pipeline.store.contracts import HF_DIR, WEIGHTS_FILE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch, config, hf_class", [("mamba", "smoke_mamba.yaml", "MambaForCausalLM"),
                                                    ("mamba2", "smoke_mamba2.yaml", "Mamba2ForCausalLM"),
                                                    ("hybrid", "smoke_hybrid.yaml", "GraniteMoeHybridForCausalLM")])
def test_mamba_smoke_trains_registers_exports_and_serves(tmp_path, smoke, smoke_artifact_root, arch, config, hf_class):
    import transformers

    from models.export import load_safetensors

    cfg = load_config(ROOT / "configs" / config,
                      [f"run.workdir={tmp_path}", f"run.artifact_root={smoke_artifact_root}", "train.steps=40",
                       "eval.max_batches=2", "eval.max_new_tokens=8"])
    lines: list[str] = []
    result = run_pipeline(cfg, echo=lines.append)
    data_stages, smoke_result = ORDER[:3], smoke[1]
    assert [ln for ln in lines if ": cached" in ln] == \
        [f"{n}: cached ({smoke_result.artifacts[n].hash})" for n in data_stages]
    assert [ln.split(":")[0] for ln in lines if ": done" in ln] == ORDER[3:]

    counts = result.artifacts["train"].manifest["counts"]
    assert counts["final_loss"] < counts["first_loss"] - 0.5, counts
    model = load_safetensors(result.artifacts["train"].path / WEIGHTS_FILE).eval()
    assert model.cfg.arch == arch

    # The Hugging Face export shipped in the registered version computes our logits.
    c = tracking.client(result.tracking_uri)
    mv = c.get_model_version_by_alias(cfg.register.model_name, "challenger")
    assert mv.tags["conduit.hf_export"] == f"artifacts/{HF_DIR}"
    local = tracking.download_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger", tmp_path / "dl")
    hf = getattr(transformers, hf_class).from_pretrained(local / "artifacts" / HF_DIR, dtype=torch.float32).eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x, use_cache=False).logits, model(x).logits, atol=1e-5, rtol=1e-5)

    served = tracking.load_registered_model(result.tracking_uri, f"models:/{cfg.register.model_name}@challenger")
    out = served.predict(pd.DataFrame({"prompt": ["KING:"]}), params={"max_new_tokens": 8, "temperature": 0.0})
    assert isinstance(out["text"][0], str) and out["text"][0].strip()
