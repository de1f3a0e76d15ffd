"""A plan of a run config on a cluster: memory per device term by term, the step, the run's cost, and the
cheapest change that makes a config fit (`plan`, `render`, `advise`, `as_json`).

The world is the cluster's (``NODESxGPUSxTYPE``): the plan answers "what if this config ran there", so
the batch arithmetic is checked against that world, naming the fields and the cluster.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from models.accounting import kv_cache_bytes_per_token, param_counts, state_bytes_per_sequence
from pipeline.base import ConfigError
from pipeline.plan.activations import ActivationPlan, plan_activations
from pipeline.plan.hardware import Cluster
from pipeline.plan.memory import ModelShape, Setup, deepspeed_buffers, model_shape, model_states, optimizer_on_cpu
from pipeline.plan.step import Collective, StepTime, collectives, step_time

GB = 1e9


def check_layout(cfg, cluster: Cluster) -> None:
    """The batch and expert arithmetic of ``cfg`` on ``cluster``'s world, one error naming the field.

    Raises:
        ConfigError: a global batch that the world's micro-batches do not divide, or an ep_size that
            does not divide the world (the config's own layout is validated when it loads).
    """
    t, world, ep = cfg.train, cluster.world, cfg.parallel.ep_size
    sp = cfg.parallel.sequence_parallel_size
    where = f"on --cluster {cluster.nodes}x{cluster.per_node}x{cluster.device.name}"
    if world % ep:
        raise ConfigError(f"parallel.ep_size={ep} must divide the world ({world} devices {where})")
    if world % sp:
        raise ConfigError(f"parallel.sequence_parallel_size={sp} must divide the world ({world} devices {where})")
    readers = f"the world ({world} devices {where})" + (f" / parallel.sequence_parallel_size={sp}" if sp > 1 else "")
    if t.global_batch_size % (world // sp * t.micro_batch_size_per_rank):
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a multiple of {readers} x "
                          f"train.micro_batch_size_per_rank={t.micro_batch_size_per_rank} = "
                          f"{world // sp * t.micro_batch_size_per_rank}")


def setup_from_config(cfg, cluster: Cluster) -> Setup:
    """The plan's `Setup` of a validated RunConfig on ``cluster`` (precision and ZeRO stage resolved as the
    train stage resolves them; "auto" on a CPU plans fp32, the larger of its two choices).

    Raises:
        ConfigError: from `check_layout`.
    """
    from pipeline.training.device import resolve_precision
    from pipeline.training.ds_config import build_ds_config, engine_zero_stage
    from pipeline.training.layout import ParallelDims

    check_layout(cfg, cluster)
    t = cfg.train
    precision = resolve_precision(t.precision, "cuda" if cluster.device.is_gpu else "cpu")
    precision = "fp32" if precision == "auto" else precision
    sp = cfg.parallel.sequence_parallel_size
    dims = ParallelDims(cluster.world, cfg.parallel.ep_size, t.global_batch_size, t.micro_batch_size_per_rank,
                        cfg.tokenize.seq_len, sp_size=sp)
    stage = engine_zero_stage(t, dims, precision)
    ds = build_ds_config(dims=dims, zero_stage=stage, precision=precision, grad_clip=cfg.optimizer.grad_clip,
                         offload_optimizer=t.offload_optimizer, offload_params=t.offload_params)
    return Setup(model=cfg.model_config(), seq_len=cfg.tokenize.seq_len, micro_batch=t.micro_batch_size_per_rank,
                 global_batch=t.global_batch_size, world=cluster.world, ep_size=cfg.parallel.ep_size, zero_stage=stage,
                 precision=precision, offload_optimizer=t.offload_optimizer, offload_params=t.offload_params,
                 checkpointing=t.activation_checkpointing, chunk_tokens=t.loss_chunk_tokens,
                 zero=ds["zero_optimization"], sp_size=sp)


@dataclass(frozen=True)
class Plan:
    """Everything planned for one setup on one cluster."""

    setup: Setup
    cluster: Cluster
    mfu: float
    steps: int
    tokens: int | None
    shape: ModelShape
    states: dict[str, int]
    buffers: int
    acts: ActivationPlan
    comm: list[Collective]
    time: StepTime
    cpu_offload_bytes: int

    def terms(self) -> dict[str, int]:
        """Per-device bytes at the step's peak, by term; they add up to `peak`."""
        out = dict(self.states)
        out["deepspeed_buffers"] = self.buffers
        out["activations"] = self.acts.layers
        out["loss_output"] = self.acts.output
        out["backward_and_logits_transient"] = self.acts.peak - self.acts.layers - self.acts.output
        return out

    @property
    def peak(self) -> int:
        return sum(self.terms().values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.cluster.device.memory_bytes

    def largest_term(self) -> tuple[str, int]:
        return max(self.terms().items(), key=lambda kv: kv[1])

    def run_seconds(self) -> float:
        return self.time.run_time(self.steps)

    def budget_seconds(self) -> float | None:
        return None if self.tokens is None else self.tokens / self.time.tokens_per_s


def plan_setup(setup: Setup, cluster: Cluster, mfu: float = 0.4, steps: int = 1, tokens: int | None = None,
               shape: ModelShape | None = None) -> Plan:
    """Plan ``setup`` on ``cluster`` at ``mfu``, for ``steps`` steps and a budget of ``tokens``.

    Raises:
        ConfigError: an MFU outside (0, 1].
    """
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu}: the model FLOPs utilisation must be in (0, 1]")
    shape = shape or model_shape(setup.model, setup.ep_size)
    return Plan(setup=setup, cluster=cluster, mfu=mfu, steps=steps, tokens=tokens, shape=shape,
                states=model_states(setup, shape), buffers=deepspeed_buffers(setup, shape),
                acts=plan_activations(setup, shape), comm=collectives(setup, shape),
                time=step_time(setup, shape, cluster, mfu), cpu_offload_bytes=optimizer_on_cpu(setup, shape))


