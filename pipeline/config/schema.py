"""The one typed config tree of a Conduit run.

Precedence: dataclass defaults < model preset < YAML file < ``a.b=c`` command-line overrides.
Unknown keys are errors that name the key and suggest the nearest valid one; bad values are errors
that name the field and what is allowed. The resolved tree is saved with every artifact and logged to
MLflow as flattened params.

Fields whose metadata says ``hash=False`` change how a stage reports, not what it produces; they stay
out of the artifact hashes (see ``pipeline.store.artifacts``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from models import PRESETS, ModelConfig
from models.config import DEFAULT_CHUNK_TOKENS
from models.families import family
from models.families.encdec import denoising_lengths, span_counts
from pipeline import credentials
from pipeline.base import DEFAULT_DATA_ROOT, ConfigError, is_uri
from pipeline.config import limits
from pipeline.config.dialect import DuplicateKeyError, load_yaml
from pipeline.config.ranges import out_of_range
from pipeline.config.data_filters import NearDedupSection, QualitySection, check_near_dedup, check_quality
from pipeline.tokenization.spm import NUM_SPECIAL


def _unhashed(default: Any, **kw: Any) -> Any:
    """A field that never changes an artifact's content (logging cadence, progress bars, a location
    whose files are fingerprinted anyway)."""
    return field(default=default, metadata={"hash": False}, **kw)


@dataclass
class RunSection:
    name: str = "conduit"
    workdir: str = "outputs"  # relative paths resolve against the current directory
    # None: <workdir>/artifacts. Or any pyarrow.fs URI (s3://, gs://, hdfs://, file://) with pyarrow's
    # options in the query (s3://b/conduit?endpoint_override=host:9000&scheme=http); credentials come
    # from each node's environment, never the URI. Stages then write to node-local scratch
    # ($CONDUIT_SCRATCH_DIR) and pipeline.store.backends uploads and fetches.
    artifact_root: str | None = None
    seed: int = 1234
    # Another driver holding a stage's lock (the same config, running now): wait this long for it, then
    # stop naming it. 0 stops at once. Waiting ends early when it finishes: its artifact is then used.
    lock_wait_s: float = 0.0


@dataclass
class DataSection:
    # None: $CONDUIT_DATA_ROOT, else ../shared/data beside the repo. Unhashed: the shard stage
    # fingerprints the files it resolves to.
    data_root: str | None = _unhashed(None)
    # Files, folders, globs (``*``, ``?``, ``**``) relative to the data root, absolute paths, or
    # pyarrow filesystem URIs (file://, s3://, gs://, hdfs://), which may end in pyarrow's options
    # (``s3://b/x/*.txt?endpoint_override=host:9000&scheme=http``); credentials come from the
    # environment (AWS_ACCESS_KEY_ID, ...), never the URI. Formats by suffix: .txt .jsonl .json .csv
    # .parquet; a folder saved by ``datasets.save_to_disk`` is one input.
    train_paths: list[str] = field(default_factory=lambda: ["tinyshakespeare/input.txt"])
    text_field: str = "text"  # .jsonl/.json field, .csv/.parquet/datasets column holding the text
    separator: str | None = "\n\n"  # split .txt files into documents on this; None: one file, one doc
    # Who reads .txt/.jsonl/.parquet: Conduit's readers, or datasets.load_dataset with the text, json
    # or parquet builder. .csv and .json are always read through datasets (csv, json builders).
    reader: Literal["native", "datasets"] = "native"
    normalize: Literal["none", "nfc", "nfkc"] = "none"  # Unicode normalisation of every document
    strip_control_chars: bool = False  # drop C0/C1 control characters except tab, newline, CR
    min_doc_chars: int = 1  # shorter documents (after stripping whitespace) are removed and counted
    max_doc_chars: int | None = None  # longer documents are removed and counted; None: no limit
    validation_fraction: float = 0.05
    test_fraction: float = 0.0  # > 0 adds a test split (test-00000.parquet)
    num_shards: int = 2  # train shards, when target_shard_bytes is None
    target_shard_bytes: int | None = None  # set: every split gets ceil(bytes / target) shards
    max_documents: int | None = None  # cap after the split-independent ordering; None: all
    encoding_errors: Literal["error", "replace"] = "error"
    # A malformed .jsonl line (bad JSON, no text field, a non-string text) or an undecodable text file
    # (invalid UTF-8 under encoding_errors=error, NUL bytes): error stops the run naming the file and
    # place; skip leaves it out and counts it by reason (the shard manifest's counts.skipped).
    on_bad_document: Literal["error", "skip"] = "error"
    # Near-duplicates across the whole corpus (MinHash LSH; pipeline.data.near_dedup) and per-document
    # quality filters (language, Gopher's repetition and quality rules, C4's lines; pipeline.data.quality),
    # each off unless enabled, each counted in the shard manifest and MLflow.
    near_dedup: NearDedupSection = field(default_factory=NearDedupSection)
    quality: QualitySection = field(default_factory=QualitySection)


@dataclass
class TokenizerSection:
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = 512
    character_coverage: float = 1.0
    byte_fallback: bool = True
    normalization: Literal["identity", "nfkc", "nmt_nfkc"] = "identity"
    max_training_bytes: int = 20_000_000  # the deterministic sample the tokenizer trains on
    user_defined_symbols: list[str] = field(default_factory=list)  # ids 5, 6, ... in this order
    num_threads: int = _unhashed(2)


@dataclass
class TokenizeSection:
    seq_len: int = 128
    add_bos: bool = False
    # Where documents are encoded and packed. ray: a Ray task per document shard, num_actors at a
    # time (1 logical CPU and threads_per_actor threads each), which spreads over the cluster's nodes
    # but costs a second or so of start-up; local: the stage's own process with num_actors x
    # threads_per_actor threads; auto: ray from ray_data_min_bytes of text on, local below. ray_data
    # is ray's older name. Without Ray (unit tests) it is always local. The output is identical.
    engine: Literal["auto", "ray", "ray_data", "local"] = _unhashed("auto")
    ray_data_min_bytes: int = _unhashed(256_000_000)
    num_actors: int = _unhashed(1)  # encode tasks at a time with the ray engine (1 logical CPU each)
    threads_per_actor: int = _unhashed(1)  # sentencepiece encode threads inside each task
    batch_size: int = _unhashed(1024)  # documents per sentencepiece encode call


@dataclass
class TrainSection:
    steps: int = 20
    global_batch_size: int = 16  # sequences per optimizer step, over all ranks
    micro_batch_size_per_rank: int = 4
    # Label smoothing eps of the training loss (Szegedy et al. 2016): the target is (1 - eps) one-hot
    # + eps uniform over the vocabulary. The logged training loss is then the smoothed one (logged as
    # ``loss`` with the tag train.loss_smoothing); evaluation always reports the plain cross-entropy.
    label_smoothing: float = 0.0
    zero_stage: Literal[0, 1, 2, 3] = 1
    offload_optimizer: bool = False  # ZeRO 1-3: optimizer states and the step on the CPU
    offload_params: bool = False  # ZeRO-3: parameters live on the CPU between uses
    activation_checkpointing: bool = False  # recompute each block's activations in backward
    # auto: bf16 on GPU; on CPU fp32 or amp_bf16, whichever the run's own micro-steps measure faster
    # (pipeline.training.precision_choice, cached per machine and shape). bf16/fp16: DeepSpeed's mixed
    # precision (16-bit weights, fp32 master copy). amp_bf16: fp32 weights and optimizer, matmuls in
    # bf16 under torch.autocast.
    precision: Literal["auto", "fp32", "bf16", "fp16", "amp_bf16"] = "auto"
    # torch.compile (inductor) by regions: every block, and the output end (final norm, LM head and the
    # loss); not with zero_stage 3. auto: on a GPU (ZeRO 0-2); on a CPU where the time it saves over the
    # run's steps, measured on the run's own micro-steps, exceeds its compile time
    # (pipeline.training.compile_choice, cached per machine and shape).
    compile: Literal[False, True, "auto"] = "auto"
    # The LM head and the cross-entropy a chunk of this many tokens at a time, never holding the whole
    # logits (models.layers.loss.linear_cross_entropy); 0: the whole logits at once.
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # Continue a model instead of starting from random weights: a registered version (models:/NAME/VERSION)
    # or a finished train artifact under run.artifact_root (train:HASH). Its
    # architecture must be model's, but for the context (max_seq_len) and the RoPE scaling, which a
    # context extension changes; its tokenizer must be this run's (the same tokenizer artifact).
    init_from: str | None = None
    log_every: int = _unhashed(1)
    progress_bar: bool = _unhashed(True)


@dataclass
class OptimizerSection:
    """AdamW and its learning-rate schedule."""

    # The base learning rate: the schedule's value multiplies it. None: 1.0 for schedule noam (whose
    # value is the learning rate of Vaswani et al. 2017 itself, so optimizer.lr is a plain multiplier
    # of the paper's formula), 3e-3 for every other schedule. See ``resolved_lr``.
    lr: float | None = None
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    # constant, cosine (warmup then cosine to min_lr_ratio), wsd (warmup-stable-decay), noam
    # (d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), times optimizer.lr), inverse_sqrt (the same
    # curve, kept for older configs; times optimizer.lr, which defaults to 3e-3 for it).
    schedule: Literal["constant", "cosine", "wsd", "inverse_sqrt", "noam"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0

    @property
    def resolved_lr(self) -> float:
        """The base learning rate: ``lr`` when set, else 1.0 for schedule noam and 3e-3 otherwise."""
        if self.lr is not None:
            return self.lr
        return 1.0 if self.schedule == "noam" else 3e-3


@dataclass
class ValidationSection:
    """Validation during training (pipeline.training.validation): every ``every`` steps (a multiple of
    train.log_every; 0: never) the loss on the first ``batches`` global batches of the validation
    split, logged as val_loss; ``early_stop_patience`` > 0 stops after that many validations without a
    new best."""

    every: int = 0
    batches: int = 4
    early_stop_patience: int = 0


@dataclass
class CheckpointSection:
    """Checkpoints and recovery. They change nothing a finished run produces (resume is exact), so
    all but ``resume_from`` stay out of the hash."""

    every: int = _unhashed(0)  # steps between checkpoints; 0: by time only (and at the end)
    # Also checkpoint when this many seconds have passed since the last one (checked at log steps),
    # so a fault costs minutes of training whatever the step time; 0: by steps only.
    every_s: float = _unhashed(900.0)
    keep: int = _unhashed(2)
    # Worker-group restarts from the latest checkpoint: a lost node or an OOM-killed worker costs a
    # restart, while a bug that fails every time still stops the run after a few quick tries.
    max_failures: int = _unhashed(3)
    # Ray Train storage (a path or a pyarrow.fs URI), shared by every config: checkpoints go to its run
    # "train-<artifact hash>". None: <artifact_root>/checkpoints, in the object store with the artifacts.
    storage: str | None = _unhashed(None)
    # A checkpoint folder of an earlier run to continue from, with any number of workers, ZeRO stage
    # or ep_size (through its layout-independent canonical.pt). Hashed: it changes the result.
    resume_from: str | None = None


# Keys that left the train section, and where they live now (an old config is told the new name).
MOVED_FROM_TRAIN = {
    **{k: f"optimizer.{k}" for k in ("lr", "min_lr_ratio", "warmup_steps", "schedule", "weight_decay", "beta1",
                                     "beta2", "adam_eps", "grad_clip")},
    "eval_every": "validation.every", "eval_batches": "validation.batches",
    "early_stop_patience": "validation.early_stop_patience",
    "checkpoint_every": "checkpoint.every", "checkpoint_every_s": "checkpoint.every_s", "keep_checkpoints": "checkpoint.keep",
    "max_failures": "checkpoint.max_failures", "checkpoint_storage": "checkpoint.storage",
    "resume_from": "checkpoint.resume_from",
}


@dataclass
class ParallelSection:
    num_workers: int = 2
    ep_size: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when a GPU is visible
    # Intra-op threads of each worker on a CPU, and the CPUs it reserves from Ray. None: the most CPUs the nodes'
    # free ones place for every worker as the train stage starts, threads at most the node's cores over its workers
    # (a sweep sets it to the cluster's CPUs split over the workers of the trials that run at once; two runs
    # meant to share a node set it to their share). A speed setting, like eval.threads, so not in the
    # train stage's hash: a trial's model is found cached on any cluster.
    threads_per_worker: int | None = _unhashed(None)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # workers over nodes
    # Ranks that split each sequence between them (DeepSpeed-Ulysses; pipeline.training.sequence_parallel):
    # consecutive ranks, each holding seq_len / sp positions of the same sequences; attention runs on all
    # positions for n_heads / sp heads. Data parallelism is over num_workers / sp groups.
    sequence_parallel_size: int = 1
    # Where the workers train (pipeline.training.launch). ray_train: Ray Train's workers (a controller and a
    # worker process each, with their process group). in_task: Ray Train's local mode in the train stage's own
    # task, as its one worker (one worker only). auto: in_task for one worker on a CPU (unless
    # cluster.stage_resources keeps stage tasks on some nodes), else ray_train. The weights are the same
    # either way, and so are the checkpoints: a run begun by one resumes under the other.
    launcher: Literal["auto", "ray_train", "in_task"] = _unhashed("auto")


@dataclass
class EvalSection:
    max_batches: int = 50
    batch_size: int = 8
    prompts: list[str] = field(default_factory=lambda: ["Once upon a time", "The king said"])
    max_new_tokens: int = 40
    temperature: float = 0.0
    # Benchmarks under the data root; null skips one. Budgets keep a smoke run to a few seconds.
    heldout_paths: list[str] = field(default_factory=lambda: ["gutenberg/heldout/*.txt"])
    wikitext_path: str | None = "wikitext-2/wiki.test.raw"
    lambada_path: str | None = "lambada/lambada_openai_test.jsonl"
    max_text_tokens: int = 8192  # per benchmark text set (split evenly over its files)
    lambada_max_examples: int = 300
    # Held-out bits per byte at each of these context lengths (tokens; e.g. the trained length and 2x,
    # 4x it, each at most the model's max_seq_len), loss by position in the longest, and a picture of
    # both (pipeline.evaluation.context_length). []: not measured.
    context_lengths: list[int] = field(default_factory=list)
    attention_sentence: str = "The old man looked at the sea and said nothing."
    # Where the scoring runs. auto: a GPU when the Ray cluster has one (the task then holds one GPU),
    # else CPU with eval.cpus logical CPUs and eval.threads torch threads (null: eval.cpus).
    device: Literal["auto", "cpu", "cuda"] = _unhashed("auto")
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on a GPU, fp32 on CPU
    cpus: int = _unhashed(1)
    threads: int | None = _unhashed(None)
    # On a GPU, batches grow from eval.batch_size by doubling while they fit in memory; false keeps it.
    fit_gpu_batch: bool = _unhashed(True)


@dataclass
class RegisterSection:
    model_name: str = "conduit-lm"
    alias: str = "challenger"
    # also log a Hugging Face (Llama / Mixtral / DeepseekV2 / V3) export where the architecture allows
    hf_export: bool = True


@dataclass
class PromoteSection:
    """Gates ``jobs.promote`` applies before moving the target alias (``champion``) to a version."""

    metric: str = "heldout_bits_per_byte"  # lower is better
    min_improvement: float = 0.0  # the candidate's metric must be at least this much below the champion's
    not_lower: list[str] = field(default_factory=lambda: ["lambada_accuracy"])  # must not drop


@dataclass
class TrackingSection:
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///<workdir>/mlflow.db
    experiment: str = "conduit"
    # Seconds between samples of each training node's CPU, memory, disk, network (and GPU) use, logged
    # to the train run as MLflow's system metrics (system/...); 0: none.
    system_metrics_every_s: float = 10.0


@dataclass
class ClusterSection:
    address: str | None = None  # None: $RAY_ADDRESS, else start a local Ray in-process
    num_cpus: int | None = None  # logical CPUs of the embedded local Ray; None: this machine's
    dashboard_host: str = "127.0.0.1"
    include_dashboard: bool = False
    # A Ray cluster of several nodes needs an artifact_root every node sees. A URI (s3://...) is
    # shared by nature; a path is shared only if it is a shared-filesystem mount, which you assert here.
    shared_storage: bool = False
    # Custom Ray resources (``ray start --resources '{"stages": 100}'``) that every stage task asks
    # for a sliver of, so that stage tasks run only on the nodes that have them (the CPU nodes of a
    # GPU cluster, say); Ray Train workers are placed by parallel.placement_strategy. []: anywhere.
    stage_resources: list[str] = field(default_factory=list)


@dataclass
class DeploySection:
    """The Ray Serve deployment of ``jobs.deploy`` (``pipeline.serving.deploy``); no field changes an artifact."""

    num_replicas: int = _unhashed(1)
    num_cpus_per_replica: float = _unhashed(1.0)
    num_gpus_per_replica: float = _unhashed(0.0)
    host: str = _unhashed("127.0.0.1")  # where Serve's HTTP proxy listens (set once per Ray cluster)
    port: int = _unhashed(8000)
    route_prefix: str = _unhashed("/")  # the OpenAI API is under <route_prefix>v1/
    max_batch_size: int = _unhashed(16)  # rows (choices of requests) generated as one batch
    # The most KV-cache slots of a replica's batch (rows x slots); at least the model's max_seq_len.
    max_batch_tokens: int = _unhashed(65536)
    # continuous: requests join the running batch at its next step and leave it when they end;
    # static: a batch forms when the replica is idle and runs until its last request ends.
    batching: str = _unhashed("continuous")
    batch_wait_timeout_s: float = _unhashed(0.01)  # static batching: how long a batch waits to fill
    max_ongoing_requests: int = _unhashed(64)  # per replica; more wait in Serve's queue
    # Which engine generates: vllm (Ray Serve LLM running vLLM on the version's HF export), conduit
    # (Conduit's own continuous-batching engine), or auto: the one measured faster on the replicas'
    # hardware (vLLM on GPUs; on CPUs only where benchmarks/RESULTS.md "serve_vllm" measured it faster:
    # pipeline.serving.vllm_support), where vLLM is installed and can serve the version; else Conduit's.
    engine: str = _unhashed("auto")
    # The interpreter that has vLLM, on the cluster's nodes: a path (relative: to the checkout; the
    # .venv-vllm that `make install` builds), or "" for the nodes' own Python (a GPU image with vLLM).
    vllm_python: str = _unhashed(".venv-vllm/bin/python")
    vllm_kv_cache_gib: float = _unhashed(1.0)  # vLLM's KV cache per replica (CPU: of the machine's memory)

    def __post_init__(self):
        if self.engine not in ("auto", "vllm", "conduit"):
            raise ConfigError(f"deploy.engine={self.engine!r} must be 'auto', 'vllm' or 'conduit'")
        if not self.vllm_kv_cache_gib > 0:
            raise ConfigError(f"deploy.vllm_kv_cache_gib={self.vllm_kv_cache_gib} must be > 0")
        if self.batching not in ("continuous", "static"):
            raise ConfigError(f"deploy.batching={self.batching!r} must be 'continuous' or 'static'")
        for name in ("num_replicas", "max_batch_size", "max_batch_tokens", "max_ongoing_requests"):
            if getattr(self, name) < 1:
                raise ConfigError(f"deploy.{name}={getattr(self, name)} must be >= 1")
        for name in ("num_cpus_per_replica", "num_gpus_per_replica", "batch_wait_timeout_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"deploy.{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.port < 65536:
            raise ConfigError(f"deploy.port={self.port} must be in 1..65535")
        if not self.route_prefix.startswith("/"):
            raise ConfigError(f"deploy.route_prefix={self.route_prefix!r} must start with '/'")


@dataclass
class RunConfig:
    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    tokenizer: TokenizerSection = field(default_factory=TokenizerSection)
    tokenize: TokenizeSection = field(default_factory=TokenizeSection)
    model: dict = field(default_factory=lambda: {"preset": "debug_dense"})
    train: TrainSection = field(default_factory=TrainSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    validation: ValidationSection = field(default_factory=ValidationSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    eval: EvalSection = field(default_factory=EvalSection)
    register: RegisterSection = field(default_factory=RegisterSection)
    promote: PromoteSection = field(default_factory=PromoteSection)
    tracking: TrackingSection = field(default_factory=TrackingSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    deploy: DeploySection = field(default_factory=DeploySection)

    # ---- derived values -------------------------------------------------------------------------
    def model_config(self) -> ModelConfig:
        """The model the train stage builds: preset, then YAML fields; vocab from the tokenizer."""
        return _resolve_model(self.model, self.tokenizer.vocab_size)

    def workdir(self) -> Path:
        return Path(self.run.workdir).expanduser().resolve()

    def artifact_root(self) -> str:
        if self.run.artifact_root:
            root = self.run.artifact_root
            return root if is_uri(root) else str(Path(root).expanduser().resolve())
        return str(self.workdir() / "artifacts")

    def data_root(self) -> Path:
        root = self.data.data_root or os.environ.get("CONDUIT_DATA_ROOT") or str(DEFAULT_DATA_ROOT)
        return Path(root).expanduser().resolve()

    def data_patterns(self) -> list[str]:
        """Every file pattern the run reads under the data root: ``data.train_paths``, then the evaluate
        stage's ``eval.heldout_paths``, ``eval.wikitext_path`` and ``eval.lambada_path`` where set."""
        e = self.eval
        return [*self.data.train_paths, *e.heldout_paths, *(p for p in (e.wikitext_path, e.lambada_path) if p)]

    def tracking_uri(self) -> str:
        """``tracking.uri``, else ``$MLFLOW_TRACKING_URI`` (refused when it carries a credential: the
        resolved URI is logged with the config), else the sqlite store under ``run.workdir``.

        Raises:
            ConfigError: ``$MLFLOW_TRACKING_URI`` holds a password or secret.
        """
        if self.tracking.uri:
            return self.tracking.uri
        from_env = os.environ.get("MLFLOW_TRACKING_URI")
        try:
            credentials.check_uri("$MLFLOW_TRACKING_URI", from_env)
        except credentials.CredentialsInUri as e:
            raise ConfigError(str(e)) from e
        return from_env or f"sqlite:///{self.workdir() / 'mlflow.db'}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- loading ------------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config, apply ``a.b=c`` overrides, validate everything.

    Args:
        path: YAML file; None starts from the defaults.
        overrides: strings ``section.field=value``; the value is parsed as YAML (``2``, ``3e-4``, ``true``,
            ``[a, b]``) in the dialect of ``pipeline.config.dialect``, like the file.

    Returns:
        The validated RunConfig.

    Raises:
        ConfigError: naming the file, key or field and what is allowed; a key given twice in one
            mapping, naming both lines; an empty (or comments-only) file.
    """
    raw: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
        try:
            raw = load_yaml(text)
        except DuplicateKeyError as e:
            raise ConfigError(f"{path}: {e}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if raw is None:  # an empty file, or only comments: running the defaults would be a surprise
            raise ConfigError(f"{path}: the config is empty (nothing but blank lines or comments); write the sections "
                              f"to run, e.g. from configs/smoke.yaml, or run without a file for the defaults")
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(raw).__name__}")
    for item in overrides or []:
        _apply_override(raw, item)
    return config_from_dict(raw, source=source)


def config_from_dict(raw: dict, source: str = "<dict>") -> RunConfig:
    """Build and validate a RunConfig from a nested dict (the inverse of ``RunConfig.to_dict``).

    Every string of it is checked for credentials first: the config is logged whole (MLflow params,
    manifests, Ray tasks), so no field may carry a secret, whatever its type or other checks.
    """
    leak = credentials.config_problem(raw)
    if leak is not None:
        raise ConfigError(f"{source}: {leak}")
    cfg = _build(RunConfig, raw, prefix="", source=source)
    validate(cfg, source)
    return cfg


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"override {item!r}: the key must be section.field (for example train.steps=10)")
    node = raw
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {p} is not a section")
    try:
        node[parts[-1]] = load_yaml(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {e}") from e


def _unknown(key: str, valid: list[str], where: str, source: str) -> ConfigError:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return ConfigError(f"{source}: unknown key {where}{key!r}{hint} (valid: {', '.join(sorted(valid))})")


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if cls is TrainSection and key in MOVED_FROM_TRAIN:
            raise ConfigError(f"{source}: train.{key} has moved: it is {MOVED_FROM_TRAIN[key]} now")
        if key not in names:
            raise _unknown(str(key), names, prefix, source)
        hint = hints[key]
        if key == "model" and cls is RunConfig:
            kwargs[key] = _model_section(value, source)
        elif dataclasses.is_dataclass(hint):
            kwargs[key] = _build(hint, value, f"{prefix}{key}.", source)
        else:
            kwargs[key] = _coerce(value, hint, f"{prefix}{key}", source)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, name: str, source: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name, source)
    if origin is Literal:
        if not any(value == a and type(value) is type(a) for a in args):  # 1 is not true, nor 1.0 the stage 1
            raise ConfigError(f"{source}: {name}={value!r} is not allowed; choose one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {name} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{name}[{i}]", source) for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {name} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # ``steps: 1e4``: a whole number written in scientific notation
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {name} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{source}: {name} must be a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {name} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{source}: {name} has an unsupported type {hint}")  # a bug in this file


def _model_section(value: Any, source: str) -> dict:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: model must be a mapping with a preset and ModelConfig fields")
    value = dict(value)
    value.setdefault("preset", "debug_dense")
    valid = ["preset"] + [f.name for f in dataclasses.fields(ModelConfig)]
    for key in value:
        if key not in valid:
            raise _unknown(str(key), valid, "model.", source)
    if value["preset"] not in PRESETS:
        raise ConfigError(
            f"{source}: model.preset={value['preset']!r} is not a preset; choose one of {sorted(PRESETS)}"
        )
    return value


def _resolve_model(section: dict, vocab_size: int) -> ModelConfig:
    fields = {k: v for k, v in section.items() if k != "preset"}
    if "vocab_size" in fields and fields["vocab_size"] != vocab_size:
        raise ConfigError(
            f"model.vocab_size={fields['vocab_size']} differs from tokenizer.vocab_size={vocab_size}; "
            "leave model.vocab_size out, it follows the tokenizer"
        )
    fields["vocab_size"] = vocab_size
    try:
        return PRESETS[section["preset"]].replace(**fields)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from e


def validate(cfg: RunConfig, source: str = "<config>") -> None:
    """Cross-field checks that no single field can make. Raises ConfigError."""

    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{source}: {msg}")

    def within(problem: str | None) -> None:
        if problem is not None:
            raise ConfigError(f"{source}: {problem}")

    d, t, tr, p = cfg.data, cfg.tokenizer, cfg.train, cfg.parallel
    within(out_of_range(cfg))
    need(bool(d.train_paths), "data.train_paths must name at least one file, directory or glob")
    need(0.0 < d.validation_fraction < 1.0, f"data.validation_fraction={d.validation_fraction} must be in (0, 1)")
    need(d.num_shards >= 1, f"data.num_shards={d.num_shards} must be >= 1")
    need(d.min_doc_chars >= 0, f"data.min_doc_chars={d.min_doc_chars} must be >= 0")
    need(d.separator is None or d.separator != "", "data.separator must be null or a non-empty string")
    need(0.0 <= d.test_fraction < 1.0, f"data.test_fraction={d.test_fraction} must be in [0, 1)")
    within(check_near_dedup(d.near_dedup))
    within(check_quality(d.quality))
    need(
        d.validation_fraction + d.test_fraction < 1.0,
        f"data.validation_fraction={d.validation_fraction} + data.test_fraction={d.test_fraction} must be < 1",
    )
    need(
        d.max_doc_chars is None or d.max_doc_chars >= max(d.min_doc_chars, 1),
        f"data.max_doc_chars={d.max_doc_chars} must be >= data.min_doc_chars={d.min_doc_chars} (and >= 1)",
    )
    need(
        d.target_shard_bytes is None or d.target_shard_bytes >= 1,
        f"data.target_shard_bytes={d.target_shard_bytes} must be null or >= 1",
    )
    need(d.max_documents is None or d.max_documents >= 1, f"data.max_documents={d.max_documents} must be >= 1")
    need(bool(d.text_field), "data.text_field must be a non-empty string")
    need(
        d.reader != "datasets" or d.separator in (None, "\n", "\n\n"),
        f"data.separator={d.separator!r} with data.reader=datasets: the text builder splits .txt files into "
        "lines ('\\n'), paragraphs ('\\n\\n') or not at all (null)",
    )
    uds = t.user_defined_symbols
    need(
        all(uds) and len(set(uds)) == len(uds) and "\n" not in uds,
        f"tokenizer.user_defined_symbols={uds!r} must be distinct non-empty strings other than \"\\n\" "
        "(the newline is always id 4)",
    )
    need(t.vocab_size >= 64, f"tokenizer.vocab_size={t.vocab_size} must be >= 64")
    need(0.0 < t.character_coverage <= 1.0, f"tokenizer.character_coverage={t.character_coverage} must be in (0, 1]")
    need(cfg.tokenize.seq_len >= 8, f"tokenize.seq_len={cfg.tokenize.seq_len} must be >= 8")
    for name in ("num_actors", "threads_per_actor", "batch_size"):
        value = getattr(cfg.tokenize, name)
        need(value >= 1, f"tokenize.{name}={value} must be >= 1")
    need(cfg.tokenize.ray_data_min_bytes >= 0, f"tokenize.ray_data_min_bytes={cfg.tokenize.ray_data_min_bytes} must be >= 0")
    need(tr.steps >= 1, f"train.steps={tr.steps} must be >= 1")
    need(tr.init_from is None or re.fullmatch(r"models:/[^/@]+/\d+|train:[0-9a-f]+", tr.init_from) is not None,
         f"train.init_from={tr.init_from!r} must be models:/NAME/VERSION (a registered version; an alias moves, "
         "a version does not) or train:HASH (a finished train artifact under run.artifact_root)")
    op, va, ck = cfg.optimizer, cfg.validation, cfg.checkpoint
    need(op.lr is None or op.lr > 0, f"optimizer.lr={op.lr} must be > 0 (or null for the schedule's default)")
    need(0.0 <= tr.label_smoothing < 1.0, f"train.label_smoothing={tr.label_smoothing} must be in [0, 1)")
    need(tr.loss_chunk_tokens >= 0,
         f"train.loss_chunk_tokens={tr.loss_chunk_tokens} must be >= 0 (0: the whole logits at once)")
    need(0 <= op.warmup_steps <= tr.steps,
         f"optimizer.warmup_steps={op.warmup_steps} must be in [0, train.steps={tr.steps}]")
    need(op.schedule != "noam" or op.warmup_steps >= 1,
         f"optimizer.schedule=noam divides by optimizer.warmup_steps, so optimizer.warmup_steps={op.warmup_steps} "
         "must be >= 1")
    need(op.schedule not in ("cosine", "wsd") or op.warmup_steps < tr.steps,
         f"optimizer.schedule={op.schedule} decays after warmup, so optimizer.warmup_steps={op.warmup_steps} must be "
         f"below train.steps={tr.steps}")
    need(tr.log_every >= 1, f"train.log_every={tr.log_every} must be >= 1")
    need(va.every % tr.log_every == 0,
         f"validation.every={va.every} must be a multiple of train.log_every={tr.log_every} (val_loss is "
         "logged with that step's metrics)")
    need(va.early_stop_patience == 0 or va.every > 0,
         f"validation.early_stop_patience={va.early_stop_patience} needs validation: set validation.every")
    need(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0")
    need(ck.keep >= 1, f"checkpoint.keep={ck.keep} must be >= 1")
    need(ck.max_failures >= 0, f"checkpoint.max_failures={ck.max_failures} must be >= 0")
    need(ck.every_s >= 0, f"checkpoint.every_s={ck.every_s} must be >= 0")
    need(cfg.tracking.system_metrics_every_s >= 0,
         f"tracking.system_metrics_every_s={cfg.tracking.system_metrics_every_s} must be >= 0 (0: none)")
    need(cfg.register.alias != "champion",
         "register.alias=champion would skip the promotion gates: the register stage sets a candidate alias "
         "(challenger by default), and jobs.promote moves champion after the gates in the promote section pass")
    mc = cfg.model_config()
    if family(mc).seq2seq:
        _validate_encdec(cfg, mc, need)
    need(
        cfg.tokenize.seq_len <= mc.max_seq_len,
        f"tokenize.seq_len={cfg.tokenize.seq_len} exceeds the model's max_seq_len={mc.max_seq_len}",
    )
    lengths = cfg.eval.context_lengths
    need(all(isinstance(L, int) and not isinstance(L, bool) and L >= 2 for L in lengths),
         f"eval.context_lengths={lengths} must be whole numbers >= 2")
    need(all(L <= mc.max_seq_len for L in lengths),
         f"eval.context_lengths {[L for L in lengths if L > mc.max_seq_len]} exceed the model's "
         f"max_seq_len={mc.max_seq_len}")
    need(not lengths or bool(cfg.eval.heldout_paths),
         "eval.context_lengths scores the held-out text: set eval.heldout_paths")
    # The layout limits, each written once in pipeline.config.limits (the training code relies on them);
    # checked in this order, so that each one may assume the ones before it.
    within(limits.layout_sizes(p.num_workers, p.ep_size, tr.micro_batch_size_per_rank))
    need(p.launcher != "in_task" or p.num_workers == 1,
         f"parallel.launcher=in_task trains in the train stage's task, as one worker: parallel.num_workers="
         f"{p.num_workers} needs parallel.launcher=ray_train (or auto)")
    within(limits.sequence_parallel(p.sequence_parallel_size, p.num_workers, p.ep_size, cfg.tokenize.seq_len))
    within(limits.global_batch(tr.global_batch_size, p.num_workers, tr.micro_batch_size_per_rank,
                               p.sequence_parallel_size))
    within(limits.ep_divides_workers(p.ep_size, p.num_workers))
    within(limits.ep_needs_moe(p.ep_size, mc.num_experts))
    within(limits.ep_divides_experts(p.ep_size, mc.num_experts))
    within(limits.ep_zero_stage(p.ep_size, tr.zero_stage))
    within(limits.ep_shared_experts(p.ep_size, mc.moe_shared_experts))
    within(limits.offload(tr.zero_stage, tr.offload_optimizer, tr.offload_params))
    within(limits.compile_zero_stage(tr.compile, tr.zero_stage))


def _validate_encdec(cfg: RunConfig, mc: ModelConfig, need) -> None:
    """An encoder-decoder run: span-corrupted blocks must fit both stacks and the sentinels the vocabulary;
    the next-token benchmarks of evaluate do not apply to it."""
    block = cfg.tokenize.seq_len + 1
    enc_len, dec_len = denoising_lengths(mc, block)
    need(max(enc_len, dec_len) <= mc.max_seq_len,
         f"model.max_seq_len={mc.max_seq_len} must hold the span-corrupted encoder ({enc_len}) and decoder "
         f"({dec_len}) sequences of a tokenize.seq_len={cfg.tokenize.seq_len} block")
    sentinels = span_counts(block, mc.denoise_noise_density, mc.denoise_mean_span_length)[1]
    last = NUM_SPECIAL + len(cfg.tokenizer.user_defined_symbols) + sentinels  # pipeline.data.span_corruption's ids
    need(last < cfg.tokenizer.vocab_size,
         f"tokenizer.vocab_size={cfg.tokenizer.vocab_size} must exceed the {sentinels} sentinels' ids "
         f"(up to {last - 1})")
    e = cfg.eval
    need(not (e.heldout_paths or e.wikitext_path or e.lambada_path),
         "eval.heldout_paths, eval.wikitext_path and eval.lambada_path score next-token prediction; with "
         "model.arch=encoder_decoder set them to [] / null (evaluate reports the denoising loss instead)")


def hash_view(obj: Any) -> Any:
    """The part of a config (a section, a ``ModelConfig``) that changes outputs, for artifact hashes.

    Drops fields marked ``hash=False`` and fields left at their default: a field added to Conduit with a
    default leaves every existing hash, and so every cached artifact, as it was. (So a default is never
    changed in place: a new default is a change of the stage's output and bumps the stage's version.)
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        view = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.metadata.get("hash", True) and not _at_default(f, value):
                view[f.name] = hash_view(value)
        return view
    return obj


def _at_default(f: dataclasses.Field, value: Any) -> bool:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return False
    return type(value) is type(default) and value == default


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (for MLflow params)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
