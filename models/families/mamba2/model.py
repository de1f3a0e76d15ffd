"""Mamba-2 (Dao & Gu 2024, "Transformers are SSMs"): the state-space dual layer, trained by matmuls.

Per token x (D wide), with E = ssm_expand * D inner features in H = E / P heads of P = ssm_head_dim,
G = ssm_n_groups groups of B and C (N = ssm_state_size each), K = ssm_conv_kernel:

    [z, xBC, dt] = in_proj(x)             z: E (the gate), xBC: E + 2 G N, dt: H (one step per head)
    xBC = silu(causal depthwise conv(xBC))  then split into x (H x P), B (G x N), C (G x N)
    dt = softplus(dt + dt_bias);  a = -exp(A_log) * dt    (one scalar decay per head and token)
    h_t = exp(a_t) h_{t-1} + dt_t x_t B_t^T        (H x P x N per sequence; B, C shared by H / G heads)
    y_t = h_t C_t + D x_t
    out = out_proj(gated_rmsnorm(y, z))   rmsnorm over each of the G groups of y * silu(z)

Training runs the chunked state-space-duality algorithm (``ssd_scan``): inside each chunk of Q =
ssm_chunk_size tokens the layer is a masked attention-like product, (C B^T * L) (dt x) with L[l, s] =
exp(sum of a over (s, l]) for s <= l, which is matmuls; each chunk's contribution to the state is one
more matmul, and a scan over the T / Q chunks carries the state from chunk to chunk. So the cost is
matmuls plus a loop of T / Q steps, not a loop over tokens. Generation keeps, per layer, the last K - 1
conv inputs and the (H, P, N) state (``Mamba2State``): one token costs the same whatever came before.

Names and layout follow transformers' ``Mamba2ForCausalLM`` (``models.families.mamba2.hf_mamba2``), so export is a
renaming; the model answers the Transformer's calls as ``MambaLM`` does (it is one, with other blocks).

Shape legend: B batch, T time, D d_model, E inner width, H heads, P head width, G groups, N state,
K conv kernel, C chunks, Q chunk length, L layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.families.mamba.model import DT_FLOOR, DT_MAX, DT_MIN, MambaLM, MambaState
from models.layers.norms import RMSNorm


class Mamba2State(MambaState):
    """What generation keeps per layer: ``conv_LBEK`` (L, B, E + 2 G N, K - 1), the conv's previous
    inputs, and ``ssm_LBEN`` (L, B, H, P, N), the state, fp32. (The names are ``MambaState``'s, whose
    row operations, ``gather_rows`` and ``put_row``, work on any shape.) A hybrid model's state has a
    layer for each of its ``n_layers`` Mamba-2 layers (default: ``cfg.n_layers``)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, device: torch.device, dtype: torch.dtype,
                 n_layers: int | None = None) -> None:
        L, K = cfg.n_layers if n_layers is None else n_layers, cfg.ssm_conv_kernel
        conv_dim = cfg.ssm_d_inner + 2 * cfg.ssm_n_groups * cfg.ssm_state_size
        self.conv_LBEK = torch.zeros(L, batch_size, conv_dim, K - 1, device=device, dtype=dtype)
        self.ssm_LBEN = torch.zeros(L, batch_size, cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size,
                                    device=device, dtype=torch.float32)
        self.length = 0
        self.next_pos_B = torch.zeros(batch_size, dtype=torch.long, device=device)


