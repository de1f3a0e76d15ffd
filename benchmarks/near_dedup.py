"""Near-duplicate removal in the shard stage: recall and precision on planted near-copies, documents/s
against datatrove's own local MinHash pipeline, growth with the corpus, and each process's peak memory.

The corpus: paragraphs of at least 50 words from the shared data's Gutenberg training books and
WikiText-2 (``--base`` of them per unit of ``--scales``), plus planted near-copies of a tenth of them,
each made from its source by one kind of edit at one rate (``swap`` neighbouring words, ``insert``
words, ``delete`` words, ``truncate`` the tail; rates 2-20% of the words), shuffled, written as 4
.jsonl files. Ground truth: every pair of documents whose word 5-gram shingle sets (the stage's own
``shingles``) have an exact Jaccard similarity >= 0.8, found through an inverted index (exact, not sampled).

- recall: the share of those pairs of which the stage removed at least one document;
- precision: the share of removed documents that have such a partner (a removal with none is a false one).

Conduit: the shard stage (``data.near_dedup.enabled=true``, its defaults: 14 bands x 8 rows, threshold
0.8) run as the pipeline runs it on an embedded Ray with ``--cpus`` CPUs, timed whole (read, clean, dedupe,
split, write parquet) and with ``near_dedup`` off, so its cost is seen. datatrove: its four MinHash
stages (signatures, buckets, clusters, filter; 14 buckets x 8 hashes, word 5-grams) with
``LocalPipelineExecutor(tasks=cpus, workers=cpus)`` reading the same files and writing the kept
documents, run by ``--datatrove-python`` (a venv with ``datatrove``, ``spacy`` and ``xxhash``: datatrove's
English word tokenizer is spaCy's); skipped when not given. While each runs, every process of its tree
is sampled for its resident memory.

    .venv/bin/python benchmarks/near_dedup.py [--scales 1 2 4] [--base 3000] [--cpus 2] \
        [--datatrove-python /path/to/venv/bin/python]

Measured 2026-12-04 with datatrove 0.10.1 (spacy 3.8, xxhash 3.x: datatrove's own pin) in a venv of its own.

Prints a table and writes ``benchmarks/results/near_dedup.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from benchmarks.data_stages import sample  # noqa: E402
from pipeline.config import DEFAULT_DATA_ROOT, load_config  # noqa: E402
from pipeline.data.near_dedup import shingles  # noqa: E402

EDITS = ("swap", "insert", "delete", "truncate")
RATES = (0.02, 0.05, 0.1, 0.2)
FILLER = "river stone light window garden morning silver quiet road winter letter mountain".split()
TARGET_RECALL, TARGET_PRECISION, TARGET_SPEED = 0.95, 0.99, 1.0
THRESHOLD = 0.8


def base_documents(n: int, seed: int) -> list[str]:
    root = Path(DEFAULT_DATA_ROOT)
    paras = []
    for f in sorted((root / "gutenberg" / "train").glob("*.txt")) + [root / "wikitext-2" / "wiki.test.raw"]:
        for p in f.read_text(encoding="utf-8").split("\n\n"):
            p = " ".join(p.split())
            if len(p.split()) >= 50:
                paras.append(p)
    paras = list(dict.fromkeys(paras))
    random.Random(seed).shuffle(paras)
    if len(paras) < n:
        sys.exit(f"only {len(paras)} paragraphs of 50+ words in the shared data; ask for fewer (--base)")
    return paras[:n]


def edit(text: str, kind: str, rate: float, rng: random.Random) -> str:
    words = text.split()
    k = max(1, round(rate * len(words)))
    if kind == "truncate":
        return " ".join(words[: len(words) - k])
    for _ in range(k):
        i = rng.randrange(len(words) - 1)
        if kind == "swap":
            words[i], words[i + 1] = words[i + 1], words[i]
        elif kind == "insert":
            words.insert(i, rng.choice(FILLER))
        else:
            del words[i]
    return " ".join(words)


def corpus(n_base: int, seed: int) -> tuple[list[str], list[dict]]:
    rng = random.Random(seed)
    docs = base_documents(n_base, seed)
    planted = []
    for src in rng.sample(range(len(docs)), n_base // 10):
        kind, rate = rng.choice(EDITS), rng.choice(RATES)
        planted.append({"source": src, "kind": kind, "rate": rate, "text": edit(docs[src], kind, rate, rng)})
    texts = docs + [p["text"] for p in planted]
    order = list(range(len(texts)))
    rng.shuffle(order)
    return [texts[i] for i in order], planted


def truth_pairs(texts: list[str], n: int = 5) -> set[tuple[int, int]]:
    """Every pair with exact shingle Jaccard >= THRESHOLD, through an inverted index of the shingles."""
    sets = [set(shingles(t, n)) for t in texts]
    index = defaultdict(list)
    for i, s in enumerate(sets):
        for sh in s:
            index[sh].append(i)
    pairs = set()
    for i, s in enumerate(sets):
        shared = defaultdict(int)
        for sh in s:
            for j in index[sh]:
                if j > i:
                    shared[j] += 1
        for j, c in shared.items():
            if c / (len(s) + len(sets[j]) - c) >= THRESHOLD:
                pairs.add((i, j))
    return pairs


def quality(texts: list[str], kept: list[str], pairs: set[tuple[int, int]]) -> dict:
    """Recall and precision of the documents removed (``texts`` minus ``kept``) against ``pairs``."""
    left = defaultdict(int)
    for t in kept:
        left[t] += 1
    removed = set()
    for i, t in enumerate(texts):  # a text written twice keeps its first
        if left[t] > 0:
            left[t] -= 1
        else:
            removed.add(i)
    partnered = {i for p in pairs for i in p}
    recalled = sum(1 for a, b in pairs if a in removed or b in removed)
    return {"removed": len(removed), "truth_pairs": len(pairs),
            "recall": recalled / max(len(pairs), 1),
            "precision": len(removed & partnered) / max(len(removed), 1)}


def write_inputs(texts: list[str], folder: Path, files: int = 4) -> None:
    folder.mkdir(parents=True)
    per = -(-len(texts) // files)
    for k in range(files):
        with open(folder / f"part-{k}.jsonl", "w", encoding="utf-8") as f:
            for i in range(k * per, min((k + 1) * per, len(texts))):
                f.write(json.dumps({"text": texts[i], "id": str(i)}) + "\n")


class Tracker:
    def log_metrics(self, m, step=None):
        pass

    def set_tags(self, tags):
        pass

    def log_figure(self, fig, name):
        pass


def run_conduit(data: Path, work: Path, near: bool) -> tuple[float, list[str], dict, dict]:
    import pyarrow.parquet as pq

    from pipeline.runner import make_plan, resolve
    from pipeline.stages import STAGES
    from pipeline.store.contracts import SPLITS, shard_files

    cfg = resolve(load_config(None, [f"run.workdir={work}", f"data.data_root={data}", "data.train_paths=['*.jsonl']",
                                     f"data.near_dedup.enabled={str(near).lower()}", "data.separator=null"]))
    plan = {p.stage: p for p in make_plan(cfg)}
    peaks: dict[str, int] = {}
    stop = threading.Event()
    import os

    sampler = threading.Thread(target=sample, args=(os.getpid(), 0.2, stop, peaks))
    sampler.start()
    t0 = time.perf_counter()
    art = STAGES["shard"].execute(cfg, plan["shard"].hash, plan["shard"].path, {}, Tracker())
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    kept = [t for s in SPLITS for f in shard_files(art.path, s) for t in pq.read_table(f).column("text").to_pylist()]
    return seconds, kept, art.manifest["counts"], peaks


DATATROVE_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                                  MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.hashing import HashConfig

    def main():
        data, work, cpus = sys.argv[1], sys.argv[2], int(sys.argv[3])
        config = MinhashConfig(hash_config=HashConfig(precision=64), n_grams=5, num_buckets=14, hashes_per_bucket=8)
        reader = lambda: JsonlReader(data, glob_pattern="*.jsonl", text_key="text", id_key="id")
        t0 = time.perf_counter()
        LocalPipelineExecutor(pipeline=[reader(), MinhashDedupSignature(output_folder=f"{work}/sigs", config=config)],
                              tasks=cpus, workers=cpus, logging_dir=f"{work}/logs/1").run()
        LocalPipelineExecutor(pipeline=[MinhashDedupBuckets(input_folder=f"{work}/sigs", output_folder=f"{work}/buckets",
                                                            config=config)],
                              tasks=config.num_buckets, workers=cpus, logging_dir=f"{work}/logs/2").run()
        LocalPipelineExecutor(pipeline=[MinhashDedupCluster(input_folder=f"{work}/buckets", output_folder=f"{work}/ids",
                                                            config=config)],
                              tasks=1, logging_dir=f"{work}/logs/3").run()
        LocalPipelineExecutor(pipeline=[reader(), MinhashDedupFilter(input_folder=f"{work}/ids"),
                                        JsonlWriter(f"{work}/out", compression=None)],
                              tasks=cpus, workers=cpus, logging_dir=f"{work}/logs/4").run()
        print(json.dumps({"seconds": time.perf_counter() - t0}))

    if __name__ == "__main__":  # the executor's workers import this file again
        main()
""")


