"""Model states per GPU, term by term, against the rows DeepSpeed 0.19's own estimators print.

``estimate_zero2_model_states_mem_needs_all_cold`` / ``estimate_zero3_model_states_mem_needs_all_cold`` take
a shape's counts (here Llama 3 8B's published ones), the ``_all_live`` variants walk a built model
themselves (here the shipped ``configs/gpu_1b.yaml`` model and an MLA + MoE preset). Both assume what the
planner's 16-bit precisions (bf16, fp16) run: 16-bit weights and gradients, fp32 master weights,
gradients and Adam moments. Each prints one row per offload choice; their per-GPU bytes (DeepSpeed's
source, P parameters, N GPUs, L the parameters of the largest module) are

    ZeRO-2  offload none          2P + int(18P/N)  the whole 16-bit weights, and the partition of the
                                                   16-bit gradients (2) and of the fp32 gradients,
                                                   master weights and moments (16), as its comment splits 18
            offload_optimizer     2P               the whole 16-bit weights alone
    ZeRO-3  offload none          4L + int(18P/N)
            offload_optimizer     4L + int(2P/N)
            offload_param too     4L               the largest module gathered (16-bit weights and gradients)

so the rows and their differences isolate the planner's terms: weights, gradients, optimizer and
gathered_layer each equal an estimator figure, to the byte where the row is a whole number of bytes per
parameter (2P, 4L) and within 2 bytes where it is divided by N (DeepSpeed truncates each row with int(),
the planner rounds each term). What the estimators do not price, and what stands in for it:

- ZeRO-1 has no estimator. DeepSpeed runs it through stage 2's optimizer (``DeepSpeedZeroOptimizer``
  with ``partition_gradients=False``): stage 2's weights and optimizer partition, and every 16-bit
  gradient kept whole, which is as many bytes as the whole 16-bit weights (the 2P row).
- ZeRO-3's 16-bit gradient partition (DeepSpeed's ``grad_partitions_flat_buffer``, P/N elements in the
  model's dtype) is in no stage-3 row: its 18 bytes are the weight partition and the optimizer's 16. The
  planner counts it as stage 2's 16-bit gradient partition, 2/18 of the ZeRO-2 partitioned share.
- Under ZeRO-3 optimizer offload DeepSpeed allocates that gradient partition on the CPU (stage3.py: its
  ``self.device`` is the CPU when the optimizer is offloaded), as the 4L + 2P/N row says, and so does the
  planner (`test_zero3_optimizer_offload_keeps_no_gradients_on_the_gpu`: it kept them on the GPU before).
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

from models import build_model
from models.presets import PRESETS
from pipeline.config import load_config
from pipeline.plan.memory import Setup, model_shape, model_states
from pipeline.plan.validation import LLAMA3_8B

ROUNDING = 2  # bytes: DeepSpeed's int() of each row against the planner's round() of each term

# Llama 3 8B (Meta-Llama-3-8B, config.json and its safetensors index): 8,030,261,248 parameters; its
# largest module is the embedding table (or the untied head), vocab_size 128256 x hidden_size 4096.
LLAMA3_8B_PARAMS, LLAMA3_8B_LARGEST = 8_030_261_248, 128256 * 4096
CLUSTERS = [(1, 8), (4, 8), (64, 8)]  # nodes x GPUs per node


@dataclass(frozen=True)
class Rows:
    """The per-GPU bytes of the rows the estimators print."""

    zero2: dict[bool, int]  # by offload_optimizer
    zero3: dict[tuple[bool, bool], int]  # by (offload_optimizer, offload_param)


def printed_rows(module, inner: str, call) -> dict[tuple, int]:
    """Run a printing estimator (``call``) and return each printed row's per-GPU bytes, exactly: the rows are
    what ``module.inner`` returns as the estimator calls it, and they are checked to be the printed ones."""
    real, rows, order = getattr(module, inner), {}, []

    def record(**kw):
        out = real(**kw)
        key = (kw["cpu_offload"], kw.get("cpu_offload_params", False))
        assert rows.setdefault(key, out[1]) == out[1]  # zero_init changes the CPU figure only
        order.append(out[1])
        return out

    with mock.patch.object(module, inner, record), contextlib.redirect_stdout(io.StringIO()) as text:
        call()
    printed = re.findall(r"\|\s*([\d.]+)GB \|", text.getvalue())
    assert printed == [f"{gpu / 2**30:.2f}" for gpu in order]
    return rows


def estimator_rows(nodes: int, per_node: int, *, model: torch.nn.Module | None = None, params: int = 0,
                   largest: int = 0) -> Rows:
    """The rows of the ``_all_live`` estimators on ``model``, or of the ``_all_cold`` ones on its counts."""
    from deepspeed.runtime.zero import stage3
    from deepspeed.runtime.zero import stage_1_and_2 as stage2

    if model is not None:
        def run2():
            stage2.estimate_zero2_model_states_mem_needs_all_live(model, per_node, nodes)

        def run3():
            stage3.estimate_zero3_model_states_mem_needs_all_live(model, per_node, nodes)
    else:
        def run2():
            stage2.estimate_zero2_model_states_mem_needs_all_cold(params, per_node, nodes)

        def run3():
            stage3.estimate_zero3_model_states_mem_needs_all_cold(params, largest, per_node, nodes)
    zero2 = printed_rows(stage2, "estimate_zero2_model_states_mem_needs", run2)
    zero3 = printed_rows(stage3, "estimate_zero3_model_states_mem_needs", run3)
    return Rows(zero2={offload: gpu for (offload, _), gpu in zero2.items()}, zero3=zero3)


def planned(cfg, world: int, stage: int, precision: str, offload_optimizer=False, offload_params=False) -> dict:
    setup = Setup(model=cfg, seq_len=64, micro_batch=1, global_batch=world, world=world, ep_size=1, zero_stage=stage,
                  precision=precision, offload_optimizer=offload_optimizer, offload_params=offload_params,
                  checkpointing=False, chunk_tokens=0, zero={"stage": stage})
    return model_states(setup, model_shape(cfg, 1))


def expected_terms(rows: Rows) -> dict[tuple, dict[str, tuple[float, int]]]:
    """The planner's terms as the estimator rows give them (module docstring), each with its tolerance in
    bytes (none for a row DeepSpeed does not truncate), by (stage, offload_optimizer, offload_params)."""
    whole_weights = (rows.zero2[True], 0)  # 2P
    partitioned = rows.zero2[False] - rows.zero2[True]  # int(18P/N): 2 of 16-bit gradients, 16 of optimizer
    gradients, optimizer = (partitioned * 2 / 18, ROUNDING), (partitioned * 16 / 18, ROUNDING)
    gathered = (rows.zero3[True, True], 0)  # 4L
    weight_partition = (rows.zero3[True, False] - rows.zero3[True, True], ROUNDING)  # int(2P/N)
    optimizer_partition = (rows.zero3[False, False] - rows.zero3[True, False], ROUNDING)  # 16P/N
    return {
        (1, False, False): {"weights": whole_weights, "gradients": whole_weights, "optimizer": optimizer},
        (2, False, False): {"weights": whole_weights, "gradients": gradients, "optimizer": optimizer},
        (2, True, False): {"weights": whole_weights},
        (3, False, False): {"weights": weight_partition, "gradients": gradients, "optimizer": optimizer_partition,
                            "gathered_layer": gathered},
        (3, True, False): {"weights": weight_partition, "gathered_layer": gathered},
        (3, True, True): {"weights": (0, 0), "gathered_layer": gathered},
    }


def check_terms(cfg, rows: Rows, world: int, precision: str) -> None:
    for (stage, offload_optimizer, offload_params), expected in expected_terms(rows).items():
        ours = planned(cfg, world, stage, precision, offload_optimizer, offload_params)
        case = f"ZeRO-{stage} offload_optimizer={offload_optimizer} offload_params={offload_params}"
        assert ours.keys() == expected.keys(), case
        for term, (value, tolerance) in expected.items():
            assert abs(ours[term] - value) <= tolerance, (case, term, ours[term], value)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("nodes,per_node", CLUSTERS)
def test_llama3_8b_terms_equal_the_cold_estimates(nodes, per_node, precision):
    """The published counts go to DeepSpeed; the planner reads its own from the config."""
    rows = estimator_rows(nodes, per_node, params=LLAMA3_8B_PARAMS, largest=LLAMA3_8B_LARGEST)
    check_terms(LLAMA3_8B, rows, nodes * per_node, precision)


@pytest.fixture(scope="module")
def live_models() -> dict:
    """The shipped gpu_1b model (840M parameters: allocated uninitialised in bf16, so no page is written)
    and an MLA + shared/routed-experts preset, each with its config."""
    gpu_1b = load_config("configs/gpu_1b.yaml", []).model_config()
    mla_moe = PRESETS["cpu_mla_moe"]
    return {"gpu_1b": (gpu_1b, build_model(gpu_1b, device="meta").to(torch.bfloat16).to_empty(device="cpu")),
            "cpu_mla_moe": (mla_moe, build_model(mla_moe))}


@pytest.mark.parametrize("name", ["gpu_1b", "cpu_mla_moe"])
@pytest.mark.parametrize("nodes,per_node", [(1, 8), (8, 8)])
def test_built_models_terms_equal_the_live_estimates(live_models, name, nodes, per_node):
    """DeepSpeed counts P and the largest module on the built model; the planner from the config."""
    cfg, model = live_models[name]
    check_terms(cfg, estimator_rows(nodes, per_node, model=model), nodes * per_node, "bf16")


@pytest.mark.parametrize("offload_params", [False, True])
def test_zero3_optimizer_offload_keeps_no_gradients_on_the_gpu(offload_params):
    rows = estimator_rows(1, 8, params=LLAMA3_8B_PARAMS, largest=LLAMA3_8B_LARGEST)
    ours = planned(LLAMA3_8B, 8, 3, "bf16", offload_optimizer=True, offload_params=offload_params)
    assert sum(ours.values()) == pytest.approx(rows.zero3[True, offload_params], abs=ROUNDING)
