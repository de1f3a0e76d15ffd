"""A real ``mlflow server`` (sqlite, 127.0.0.1, a free port) and a tiny trained run registered into it.

The server and the run are built once per module: a sentencepiece tokenizer trained on a slice of
tiny-shakespeare, a debug_dense model trained a few dozen steps with plain torch, and the real
evaluate and register stage bodies run against the server. Every process started here is stopped,
with its whole tree, also when a test fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import torch

from models import build_model
from models.export import save_safetensors
from models.loss import lm_loss
from pipeline import tracking
from pipeline.artifacts import Artifact
from pipeline.config import RunConfig, config_from_dict
from pipeline.data.packing import SplitWriter, pack, segment
from pipeline.data.token_blocks import TokenBlocks
from pipeline.stage_io import TOKENIZER_FILE, WEIGHTS_FILE, SplitTokens, TokenIndex
from pipeline.stages import STAGES
from pipeline.text import load_sentencepiece, train_sentencepiece, training_lines

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "conduit-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_tree(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL whatever is left after ``timeout``."""
    if proc.poll() is not None:
        return
    parent = psutil.Process(proc.pid)
    family = [*parent.children(recursive=True), parent]
    for p in family:
        if p.is_running():
            p.terminate()
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for p in alive:
        p.kill()
    psutil.wait_procs(alive, timeout=timeout)
    proc.wait(timeout=timeout)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200; fail with the process's log if it dies or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited with {proc.returncode} before {url} answered:\n{log.read_text()[-4000:]}")
        try:
            up = requests.get(url, timeout=5).status_code == 200
        except (requests.ConnectionError, requests.Timeout):
            up = False  # not listening yet, or still starting up on a busy machine
        if up:
            return
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout}s:\n{log.read_text()[-4000:]}")


def start_process(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **tracking.env_for_workers()})


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """URI of a real MLflow tracking + registry server with proxied artifacts."""
    work = tmp_path_factory.mktemp("mlflow_server")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{work / 'mlflow.db'}",
           "--artifacts-destination", str(work / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1"]
    log = work / "server.log"
    proc = start_process(cmd, log)
    try:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/health", proc, log, timeout=300)  # ~20 s idle; minutes on a loaded box
        yield uri
    finally:
        stop_tree(proc)


def tiny_config(work: Path, uri: str, data_root: Path) -> RunConfig:
    return config_from_dict({
        "run": {"name": "tiny", "workdir": str(work)},
        "data": {"data_root": str(data_root)},
        "tokenizer": {"vocab_size": 512},
        "tokenize": {"seq_len": 32},
        "model": {"preset": "debug_dense", "max_seq_len": 64},
        "train": {"steps": 120},
        "eval": {"max_batches": 4, "max_text_tokens": 2048, "lambada_max_examples": 64, "max_new_tokens": 8,
                 "prompts": ["KING:", "The old man said"]},
        "register": {"model_name": MODEL_NAME},
        "tracking": {"uri": uri, "experiment": "tests"},
    })


def train_tiny(cfg: RunConfig, train_blocks: np.ndarray) -> torch.nn.Module:
    """A debug_dense model trained on ``train_blocks`` with AdamW (seconds on one core)."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.resolved_lr)
    rng = np.random.default_rng(cfg.run.seed)
    for _ in range(cfg.train.steps):
        batch = torch.from_numpy(train_blocks[rng.integers(0, len(train_blocks), 16)].astype(np.int64))
        loss = lm_loss(model(batch[:, :-1]).logits, batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@dataclass
class TinyRun:
    cfg: RunConfig
    uri: str
    experiment_id: str
    arts: dict[str, Artifact]
    model: torch.nn.Module
    sp: object
    work: Path
    run_ids: dict[str, str]

    def stage(self, name: str, inputs: dict[str, Artifact], out_dir: Path) -> Artifact:
        """Run a stage body under a fresh MLflow run on the server (its id kept under ``out_dir.name``)."""
        run_id = tracking.start_run(self.uri, self.experiment_id, name)
        art = STAGES[name].execute(self.cfg, f"{name}-{out_dir.name}", out_dir, inputs,
                                   tracking.StageTracker(self.uri, run_id))
        tracking.end_run(self.uri, run_id)
        self.run_ids[f"{name}/{out_dir.name}"] = run_id
        return art


def _artifact(stage: str, path: Path, inputs: dict[str, str]) -> Artifact:
    return Artifact(stage=stage, hash=f"{stage}-test", path=path, manifest={"inputs": inputs, "counts": {}})


@pytest.fixture(scope="module")
def tiny_run(mlflow_server, tmp_path_factory, data_root) -> TinyRun:
    """Tokenizer, token blocks and a trained model as stage artifacts, then evaluate and register (v1)."""
    work = tmp_path_factory.mktemp("tiny_run")
    cfg = tiny_config(work, mlflow_server, data_root)
    docs = (data_root / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8")[:400_000].split("\n\n")
    tok_dir, tokd_dir, train_dir = work / "tokenizer", work / "tokenize", work / "train"
    for d in (tok_dir, tokd_dir, train_dir):
        d.mkdir()
    (tok_dir / TOKENIZER_FILE).write_bytes(train_sentencepiece(
        training_lines(docs, 10**9), vocab_size=512, model_type="bpe", character_coverage=1.0,
        byte_fallback=True, normalization="identity", num_threads=1))
    sp = load_sentencepiece(str(tok_dir / TOKENIZER_FILE))
    split = int(len(docs) * 0.95)
    splits = {}
    for name, part in (("train", docs[:split]), ("validation", docs[split:])):  # packed as the stage packs
        writer = SplitWriter(tokd_dir, name, cfg.tokenize.seq_len + 1, np.dtype(np.uint16))
        writer.add(0, pack(*segment(sp.encode(part), False, np.dtype(np.uint16)), cfg.tokenize.seq_len + 1, 0,
                           np.dtype(np.uint16)))
        shards, dropped = writer.finish()
        splits[name] = SplitTokens(blocks=sum(shards), tokens=sum(shards) * (cfg.tokenize.seq_len + 1),
                                   dropped_tail_tokens=dropped, documents=writer.documents,
                                   bytes=sum(len(t.encode()) for t in part),
                                   tokens_in_documents=writer.total - writer.documents, shards=shards)
    TokenIndex(seq_len=cfg.tokenize.seq_len, dtype="uint16", vocab_size=sp.get_piece_size(), add_bos=False,
               splits=splits).write(tokd_dir)
    model = train_tiny(cfg, TokenBlocks.of(tokd_dir, "train").head(10**9))
    save_safetensors(model, model.cfg, train_dir / WEIGHTS_FILE)
    arts = {"tokenizer": _artifact("tokenizer", tok_dir, {}),
            "tokenize": _artifact("tokenize", tokd_dir, {"tokenizer": "tokenizer-test"}),
            "train": _artifact("train", train_dir, {"tokenize": "tokenize-test"})}
    exp_id = tracking.ensure_experiment(mlflow_server, cfg.tracking.experiment)
    run = TinyRun(cfg, mlflow_server, exp_id, arts, model, sp, work, {})
    arts["evaluate"] = run.stage("evaluate", arts, work / "evaluate" / "a")
    arts["register"] = run.stage("register", arts, work / "register" / "a")
    return run
