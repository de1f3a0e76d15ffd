"""What the benchmark scripts share: summaries, the machine's description, result files, and
Conduit's full training path (the train stage: Ray Train + DeepSpeed) on synthetic token blocks.

Scripts put the repository root on ``sys.path`` before importing this (they run as plain files).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def summary(values: list[float]) -> dict:
    """Median, range and the values themselves (the form every result file uses)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


def machine() -> dict:
    """The machine and the stack's versions, for the result files and RESULTS.md."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    for mod in ("deepspeed", "ray", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def matmul_rate(m: int, k: int, n: int, dtype=None, seconds: float = 0.5) -> float:
    """Measured FLOP/s of an (m x k) @ (k x n) matmul (fp32 unless ``dtype``) on this process's threads."""
    import torch

    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(5):
        a @ b
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        a @ b
        count += 1
    return 2 * m * k * n * count / elapsed


def peak_at_model_shapes(model, tokens: int, dtype=None) -> tuple[float, tuple[int, int, int]]:
    """(the fastest measured matmul rate over ``model``'s shapes, that shape): tokens x in x out of every
    linear layer and the LM head, on this process's threads. The MFU denominator "at the model's shapes"."""
    import torch

    shapes = sorted({(tokens, m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    rates = {s: matmul_rate(*s, dtype) for s in shapes}
    best = max(rates, key=rates.get)
    return rates[best], best


def write_result(name: str, data: dict) -> Path:
    """``benchmarks/results/<name>.json`` with the machine's description added."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), "written_at": time.strftime("%Y-%m-%d %H:%M:%S"), **data},
                               indent=1) + "\n")
    return path


class FullPath:
    """Conduit's train stage, run as the pipeline runs it (``STAGES["train"].execute(...)``: Ray Train's
    TorchTrainer, one DeepSpeed engine per worker, checkpoints and MLflow metrics included) on
    random token blocks, so the model and batch alone decide the speed.

    Tokens/s comes from the loop's own windows (``train.log_every`` steps each, timed on rank 0 with
    the same clock the MLflow metrics use); the first window holds warm-up (first allocations, the
    optimizer's lazy state) and is left out.

    Use as a context manager: it starts a local Ray with ``ray_cpus`` logical CPUs and a sqlite MLflow
    store in a temporary folder, and removes both at exit.
    """

    def __init__(self, *, vocab_size: int, seq_len: int, n_blocks: int = 4096, ray_cpus: int = 4):
        self.vocab_size, self.seq_len, self.n_blocks, self.ray_cpus = vocab_size, seq_len, n_blocks, ray_cpus
        self.work: Path | None = None
        self.runs = 0

    def __enter__(self) -> "FullPath":
        import ray

        from pipeline import tracking
        from pipeline.stage_tracker import StageTracker
        from pipeline.store.artifacts import write_manifest
        from pipeline.runner import worker_env
        from pipeline.store.contracts import SplitTokens, TokenIndex, tokens_file

        os.environ.update(worker_env())
        self.work = Path(tempfile.mkdtemp(prefix="conduit-bench-fullpath-"))
        tokens_dir = self.work / "tokenize"
        tokens_dir.mkdir()
        rng = np.random.default_rng(0)
        blocks = rng.integers(5, self.vocab_size, size=(self.n_blocks, self.seq_len + 1), dtype=np.int64)
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        np.save(tokens_dir / tokens_file("train", 0), blocks.astype(dtype))
        n_tokens = self.n_blocks * (self.seq_len + 1)
        index = TokenIndex(seq_len=self.seq_len, dtype=np.dtype(dtype).name, vocab_size=self.vocab_size, add_bos=False,
                           splits={"train": SplitTokens(blocks=self.n_blocks, tokens=n_tokens, dropped_tail_tokens=0,
                                                        documents=1, bytes=n_tokens, tokens_in_documents=n_tokens,
                                                        shards=[self.n_blocks])})
        index.write(tokens_dir)
        self.tokens = write_manifest(tokens_dir, stage="tokenize", hash_="synthetic", stage_config={}, run_config={},
                                     inputs={"shard": "synthetic", "tokenizer": "synthetic"}, counts=index.to_dict(),
                                     started_at=time.time())
        self.uri = f"sqlite:///{self.work / 'mlflow.db'}"
        self.experiment = tracking.ensure_experiment(self.uri, "bench", str(self.work / "mlruns"))
        ray.init(address="local", num_cpus=self.ray_cpus, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {**worker_env(), **tracking.env_for_workers()}})
        return self

    def __exit__(self, *exc) -> None:
        import ray

        ray.shutdown()
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)

    def run(self, overrides: list[str], *, steps: int, log_every: int) -> dict:
        """Train ``steps`` steps with the config ``overrides`` (``model.preset=...``, ``parallel.num_workers=...``).

        Returns:
            ``tokens_per_s`` (median over the windows after the first), ``windows`` (each window's
            tokens/s), ``mfu`` (the loop's own, median), ``seconds`` (the stage's wall time, start-up
            included), ``peak_memory_gib`` (rank 0's).
        """
        from pipeline import tracking
        from pipeline.stage_tracker import StageTracker
        from pipeline.config import load_config
        from pipeline.runner import resolve
        from pipeline.store.contracts import read_train_metrics
        from pipeline.stages import STAGES

        if steps < 2 * log_every:
            raise ValueError(f"steps={steps} must give at least two windows of log_every={log_every}")
        self.runs += 1
        cfg = resolve(load_config(None, [
            f"run.workdir={self.work}", f"tokenize.seq_len={self.seq_len}", f"train.steps={steps}",
            f"train.log_every={log_every}", "optimizer.warmup_steps=1", "train.progress_bar=false",
            f"tokenizer.vocab_size={self.vocab_size}", f"model.max_seq_len={self.seq_len}", *overrides,
        ]))
        run_id = tracking.start_run(self.uri, self.experiment, f"bench-{self.runs}")
        out = self.work / f"train-{self.runs}"
        started = time.perf_counter()
        STAGES["train"].execute(cfg, f"bench{self.runs}", out, {"tokenize": self.tokens},
                                StageTracker(self.uri, run_id))
        seconds = time.perf_counter() - started
        tracking.end_run(self.uri, run_id)
        history = read_train_metrics(out)[1:]
        shutil.rmtree(out, ignore_errors=True)
        windows = [h["tokens_per_s"] for h in history]
        return {"tokens_per_s": statistics.median(windows), "windows": windows,
                "mfu": statistics.median(h["mfu"] for h in history), "seconds": seconds,
                "peak_memory_gib": max(h["peak_memory_gib"] for h in history)}
