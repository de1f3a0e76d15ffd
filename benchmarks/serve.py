"""Serving throughput: the Ray Serve deployment with batching against one request at a time.

An untrained ``--preset`` model (speed does not depend on the weights) and a small sentencepiece
tokenizer are registered in a throwaway MLflow store (sqlite) under two names, and deployed by
``pipeline.serving.deploy`` on an embedded Ray as two applications side by side, each one replica of ``--cpus``
CPUs: with ``deploy.max_batch_size=16`` (batched, route ``/batched``) and with ``1`` (one at a time,
route ``/single``). For 1, 4 and 16 concurrent clients, each sending POST /v1/completions back to back
(greedy, ``--max-tokens`` new tokens, prompts of a few words), it measures requests/s, generated
tokens/s (from each response's ``usage``) and the p50 and p99 latency, after one warm-up round per
level. The two modes alternate ``--repeats`` times per level (a busy neighbour slows both alike) and
the run with the median requests/s is reported. Target: batched >= 3x one-at-a-time requests/s at 16
clients.

Prints a table and writes ``benchmarks/results/serve.json``.

    .venv/bin/python benchmarks/serve.py [--preset cpu_small] [--max-tokens 32] [--requests-per-client 6]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result
from models import build_model
from models.export import save_safetensors
from pipeline import tracking
from pipeline.serving import deploy
from pipeline.config import DEFAULT_DATA_ROOT, REPO_ROOT, DeploySection
from pipeline.tokenization.spm import load_sentencepiece, train_sentencepiece, training_lines

TARGET_SPEEDUP = 3.0  # batched / one-at-a-time requests/s at 16 clients
LEVELS = (1, 4, 16)
PROMPTS = ["KING:", "The old man said", "It was a dark and stormy night", "First Citizen:",
           "What light through yonder window breaks", "O Romeo, Romeo", "To be, or not to be", "Ay, my lord"]


def register_untrained(work: Path, preset: str, corpus: Path, names: list[str]) -> str:
    """Register an untrained ``preset`` model with a tokenizer trained on ``corpus`` under each of
    ``names`` (alias champion); returns the tracking URI."""
    docs = corpus.read_text(encoding="utf-8")[:300_000].split("\n\n")
    tok = work / "tokenizer.model"
    tok.write_bytes(train_sentencepiece(training_lines(docs, 10**9), vocab_size=512, model_type="bpe",
                                        character_coverage=1.0, byte_fallback=True, normalization="identity",
                                        num_threads=1))
    sp = load_sentencepiece(str(tok))
    model = build_model(preset, vocab_size=sp.get_piece_size())
    save_safetensors(model, model.cfg, work / "model.safetensors")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "bench", artifact_location=str(work / "mlartifacts"))
    for name in names:
        tracker = tracking.StageTracker(uri, tracking.start_run(uri, exp, "register"))
        tracking.log_and_register_model(tracker, weights=work / "model.safetensors", tokenizer=tok, model_name=name,
                                        alias="champion", tags={}, description=f"untrained {preset}",
                                        code_paths=[str(REPO_ROOT / "models"), str(REPO_ROOT / "pipeline")])
        tracking.end_run(uri, tracker.run_id)
    return uri


def run_level(base: str, name: str, clients: int, per_client: int, max_tokens: int) -> dict:
    """``clients`` threads, each sending ``per_client`` requests back to back; throughput and latency."""
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with requests.Session() as s:
            for i in range(per_client):
                body = {"model": name, "prompt": PROMPTS[(k + i) % len(PROMPTS)], "max_tokens": max_tokens,
                        "temperature": 0.0}
                t0 = time.perf_counter()
                r = s.post(f"{base}/completions", json=body, timeout=600)
                dt = time.perf_counter() - t0
                with lock:
                    if r.status_code != 200:
                        errors.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        latencies.append(dt)
                        tokens.append(r.json()["usage"]["completion_tokens"])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests at {clients} clients, first: {errors[0]}")
    lat = sorted(latencies)
    return {"clients": clients, "requests": len(lat), "wall_s": wall, "requests_per_s": len(lat) / wall,
            "tokens_per_s": sum(tokens) / wall, "p50_latency_s": statistics.median(lat),
            "p99_latency_s": lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))],
            "mean_tokens": sum(tokens) / len(tokens)}


def report_fields(results: dict[str, list[dict]], runs: dict[str, list[list[dict]]]) -> dict:
    """``rows`` (one per mode and level, the median run) and ``checks`` (the 16-client speedup, its
    range over the interleaved pairs of runs) in the form ``benchmarks/report.py`` tabulates."""
    rows = [{"mode": mode, **{k: r[k] for k in ("clients", "requests_per_s", "tokens_per_s", "p50_latency_s",
                                                 "p99_latency_s")}}
            for mode, level_rows in results.items() for r in level_rows]
    i16 = LEVELS.index(16)
    pairs = [b["requests_per_s"] / o["requests_per_s"]
             for b, o in zip(runs["batched"][i16], runs["one_at_a_time"][i16])]
    median16 = results["batched"][i16]["requests_per_s"] / results["one_at_a_time"][i16]["requests_per_s"]
    return {"rows": rows, "checks": [{"name": "batched / one-at-a-time requests/s at 16 clients",
                                      "measured": {"median": median16, "min": min(pairs), "max": max(pairs),
                                                   "values": pairs},
                                      "target": TARGET_SPEEDUP, "op": ">="}]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu_small")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--cpus", type=float, default=1.0, help="CPUs of the one replica")
    p.add_argument("--corpus", default=str(DEFAULT_DATA_ROOT / "tinyshakespeare" / "input.txt"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-wait-s", type=float, default=DeploySection().batch_wait_timeout_s,
                   help="deploy.batch_wait_timeout_s of the batched deployment")
    args = p.parse_args()
    modes = {"batched": 16, "one_at_a_time": 1}
    names = {mode: f"conduit-bench-{mode.replace('_', '-')}" for mode in modes}
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in modes}
    port = 8000
    with tempfile.TemporaryDirectory(prefix="conduit-bench-serve-") as tmp:
        uri = register_untrained(Path(tmp), args.preset, Path(args.corpus), list(names.values()))
        gcs, _ = deploy.connect(None)
        bases = {}
        for mode, batch in modes.items():
            section = dataclasses.replace(DeploySection(), port=port, num_cpus_per_replica=args.cpus,
                                          max_batch_size=batch, route_prefix=f"/{mode}",
                                          batch_wait_timeout_s=args.batch_wait_s if batch > 1 else 0.0)
            d = deploy.deploy(section, uri, names[mode], "champion", gcs)
            bases[mode] = d.endpoint
            print(f"{mode}: {d.app} v{d.version} {d.status} at {d.endpoint}", flush=True)
        for clients in LEVELS:
            tries: dict[str, list[dict]] = {mode: [] for mode in modes}
            for _ in range(args.repeats):
                for mode in modes:
                    run_level(bases[mode], names[mode], clients, 1, args.max_tokens)  # warm-up
                    row = run_level(bases[mode], names[mode], clients, args.requests_per_client, args.max_tokens)
                    tries[mode].append(row)
                    print(f"  {mode:>14} {clients:>2} clients: {row['requests_per_s']:.2f} req/s, "
                          f"{row['tokens_per_s']:.0f} tok/s, p50 {row['p50_latency_s'] * 1000:.0f} ms, "
                          f"p99 {row['p99_latency_s'] * 1000:.0f} ms", flush=True)
            for mode in modes:
                ordered = sorted(tries[mode], key=lambda r: r["requests_per_s"])
                results[mode].append(ordered[len(ordered) // 2])
                runs[mode].append(tries[mode])
        for mode in modes:
            deploy.down(uri, names[mode])
    speedups = {str(c): b["requests_per_s"] / o["requests_per_s"]
                for c, b, o in zip(LEVELS, results["batched"], results["one_at_a_time"])}
    print(f"\n{'clients':>7} {'mode':>14} {'req/s':>8} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for mode, rows in results.items():
        for r in rows:
            print(f"{r['clients']:>7} {mode:>14} {r['requests_per_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
                  f"{r['p50_latency_s'] * 1000:>8.0f} {r['p99_latency_s'] * 1000:>8.0f}")
    met = speedups["16"] >= TARGET_SPEEDUP
    print(f"batched / one-at-a-time req/s: " + ", ".join(f"{c} clients {s:.2f}x" for c, s in speedups.items())
          + f"; target >= {TARGET_SPEEDUP}x at 16 clients: {'met' if met else 'NOT met'}")
    path = write_result("serve", {
        "config": {"preset": args.preset, "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
                   "replica_cpus": args.cpus, "max_batch_size": 16, "levels": list(LEVELS),
                   "repeats": args.repeats, "batch_wait_timeout_s": args.batch_wait_s},
        "results": results, "all_runs": runs, **report_fields(results, runs), "speedup_requests_per_s": speedups,
        "target": {"speedup_at_16_clients": TARGET_SPEEDUP, "met": met},
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
