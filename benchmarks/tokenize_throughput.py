"""Tokenize-stage throughput against plain sentencepiece, and shard-stage throughput, in one run.

The tokenize stage (encoding -> packing and .npy writing) is timed with both engines: ``local``
(the stage's own process, ``--actors x --threads-per-actor`` sentencepiece threads; what ``auto``
picks below ``tokenize.ray_data_min_bytes``, as here) and ``ray`` (a Ray task per document shard,
``--actors`` at a time; its results keep the older ``ray_data`` keys), against
``SentencePieceProcessor.encode(texts, num_threads=actors * threads_per_actor)`` on the same
documents with the same tokenizer, interleaved, ``--repeats`` times; the shard stage (parallel Ray
read tasks, cleaning, dedup, split, parquet writing) is timed on the raw inputs. MB are UTF-8 text
megabytes (10^6 bytes): tokenize counts the documents it encodes, shard the input bytes it reads.
``--scale k`` tokenizes the shards k times over (their files repeated), which shows the Ray engine's
start-up amortised on a corpus past ``tokenize.ray_data_min_bytes``, where ``auto`` picks it.
Prints a table and writes ``benchmarks/results/tokenize.json`` (``tokenize_scale<k>.json``).

    .venv/bin/python benchmarks/tokenize_throughput.py [--paths 'gutenberg/train/*.txt'] [--repeats 3] [--actors 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import summary, write_result
from pipeline.store.artifacts import Artifact
from pipeline.config import load_config
from pipeline.runner import make_plan, resolve, worker_env
from pipeline.stages import STAGES, shard
from pipeline.tokenization.spm import load_sentencepiece



class NullTracker:
    def log_metrics(self, m, step=None):
        pass



def scaled_shards(art: Artifact, k: int, out: Path) -> Artifact:
    """A shard artifact whose every split holds ``art``'s shard files ``k`` times (links)."""
    out.mkdir(parents=True)
    counts = dict(art.manifest["counts"])
    for key in ("bytes", "documents"):
        counts[key] = {split: n * k for split, n in counts[key].items()}
    for split in shard.SPLITS:
        files = shard.shard_files(art.path, split)
        for i in range(k * len(files)):
            (out / f"{split}-{i:05d}.parquet").symlink_to(files[i % len(files)])
    return Artifact(stage="shard", hash=f"{art.hash}x{k}", path=out, manifest={**art.manifest, "counts": counts})