def plan(cfg, cluster: Cluster, mfu: float = 0.4, tokens: int | None = None) -> Plan:
    """Plan a validated RunConfig on ``cluster`` (see `plan_setup`)."""
    return plan_setup(setup_from_config(cfg, cluster), cluster, mfu, cfg.train.steps, tokens)


def _variants(setup: Setup) -> list[tuple[str, Setup]]:
    """The single changes `advise` tries, each where the limits allow it: more ep_size (MoE without shared
    experts or sequence parallelism, below ZeRO-3), a higher ZeRO stage (ZeRO-3 not with ep_size > 1),
    activation checkpointing, a smaller micro-batch that still divides the global batch, the optimizer
    offloaded."""
    out, s, cfg = [], setup, setup.model
    ep = s.ep_size * 2
    if (cfg.num_experts and s.zero_stage < 3 and cfg.moe_shared_experts == 0 and s.sp_size == 1
            and s.world % ep == 0 and cfg.num_experts % ep == 0):  # the limits of pipeline.config.limits
        out.append((f"parallel.ep_size={ep}", dataclasses.replace(s, ep_size=ep)))
    if s.zero_stage < 3 and (s.zero_stage < 2 or s.ep_size == 1):
        out.append((f"train.zero_stage={s.zero_stage + 1}", dataclasses.replace(s, zero_stage=s.zero_stage + 1)))
    if not s.checkpointing:
        out.append(("train.activation_checkpointing=true", dataclasses.replace(s, checkpointing=True)))
    micro = s.micro_batch // 2
    while micro >= 1 and s.global_batch % (s.dp_size * micro):
        micro -= 1
    if micro >= 1:
        out.append((f"train.micro_batch_size_per_rank={micro}", dataclasses.replace(s, micro_batch=micro)))
    if s.zero_stage >= 1 and not s.offload_optimizer:
        out.append(("train.offload_optimizer=true", dataclasses.replace(s, offload_optimizer=True)))
    return out


def advise(p: Plan) -> list[tuple[str, Plan]]:
    """The changes (one, or else two together) after which the config fits, fastest planned step first."""
    found: list[tuple[str, Plan]] = []
    singles = _variants(p.setup)
    for name, s in singles:
        q = plan_setup(s, p.cluster, p.mfu, p.steps, p.tokens)
        if q.fits:
            found.append((name, q))
    if not found:
        for name, s in singles:
            for name2, s2 in _variants(s):
                if name2.split("=")[0] != name.split("=")[0]:
                    q = plan_setup(s2, p.cluster, p.mfu, p.steps, p.tokens)
                    if q.fits:
                        found.append((f"{name} {name2}", q))
    return sorted(found, key=lambda item: item[1].time.step_s)


def serving(setup: Setup) -> dict[str, int]:
    """What a served sequence holds in bf16: KV-cache bytes per token, SSM state per sequence, and a whole
    sequence of the model's max_seq_len."""
    per_token = kv_cache_bytes_per_token(setup.model, 2)
    state = state_bytes_per_sequence(setup.model, 2)
    return {"kv_cache_bytes_per_token": per_token, "state_bytes_per_sequence": state,
            "bytes_per_full_sequence": per_token * setup.model.max_seq_len + state}


def _fmt(n: float) -> str:
    """Bytes in GB, or MB below a tenth of a GB (the smoke configs)."""
    return f"{n / GB:8.2f} GB" if n >= GB / 10 or n == 0 else f"{n / 1e6:8.2f} MB"


def _count(n: float) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds:,.0f} s"


