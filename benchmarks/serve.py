"""Serving throughput: continuous batching against static batching and one request at a time.

Untrained models (speed does not depend on the weights) with a small sentencepiece tokenizer are
registered in a throwaway MLflow store (sqlite), and deployed by ``pipeline.serving.deploy`` on an
embedded Ray, one replica of ``--cpus`` CPUs per application, two applications at a time:

1. **Batching at all** (``--preset``, cpu_medium): ``batched`` (the default settings: continuous
   batching, ``deploy.max_batch_size=16``) against ``one_at_a_time`` (``max_batch_size=1``). For 1, 4
   and 16 concurrent clients, each sending POST /v1/completions back to back (greedy, ``--max-tokens``
   new tokens, prompts of a few words): requests/s, tokens/s (from each response's ``usage``), p50 and
   p99 latency. Target: batched >= 3x one-at-a-time requests/s at 16 clients.
2. **Continuous against static batching** (issue 35; ``--mixed-preset``, gpt_125m's shape): ``continuous``
   (the default settings) against ``static`` (``deploy.batching=static``: a batch forms when the
   replica is idle, waiting up to ``--batch-wait-s``, and runs until its last request ends, as
   ``@serve.batch`` did before; its finished rows leave the batch, which the old code did not, so it is
   the stronger reference). 16 clients, each sending one request of each budget in (8, 16, 32, 64, 128)
   new tokens back to back, in an order of its own (seeded, the same for every mode). Targets: continuous >= 1.5x static's requests/s; the short
   requests' (<= 16 tokens) p50 latency <= 0.5x static's. The same load streamed (``stream: true``):
   the p50 time to the first text event of the 64-token requests <= 0.25x their p50 time to the whole
   completion. A model of GPT-2 small's shape is where a decode step costs about the same for 1 row
   as for 16 (the weights' reads dominate, as on a GPU serving a real model); at cpu_medium's width a
   step's cost grows with its rows and the HTTP path's fixed cost per request weighs more, which
   narrows what any batching policy can change (see RESULTS.md).

After one warm-up round per level, the modes alternate ``--repeats`` times (a busy neighbour slows
both alike) and the run with the median requests/s is reported.

Prints a table and writes ``benchmarks/results/serve.json``.

    .venv/bin/python benchmarks/serve.py [--preset cpu_medium] [--mixed-preset gpt_125m] [--max-tokens 32]
        [--requests-per-client 6] [--repeats 3] [--batch-wait-s 0.05]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
import random
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
from pipeline.stage_tracker import StageTracker
from pipeline.serving import deploy
from pipeline.config import DEFAULT_DATA_ROOT, REPO_ROOT, DeploySection
from pipeline.tokenization.spm import load_sentencepiece, train_sentencepiece, training_lines

OPS = {">=": operator.ge, "<=": operator.le}
TARGET_SPEEDUP = 3.0  # batched / one-at-a-time requests/s at 16 clients
TARGET_CONTINUOUS = 1.5  # continuous / static requests/s, mixed budgets, 16 clients
TARGET_SHORT_P50 = 0.5  # continuous / static p50 latency of the short requests
TARGET_TTFT = 0.25  # streamed: p50 first text event / p50 whole completion, 64-token requests
LEVELS = (1, 4, 16)
BUDGETS = (8, 16, 32, 64, 128)  # the mixed load's max_tokens; <= SHORT counts as short
SHORT = 16
MIXED_CLIENTS = 16
PROMPTS = ["KING:", "The old man said", "It was a dark and stormy night", "First Citizen:",
           "What light through yonder window breaks", "O Romeo, Romeo", "To be, or not to be", "Ay, my lord"]


def register_untrained(work: Path, preset: str, corpus: Path, names: list[str]) -> str:
    """Register an untrained ``preset`` model with a tokenizer trained on ``corpus`` under each of
    ``names`` (alias champion), with its Hugging Face export as the register stage ships it (what vLLM
    loads); returns the tracking URI."""
    from pipeline.stages.register import export_hf
    from pipeline.store.contracts import HF_DIR

    docs = corpus.read_text(encoding="utf-8")[:300_000].split("\n\n")
    tok = work / "tokenizer.model"
    tok.write_bytes(train_sentencepiece(training_lines(docs, 10**9), vocab_size=512, model_type="bpe",
                                        character_coverage=1.0, byte_fallback=True, normalization="identity",
                                        num_threads=1))
    sp = load_sentencepiece(str(tok))
    model = build_model(preset, vocab_size=sp.get_piece_size())
    save_safetensors(model, model.cfg, work / "model.safetensors")
    not_exported = export_hf(work / "model.safetensors", tok, work / HF_DIR)
    if not_exported:
        raise ValueError(f"{preset} has no HF export: {not_exported}")
    uri = f"sqlite:///{work / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "bench", artifact_location=str(work / "mlartifacts"))
    for name in names:
        tracker = StageTracker(uri, tracking.start_run(uri, exp, "register"))
        tracking.log_and_register_model(tracker, weights=work / "model.safetensors", tokenizer=tok, model_name=name,
                                        alias="champion", tags={"conduit.hf_export": f"artifacts/{HF_DIR}"},
                                        description=f"untrained {preset}",
                                        code_paths=[str(REPO_ROOT / "models"), str(REPO_ROOT / "pipeline")],
                                        extra_artifacts={HF_DIR: work / HF_DIR})
        tracking.end_run(uri, tracker.run_id)
    return uri


def _post(s: requests.Session, base: str, body: dict) -> tuple[int, float, float | None, str]:
    """One request: (completion tokens, seconds to the whole answer, seconds to its first token's event
    when streamed, error text or ""). The first token's event is the first that reports a choice: vLLM
    sends one per token, its text possibly empty (a character's first bytes)."""
    t0 = time.perf_counter()
    if not body.get("stream"):
        r = s.post(f"{base}/completions", json=body, timeout=600)
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            return 0, dt, None, f"{r.status_code} {r.text[:200]}"
        return r.json()["usage"]["completion_tokens"], dt, None, ""
    first, tokens = None, 0
    with s.post(f"{base}/completions", json=body, timeout=600, stream=True) as r:
        if r.status_code != 200:
            return 0, time.perf_counter() - t0, None, f"{r.status_code} {r.text[:200]}"
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 0, time.perf_counter() - t0, None, str(event["error"])
            if first is None and event.get("choices"):
                first = time.perf_counter() - t0
            tokens = event.get("usage", {}).get("completion_tokens", tokens)
    return tokens, time.perf_counter() - t0, first, ""


def run_level(base: str, name: str, clients: int, budgets: list[list[int]], stream: bool = False) -> dict:
    """``clients`` threads, client k sending one request per entry of ``budgets[k]`` (its max_tokens)
    back to back; throughput and latency, overall and per budget."""
    done: list[tuple[int, int, float, float | None]] = []  # (budget, tokens, latency, first event)
    errors: list[str] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        with requests.Session() as s:
            for i, budget in enumerate(budgets[k]):
                body = {"model": name, "prompt": PROMPTS[(k + i) % len(PROMPTS)], "max_tokens": budget,
                        "temperature": 0.0, "stream": stream}
                tokens, dt, first, error = _post(s, base, body)
                with lock:
                    if error:
                        errors.append(error)
                    else:
                        done.append((budget, tokens, dt, first))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests at {clients} clients, first: {errors[0]}")
    lat = sorted(d[2] for d in done)
    row = {"clients": clients, "requests": len(lat), "wall_s": wall, "requests_per_s": len(lat) / wall,
           "tokens_per_s": sum(d[1] for d in done) / wall, "p50_latency_s": statistics.median(lat),
           "p99_latency_s": lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))],
           "mean_tokens": sum(d[1] for d in done) / len(done)}
    if len({d[0] for d in done}) > 1:
        row["short_p50_latency_s"] = statistics.median(d[2] for d in done if d[0] <= SHORT)
        row["p50_latency_s_by_budget"] = {str(b): statistics.median(d[2] for d in done if d[0] == b)
                                          for b in sorted({d[0] for d in done})}
    if stream:
        row["p50_first_event_s_by_budget"] = {str(b): statistics.median(d[3] for d in done if d[0] == b)
                                              for b in sorted({d[0] for d in done})}
    return row