def ssd_scan(x_BTHP: torch.Tensor, dt_BTH: torch.Tensor, A_H: torch.Tensor, B_BTGN: torch.Tensor,
             C_BTGN: torch.Tensor, chunk: int, h0_BHPN: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = C_t . h_t, h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, by chunks (module docstring), in fp32.

    Args:
        x_BTHP: the heads' inputs. dt_BTH: step sizes (after softplus). A_H: the (negative) decay rates.
        B_BTGN, C_BTGN: the groups' input and output projections of the state (each serves H / G heads).
        chunk: Q, tokens per chunk (any T: the last chunk is padded with steps that change nothing).
        h0_BHPN: the state before the first token (None: zeros).

    Returns:
        (y_BTHP without the D skip, h_BHPN the state after the last token), fp32.
    """
    Bsz, T, H, P = x_BTHP.shape
    rep = H // B_BTGN.shape[2]
    Bh = B_BTGN.float().repeat_interleave(rep, dim=2)  # (B, T, H, N)
    Ch = C_BTGN.float().repeat_interleave(rep, dim=2)
    a_BTH = dt_BTH.float() * A_H.float()
    xdt_BTHP = x_BTHP.float() * dt_BTH.float().unsqueeze(-1)
    pad = (-T) % chunk  # padded steps: a = 0 (no decay) and no input, so they change nothing
    if pad:
        a_BTH, xdt_BTHP, Bh, Ch = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (a_BTH, xdt_BTHP, Bh, Ch))
    nC = (T + pad) // chunk
    a = a_BTH.view(Bsz, nC, chunk, H)
    xdt = xdt_BTHP.view(Bsz, nC, chunk, H, P)
    Bc, Cc = Bh.view(Bsz, nC, chunk, H, -1), Ch.view(Bsz, nC, chunk, H, -1)
    cum = a.cumsum(dim=2)  # (B, C, Q, H): the decay from the chunk's start to each token, in log
    # Within a chunk: L[l, s] = exp(cum_l - cum_s) for s <= l (the decay over (s, l]), else 0.
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=a.device).tril()
    seg = (cum.unsqueeze(3) - cum.unsqueeze(2)).masked_fill(~causal[None, None, :, :, None], float("-inf"))
    scores = torch.einsum("bclhn,bcshn->bclsh", Cc, Bc) * seg.exp()
    y = torch.einsum("bclsh,bcshp->bclhp", scores, xdt)
    # Each chunk's own contribution to the state at its end, then the scan over chunks.
    to_end = (cum[:, :, -1:, :] - cum).exp()  # (B, C, Q, H)
    added = torch.einsum("bclhn,bclh,bclhp->bchpn", Bc, to_end, xdt)
    chunk_decay = cum[:, :, -1, :].exp()  # (B, C, H)
    h = x_BTHP.new_zeros(Bsz, H, P, Bc.shape[-1], dtype=torch.float32) if h0_BHPN is None else h0_BHPN.float()
    starts = []
    for c in range(nC):
        starts.append(h)
        h = h * chunk_decay[:, c, :, None, None] + added[:, c]
    start_BCHPN = torch.stack(starts, dim=1)
    # What the state at each chunk's start gives every token of it.
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cc, start_BCHPN) * cum.exp().unsqueeze(-1)
    return y.reshape(Bsz, nC * chunk, H, P)[:, :T], h


class GatedRMSNorm(nn.Module):
    """rmsnorm(y * silu(z)) over each of ``groups`` groups of features, times a weight (transformers'
    ``MambaRMSNormGated``), in fp32."""

    def __init__(self, width: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.groups, self.eps = groups, eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """The state-space dual sublayer (module docstring).

    Args:
        cfg: model config (arch 'mamba2').
    """

    NO_WEIGHT_DECAY = ("A_log", "D", "dt_bias")  # the dynamics, as in the reference implementation

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, E, N, G, K = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_n_groups, cfg.ssm_conv_kernel
        self.d_inner, self.state_size, self.groups, self.conv_kernel = E, N, G, K
        self.heads, self.head_dim, self.chunk = cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_chunk_size
        self.conv_dim = E + 2 * G * N
        self.in_proj = nn.Linear(D, E + self.conv_dim + self.heads, bias=cfg.bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, K, groups=self.conv_dim, bias=True)  # causal: padded in forward
        self.dt_bias = nn.Parameter(torch.empty(self.heads))
        self.A_log = nn.Parameter(torch.empty(self.heads))
        self.D = nn.Parameter(torch.empty(self.heads))
        self.norm = GatedRMSNorm(E, G, cfg.norm_eps)
        self.out_proj = nn.Linear(E, D, bias=cfg.bias)

    @torch.no_grad()
    def init_dynamics(self, generator: torch.Generator | None = None) -> None:
        """transformers' initialisation: A = 1..H (A_log its log), D = 1, and dt ~ log-uniform in
        [DT_MIN, DT_MAX] (floored at DT_FLOOR) stored as softplus^-1 in dt_bias; the conv as PyTorch's
        default (uniform in +-1/sqrt(K), bias 0); the gated norm's weight 1."""
        bound = 1.0 / math.sqrt(self.conv_kernel)
        self.conv1d.weight.uniform_(-bound, bound, generator=generator)
        self.A_log.copy_(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32, device=self.A_log.device)))
        self.D.fill_(1.0)
        u = torch.rand(self.heads, generator=generator, device=self.dt_bias.device)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.conv1d.bias.zero_()
        self.norm.reset_parameters()

    def forward(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor | None, state: Mamba2State | None,
                layer_idx: int) -> torch.Tensor:
        """Apply the mixer; with ``state``, continue from it and leave the new state in it. A mask zeroes
        padded positions before the projection and after the convolution (as transformers does)."""
        Bsz, T, _ = x_BTD.shape
        E, H, P, G, N, K = self.d_inner, self.heads, self.head_dim, self.groups, self.state_size, self.conv_kernel
        if mask_BT is not None:
            x_BTD = x_BTD * mask_BT.unsqueeze(-1).to(x_BTD.dtype)
        z_BTE, xBC_BTC, dt_BTH = self.in_proj(x_BTD).split([E, self.conv_dim, H], dim=-1)
        xBC_BCT = xBC_BTC.transpose(1, 2)
        past = xBC_BCT.new_zeros(Bsz, self.conv_dim, K - 1) if state is None else state.conv_LBEK[layer_idx].to(xBC_BCT.dtype)
        padded = torch.cat([past, xBC_BCT], dim=2)
        if state is not None:
            state.conv_LBEK[layer_idx] = padded[:, :, -(K - 1):] if K > 1 else padded[:, :, :0]
        if T == 1:  # one token: the conv's one output is a weighted sum (a conv call costs several times more)
            conv_BC = (padded * self.conv1d.weight[:, 0, :]).sum(-1) + self.conv1d.bias
            xBC_BTC = F.silu(conv_BC).unsqueeze(1)
        else:
            xBC_BTC = F.silu(self.conv1d(padded)).transpose(1, 2)
        if mask_BT is not None:
            xBC_BTC = xBC_BTC * mask_BT.unsqueeze(-1).to(xBC_BTC.dtype)
        x_BTE, B_BTG, C_BTG = xBC_BTC.split([E, G * N, G * N], dim=-1)
        dt_BTH = F.softplus(dt_BTH.float() + self.dt_bias.float())
        A_H = -torch.exp(self.A_log.float())
        x_BTHP = x_BTE.view(Bsz, T, H, P)
        h0 = None if state is None else state.ssm_LBEN[layer_idx]
        if state is not None and T == 1:  # one token: the recurrence itself
            dt_BH = dt_BTH[:, 0]
            Bh = B_BTG[:, 0].float().view(Bsz, G, N).repeat_interleave(H // G, dim=1)  # (B, H, N)
            Ch = C_BTG[:, 0].float().view(Bsz, G, N).repeat_interleave(H // G, dim=1)
            h = h0 * torch.exp(dt_BH * A_H)[..., None, None] + (dt_BH[..., None] * x_BTHP[:, 0].float())[..., None] * Bh[:, :, None, :]
            y_BTHP = (h * Ch[:, :, None, :]).sum(-1).unsqueeze(1)
        else:
            y_BTHP, h = ssd_scan(x_BTHP, dt_BTH, A_H, B_BTG.view(Bsz, T, G, N), C_BTG.view(Bsz, T, G, N),
                                 self.chunk, h0)
        if state is not None:
            state.ssm_LBEN[layer_idx] = h
        y_BTHP = y_BTHP + x_BTHP.float() * self.D.float()[:, None]
        y_BTE = self.norm(y_BTHP.reshape(Bsz, T, E).to(x_BTD.dtype), z_BTE)
        return self.out_proj(y_BTE.to(x_BTD.dtype))


class Mamba2Block(nn.Module):
    """Pre-norm residual block around a `Mamba2Mixer`: x + drop(mixer(rmsnorm(x)))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = Mamba2Mixer(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor | None, state: Mamba2State | None) -> torch.Tensor:
        return x_BTD + self.resid_dropout(self.mixer(self.norm(x_BTD), mask_BT, state, self.layer_idx))


class Mamba2LM(MambaLM):
    """Mamba-2 language model (arch 'mamba2'): ``MambaLM`` with Mamba-2 blocks and state."""

    ARCH = "mamba2"
    BLOCK = Mamba2Block
    STATE = Mamba2State


__all__ = ["GatedRMSNorm", "Mamba2Block", "Mamba2LM", "Mamba2Mixer", "Mamba2State", "ssd_scan"]