def render(p: Plan) -> str:
    """The plan as the text ``jobs.plan`` prints."""
    s, c, t = p.setup, p.cluster, p.time
    counts = param_counts(s.model)
    lines = [f"plan on {c.describe()}: {c.device.memory_bytes / GB:.1f} GB and {c.device.peak_flops / 1e12:.3g} "
             f"TFLOP/s peak per device",
             f"model {_count(counts['total'])} parameters ({_count(counts['active'])} active); per device "
             f"{s.micro_batch} x {s.seq_len} tokens a micro-batch, {s.precision}, ZeRO-{s.zero_stage}, ep_size "
             f"{s.ep_size}, sequence parallel {s.sp_size}, activation checkpointing "
             f"{'on' if s.checkpointing else 'off'}, loss chunk {s.chunk_tokens or 'off'}",
             "", "memory per device at the step's peak:"]
    for name, value in p.terms().items():
        lines.append(f"  {name:32} {_fmt(value)}")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    lines.append(f"  {'peak':32} {_fmt(p.peak)}  of {_fmt(c.device.memory_bytes).strip()}: {verdict}")
    if p.cpu_offload_bytes:
        lines.append(f"  (CPU memory for the offloaded optimizer: {_fmt(p.cpu_offload_bytes).strip()} per device)")
    serve = serving(s)
    full = _fmt(serve["bytes_per_full_sequence"]).strip()
    lines.append(f"serving (bf16): KV cache {serve['kv_cache_bytes_per_token']:,} bytes per token, state "
                 f"{serve['state_bytes_per_sequence']:,} bytes per sequence: {full} per sequence of "
                 f"{s.model.max_seq_len} tokens")
    lines += ["", f"step at MFU {p.mfu:.0%}: {t.flops_per_token / 1e6:,.1f} MFLOP per token"]
    lines.append(f"  compute {t.compute_s:.3f} s, communication {t.comm_s:.3f} s of which {t.exposed_comm_s:.3f} s "
                 f"not overlapped: step {t.step_s:.3f} s, {t.tokens_per_s:,.0f} tokens/s")
    for col in p.comm:
        lines.append(f"  {col.name:44} {col.kind:14} {_fmt(col.payload)} over {col.group}"
                     f"{'' if col.hidden else ' (exposed)'}")
    lines.append(f"train.steps={p.steps}: {_hours(p.run_seconds())}, {p.run_seconds() * c.world / 3600:,.1f} "
                 "device-hours")
    if p.tokens is not None:
        lines.append(f"{p.tokens:,} tokens: {_hours(p.budget_seconds())}, "
                     f"{p.budget_seconds() * c.world / 3600:,.1f} device-hours")
    if not p.fits:
        lines.append("")
        lines.append(refusal(p))
    return "\n".join(lines)


def refusal(p: Plan) -> str:
    """Why ``p`` does not fit: its peak, its largest term and the cheapest change that fits."""
    name, value = p.largest_term()
    fixes = advise(p)
    fix = (f"the cheapest change that fits: {fixes[0][0]} (peak {fixes[0][1].peak / GB:.2f} GB, step "
           f"{fixes[0][1].time.step_s:.3f} s)" if fixes else "no single change or pair of changes fits: "
           "use more devices or devices with more memory")
    return (f"planned peak {p.peak / GB:.2f} GB per device exceeds the {p.cluster.device.name}'s "
            f"{p.cluster.device.memory_bytes / GB:.2f} GB; the largest term is {name} ({value / GB:.2f} GB); {fix}")


def as_json(p: Plan) -> dict:
    """The plan as a JSON-ready dict (``jobs.plan --json``)."""
    return {"cluster": p.cluster.describe(), "device": dataclasses.asdict(p.cluster.device),
            "setup": {k: v for k, v in dataclasses.asdict(p.setup).items() if k != "model"},
            "memory": p.terms(), "peak": p.peak, "fits": p.fits, "cpu_offload_bytes": p.cpu_offload_bytes,
            "serving": serving(p.setup), "mfu": p.mfu,
            "step": dataclasses.asdict(p.time), "collectives": [dataclasses.asdict(c) for c in p.comm],
            "steps": p.steps, "run_seconds": p.run_seconds(), "device_hours": p.run_seconds() * p.cluster.world / 3600,
            "tokens": p.tokens, "budget_seconds": p.budget_seconds(),
            "budget_device_hours": None if p.tokens is None else p.budget_seconds() * p.cluster.world / 3600,
            "advice": [name for name, _ in advise(p)] if not p.fits else []}


def config_cluster(cfg, cpu_flops: float | None = None) -> Cluster:
    """The cluster a config describes itself: ``parallel.num_workers`` devices on one node, CPUs unless
    ``parallel.device`` is cuda (then H100s, the table's first row: ``jobs.plan --cluster`` names others)."""
    from pipeline.plan.hardware import GPUS, cpu

    device = GPUS["H100"] if cfg.parallel.device == "cuda" else cpu(cpu_flops)
    return Cluster(nodes=1, per_node=cfg.parallel.num_workers, device=device)


def summary(cfg, cpu_flops: float | None = None) -> str:
    """`render` of ``cfg`` on `config_cluster`, introduced as such (``jobs.run --dry-run``, ``jobs.submit``)."""
    cluster = config_cluster(cfg, cpu_flops)
    shape = f"{cluster.nodes}x{cluster.per_node}x{cluster.device.name}"
    return (f"plan of the train stage on the config's own cluster ({shape}; python -m jobs.plan CONFIG --cluster "
            f"NODESxGPUSxTYPE plans another):\n" + render(plan(cfg, cluster)))