def mixed_budgets(clients: int, seed: int = 0) -> list[list[int]]:
    """Each client sends every budget of ``BUDGETS`` once, in its own order (seeded: the same load for
    every mode). The same work per client, so no client's tail decides the wall time; a random order,
    so that short requests follow long ones and short ones alike."""
    rng = random.Random(seed)
    return [rng.sample(BUDGETS, len(BUDGETS)) for _ in range(clients)]


def _median_run(tries: list[dict]) -> dict:
    return sorted(tries, key=lambda r: r["requests_per_s"])[len(tries) // 2]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def report_fields(results: dict[str, list[dict]], runs: dict[str, list[list[dict]]], mixed: dict[str, dict],
                  mixed_runs: dict[str, list[dict]]) -> dict:
    """``rows`` (one per mode and level, the median run; then the mixed load's), ``checks`` (the four
    targets, each with its range over the interleaved runs) in the form ``benchmarks/report.py`` tabulates."""
    rows = [{"mode": mode, "load": "fixed", **{k: r[k] for k in ("clients", "requests_per_s", "tokens_per_s",
                                                               "p50_latency_s", "p99_latency_s")}}
            for mode, level_rows in results.items() for r in level_rows]
    rows += [{"mode": mode, "load": "mixed", **{k: r.get(k) for k in ("clients", "requests_per_s", "tokens_per_s",
                                                                      "p50_latency_s", "p99_latency_s",
                                                                      "short_p50_latency_s")}}
             for mode, r in mixed.items()]
    i16 = LEVELS.index(16)
    pairs = [b["requests_per_s"] / o["requests_per_s"] for b, o in zip(runs["batched"][i16], runs["one_at_a_time"][i16])]
    median16 = results["batched"][i16]["requests_per_s"] / results["one_at_a_time"][i16]["requests_per_s"]
    cont, static = mixed_runs["continuous"], mixed_runs["static"]
    rps = [c["requests_per_s"] / s["requests_per_s"] for c, s in zip(cont, static)]
    short = [c["short_p50_latency_s"] / s["short_p50_latency_s"] for c, s in zip(cont, static)]
    ttft = [r["p50_first_event_s_by_budget"]["64"] / r["p50_latency_s_by_budget"]["64"]
            for r in mixed_runs["continuous_streamed"]]
    m = mixed
    return {"rows": rows, "checks": [
        {"name": "batched / one-at-a-time requests/s at 16 clients",
         "measured": {**_summary(pairs), "median": median16}, "target": TARGET_SPEEDUP, "op": ">="},
        {"name": "continuous / static batching requests/s (16 clients, 8-128 tokens)",
         "measured": {**_summary(rps), "median": m["continuous"]["requests_per_s"] / m["static"]["requests_per_s"]},
         "target": TARGET_CONTINUOUS, "op": ">="},
        {"name": "continuous / static p50 latency of the short requests (<= 16 tokens)",
         "measured": {**_summary(short),
                      "median": m["continuous"]["short_p50_latency_s"] / m["static"]["short_p50_latency_s"]},
         "target": TARGET_SHORT_P50, "op": "<="},
        {"name": "streamed: p50 first text event / p50 whole completion, 64-token requests",
         "measured": _summary(ttft), "target": TARGET_TTFT, "op": "<="},
    ]}


