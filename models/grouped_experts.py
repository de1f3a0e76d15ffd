"""Run a layer's experts on token rows already grouped by expert: one grouped matmul per projection,
or a Python loop over experts.

Both dispatchers (``models.moe.LocalDispatcher`` and expert parallelism's ``AllToAllDispatcher``) end up
with the same thing: rows ``x_SD`` sorted by expert, and how many rows each expert owns (``counts_E``).
``run_experts`` turns that into the experts' outputs ``y_SD`` in the same row order, in one of two ways:

- ``"grouped_mm"``: the experts' weights are stacked into (E, in, out) tensors and every projection is
  one ``torch.nn.functional.grouped_mm`` over all experts, its groups given by cumulative row offsets.
  The offsets are computed on the device from ``counts_E``, so this path needs no host sync. SwiGLU's
  gate and up projections share one grouped matmul (their weights are concatenated along ``out``).
- ``"loop"``: each expert module is called on its slice of rows. Splitting needs the counts on the host
  (one ``.tolist()``), and every expert is one set of small kernel launches; kept as the reference
  that the grouped path is tested against, and for what grouped_mm does not support (float64 on CPU,
  rows whose byte stride is not a multiple of 16).

``grouped_mm``'s own backward (torch 2.13) rejects an upstream gradient with zero strides, which is
what ``.sum()`` or ``.expand`` hand back; ``GroupedMatmul`` wraps the forward and computes both
gradients itself, from a contiguous copy of the upstream gradient, again with grouped matmuls:
dX = grouped_mm(dY, W^T) with the same row groups, and dW_e = X_e^T dY_e as a 2D x 2D grouped matmul
whose groups run along the contracted dimension.

Shape legend: S rows (token slots, grouped by expert), E experts, D d_model, F expert hidden width,
I / O a projection's input and output widths.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F

from models.config import MOE_EXPERT_IMPLS as EXPERT_IMPLS
from models.ffn import FeedForward


class GroupedMatmul(torch.autograd.Function):
    """``y_SO = x_SI @ w_EIO[e]`` for the rows of group e, with a backward that accepts any gradient layout."""

    @staticmethod
    def forward(ctx, x_SI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_SI, w_EIO, offsets_E)
        return F.grouped_mm(x_SI, w_EIO, offs=offsets_E)

    @staticmethod
    def backward(ctx, dy_SO: torch.Tensor):
        x_SI, w_EIO, offsets_E = ctx.saved_tensors
        dy_SO = dy_SO.contiguous()  # a stride-0 gradient (from .sum(), .expand) fails inside grouped_mm
        dx_SI = dw_EIO = None
        if ctx.needs_input_grad[0]:
            dx_SI = F.grouped_mm(dy_SO, w_EIO.transpose(1, 2), offs=offsets_E)
        if ctx.needs_input_grad[1]:
            # (I, S) x (S, O) with groups along S: one (I, O) block per expert; empty groups give zeros.
            dw_EIO = F.grouped_mm(x_SI.t(), dy_SO, offs=offsets_E)
        return dx_SI, dw_EIO, None


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs forward and backward on this device type and dtype (probed once, tiny)."""
    if not hasattr(F, "grouped_mm"):
        return False
    # Grad mode on whatever the caller's mode (the first call may come from evaluation under no_grad):
    # the answer is cached for the process.
    with torch.inference_mode(False), torch.enable_grad():
        x_SI = torch.ones(8, 8, device=device_type, dtype=dtype, requires_grad=True)
        w_EIO = torch.ones(2, 8, 8, device=device_type, dtype=dtype, requires_grad=True)
        offsets_E = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
        try:
            GroupedMatmul.apply(x_SI, w_EIO, offsets_E).sum().backward()
        except (RuntimeError, NotImplementedError):  # unsupported dtype, device or GPU architecture
            return False
    return True


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on for ``x``'s device, else ``x``'s."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def grouped_mm_supported(experts: Sequence[FeedForward], x_SD: torch.Tensor) -> bool:
    """Whether the grouped path can run these experts on ``x_SD``: grouped_mm works for the device and
    compute dtype, and every row of every operand is a multiple of 16 bytes (grouped_mm's alignment)."""
    dtype = compute_dtype(x_SD)
    itemsize = torch.empty((), dtype=dtype).element_size()
    widths = (experts[0].w1.in_features, experts[0].w1.out_features)
    return all(w * itemsize % 16 == 0 for w in widths) and _grouped_mm_runs(x_SD.device.type, dtype)


