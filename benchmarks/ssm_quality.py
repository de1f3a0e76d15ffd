"""The quality side of issue 37: the Transformer, Mamba-1, Mamba-2 and a hybrid trained alike on the demo data.

Each model runs the smoke pipeline (``configs/smoke.yaml``: tiny-shakespeare, the same 512-piece tokenizer
and 64-token blocks, ``--steps`` steps of 16 blocks, AdamW at lr 3e-3 with 10 warm-up steps, 2 DeepSpeed
workers) up to and including its evaluate stage; only the model differs, each of about the same number of
non-embedding parameters at width 64 (``MODELS``). The data stages run once (the others find them cached).
Reported per model: the evaluate stage's validation bits per byte (and loss), bits per byte on held-out
Gutenberg books and WikiText-2, its bits per byte at windows of 32, 64 and 128 tokens (twice the trained
length: an SSM has no positions to run out of), and the train stage's wall time.

Prints a table and writes ``benchmarks/results/ssm_quality.json``.

    .venv/bin/python benchmarks/ssm_quality.py [--steps 600]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_result  # noqa: E402
from models.accounting import param_counts  # noqa: E402
from models.export import read_config  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.runner import run_pipeline  # noqa: E402
from pipeline.store.contracts import WEIGHTS_FILE  # noqa: E402

# (label, model overrides): about 100-120 k non-embedding parameters each at d_model 64.
MODELS = {
    "transformer": ["model.preset=debug_dense"],  # 2 layers of attention + SwiGLU
    "mamba": ["model.preset=debug_mamba", "model.n_layers=3"],
    "mamba2": ["model.preset=debug_mamba2", "model.n_layers=4"],
    "hybrid": ["model.preset=debug_hybrid", "model.n_layers=2", "model.hybrid_layers=MA"],  # Mamba-2, attention
}
METRICS = ("val_bits_per_byte", "val_loss", "heldout_bits_per_byte", "wikitext2_bits_per_byte",
           "context_bits_per_byte_32", "context_bits_per_byte_64", "context_bits_per_byte_128")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ssm_quality_") as tmp:
        for name in args.models:
            overrides = [f"run.workdir={tmp}/{name}", f"run.artifact_root={tmp}/artifacts", f"run.name=quality_{name}",
                         f"train.steps={args.steps}", "validation.every=0", "eval.max_new_tokens=8",
                         *MODELS[name]]
            cfg = load_config(ROOT / "configs" / "smoke.yaml", overrides)
            t0 = time.perf_counter()
            result = run_pipeline(cfg, until="evaluate", echo=lambda line: print(f"  {name}: {line}", flush=True))
            wall = time.perf_counter() - t0
            train = result.artifacts["train"]
            metrics = json.loads((result.artifacts["evaluate"].path / "metrics.json").read_text())["metrics"]
            model_cfg = read_config(train.path / WEIGHTS_FILE)
            counts = param_counts(model_cfg)
            rows.append({"model": name, "arch": model_cfg.arch, "layers": model_cfg.hybrid_layers or model_cfg.n_layers,
                         "non_embedding_parameters": counts["non_embedding"], "steps": args.steps,
                         "final_train_loss": train.manifest["counts"]["final_loss"],
                         **{k: metrics.get(k) for k in METRICS}, "pipeline_wall_s": wall})
    print(f"\n{'model':>12} {'non-emb':>9} {'val bpb':>8} {'val loss':>8} {'books':>7} {'wiki':>7} "
          f"{'bpb@32':>7} {'bpb@64':>7} {'bpb@128':>7}")
    for r in rows:
        print(f"{r['model']:>12} {r['non_embedding_parameters']:>9,} "
              + " ".join(f"{r[k]:>7.3f}" if r[k] is not None else f"{'-':>7}" for k in METRICS))
    path = write_result("ssm_quality", {
        "config": vars(args), "rows": rows,
        "summary": ("The smoke pipeline up to evaluate, {S} steps of 16 x 64 tokens on tiny-shakespeare, the same "
                    "tokenizer, optimizer and schedule for each; models of about equal non-embedding parameters at "
                    "width 64. Bits per byte from the evaluate stage (validation split, held-out books and "
                    "WikiText-2; context32/64/128: windows of that many tokens, the model trained at 64).").format(
                        S=args.steps),
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
