"""A tiny trained run, evaluated and registered into the session's real ``mlflow server``.

The run is built once per session (``tiny_model``): a sentencepiece tokenizer trained on a slice of
tiny-shakespeare, a debug_dense model trained a few dozen steps with plain torch, and the real
evaluate stage body run against the server (tests/conftest.py's ``mlflow_server``). Each test module
then registers it as version 1 of a registered model of its own (``tiny_run``: the module's
``MODEL_NAME``), so that one module's promotions and versions never meet another's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from models import build_model
from models.export import save_safetensors
from models.layers.loss import lm_loss
from pipeline import tracking
from pipeline.stage_tracker import StageTracker
from pipeline.store.artifacts import Artifact
from pipeline.config import RunConfig, config_from_dict
from pipeline.data.packing import SplitWriter, pack, segment
from pipeline.data.token_blocks import TokenBlocks
from pipeline.store.contracts import TOKENIZER_FILE, WEIGHTS_FILE, SplitTokens, TokenIndex
from pipeline.stages import STAGES
from pipeline.tokenization.spm import load_sentencepiece, train_sentencepiece, training_lines


MODEL_NAME = "conduit-test"


TINY_MODEL = {"preset": "debug_dense", "max_seq_len": 64}
# debug_dense with two heads of 32 (and one key/value head): a head size vLLM's CPU kernels serve.
TINY_VLLM_MODEL = {**TINY_MODEL, "n_heads": 2, "num_kv_heads": 1}


def tiny_config(work: Path, uri: str, data_root: Path, model_name: str = MODEL_NAME,
                model: dict | None = None) -> RunConfig:
    return config_from_dict({
        "run": {"name": "tiny", "workdir": str(work)},
        "data": {"data_root": str(data_root)},
        "tokenizer": {"vocab_size": 512},
        "tokenize": {"seq_len": 32},
        "model": dict(model or TINY_MODEL),
        "train": {"steps": 120},
        "eval": {"max_batches": 4, "max_text_tokens": 2048, "lambada_max_examples": 64, "max_new_tokens": 8,
                 "prompts": ["KING:", "The old man said"]},
        "register": {"model_name": model_name},
        "tracking": {"uri": uri, "experiment": "tests"},
    })


def train_tiny(cfg: RunConfig, train_blocks: np.ndarray) -> torch.nn.Module:
    """A debug_dense model trained on ``train_blocks`` with AdamW (seconds on one core)."""
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.resolved_lr)
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
                                   StageTracker(self.uri, run_id))
        tracking.end_run(self.uri, run_id)
        self.run_ids[f"{name}/{out_dir.name}"] = run_id
        return art


def _artifact(stage: str, path: Path, inputs: dict[str, str]) -> Artifact:
    return Artifact(stage=stage, hash=f"{stage}-test", path=path, manifest={"inputs": inputs, "counts": {}})


@pytest.fixture(scope="session")
def tiny_model(mlflow_server, tmp_path_factory, data_root) -> TinyRun:
    """Tokenizer, token blocks and a trained model as stage artifacts, then the evaluate stage (not
    registered: ``tiny_run`` registers it for each module)."""
    return build_tiny(mlflow_server, tmp_path_factory.mktemp("tiny_run"), data_root, TINY_MODEL)


@pytest.fixture(scope="session")
def tiny_vllm_model(mlflow_server, tmp_path_factory, data_root) -> TinyRun:
    """The same, with a model whose head size vLLM serves on CPU (``TINY_VLLM_MODEL``)."""
    return build_tiny(mlflow_server, tmp_path_factory.mktemp("tiny_vllm_run"), data_root, TINY_VLLM_MODEL)


def build_tiny(mlflow_server, work: Path, data_root: Path, model_spec: dict) -> TinyRun:
    cfg = tiny_config(work, mlflow_server.uri, data_root, model=model_spec)
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
    exp_id = tracking.ensure_experiment(mlflow_server.uri, cfg.tracking.experiment)
    run = TinyRun(cfg, mlflow_server.uri, exp_id, arts, model, sp, work, {})
    arts["evaluate"] = run.stage("evaluate", arts, work / "evaluate" / "a")
    return run


@pytest.fixture(scope="module")
def tiny_run(tiny_model, request, data_root) -> TinyRun:
    """The session's tiny run registered as version 1 of the test module's ``MODEL_NAME`` (this
    file's by default), with the module's own folder for what its tests write."""
    return register_tiny(tiny_model, getattr(request.module, "MODEL_NAME", MODEL_NAME), data_root)


@pytest.fixture(scope="module")
def tiny_vllm_run(tiny_vllm_model, request, data_root) -> TinyRun:
    """``tiny_vllm_model`` registered as version 1 of the test module's ``MODEL_NAME``."""
    return register_tiny(tiny_vllm_model, request.module.MODEL_NAME, data_root)


def register_tiny(tiny: TinyRun, name: str, data_root: Path) -> TinyRun:
    work = tiny.work / name
    work.mkdir()
    model_spec = tiny.cfg.model
    run = replace(tiny, cfg=tiny_config(tiny.cfg.workdir(), tiny.uri, data_root, name, model_spec),
                  arts=dict(tiny.arts), run_ids=dict(tiny.run_ids), work=work)
    run.arts["register"] = run.stage("register", run.arts, work / "register" / "a")
    return run
