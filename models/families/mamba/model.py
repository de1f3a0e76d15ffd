"""Mamba: a language model of selective state-space blocks (Gu & Dao 2023), in pure torch.

Layout (names chosen to map one-to-one onto Hugging Face MambaForCausalLM tensors):
    tok_embeddings (V, D) -> dropout
    -> layers[i]: MambaBlock: x = x + drop(mixer(norm(x)))
         mixer: in_proj (D -> 2E) = [x | z]; x -> causal depthwise conv1d (kernel K) -> SiLU
                x_proj (E -> R + 2N) = [delta_low | B | C]; delta = softplus(dt_proj(delta_low)) (R -> E)
                selective scan  h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t,  y_t = C_t . h_t + D x_t
                y * SiLU(z) -> out_proj (E -> D)
    -> norm (RMSNorm) -> lm_head (D -> V), tied to tok_embeddings when cfg.tie_embeddings.
A = -exp(A_log) is input independent; delta, B and C are functions of the input: the "selection".

Training runs the scan in parallel: the sequence is cut into chunks of `SCAN_CHUNK` steps; inside a
chunk a Hillis-Steele scan combines the pairs (decay, input) in log2(chunk) whole-tensor steps, and a
loop over the chunks (not over tokens) carries the state from one chunk to the next. Decays are kept
as log sums (<= 0) and only exponentiated where applied, so nothing overflows. The backward pass is a
scan too, written by hand (`_SelectiveScan`), so that training keeps one state per chunk rather than
every intermediate of every layer.

Generation keeps per layer the last K-1 convolution inputs and the (E, N) SSM state (`MambaState`),
so each new token costs the same whatever the length of what came before.

Shape legend: B batch, T time, D d_model, E inner width (ssm_expand * D), N ssm_state_size, R dt rank,
K conv kernel, V vocab, L layers, C chunk length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.config import ModelConfig
from models.families.mamba import SCAN_CHUNK
from models.layers.base import ModelOutput, init_base
from models.layers.head import LMHead, head_output
from models.layers.norms import RMSNorm

# Window decays below exp(-60) ~ 1e-26 are computed as exp(-60): the difference is far below fp32's
# resolution of any state it is added to, and it keeps the products out of subnormal floats, which x86
# CPUs compute tens of times slower (they made training steps several times slower here).
LOG_DECAY_FLOOR = -60.0

# HF MambaConfig's delta initialisation: delta ~ log-uniform in [DT_MIN, DT_MAX], floored at DT_FLOOR.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4


class MambaState:
    """What generation keeps per layer: the last K-1 inputs of the convolution and the SSM state.

    Attributes:
        conv_LBEK: (L, B, E, K-1) the convolution's previous inputs (zeros = no history).
        ssm_LBEN: (L, B, E, N) the SSM state, fp32.
        length: tokens fed so far, pads included.
        next_pos_B: (B,) real tokens each row has consumed (what ``max_seq_len`` bounds).
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, device: torch.device, dtype: torch.dtype) -> None:
        L, E, N, K = cfg.n_layers, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.ssm_conv_kernel
        self.conv_LBEK = torch.zeros(L, batch_size, E, K - 1, device=device, dtype=dtype)
        self.ssm_LBEN = torch.zeros(L, batch_size, E, N, device=device, dtype=torch.float32)
        self.length = 0
        self.next_pos_B = torch.zeros(batch_size, dtype=torch.long, device=device)

    def span(self, rows_R: torch.Tensor) -> int:
        """0: a state has no slots (``KVCache.span``'s signature)."""
        return 0

    def can_put(self, span: int, more: int) -> bool:
        """Always: a row's state is its own (``KVCache.can_put``'s signature)."""
        return True

    def put_row(self, slot: int, src: "MambaState", row: int) -> None:
        """Write ``src``'s row ``row`` into row ``slot`` (a row joining a batch in place of one that left)."""
        self.conv_LBEK[:, slot] = src.conv_LBEK[:, row]
        self.ssm_LBEN[:, slot] = src.ssm_LBEN[:, row]
        self.next_pos_B[slot] = src.next_pos_B[row]

    @classmethod
    def gather_rows(cls, parts: list[tuple["MambaState", torch.Tensor]], max_len: int = 0, spare: int = 0,
                    free_rows: int = 0) -> "MambaState":
        """A new state of the rows ``parts`` names, in that order (rows leaving or joining a running
        batch; each row's state is its own, so nothing else moves), and ``free_rows`` zero rows after
        them. ``max_len`` and ``spare`` are ignored: the state does not grow with length (``KVCache.gather_rows``'s signature).

        Raises:
            ValueError: no rows.
        """
        if not parts or sum(len(rows) for _, rows in parts) == 0:
            raise ValueError("gather_rows needs at least one row")
        out = cls.__new__(cls)
        idx = [(c, rows.to(device=c.ssm_LBEN.device, dtype=torch.long)) for c, rows in parts]
        c0 = parts[0][0]
        free = (c0.conv_LBEK.new_zeros(c0.conv_LBEK.shape[0], free_rows, *c0.conv_LBEK.shape[2:]),
                c0.ssm_LBEN.new_zeros(c0.ssm_LBEN.shape[0], free_rows, *c0.ssm_LBEN.shape[2:]),
                c0.next_pos_B.new_zeros(free_rows))
        out.conv_LBEK = torch.cat([c.conv_LBEK[:, rows] for c, rows in idx] + [free[0]], dim=1)
        out.ssm_LBEN = torch.cat([c.ssm_LBEN[:, rows] for c, rows in idx] + [free[1]], dim=1)
        out.next_pos_B = torch.cat([c.next_pos_B[rows] for c, rows in idx] + [free[2]])
        out.length = max(c.length for c, _ in parts)
        return out


