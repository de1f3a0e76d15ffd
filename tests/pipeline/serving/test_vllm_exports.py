"""Exports vLLM reads: each family's Hugging Face export that vLLM serves on this hardware loads in vLLM's
own engine (the .venv-vllm interpreter) and generates Conduit's own greedy tokens (models.generate on the
same prompt ids): Llama with YaRN, Mixtral, GraniteMoeHybrid and Mamba-2, in float32."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from models import PRESETS, build_model
from models.export import save_hf
from models.generate import generate
from pipeline.serving import deploy, vllm_support
from pipeline.config import DeploySection

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
HERE = Path(__file__).parent

# Head size 32 (vLLM's CPU kernels have no 16), every other field as in the debug presets. (Llama with GQA:
# tests/jobs/test_deploy_vllm.py serves it through the deployment and compares the same way.)
FAMILIES = {
    "llama_yarn": PRESETS["debug_dense"].replace(n_heads=2, rope_scaling=4.0, rope_scaling_type="yarn",
                                                 rope_original_max_seq_len=32),
    "mixtral": PRESETS["debug_moe"].replace(n_heads=2),
    "granite_hybrid": PRESETS["debug_hybrid"].replace(n_heads=2),
    "mamba2": PRESETS["debug_mamba2"],
}
PROMPTS = [[3, 17, 42, 99, 7], [3, 250, 11, 400, 33, 5, 61, 200]]
NEW_TOKENS = 12


def _greedy(model, ids: list[int]) -> list[int]:
    out = generate(model, torch.tensor([ids]), max_new_tokens=NEW_TOKENS, temperature=0.0)
    return out[0, len(ids):].tolist()


def test_every_family_vllm_serves_generates_conduits_greedy_tokens(tmp_path):
    python = deploy.vllm_python(DeploySection())
    assert Path(python).exists(), f"{python}: `make install` builds vLLM's venv"
    spec, want = [], {}
    for name, cfg in FAMILIES.items():
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        with torch.no_grad():  # larger weights than init's, so that greedy choices are not near-ties
            for p in model.parameters():
                p.mul_(4.0) if p.dim() > 1 else None
        save_hf(model, cfg, tmp_path / name, extra_config={"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0})
        hf = json.loads((tmp_path / name / "config.json").read_text())
        assert vllm_support.check(hf, "cpu").ok, (name, vllm_support.check(hf, "cpu"))
        want[name] = [_greedy(model, p) for p in PROMPTS]
        spec.append({"dir": str(tmp_path / name), "prompts": PROMPTS, "max_tokens": NEW_TOKENS,
                     "max_model_len": cfg.max_seq_len})
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run = subprocess.run([python, str(HERE / "vllm_greedy.py"), str(tmp_path / "spec.json")], capture_output=True,
                         text=True, timeout=900, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                                      "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1",
                                                      # the engine in this process: no process to start per model
                                                      "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-4000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for (name, expected), tokens in zip(want.items(), got):
        assert tokens == expected, name


def test_the_vllm_interpreter_fetches_a_version_from_a_sqlite_registry(tmp_path):
    """`make run`'s registry is sqlite (no MLflow server): the replicas' callback, in the vLLM interpreter
    (mlflow-skinny, which registers sqlite stores only beside SQLAlchemy), fetches the version's export."""
    from pipeline import tracking
    from pipeline.stage_tracker import StageTracker
    from pipeline.stages.register import export_hf
    from pipeline.tokenization.spm import train_sentencepiece, training_lines
    from models.export import save_safetensors
    from pipeline.base import DEFAULT_DATA_ROOT, REPO_ROOT

    text = (DEFAULT_DATA_ROOT / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:50_000]
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(train_sentencepiece(training_lines(text.split("\n\n"), 10**9), vocab_size=512, model_type="bpe",
                                        character_coverage=1.0, byte_fallback=True, normalization="identity",
                                        num_threads=1))
    cfg = FAMILIES["llama_yarn"]
    save_safetensors(build_model(cfg), cfg, tmp_path / "model.safetensors")
    assert export_hf(tmp_path / "model.safetensors", tok, tmp_path / "hf") is None
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "t", artifact_location=str(tmp_path / "mlartifacts"))
    tracker = StageTracker(uri, tracking.start_run(uri, exp, "register"))
    version = tracking.log_and_register_model(
        tracker, weights=tmp_path / "model.safetensors", tokenizer=tok, model_name="m", alias="champion",
        tags={"conduit.hf_export": "artifacts/hf"}, description="", code_paths=[str(REPO_ROOT / "models")],
        extra_artifacts={"hf": tmp_path / "hf"})
    tracking.end_run(uri, tracker.run_id)
    dst = tmp_path / "node-cache" / "m-v1"
    script = ("import sys; from pipeline.serving.vllm_ingress import fetch_version_files; "
              "print(fetch_version_files(sys.argv[1], 'm', int(sys.argv[2]), sys.argv[3]))")
    run = subprocess.run([deploy.vllm_python(DeploySection()), "-c", script, uri, str(version), str(dst)],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads((dst / "config.json").read_text()) == json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (dst / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
