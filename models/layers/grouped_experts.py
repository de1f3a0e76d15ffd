"""A layer's routed experts, stored stacked, and how they run on token rows grouped by expert.

`StackedExperts` holds every expert's weights as one tensor per projection over the experts, in the
layout the grouped matmul consumes: for SwiGLU ``w13`` (E, 2F, D), each expert's gate rows (its
``w1``) then its up rows (``w3``), and ``w2`` (E, D, F); for GELU/ReLU ``w1`` (E, F, D) and ``w2``;
biases (when ``bias``) ``b13`` / ``b1`` (E, 2F or F) and ``b2`` (E, D). Expert e's ``w1`` is row
block e of the per-expert (Mixtral) layout ``experts.{e}.w1.weight`` (F, D), and so on: `stack_expert_state`
and `unstack_expert_state` convert between the two (exports write the per-expert layout; a state
dict in it, an older checkpoint or a Hugging Face import, loads into the stacked one).

Both dispatchers (``models.layers.moe.LocalDispatcher`` and expert parallelism's ``AllToAllDispatcher``) end up
with the same thing: rows ``x_SD`` sorted by expert, and how many rows each expert owns (``counts_E``).
``run_experts`` turns that into the experts' outputs ``y_SD`` in the same row order, in one of two ways:

- ``"grouped_mm"``: every projection is one ``torch.nn.functional.grouped_mm`` over all experts, its
  groups given by cumulative row offsets, on views of the stored tensors (no copy in the weights'
  dtype). The offsets are computed on the device from ``counts_E``, so this path needs no host sync.
  SwiGLU's gate and up projections share one grouped matmul (``w13``).
- ``"loop"``: each expert's slice of the weights on its slice of rows. Splitting needs the counts on
  the host (one ``.tolist()``), and every expert is one set of small kernel launches; kept as the
  reference that the grouped path is tested against, and for what grouped_mm does not support
  (float64 on CPU, rows whose byte stride is not a multiple of 16).

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
import re

import torch
import torch.nn.functional as F
from torch import nn

from models.config import MOE_EXPERT_IMPLS as EXPERT_IMPLS

_PER_EXPERT = re.compile(r"(?P<prefix>(?:.*\.)?)experts\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<kind>weight|bias)")
_STACKED = re.compile(r"(?P<prefix>(?:.*\.)?)experts\.(?P<name>w13|w1|w2|b13|b1|b2)")


class StackedExperts(nn.Module):
    """Every routed expert of one MoE layer, one tensor per projection (see the module docstring).

    Args:
        num_experts: E.
        d_model: D.
        hidden: F, each expert's hidden width.
        kind: "swiglu", "gelu" or "relu".
        bias: whether the projections have biases.
    """

    # Biases set offsets, not feature maps: no weight decay (``pipeline.training.engine.param_groups``).
    NO_WEIGHT_DECAY = ("b13", "b1", "b2")

    def __init__(self, num_experts: int, d_model: int, hidden: int, kind: str, bias: bool) -> None:
        super().__init__()
        if kind not in ("swiglu", "gelu", "relu"):
            raise ValueError(f"ffn must be one of ['swiglu', 'gelu', 'relu'], got {kind!r}")
        self.num_experts, self.d_model, self.hidden, self.kind = num_experts, d_model, hidden, kind
        eager_grouped_experts()  # before any torch.compile of the model that holds these experts
        E, D, Fh = num_experts, d_model, hidden
        up = 2 * Fh if kind == "swiglu" else Fh
        self.w_in_name = "w13" if kind == "swiglu" else "w1"
        self.register_parameter(self.w_in_name, nn.Parameter(torch.empty(E, up, D)))
        self.w2 = nn.Parameter(torch.empty(E, D, Fh))
        self.b_in_name = "b13" if kind == "swiglu" else "b1"
        self.register_parameter(self.b_in_name, nn.Parameter(torch.empty(E, up)) if bias else None)
        self.b2 = nn.Parameter(torch.empty(E, D)) if bias else None
        # As nn.Linear starts (each expert a Linear of its own): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        with torch.no_grad():
            for w, b, fan_in in ((self.w_in, self.b_in, D), (self.w2, self.b2, Fh)):
                for t in (w, b):
                    if t is not None:
                        nn.init.uniform_(t, -fan_in ** -0.5, fan_in ** -0.5)

    def __len__(self) -> int:
        return self.num_experts

    @property
    def w_in(self) -> torch.Tensor:
        """The input projection(s): (E, 2F, D) gate then up rows for SwiGLU, else (E, F, D)."""
        return getattr(self, self.w_in_name)

    @property
    def b_in(self) -> torch.Tensor | None:
        return getattr(self, self.b_in_name)

    @torch.no_grad()
    def reset_parameters(self, std: float, out_std: float, generator: torch.Generator | None = None) -> None:
        """Input projections ~ normal(0, std), w2 ~ normal(0, out_std) (the residual branch's), biases 0."""
        nn.init.normal_(self.w_in, 0.0, std, generator=generator)
        nn.init.normal_(self.w2, 0.0, out_std, generator=generator)
        for b in (self.b_in, self.b2):
            if b is not None:
                nn.init.zeros_(b)

    def expert(self, e: int, x_ND: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` alone on rows ``x_ND`` (the reference the grouped path is tested against)."""
        b_in = None if self.b_in is None else self.b_in[e]
        h = F.linear(x_ND, self.w_in[e], b_in)
        if self.kind == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h) if self.kind == "gelu" else F.relu(h)
        return F.linear(h, self.w2[e], None if self.b2 is None else self.b2[e])

    def slice(self, lo: int, hi: int) -> "StackedExperts":
        """Experts ``[lo, hi)`` as a layer of their own (copies: expert parallelism keeps a rank's block)."""
        out = StackedExperts(hi - lo, self.d_model, self.hidden, self.kind, self.b2 is not None)
        out.to(self.w2.device, self.w2.dtype)
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                getattr(out, name).copy_(p[lo:hi])
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        """Also reads the per-expert layout (``{e}.w1.weight``, ...: older checkpoints, HF imports)."""
        mine = {k: state_dict.pop(k) for k in [k for k in state_dict if k.startswith(prefix)
                                                and _PER_EXPERT.fullmatch("experts." + k[len(prefix):])]}
        if mine:
            stacked = stack_expert_state({"experts." + k[len(prefix):]: v for k, v in mine.items()})
            state_dict.update({prefix + k.removeprefix("experts."): v for k, v in stacked.items()})
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def stack_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with every layer's per-expert tensors (``<layer>.experts.{e}.w1.weight``, ...) stacked into
    `StackedExperts`' (``<layer>.experts.w13``, ...); every other entry as it is.

    Raises:
        ValueError: when a layer's experts are not numbered 0..E-1 or a projection is missing.
    """
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[tuple[str, str], dict[int, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        layers.setdefault(m["prefix"], {}).setdefault((m["w"], m["kind"]), {})[int(m["e"])] = t
    for prefix, parts in layers.items():
        def stacked(w: str, kind: str) -> torch.Tensor:
            by_e = parts.get((w, kind))
            if by_e is None or sorted(by_e) != list(range(len(by_e))):
                raise ValueError(f"{prefix}experts: {w}.{kind} is missing for some of experts "
                                 f"{sorted(by_e or [])}: expected experts 0..E-1")
            return torch.stack([by_e[e] for e in range(len(by_e))])

        glu = ("w3", "weight") in parts
        for kind, name in (("weight", "w"), ("bias", "b")):
            if ("w1", kind) not in parts:
                continue
            first = stacked("w1", kind)
            out[f"{prefix}experts.{name}13" if glu else f"{prefix}experts.{name}1"] = (
                torch.cat([first, stacked("w3", kind)], dim=1) if glu else first)
            out[f"{prefix}experts.{name}2"] = stacked("w2", kind)
    return out


def unstack_expert_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `stack_expert_state`: stacked expert tensors as per-expert (Mixtral-layout) ones."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        m = _STACKED.fullmatch(name)
        if m is None:
            out[name] = t
            continue
        prefix, stacked_name = m["prefix"], m["name"]
        kind = "weight" if stacked_name[0] == "w" else "bias"
        for e, block in enumerate(t.unbind(0)):
            if stacked_name[1:] == "13":
                gate, up = block.chunk(2, dim=0)
                out[f"{prefix}experts.{e}.w1.{kind}"] = gate.contiguous()
                out[f"{prefix}experts.{e}.w3.{kind}"] = up.contiguous()
            else:
                out[f"{prefix}experts.{e}.w{stacked_name[1:]}.{kind}"] = block.contiguous()
    return out


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
    """Whether grouped_mm runs forward and backward on this device type and dtype (probed once, tiny).

    The probe calls the three grouped matmuls of ``GroupedMatmul`` (forward, input and weight gradients)
    directly, without autograd: the first call may come from inside an activation-checkpointed block, where
    anything autograd saved would be counted as the block's and its recomputation (the probe cached by then)
    would not match."""
    if not hasattr(F, "grouped_mm"):
        return False
    with torch.no_grad():
        x_SI = torch.ones(8, 8, device=device_type, dtype=dtype)
        w_EIO = torch.ones(2, 8, 8, device=device_type, dtype=dtype)
        offsets_E = torch.tensor([3, 8], device=device_type, dtype=torch.int32)
        try:
            dy_SO = F.grouped_mm(x_SI, w_EIO, offs=offsets_E)
            F.grouped_mm(dy_SO, w_EIO.transpose(1, 2), offs=offsets_E)
            F.grouped_mm(x_SI.t(), dy_SO, offs=offsets_E)
        except (RuntimeError, NotImplementedError):  # unsupported dtype, device or GPU architecture
            return False
    return True


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on for ``x``'s device, else ``x``'s."""
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def grouped_mm_supported(experts: StackedExperts, x_SD: torch.Tensor) -> bool:
    """Whether the grouped path can run these experts on ``x_SD``: grouped_mm works for the device and
    compute dtype, and every row of every operand is a multiple of 16 bytes (grouped_mm's alignment)."""
    dtype = compute_dtype(x_SD)
    itemsize = torch.empty((), dtype=dtype).element_size()
    widths = (experts.d_model, experts.hidden)
    return all(w * itemsize % 16 == 0 for w in widths) and eager_probe()(x_SD.device.type, dtype)


_EAGER_PROBE = None


def eager_probe():
    """``_grouped_mm_runs`` under ``torch.compiler.disable``, made on first use like ``eager_grouped_experts``: the
    first call may come from a compiled block, where Dynamo would trace the probe with fake tensors (whose
    grouped_mm takes bf16 alone) instead of running it."""
    global _EAGER_PROBE
    if _EAGER_PROBE is None:
        _EAGER_PROBE = torch.compiler.disable(_grouped_mm_runs)
    return _EAGER_PROBE


def resolve_impl(impl: str, experts: StackedExperts, x_SD: torch.Tensor) -> str:
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
            f"d_model {experts.d_model} and expert width {experts.hidden}; use 'auto' or 'loop'"
        )
    return "grouped_mm" if supported else "loop"


def _add_bias(h_SO: torch.Tensor, b_EO: torch.Tensor | None, expert_S: torch.Tensor | None) -> torch.Tensor:
    return h_SO if b_EO is None else h_SO + b_EO.to(h_SO.dtype).index_select(0, expert_S)


def grouped_experts(experts: StackedExperts, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """The experts' outputs for rows grouped by expert, one grouped matmul per projection (no host sync).

    The weights go in as transposed views of the stored tensors: (E, D, 2F) of ``w13`` and (E, F, D) of
    ``w2``; under autocast the cast to the compute dtype is the one copy.

    Always eager (run through ``eager_grouped_experts``), a graph break in a compiled block: torch's
    fake (tracing) kernel of ``_grouped_mm`` takes bf16 alone, where the CPU's eager kernel also runs
    fp32; the grouped matmuls are library kernels either way, so compiling them would gain nothing."""
    dtype = compute_dtype(x_SD)
    x_SD = x_SD.to(dtype)
    offsets_E = counts_E.cumsum(0).to(torch.int32)
    expert_S = None
    if experts.b2 is not None:  # per-row expert id; the row count is known here, so no sync
        expert_S = torch.repeat_interleave(torch.arange(len(experts), device=x_SD.device), counts_E,
                                           output_size=x_SD.shape[0])
    h_SO = _add_bias(GroupedMatmul.apply(x_SD, experts.w_in.to(dtype).transpose(1, 2), offsets_E), experts.b_in,
                     expert_S)
    if experts.kind == "swiglu":
        gate_SF, up_SF = h_SO.chunk(2, dim=1)
        h_SF = F.silu(gate_SF) * up_SF
    else:
        h_SF = F.gelu(h_SO) if experts.kind == "gelu" else F.relu(h_SO)
    return _add_bias(GroupedMatmul.apply(h_SF, experts.w2.to(dtype).transpose(1, 2), offsets_E), experts.b2, expert_S)


_EAGER_GROUPED = None


def eager_grouped_experts():
    """``grouped_experts`` under ``torch.compiler.disable``, made on first use, not at import: disable
    imports torch's compiler (about a second of every process that imports the models, most of which
    never run an MoE). ``StackedExperts`` makes it when it is built, so it exists before any compile."""
    global _EAGER_GROUPED
    if _EAGER_GROUPED is None:
        _EAGER_GROUPED = torch.compiler.disable(grouped_experts)
    return _EAGER_GROUPED


def looped_experts(experts: StackedExperts, x_SD: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts' outputs for rows grouped by expert, each expert on its rows (``counts`` on the host).

    Every expert runs, even on zero rows, so that all its weights are in the autograd graph.
    """
    chunks = x_SD.split(counts)
    return torch.cat([experts.expert(e, chunk) for e, chunk in enumerate(chunks)], dim=0)


def run_experts(experts: StackedExperts, x_SD: torch.Tensor, counts_E: torch.Tensor, impl: str,
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
        return eager_grouped_experts()(experts, x_SD, counts_E)
    return looped_experts(experts, x_SD, counts_E.tolist() if host_counts is None else host_counts)