def resolve_impl(impl: str, experts: Sequence[FeedForward], x_SD: torch.Tensor) -> str:
    """``"grouped_mm"`` or ``"loop"`` for a configured ``moe_expert_impl``.

    Raises:
        ValueError: ``impl`` is not one of EXPERT_IMPLS, or ``"grouped_mm"`` was asked for where it
            cannot run.
    """
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"moe_expert_impl must be one of {list(EXPERT_IMPLS)}, got {impl!r}")
    if impl == "loop":
        return "loop"
    supported = grouped_mm_supported(experts, x_SD)
    if impl == "grouped_mm" and not supported:
        raise ValueError(
            f"moe_expert_impl='grouped_mm' cannot run on {x_SD.device.type} in {compute_dtype(x_SD)} with "
            f"d_model {experts[0].w1.in_features} and expert width {experts[0].w1.out_features}; use 'auto' or 'loop'"
        )
    return "grouped_mm" if supported else "loop"


def _stacked_weight(linears: list[torch.nn.Linear], dtype: torch.dtype) -> torch.Tensor:
    """The experts' ``weight`` (O, I) stacked and viewed as (E, I, O), differentiable back to each one."""
    return torch.stack([lin.weight for lin in linears]).to(dtype).transpose(1, 2)


def _add_bias(h_SO: torch.Tensor, linears: list[torch.nn.Linear], expert_S: torch.Tensor | None) -> torch.Tensor:
    if linears[0].bias is None:
        return h_SO
    return h_SO + torch.stack([lin.bias for lin in linears]).to(h_SO.dtype).index_select(0, expert_S)


@torch.compiler.disable
def grouped_experts(experts: Sequence[FeedForward], x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The experts' outputs for rows grouped by expert, one grouped matmul per projection (no host sync).

    Always eager, a graph break in a compiled block: torch's fake (tracing) kernel of ``_grouped_mm``
    takes bf16 alone, where the CPU's eager kernel also runs fp32; the grouped matmuls are library
    kernels either way, so compiling them would gain nothing."""
    dtype = compute_dtype(x_SD)
    x_SD = x_SD.to(dtype)
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    expert_S = None
    if experts[0].w1.bias is not None:  # per-row expert id; the row count is known here, so no sync
        expert_S = torch.repeat_interleave(torch.arange(len(experts), device=x_SD.device), counts_E,
                                           output_size=x_SD.shape[0])
    w1s = [e.w1 for e in experts]
    if experts[0].kind == "swiglu":
        w3s = [e.w3 for e in experts]
        # Gate and up in one grouped matmul: (E, D, 2F), split after. One cat of every expert's
        # [w1; w3] (E*2F, D) is one copy, where stacking each then concatenating made three.
        w13_EF2D = torch.cat([w.weight for e in experts for w in (e.w1, e.w3)]).to(dtype)
        w13_EDF2 = w13_EF2D.view(len(experts), -1, w13_EF2D.shape[1]).transpose(1, 2)
        gate_SF, up_SF = GroupedMatmul.apply(x_SD, w13_EDF2, offsets_E).chunk(2, dim=1)
        h_SF = F.silu(_add_bias(gate_SF, w1s, expert_S)) * _add_bias(up_SF, w3s, expert_S)
    else:
        h_SF = _add_bias(GroupedMatmul.apply(x_SD, _stacked_weight(w1s, dtype), offsets_E), w1s, expert_S)
        h_SF = F.gelu(h_SF) if experts[0].kind == "gelu" else F.relu(h_SF)
    w2s = [e.w2 for e in experts]
    return _add_bias(GroupedMatmul.apply(h_SF, _stacked_weight(w2s, dtype), offsets_E), w2s, expert_S)


def looped_experts(experts: Sequence[FeedForward], x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts' outputs for rows grouped by expert, each expert called on its rows (``counts`` on the host).

    Every expert runs, even on zero rows, so that all its parameters are in the autograd graph.
    """
    chunks = x_SD.split(counts)
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks)], dim=0)


def run_experts(experts: Sequence[FeedForward], x_SD: torch.Tensor, counts_E: torch.Tensor, impl: str,
                host_counts: list[int] | None = None) -> torch.Tensor:
    """Each expert's output on its rows of ``x_SD`` (grouped by expert), in the same row order.

    Args:
        experts: expert e owns rows ``[sum(counts_E[:e]), sum(counts_E[:e+1]))``.
        x_SD: the rows.
        counts_E: rows per expert, on x's device.
        impl: ``moe_expert_impl`` ("auto", "grouped_mm" or "loop").
        host_counts: ``counts_E`` already on the host, when the caller has it (spares the loop a sync).

    Returns:
        y_SD.
    """
    if resolve_impl(impl, experts, x_SD) == "grouped_mm":
        return grouped_experts(experts, x_SD, counts_E)
    return looped_experts(experts, x_SD, counts_E.tolist() if host_counts is None else host_counts)