def run_datatrove(python: str, data: Path, work: Path, cpus: int) -> tuple[float, list[str], dict]:
    script = work / "datatrove_minhash.py"
    work.mkdir(parents=True, exist_ok=True)
    script.write_text(DATATROVE_SCRIPT)
    peaks: dict[str, int] = {}
    stop = threading.Event()
    proc = subprocess.Popen([python, str(script), str(data), str(work), str(cpus)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    sampler = threading.Thread(target=sample, args=(proc.pid, 0.2, stop, peaks))
    sampler.start()
    out, err = proc.communicate()
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"datatrove failed ({proc.returncode}):\n{err[-3000:]}")
    seconds = json.loads(out.strip().splitlines()[-1])["seconds"]
    kept = [json.loads(line)["text"] for f in sorted((work / "out").glob("*.jsonl"))
            for line in f.read_text(encoding="utf-8").splitlines()]
    return seconds, kept, peaks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--base", type=int, default=8000, help="base paragraphs per unit of scale")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--datatrove-python", default=None)
    args = ap.parse_args()

    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    rows = []
    with tempfile.TemporaryDirectory(prefix="conduit-near-dedup-") as tmp:
        tmp = Path(tmp)
        warm, _ = corpus(200, args.seed)  # Ray's workers start and import the stage's modules once, untimed
        write_inputs(warm, tmp / "warm" / "data")
        for near in (False, True):
            run_conduit(tmp / "warm" / "data", tmp / "warm" / str(near), near=near)
        for scale in args.scales:
            texts, planted = corpus(args.base * scale, args.seed + scale)
            data = tmp / f"x{scale}" / "data"
            write_inputs(texts, data)
            t0 = time.perf_counter()
            pairs = truth_pairs(texts)
            truth_s = time.perf_counter() - t0
            off_s, _, _, _ = run_conduit(data, tmp / f"x{scale}" / "off", near=False)
            on_s, kept, counts, peaks = run_conduit(data, tmp / f"x{scale}" / "on", near=True)
            row = {"scale": scale, "documents": len(texts), "planted": len(planted),
                   "bytes": sum(len(t.encode()) for t in texts), "truth_seconds": truth_s,
                   "conduit": {"seconds": on_s, "seconds_without_near_dedup": off_s,
                               "docs_per_s": len(texts) / on_s, **quality(texts, kept, pairs),
                               "near_dedup": counts["near_dedup"],
                               "peak_rss_bytes": dict(sorted(peaks.items(), key=lambda kv: -kv[1]))}}
            if args.datatrove_python:
                dt_s, dt_kept, dt_peaks = run_datatrove(args.datatrove_python, data, tmp / f"x{scale}" / "dt",
                                                        args.cpus)
                row["datatrove"] = {"seconds": dt_s, "docs_per_s": len(texts) / dt_s,
                                    **quality(texts, dt_kept, pairs),
                                    "peak_rss_bytes": dict(sorted(dt_peaks.items(), key=lambda kv: -kv[1]))}
            rows.append(row)
            c = row["conduit"]
            line = (f"x{scale}: {len(texts)} docs ({row['bytes'] / 1e6:.1f} MB), {len(pairs)} pairs >= {THRESHOLD}; "
                    f"conduit {on_s:.1f} s ({c['docs_per_s']:.0f} docs/s; {off_s:.1f} s without near-dedup), "
                    f"recall {c['recall']:.3f}, precision {c['precision']:.3f}")
            if "datatrove" in row:
                d = row["datatrove"]
                line += (f"; datatrove {d['seconds']:.1f} s ({d['docs_per_s']:.0f} docs/s), recall {d['recall']:.3f}, "
                         f"precision {d['precision']:.3f}")
            print(line, flush=True)
    ray.shutdown()

    first, last = rows[0], rows[-1]
    per_doc = lambda r: (r["conduit"]["seconds"] - r["conduit"]["seconds_without_near_dedup"]) / r["documents"]
    checks = [
        {"name": "recall of pairs with Jaccard >= 0.8 (smallest over corpora)",
         "measured": min(r["conduit"]["recall"] for r in rows), "target": TARGET_RECALL, "op": ">=", "format": "ratio"},
        {"name": "precision of removed documents (smallest over corpora)",
         "measured": min(r["conduit"]["precision"] for r in rows), "target": TARGET_PRECISION, "op": ">=",
         "format": "ratio"},
        {"name": f"near-dedup seconds per document, x{last['scale']} / x{first['scale']} (1: linear)",
         "measured": per_doc(last) / per_doc(first), "target": None, "op": "<=", "format": "ratio"},
        {"name": f"stage seconds, x{last['scale']} / x{first['scale']}, per unit of corpus",
         "measured": (last["conduit"]["seconds"] / first["conduit"]["seconds"]) / (last["scale"] / first["scale"]),
         "target": None, "op": "<=", "format": "ratio"},
    ]
    if all("datatrove" in r for r in rows):
        checks.append({"name": "docs/s, Conduit's whole shard stage / datatrove's MinHash pipeline (smallest)",
                       "measured": min(r["conduit"]["docs_per_s"] / r["datatrove"]["docs_per_s"] for r in rows),
                       "target": TARGET_SPEED, "op": ">=", "format": "ratio"})
    table = []
    for r in rows:
        for tool in ("conduit", "datatrove"):
            if tool in r:
                t = r[tool]
                table.append({"corpus": f"x{r['scale']}", "tool": tool, "documents": r["documents"],
                              "MB": round(r["bytes"] / 1e6, 1), "pairs >= 0.8": t["truth_pairs"], "removed": t["removed"], "recall": round(t["recall"], 3),
                              "precision": round(t["precision"], 3), "seconds": round(t["seconds"], 1),
                              "docs/s": round(t["docs_per_s"]),
                              "largest task MiB": round(max(v for k, v in t["peak_rss_bytes"].items()
                                                            if tool == "datatrove" or k.startswith("ray::conduit.shard"))
                                                        / 2**20)})
    print(f"\n{'check':<80} {'value':>8}  target")
    for c in checks:
        print(f"{c['name']:<80} {c['measured']:>8.3f}  {c['op'] if c['target'] is not None else ''} {c['target'] or ''}")
    summary = ("Conduit's times are the whole shard stage with near-duplicate removal on (read, clean, dedupe, split, "
               "write parquet) on an embedded Ray with the CPUs given; the same stage with it off took "
               + ", ".join(f"{r['conduit']['seconds_without_near_dedup']:.1f} s" for r in rows) + ". datatrove's are "
               "its four MinHash stages alone. Precision is the share of removed documents with a partner of Jaccard "
               ">= 0.8: datatrove removes every LSH candidate's cluster (no verification), so it also removes "
               "documents of lower similarity; Conduit verifies each candidate pair by its exact shingle Jaccard. "
               "Largest task: the peak resident memory of the stage's Ray tasks (read, join, verify, write; about "
               "500 MiB of it is the worker's Python with torch and Ray imported): a read task holds one input (a "
               "quarter of the corpus here), a join task one partition of the band keys, a verify task two inputs' "
               "candidate documents; no task holds the corpus. datatrove's column: its largest process.")
    path = write_result("near_dedup", {"args": vars(args), "rows": table, "runs": rows, "checks": checks,
                                       "summary": summary})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
