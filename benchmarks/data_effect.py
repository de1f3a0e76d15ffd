"""What the shard stage's filters do to the model: the demo trained for the same steps on its corpus as it is
and on the corpus after near-duplicate removal and the document filters, scored on the same clean held-out
text.

Each variant is ``python -m jobs.run configs/demo.yaml --until evaluate`` in a workdir of its own (its own
shards, tokenizer, tokens and model; nothing shared), on this machine, one after the other. The filtered
variant turns on ``data.near_dedup`` and, by default, the language and Gopher repetition filters
(``--filters``); Gopher's quality rules and C4's line filters are written for web pages and remove most of
a book's paragraphs (59% and 92% of the demo's, docs/configuration.md), so they are left to ``--filters``.
Evaluation reads the same held-out Gutenberg books, WikiText-2 and LAMBADA in both, and reports bits per
byte, which does not depend on the tokenizer. No target: the issue asks for the effect to be reported.

Prints a table and writes ``benchmarks/results/data_effect.json``.

    .venv/bin/python benchmarks/data_effect.py [--filters language gopher_repetition] [--steps 1400]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_result

METRICS = ("heldout_bits_per_byte", "wikitext2_bits_per_byte", "lambada_accuracy", "val_bits_per_byte")


def _run(work: Path, overrides: list[str]) -> dict:
    """One demo pipeline to its evaluate stage; the shard manifest's counts and evaluate's metrics."""
    from pipeline.config import load_config
    from pipeline.runner import make_plan, resolve
    from pipeline.store.backends import store_for

    args = [f"run.workdir={work}", "tracking.system_metrics_every_s=0", *overrides]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "jobs.run", "configs/demo.yaml", *args, "--until", "evaluate"],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the demo pipeline failed ({' '.join(overrides)}):\n{(done.stdout + done.stderr)[-4000:]}")
    cfg = resolve(load_config(ROOT / "configs" / "demo.yaml", args))
    store = store_for(cfg.artifact_root())
    plan = {p.stage: p for p in make_plan(cfg)}
    shard = store.load("shard", plan["shard"].hash).manifest["counts"]
    metrics = store.load("evaluate", plan["evaluate"].hash).manifest["counts"]
    return {"seconds": time.perf_counter() - t0, "documents": shard.get("documents"), "removed": shard.get("removed"),
            "metrics": {k: metrics[k] for k in METRICS if k in metrics}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--filters", nargs="*", default=["language", "gopher_repetition"])
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the demo's)")
    args = p.parse_args()
    common = [f"train.steps={args.steps}"] if args.steps else []
    filtered = ["data.near_dedup.enabled=true", *(f"data.quality.{f}.enabled=true" for f in args.filters)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("unfiltered", []), ("filtered", filtered)):
            print(f"{name}: running the demo to evaluate ...", flush=True)
            runs[name] = _run(Path(tmp) / name, common + extra)
            print(f"  {json.dumps(runs[name]['metrics'])}", flush=True)
    rows = [{"corpus": name, "removed": json.dumps(r["removed"]),
             **{k: round(v, 4) for k, v in r["metrics"].items()},
             "documents kept (train)": (r["documents"] or {}).get("train")}
            for name, r in runs.items()]  # the minutes stay in runs: timing is not what this measures
    checks = [{"name": f"filtered - unfiltered {k}", "measured": runs["filtered"]["metrics"][k]
               - runs["unfiltered"]["metrics"][k], "target": None, "op": "<=", "format": "ratio"}
              for k in METRICS if k in runs["filtered"]["metrics"] and k in runs["unfiltered"]["metrics"]]
    summary = (f"The demo (configs/demo.yaml) trained for the same steps on its Gutenberg corpus as it is and after "
               f"near-duplicate removal and the {', '.join(args.filters) or 'no'} filter(s); each with its own "
               "shards, tokenizer and tokens. Bits per byte on the same held-out Gutenberg books and WikiText-2 "
               "(tokenizer-independent), LAMBADA's last-word accuracy; val_bits_per_byte is each run's own "
               "validation split (not the same text in both). Lower bits per byte is better.")
    for r in rows:
        print(r)
    write_result("data_effect", {"rows": rows, "checks": checks, "summary": summary, "runs": runs,
                                 "args": {"filters": args.filters, "steps": args.steps}})


if __name__ == "__main__":
    main()
