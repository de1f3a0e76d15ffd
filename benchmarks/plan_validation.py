"""The planner (`pipeline.plan`) against what can be measured here, and against published runs.

1. Model states per GPU against DeepSpeed's estimators (ZeRO 1-3, offload), 8 GPUs.
2. Activations kept at the end of the forward, and the micro-step's peak, against the live tensors of a
   real forward + backward on this CPU (`pipeline.plan.measure`), in fp32 and in bf16: dense, MoE, MLA,
   Mamba, Mamba-2, hybrid and encoder-decoder at two sizes, with and without activation checkpointing.
3. Communication bytes per step against the real collectives of a 2-rank gloo run of the engine (ZeRO 1,
   2, 3 and EP 2), one launch.
4. Llama-3-8B- and DeepSeek-V3-shaped configs on the clusters their reports describe, at the MFU stated,
   against the published GPU-hours (no target: the gap is explained in the summary).

    .venv/bin/python benchmarks/plan_validation.py    # writes benchmarks/results/plan_validation.json
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import ROOT, write_result  # noqa: E402

from pipeline.plan.validation import DEEPSEEK_V3, LLAMA3_8B  # noqa: E402

# name: (model, nodes x GPUs x type, ep_size, global batch, sequence, tokens, MFU, published GPU-hours, source)
PUBLISHED = {
    "Llama-3-8B": (LLAMA3_8B, (64, 8, "H100"), 1, 512, 8192, 15e12, 0.40, 1.3e6,
                   "Llama 3 model card: 1.3M H100-80GB GPU-hours for 15T+ tokens; MFU 38-43% (Llama 3 report, "
                   "Table 4, for the 405B model)"),
    "DeepSeek-V3": (DEEPSEEK_V3, (256, 8, "H800"), 64, 16384, 4096, 14.8e12, 0.40, 2.664e6,
                    "DeepSeek-V3 report, Table 1: 2.664M H800 GPU-hours of pre-training on 14.8T tokens "
                    "(2.788M with context extension and post-training); no MFU reported"),
}


def plain_setup(cfg, world, ep, global_batch, seq, stage=1, micro=1, precision="bf16", checkpointing=False,
                chunk=512, offload_optimizer=False, offload_params=False):
    from pipeline.plan.memory import Setup

    return Setup(model=cfg, seq_len=seq, micro_batch=micro, global_batch=global_batch, world=world, ep_size=ep,
                 zero_stage=stage, precision=precision, offload_optimizer=offload_optimizer,
                 offload_params=offload_params, checkpointing=checkpointing, chunk_tokens=chunk, zero={"stage": stage})


def estimator_rows() -> list[dict]:
    """Planned model states of 8 GPUs against DeepSpeed's estimators (their gap stated per stage)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from models.presets import PRESETS
    from pipeline.plan.memory import model_shape, model_states

    rows, N = [], 8
    for name in ("gpt_125m", "llama_1b", "mla_moe_32x_top4"):
        cfg = PRESETS[name]
        shape = model_shape(cfg, 1)
        P, L = shape.total, shape.largest_layer
        cases = {"ZeRO-1": (1, {}, estimate_zero2_model_states_mem_needs(P, N, 1, False)[1] + 2 * P * (N - 1) / N),
                 "ZeRO-2": (2, {}, estimate_zero2_model_states_mem_needs(P, N, 1, False)[1]),
                 "ZeRO-2 offload": (2, {"offload_optimizer": True},
                                    estimate_zero2_model_states_mem_needs(P, N, 1, True)[1]),
                 "ZeRO-3": (3, {}, estimate_zero3_model_states_mem_needs(P, L, N, 1, False)[1] + 2 * P / N)}
        for case, (stage, kw, reference) in cases.items():
            planned = sum(model_states(plain_setup(cfg, N, 1, N, 64, stage, **kw), shape).values())
            rows.append({"validation": "model states vs DeepSpeed", "case": f"{name} {case}", "planned": planned,
                         "reference": round(reference), "ratio": round(planned / reference, 4)})
    return rows