def _chunk_states(logdecay_BCEN: torch.Tensor, inject_BCEN: torch.Tensor, h0_BEN: torch.Tensor) -> torch.Tensor:
    """Every state of one chunk, h_t = exp(logdecay_t) h_{t-1} + inject_t from h0, by a Hillis-Steele scan.

    After the step with offset d, element t holds the state reached from zero over the window
    (t - 2d, t] (b) and that window's summed log decay (w); at the end the window is [chunk start, t].
    Plain tensors, no autograd: the caller owns the gradient (`_SelectiveScan`). Modifies nothing it is given.
    """
    w_BCEN, b_BCEN = logdecay_BCEN.clone(), inject_BCEN.clone()
    d = 1
    while d < w_BCEN.shape[1]:
        # The right side is a new tensor, so the overlapping slices are read before they are written.
        b_BCEN[:, d:] += torch.exp(w_BCEN[:, d:].clamp(min=LOG_DECAY_FLOOR)) * b_BCEN[:, :-d]
        w_BCEN[:, d:] = w_BCEN[:, d:] + w_BCEN[:, :-d]
        d *= 2
    return b_BCEN.add_(torch.exp_(w_BCEN.clamp_(min=LOG_DECAY_FLOOR)).mul_(h0_BEN.unsqueeze(1)))