def timed_stage(name: str, cfg, arts: dict, out: Path) -> tuple[float, object]:
    plan = {p.stage: p for p in make_plan(cfg)}
    if out.exists():
        shutil.rmtree(out)
    started = time.perf_counter()
    art = STAGES[name].execute(cfg, plan[name].hash, out, arts, NullTracker())
    return time.perf_counter() - started, art


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default="gutenberg/train/*.txt", help="data.train_paths entry (relative to data root)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--threads-per-actor", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ray-cpus", type=int, default=4, help="logical CPUs of the local Ray (as in the tests)")
    ap.add_argument("--scale", type=int, default=1,
                    help="tokenize the shards this many times over (the shard files repeated), to see start-up amortised")
    args = ap.parse_args()

    import ray

    os.environ.update(worker_env())
    work = Path(tempfile.mkdtemp(prefix="conduit-bench-tokenize-"))
    overrides = [
        f"run.workdir={work}", f"data.train_paths=['{args.paths}']", "data.validation_fraction=0.01",
        f"tokenizer.vocab_size={args.vocab}", "tokenizer.max_training_bytes=5000000", "tokenize.seq_len=128",
        f"tokenize.num_actors={args.actors}", f"tokenize.threads_per_actor={args.threads_per_actor}",
        f"tokenize.batch_size={args.batch_size}",
    ]
    cfg = resolve(load_config(None, overrides))
    threads = args.actors * args.threads_per_actor
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, runtime_env={"env_vars": worker_env()},
             log_to_driver=False)
    try:
        plan = {p.stage: p for p in make_plan(cfg)}
        arts = {"shard": STAGES["shard"].execute(cfg, plan["shard"].hash, plan["shard"].path, {}, NullTracker())}
        arts["tokenizer"] = STAGES["tokenizer"].execute(cfg, plan["tokenizer"].hash, plan["tokenizer"].path, arts,
                                                        NullTracker())
        shard_art = arts["shard"]
        if args.scale > 1:
            arts["shard"] = scaled_shards(shard_art, args.scale, work / "scaled")
        texts = [t for s in shard.SPLITS for t in shard.read_texts(arts["shard"].path, s)]
        text_mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
        input_mb = sum(i["bytes"] for i in shard_art.manifest["counts"]["inputs"]) / 1e6
        sp = load_sentencepiece(str(arts["tokenizer"].path / "tokenizer.model"))
        ray_cfg = resolve(load_config(None, [*overrides, "tokenize.engine=ray"]))
        plain, stage, ray_stage, shard_s = [], [], [], []
        for r in range(args.repeats):  # interleaved, so drift on a shared machine hits both sides alike
            started = time.perf_counter()
            n_tokens = sum(map(len, sp.encode(texts, num_threads=threads)))
            plain.append(time.perf_counter() - started)
            seconds, art = timed_stage("tokenize", cfg, arts, work / "bench" / f"tokenize-{r}")
            stage.append(seconds)
            engine = art.manifest["counts"]["engine"]
            seconds, _ = timed_stage("tokenize", ray_cfg, arts, work / "bench" / f"tokenize-ray-{r}")
            ray_stage.append(seconds)
            seconds, _ = timed_stage("shard", cfg, {}, work / "bench" / f"shard-{r}")
            shard_s.append(seconds)
            print(f"repeat {r + 1}/{args.repeats}: plain {plain[-1]:.2f}s  tokenize ({engine}) {stage[-1]:.2f}s  "
                  f"tokenize (ray) {ray_stage[-1]:.2f}s  shard {shard_s[-1]:.2f}s", flush=True)
        index = json.loads((art.path / "index.json").read_text())
    finally:
        ray.shutdown()
        shutil.rmtree(work)

    mbps = {
        "plain_sentencepiece": summary([text_mb / s for s in plain]),
        "tokenize_stage": summary([text_mb / s for s in stage]),
        "tokenize_stage_ray_data": summary([text_mb / s for s in ray_stage]),
        "shard_stage": summary([input_mb / s for s in shard_s]),
    }
    ratios = [p / s for p, s in zip(plain, stage)]  # per repeat: plain seconds / stage seconds
    ray_ratios = [p / s for p, s in zip(plain, ray_stage)]
    result = {
        "paths": args.paths, "scale": args.scale, "text_mb": text_mb, "input_mb": input_mb, "tokens": n_tokens,
        "packed_tokens": sum(s["tokens"] for s in index["splits"].values()),
        "actors": args.actors, "threads_per_actor": args.threads_per_actor, "plain_threads": threads,
        "batch_size": args.batch_size, "vocab_size": args.vocab, "repeats": args.repeats,
        "ray_logical_cpus": args.ray_cpus,
        "engine": engine, "mb_per_s": mbps, "ratio_tokenize_to_plain": summary(ratios),
        "ratio_ray_data_to_plain": summary(ray_ratios),
        "seconds": {"plain_sentencepiece": plain, "tokenize_stage": stage, "tokenize_stage_ray_data": ray_stage,
                    "shard_stage": shard_s},
    }
    path = write_result("tokenize" if args.scale == 1 else f"tokenize_scale{args.scale}", result)
    print(f"\n{text_mb:.1f} MB of text ({n_tokens:,} tokens), {args.paths}; {args.actors} actor(s) x "
          f"{args.threads_per_actor} thread(s) vs sentencepiece with {threads} thread(s); {os.cpu_count()} cores")
    print(f"{'what':<22} {'MB/s median':>12} {'range':>16}")
    for name, s in mbps.items():
        print(f"{name:<22} {s['median']:>12.2f} {s['min']:>7.2f} - {s['max']:<7.2f}")
    r = result["ratio_tokenize_to_plain"]
    print(f"{'ratio stage/plain':<22} {r['median']:>12.2f} {r['min']:>7.2f} - {r['max']:<7.2f}  (goal >= 0.8; {engine})")
    r = result["ratio_ray_data_to_plain"]
    print(f"{'ratio ray_data/plain':<22} {r['median']:>12.2f} {r['min']:>7.2f} - {r['max']:<7.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