def activation_rows() -> list[dict]:
    from pipeline.plan.activations import plan_activations
    from pipeline.plan.measure import measure_step
    from pipeline.plan.memory import model_shape
    from pipeline.plan.validation import ACTIVATION_BATCH, ACTIVATION_CASES, ACTIVATION_CHUNK, ACTIVATION_SEQ

    import torch

    rows = []
    for name, cfg in ACTIVATION_CASES.items():
        for (precision, dtype), ckpt in itertools.product((("fp32", torch.float32), ("bf16", torch.bfloat16)),
                                                          (False, True)):
            got = measure_step(cfg, ACTIVATION_BATCH, ACTIVATION_SEQ, checkpointing=ckpt, chunk_tokens=ACTIVATION_CHUNK,
                               dtype=dtype)
            setup = plain_setup(cfg, 1, 1, ACTIVATION_BATCH, ACTIVATION_SEQ, 0, ACTIVATION_BATCH, precision, ckpt,
                                ACTIVATION_CHUNK)
            plan = plan_activations(setup, model_shape(cfg, 1), grads_as_they_come=True)
            tag = f"{name} {precision}{' ckpt' if ckpt else ''}"
            for what, planned, measured in (("kept", plan.kept, got.after_forward), ("peak", plan.peak, got.peak)):
                rows.append({"validation": f"activations {what} vs measured", "case": tag, "planned": planned,
                             "reference": measured, "ratio": round(planned / measured, 4)})
    return rows


def comm_rows() -> list[dict]:
    """One 2-process gloo launch of `pipeline.plan.comm_probe`, then planned vs measured per function."""
    from pipeline.plan.validation import COMM_CASES, measured_payloads, planned_payloads

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        launch_world("pipeline.plan.comm_probe", str(out))
        probe = json.loads(out.read_text())
    rows = []
    for case in COMM_CASES:
        planned, measured = planned_payloads(case), measured_payloads(probe, case)
        for fn in sorted(set(planned) | set(measured)):
            p, m = planned.get(fn, 0), measured.get(fn, 0)
            rows.append({"validation": "bytes per step vs 2-rank gloo", "case": f"{case} {fn}", "planned": p,
                         "reference": m, "ratio": round(p / m, 4) if m else None})
    return rows


def launch_world(module: str, *args: str, world: int = 2) -> None:
    """``python -m module`` in a gloo world of ``world`` local processes (env:// rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DS_ACCELERATOR": "cpu",
                                   "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
             for r in range(world)]
    if any(p.wait() for p in procs):
        raise RuntimeError(f"{module} failed in a {world}-process world")


def published_rows() -> list[dict]:
    from models.accounting import param_counts
    from pipeline.plan.hardware import GPUS, Cluster
    from pipeline.plan.report import plan_setup

    rows = []
    for name, (cfg, (nodes, per_node, gpu), ep, batch, seq, tokens, mfu, hours, source) in PUBLISHED.items():
        world = nodes * per_node
        cluster = Cluster(nodes, per_node, GPUS[gpu])
        p = plan_setup(plain_setup(cfg, world, ep, batch, seq), cluster, mfu, 1, int(tokens))
        counts = param_counts(cfg)
        compute_hours = tokens / (p.time.tokens_per_s * p.time.step_s / p.time.compute_s) * world / 3600
        planned_hours = p.budget_seconds() * world / 3600
        rows.append({"run": name, "cluster": f"{nodes}x{per_node}x{gpu}", "params_B": round(counts["total"] / 1e9, 2),
                     "active_B": round(counts["active"] / 1e9, 2),
                     "GFLOP_per_token": round(p.time.flops_per_token / 1e9, 1),
                     "tokens_T": tokens / 1e12, "mfu": mfu, "planned_compute_Mh": round(compute_hours / 1e6, 3),
                     "planned_with_exposed_comm_Mh": round(planned_hours / 1e6, 3), "published_Mh": hours / 1e6,
                     "published/compute": round(hours / compute_hours, 2),
                     "implied_mfu": round(mfu * compute_hours / hours, 3), "source": source})
    return rows


def worst(rows: list[dict], validation: str) -> float:
    return max(abs(r["ratio"] - 1) for r in rows if r["validation"].startswith(validation) and r["ratio"] is not None)


def published_table(rows: list[dict]) -> str:
    keys = ["run", "cluster", "params_B", "active_B", "GFLOP_per_token", "tokens_T", "mfu", "planned_compute_Mh",
            "planned_with_exposed_comm_Mh", "published_Mh", "published/compute", "implied_mfu"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


SUMMARY = """Published runs (GPU-hours in millions; no target). {table}