class _SelectiveScan(torch.autograd.Function):
    """The scan with a hand-written backward that recomputes the states chunk by chunk.

    Autograd through the scan would keep every Hillis-Steele step's (B, C, E, N) tensors of every
    layer alive until backward (gigabytes at cpu_small's size, and slower from the memory traffic alone);
    this keeps only the inputs and one state per chunk. The backward is itself a scan, run backwards in
    time: g_t = dL/dh_t = C_t dy_t + exp(delta_{t+1} A) g_{t+1}; from g and the states,
    dL/d(delta_t A) = g_t * h_{t-1} * exp(delta_t A) and dL/d(delta_t x_t B_t) = g_t.
    """

    @staticmethod
    def forward(ctx, x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, h0_BEN, chunk):
        # fp32 throughout, also under autocast (whose einsums would otherwise run in bf16).
        with torch.autocast(x_BTE.device.type, enabled=False):
            return _SelectiveScan._forward(ctx, x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, h0_BEN, chunk)

    @staticmethod
    def backward(ctx, dy_BTE, dhT_BEN):
        with torch.autocast(dy_BTE.device.type, enabled=False):
            saved = ctx.saved_tensors  # once: activation checkpointing unpacks each saved tensor only once
            dtype = saved[0].dtype  # the inputs' (fp32 from selective_scan)
            return _SelectiveScan._backward(ctx, saved, dy_BTE.to(dtype),
                                            None if dhT_BEN is None else dhT_BEN.to(dtype))

    @staticmethod
    def _forward(ctx, x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, h0_BEN, chunk):
        T = x_BTE.shape[1]
        h_BEN = h0_BEN
        starts, ys = [], []
        for s in range(0, T, chunk):
            e = min(s + chunk, T)
            starts.append(h_BEN)
            states_BCEN = _chunk_states(delta_BTE[:, s:e, :, None] * A_EN,
                                        (delta_BTE[:, s:e] * x_BTE[:, s:e])[..., None] * B_BTN[:, s:e, None, :], h_BEN)
            ys.append(torch.einsum("bcen,bcn->bce", states_BCEN, C_BTN[:, s:e]))
            h_BEN = states_BCEN[:, -1].clone()
        ctx.chunk = chunk
        ctx.save_for_backward(x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, torch.stack(starts, 1))
        return torch.cat(ys, 1), h_BEN

    @staticmethod
    def _backward(ctx, saved, dy_BTE, dhT_BEN):
        x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, starts_BKEN = saved
        chunk, T = ctx.chunk, x_BTE.shape[1]
        dx_BTE, ddelta_BTE = torch.empty_like(x_BTE), torch.empty_like(delta_BTE)
        dB_BTN, dC_BTN, dA_EN = torch.empty_like(B_BTN), torch.empty_like(C_BTN), torch.zeros_like(A_EN)
        # dL/dh at the first step of the chunk after this one, times that step's decay: what flows back in.
        carry_BEN = torch.zeros_like(starts_BKEN[:, 0]) if dhT_BEN is None else dhT_BEN.clone()
        for k, s in reversed(list(enumerate(range(0, T, chunk)))):
            e = min(s + chunk, T)
            logdecay_BCEN = delta_BTE[:, s:e, :, None] * A_EN
            dx_in_BCE = delta_BTE[:, s:e] * x_BTE[:, s:e]
            h_start_BEN = starts_BKEN[:, k]
            states_BCEN = _chunk_states(logdecay_BCEN, dx_in_BCE[..., None] * B_BTN[:, s:e, None, :], h_start_BEN)
            # g backwards in time: flipped, it is the forward scan with each step's decay taken from the step after.
            q_BCEN = dy_BTE[:, s:e, :, None] * C_BTN[:, s:e, None, :]
            q_BCEN[:, -1] += carry_BEN
            next_decay_BCEN = torch.cat([logdecay_BCEN[:, 1:], torch.zeros_like(logdecay_BCEN[:, :1])], 1)
            g_BCEN = _chunk_states(next_decay_BCEN.flip(1), q_BCEN.flip(1), torch.zeros_like(h_start_BEN)).flip(1)
            decay_BCEN = torch.exp(logdecay_BCEN)
            carry_BEN = decay_BCEN[:, 0] * g_BCEN[:, 0]
            prev_BCEN = torch.cat([h_start_BEN.unsqueeze(1), states_BCEN[:, :-1]], 1)
            dlog_BCEN = g_BCEN * prev_BCEN * decay_BCEN
            d_dx_BCE = torch.einsum("bcen,bcn->bce", g_BCEN, B_BTN[:, s:e])
            dC_BTN[:, s:e] = torch.einsum("bcen,bce->bcn", states_BCEN, dy_BTE[:, s:e])
            dB_BTN[:, s:e] = torch.einsum("bcen,bce->bcn", g_BCEN, dx_in_BCE)
            dA_EN += torch.einsum("bcen,bce->en", dlog_BCEN, delta_BTE[:, s:e])
            ddelta_BTE[:, s:e] = torch.einsum("bcen,en->bce", dlog_BCEN, A_EN) + d_dx_BCE * x_BTE[:, s:e]
            dx_BTE[:, s:e] = d_dx_BCE * delta_BTE[:, s:e]
        return dx_BTE, ddelta_BTE, dA_EN, dB_BTN, dC_BTN, carry_BEN, None