def _deploy(uri: str, gcs: str, name: str, mode: str, cpus: float, **settings) -> str:
    # Conduit's own engine: this benchmark compares its batching policies
    section = dataclasses.replace(DeploySection(engine="conduit"), port=8000, num_cpus_per_replica=cpus,
                                  route_prefix=f"/{mode}", **settings)
    d = deploy.deploy(section, uri, name, "champion", gcs)
    print(f"{mode}: {d.app} v{d.version} {d.status} at {d.endpoint}", flush=True)
    return d.endpoint


def _say(mode: str, row: dict) -> None:
    extra = (f", short p50 {row['short_p50_latency_s'] * 1000:.0f} ms" if "short_p50_latency_s" in row else "")
    if "p50_first_event_s_by_budget" in row:
        extra += f", 64-token first event p50 {row['p50_first_event_s_by_budget']['64'] * 1000:.0f} ms"
    print(f"  {mode:>20} {row['clients']:>2} clients: {row['requests_per_s']:.2f} req/s, "
          f"{row['tokens_per_s']:.0f} tok/s, p50 {row['p50_latency_s'] * 1000:.0f} ms, "
          f"p99 {row['p99_latency_s'] * 1000:.0f} ms{extra}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="cpu_medium", help="the model of part 1")
    p.add_argument("--mixed-preset", default="gpt_125m",
                   help="the model of part 2 (its vocabulary the benchmark's 512-piece tokenizer's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests-per-client", type=int, default=6)
    p.add_argument("--cpus", type=float, default=1.0, help="CPUs of each replica")
    p.add_argument("--corpus", default=str(DEFAULT_DATA_ROOT / "tinyshakespeare" / "input.txt"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-wait-s", type=float, default=DeploySection().batch_wait_timeout_s,
                   help="deploy.batch_wait_timeout_s of the static deployment")
    args = p.parse_args()
    names = {mode: f"conduit-bench-{mode.replace('_', '-')}" for mode in ("batched", "one_at_a_time", "continuous",
                                                                           "static")}
    results: dict[str, list[dict]] = {mode: [] for mode in ("batched", "one_at_a_time")}
    runs: dict[str, list[list[dict]]] = {mode: [] for mode in results}
    mixed_modes = {"continuous": ("continuous", False), "static": ("static", False),
                   "continuous_streamed": ("continuous", True), "static_streamed": ("static", True)}
    mixed_runs: dict[str, list[dict]] = {m: [] for m in mixed_modes}
    with tempfile.TemporaryDirectory(prefix="conduit-bench-serve-") as tmp:
        (Path(tmp) / "fixed").mkdir()
        (Path(tmp) / "mixed").mkdir()
        uri = register_untrained(Path(tmp) / "fixed", args.preset, Path(args.corpus),
                                 [names["batched"], names["one_at_a_time"]])
        gcs, _ = deploy.connect(None)
        bases = {"batched": _deploy(uri, gcs, names["batched"], "batched", args.cpus),
                 "one_at_a_time": _deploy(uri, gcs, names["one_at_a_time"], "one_at_a_time", args.cpus,
                                          max_batch_size=1)}
        print(f"1. batched against one at a time ({args.preset})", flush=True)
        for clients in LEVELS:
            tries: dict[str, list[dict]] = {mode: [] for mode in results}
            for _ in range(args.repeats):
                for mode in results:
                    run_level(bases[mode], names[mode], clients, [[args.max_tokens]] * clients)  # warm-up
                    row = run_level(bases[mode], names[mode], clients, [[args.max_tokens] * args.requests_per_client] * clients)
                    tries[mode].append(row)
                    _say(mode, row)
            for mode in results:
                results[mode].append(_median_run(tries[mode]))
                runs[mode].append(tries[mode])
        for mode in results:  # two replicas at a time on a 2-core machine
            deploy.down(uri, names[mode])
        mixed_uri = register_untrained(Path(tmp) / "mixed", args.mixed_preset, Path(args.corpus),
                                       [names["continuous"], names["static"]])
        bases["continuous"] = _deploy(mixed_uri, gcs, names["continuous"], "continuous", args.cpus)
        bases["static"] = _deploy(mixed_uri, gcs, names["static"], "static", args.cpus, batching="static",
                                  batch_wait_timeout_s=args.batch_wait_s)
        print(f"2. continuous against static batching, max_tokens 8-128 ({args.mixed_preset})", flush=True)
        load = mixed_budgets(MIXED_CLIENTS)
        for _ in range(args.repeats):
            for label, (mode, stream) in mixed_modes.items():
                run_level(bases[mode], names[mode], MIXED_CLIENTS, [[8]] * MIXED_CLIENTS)  # warm-up
                row = run_level(bases[mode], names[mode], MIXED_CLIENTS, load, stream=stream)
                mixed_runs[label].append(row)
                _say(label, row)
        for mode in ("continuous", "static"):
            deploy.down(mixed_uri, names[mode])
    mixed = {label: _median_run(rows) for label, rows in mixed_runs.items()}
    speedups = {str(c): b["requests_per_s"] / o["requests_per_s"]
                for c, b, o in zip(LEVELS, results["batched"], results["one_at_a_time"])}
    print(f"\n{'clients':>7} {'mode':>20} {'req/s':>8} {'tok/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'short p50':>9}")
    for mode, rows in results.items():
        for r in rows:
            print(f"{r['clients']:>7} {mode:>20} {r['requests_per_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
                  f"{r['p50_latency_s'] * 1000:>8.0f} {r['p99_latency_s'] * 1000:>8.0f}")
    for label, r in mixed.items():
        print(f"{r['clients']:>7} {label:>20} {r['requests_per_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
              f"{r['p50_latency_s'] * 1000:>8.0f} {r['p99_latency_s'] * 1000:>8.0f} {r['short_p50_latency_s'] * 1000:>9.0f}")
    fields = report_fields(results, runs, mixed, mixed_runs)
    for check in fields["checks"]:
        med = check["measured"]["median"]
        ok = OPS[check["op"]](med, check["target"])
        print(f"{check['name']}: {med:.2f} (range {check['measured']['min']:.2f}-{check['measured']['max']:.2f}); "
              f"target {check['op']} {check['target']}: {'met' if ok else 'NOT met'}")
    path = write_result("serve", {
        "config": {"preset": args.preset, "mixed_preset": args.mixed_preset, "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
                   "replica_cpus": args.cpus, "max_batch_size": 16, "levels": list(LEVELS),
                   "repeats": args.repeats, "static_batch_wait_timeout_s": args.batch_wait_s,
                   "mixed": {"clients": MIXED_CLIENTS, "budgets": list(BUDGETS), "short": SHORT,
                             "load": load}},
        "results": results, "all_runs": runs, "mixed": mixed, "mixed_runs": mixed_runs, **fields,
        "speedup_requests_per_s": speedups,
    })
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