Sources: {sources}. Why the plan and the published figures differ: the plan's compute is the model's
FLOPs (PaLM's 6N + 12 L H K T, attention not halved for the causal mask) at the stated MFU of the
bf16 dense peak. Llama-3-8B took about twice the compute-only plan at 40%: its implied MFU is near 20%,
which is what small models reach at 8K context on thousands of GPUs (the 38-43% of the Llama 3 report is
the 405B model's), and the published hours include restarts and evaluation. DeepSeek-V3 took slightly
less than the plan at 40% of the bf16 peak: it trained its matmuls in FP8 (twice the bf16 peak on
H800), overlapped its all-to-alls with computation (DualPipe), halves causal attention in its kernels,
and its multi-token-prediction module adds a layer the plan does not count; its implied bf16-equivalent
MFU is above 40%. The plan with exposed communication is the worst case of Conduit's own layout (ZeRO-1,
expert all-to-alls never hidden); neither run used that layout (Llama 3: FSDP with tensor and pipeline
parallelism; DeepSeek-V3: 16-way pipeline, 64-way expert parallelism, ZeRO-1), and Conduit plans no
pipeline or tensor parallelism, so the DeepSeek-V3-shaped plan does not fit in memory per GPU.

Activations: steps on this CPU in fp32 and in bf16 (weights and activations in bf16, as DeepSpeed's bf16
runs a model on a GPU; what the code keeps in fp32 whatever the weights, norm statistics, softmax and the
Mamba-2 scan, is counted at 4 bytes in both). MoE is the single-process step of an expert-parallel
layer (a rank's experts see the k routed copies of the tokens of its ep group; with balanced routing as
many as here).
Communication: payload bytes handed to torch.distributed per rank and step, the mean over the 2
ranks (the all-to-alls' split depends on routing; their sum does not)."""


def main() -> None:
    rows = estimator_rows() + activation_rows() + comm_rows()
    published = published_rows()
    checks = [
        {"name": "model states vs DeepSpeed's estimators, worst |planned/reference - 1|",
         "measured": worst(rows, "model states"), "target": 0.01, "op": "<=", "format": "percent"},
        {"name": "activations and peak vs a measured CPU step, worst |planned/measured - 1|",
         "measured": worst(rows, "activations"), "target": 0.15, "op": "<=", "format": "percent"},
        {"name": "communication bytes vs 2-rank gloo collectives, worst |planned/measured - 1|",
         "measured": worst(rows, "bytes"), "target": 0.0, "op": "<=", "format": "percent"},
    ]
    summary = SUMMARY.format(table=published_table(published),
                             sources="; ".join(f"{r['run']}: {r['source']}" for r in published))
    path = write_result("plan_validation", {"rows": rows, "published": published, "checks": checks,
                                            "summary": summary})
    for r in rows:
        print(f"{r['validation']:34} {r['case']:34} {r['planned']:>14,} {r['reference']:>14,.0f} {r['ratio']}")
    print(published_table(published))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