def selective_scan(
    x_BTE: torch.Tensor,
    delta_BTE: torch.Tensor,
    A_EN: torch.Tensor,
    B_BTN: torch.Tensor,
    C_BTN: torch.Tensor,
    h0_BEN: torch.Tensor | None = None,
    chunk: int = SCAN_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """y_t = C_t . h_t with h_t = exp(delta_t A) h_{t-1} + delta_t B_t x_t, in fp32, without a per-token loop.

    Args:
        x_BTE: the scan's input.
        delta_BTE: step sizes (> 0, after softplus).
        A_EN: the (negative) continuous-time decay rates.
        B_BTN, C_BTN: input and output projections of the state.
        h0_BEN: the state before the first step (None = zeros).
        chunk: steps per chunk (see the module docstring).

    Returns:
        (y_BTE without the D skip term, h_BEN the state after the last step), both fp32.
    """
    Bsz, _, E = x_BTE.shape
    h0_BEN = x_BTE.new_zeros(Bsz, E, A_EN.shape[1], dtype=torch.float32) if h0_BEN is None else h0_BEN.float()
    return _SelectiveScan.apply(x_BTE.float(), delta_BTE.float(), A_EN.float(), B_BTN.float(), C_BTN.float(),
                                h0_BEN, chunk)


class MambaMixer(nn.Module):
    """The selective SSM sublayer: projections, causal conv, selective scan and SiLU gate.

    Args:
        cfg: model config (arch 'mamba').
    """

    NO_WEIGHT_DECAY = ("A_log", "D")  # parameters of the dynamics, as in the reference implementation

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        D, E, N, R, K = cfg.d_model, cfg.ssm_d_inner, cfg.ssm_state_size, cfg.resolved_ssm_dt_rank, cfg.ssm_conv_kernel
        self.d_inner, self.state_size, self.dt_rank, self.conv_kernel = E, N, R, K
        self.scan_chunk = SCAN_CHUNK  # a speed setting, not a weight: any value computes the same function
        self.in_proj = nn.Linear(D, 2 * E, bias=cfg.bias)
        self.conv1d = nn.Conv1d(E, E, K, groups=E, bias=True)  # causal padding is added in forward
        self.x_proj = nn.Linear(E, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, E, bias=True)
        self.A_log = nn.Parameter(torch.empty(E, N))
        self.D = nn.Parameter(torch.empty(E))
        self.out_proj = nn.Linear(E, D, bias=cfg.bias)

    @torch.no_grad()
    def init_dynamics(self, generator: torch.Generator | None) -> None:
        """S4D-real A (A_log[e, n] = log(n + 1)), D = 1, the conv as PyTorch's default (uniform in
        +-1/sqrt(K), bias 0), and dt_proj so that softplus(dt_proj(.)) starts log-uniform in [DT_MIN, DT_MAX]."""
        n_N = torch.arange(1, self.state_size + 1, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(n_N).expand(self.d_inner, -1))
        self.D.fill_(1.0)
        bound = 1.0 / math.sqrt(self.conv_kernel)
        self.conv1d.weight.uniform_(-bound, bound, generator=generator)
        self.conv1d.bias.zero_()
        dt_std = self.dt_rank ** -0.5
        self.dt_proj.weight.uniform_(-dt_std, dt_std, generator=generator)
        u_E = torch.rand(self.d_inner, generator=generator, device=self.A_log.device)
        dt_E = torch.exp(u_E * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
        self.dt_proj.bias.copy_(dt_E + torch.log(-torch.expm1(-dt_E)))  # softplus^-1(dt)

    def forward(
        self,
        x_BTD: torch.Tensor,
        mask_BT: torch.Tensor | None,
        state: MambaState | None,
        layer_idx: int,
    ) -> torch.Tensor:
        """Apply the mixer; with `state`, continue from it and leave the new state in it.

        A mask zeroes padded positions before the projection and after the convolution (as HF's
        Mamba does), so left padding leaves every real token's output as without padding.
        """
        T = x_BTD.shape[1]
        if mask_BT is not None:
            x_BTD = x_BTD * mask_BT.unsqueeze(-1).to(x_BTD.dtype)
        xz_BTE2 = self.in_proj(x_BTD)
        x_BET, z_BTE = xz_BTE2[..., : self.d_inner].transpose(1, 2), xz_BTE2[..., self.d_inner:]

        K = self.conv_kernel
        if state is None:
            past_BEK = x_BET.new_zeros(x_BET.shape[0], self.d_inner, K - 1)
        else:
            past_BEK = state.conv_LBEK[layer_idx].to(x_BET.dtype)
        padded_BET = torch.cat([past_BEK, x_BET], dim=2)
        if state is not None:
            state.conv_LBEK[layer_idx] = padded_BET[:, :, -(K - 1):] if K > 1 else padded_BET[:, :, :0]
        x_BTE = F.silu(self.conv1d(padded_BET)).transpose(1, 2)  # the module call: ZeRO-3 gathers its weights
        if mask_BT is not None:
            x_BTE = x_BTE * mask_BT.unsqueeze(-1).to(x_BTE.dtype)

        delta_low_BTR, B_BTN, C_BTN = torch.split(self.x_proj(x_BTE), [self.dt_rank, self.state_size, self.state_size], dim=-1)
        delta_BTE = F.softplus(self.dt_proj(delta_low_BTR).float())
        A_EN = -torch.exp(self.A_log.float())
        h0_BEN = None if state is None else state.ssm_LBEN[layer_idx]
        if state is not None and T == 1:  # one token: the recurrence itself
            dA_BEN = torch.exp(delta_BTE[:, 0, :, None] * A_EN)
            h_BEN = dA_BEN * h0_BEN + (delta_BTE[:, 0] * x_BTE[:, 0].float())[..., None] * B_BTN[:, 0, None, :].float()
            y_BTE = (h_BEN * C_BTN[:, 0, None, :].float()).sum(-1).unsqueeze(1)  # fp32, also under autocast
        else:
            y_BTE, h_BEN = selective_scan(x_BTE, delta_BTE, A_EN, B_BTN, C_BTN, h0_BEN, self.scan_chunk)
        if state is not None:
            state.ssm_LBEN[layer_idx] = h_BEN
        y_BTE = (y_BTE + x_BTE.float() * self.D.float()) * F.silu(z_BTE.float())
        return self.out_proj(y_BTE.to(x_BTD.dtype))


class MambaBlock(nn.Module):
    """Pre-norm residual block around a `MambaMixer`: x + drop(mixer(rmsnorm(x)))."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mixer = MambaMixer(cfg)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, mask_BT: torch.Tensor | None, state: MambaState | None) -> torch.Tensor:
        return x_BTD + self.resid_dropout(self.mixer(self.norm(x_BTD), mask_BT, state, self.layer_idx))


class MambaLM(nn.Module):
    """Mamba language model configured by a `ModelConfig` with arch 'mamba'.

    It answers the Transformer's calls (`forward(ids, attention_mask_BT, kv_cache)` returning a
    `ModelOutput`, `new_kv_cache`, `init_weights`, `tie_weights`, `layers`), so training, generation
    and serving take either.

    Args:
        cfg: the model config.
    """

    ARCH = "mamba"  # the family's name in the table (models.families), as its Family record spells it
    BLOCK: type = None  # MambaBlock (set below); models.families.mamba2.model.Mamba2LM sets its own blocks and state
    STATE: type = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not isinstance(cfg, ModelConfig) or cfg.arch != self.ARCH:
            raise ValueError(f"{type(self).__name__} expects a ModelConfig of its arch, got {cfg!r}")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.emb_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(self.BLOCK(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make lm_head share tok_embeddings' Parameter when cfg.tie_embeddings (idempotent)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Set every parameter: linears and the embedding ~ normal(0, init_std) with zero biases,
        out_proj ~ normal(0, init_std / sqrt(n_layers)) (one residual branch per block, GPT-2's
        rule), norms 1, and the SSM dynamics as `MambaMixer.init_dynamics`."""
        self.tie_weights()
        std = self.cfg.init_std
        init_base(self, std, generator)
        for block in self.layers:
            nn.init.normal_(block.mixer.out_proj.weight, 0.0, std / math.sqrt(self.cfg.n_layers), generator=generator)
            block.mixer.init_dynamics(generator)

    def forward(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor | None = None,
        kv_cache: MambaState | None = None,
        return_attention: bool = False,
        targets_BT: torch.Tensor | None = None,
        **loss_options,
    ) -> ModelOutput:
        """Next-token logits for every input position, or with ``targets_BT`` their loss.

        Args:
            input_ids_BT: token ids.
            attention_mask_BT: 1 = real token, 0 = pad (left padding); None = all real.
            kv_cache: a `MambaState` to continue from and update (generation), or None.
            return_attention: must be False (Mamba has no attention weights).
            targets_BT, loss_options: as ``Transformer.forward``'s.

        Returns:
            models.families.decoder.model.ModelOutput (zero aux_loss, no MoE stats).

        Raises:
            ValueError: on bad shapes, return_attention, or a sequence longer than max_seq_len.
        """
        if return_attention:
            raise ValueError("return_attention: arch 'mamba' has no attention weights")
        if input_ids_BT.dim() != 2:
            raise ValueError(f"input_ids_BT must be 2-D (B, T), got shape {tuple(input_ids_BT.shape)}")
        if attention_mask_BT is not None and attention_mask_BT.shape != input_ids_BT.shape:
            raise ValueError(
                f"attention_mask_BT shape {tuple(attention_mask_BT.shape)} != input shape {tuple(input_ids_BT.shape)}"
            )
        T = input_ids_BT.shape[1]
        real_B = (torch.full((input_ids_BT.shape[0],), T, dtype=torch.long) if attention_mask_BT is None
                  else attention_mask_BT.to(device="cpu", dtype=torch.long).sum(dim=1))
        past_B = kv_cache.next_pos_B.cpu() if kv_cache is not None else torch.zeros_like(real_B)
        if len(real_B) and int((past_B + real_B).max()) > self.cfg.max_seq_len:  # each row's real tokens
            row = int((past_B + real_B).argmax())
            raise ValueError(f"sequence length {int(past_B[row])} cached + {int(real_B[row])} new exceeds "
                             f"max_seq_len {self.cfg.max_seq_len}")
        x_BTD = self.emb_dropout(self.tok_embeddings(input_ids_BT))
        for block in self.layers:
            x_BTD = block(x_BTD, attention_mask_BT, kv_cache)
        if kv_cache is not None:
            kv_cache.length += T
            kv_cache.next_pos_B = kv_cache.next_pos_B + real_B.to(kv_cache.next_pos_B.device)
        logits_BTV, loss = self.output(x_BTD, targets_BT, loss_options)
        aux_loss = torch.zeros((), device=input_ids_BT.device, dtype=torch.float32)
        return ModelOutput(logits_BTV, aux_loss, [], None, kv_cache, loss)

    def output(self, x_BTD: torch.Tensor, targets_BT: torch.Tensor | None,
               loss_options: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The final norm and the head, as ``Transformer.output``."""
        return head_output(self.lm_head, self.norm(x_BTD), targets_BT, loss_options)

    def new_kv_cache(self, batch_size: int, max_len: int | None = None) -> MambaState:
        """An empty generation state on this model's device and dtype. Its size does not depend on
        the length, so max_len is only accepted for the Transformer's signature."""
        p = self.tok_embeddings.weight
        return self.STATE(self.cfg, batch_size, device=p.device, dtype=p.dtype)


MambaLM.BLOCK, MambaLM.STATE = MambaBlock, MambaState
