"""The Gated DeltaNet layer of the Qwen3.5 family (Qwen3.5's ``linear_attn``), free of any parallelism:
the projections, short causal convolutions, per-head decay and write strength, the gated per-head
RMSNorm, and its swappable cores: ``DeltaRuleCore`` for training (the chunked gated delta rule of
``delta_rule.py``, flash-linear-attention's kernels on CUDA per ``model.linear_kernel``:
``kernels.py``; the two-pass context-parallel hand-off) and ``RecurrentCacheCore`` for generation.
Split from ``model.py`` (the decoder, its blocks and counts), which re-exports these names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import RecurrentCore, validate_attention_mask
from models.common import ParamInit, RMSNorm
from models.moe.experts import _local
from models.qwen3_5.args import Qwen3_5Args
from models.qwen3_5.delta_rule import (
    chunk_gated_delta_rule,
    chunk_terms,
    recurrent_gated_delta_rule,
    scan_chunks,
    short_conv,
    state_transition,
)
from models.qwen3_5.kernels import fla_conv, fla_gated_delta_rule, uses_fla

__all__ = ["Decay", "DeltaRuleCore", "GatedDeltaNet", "RecurrentCacheCore", "ShortConv", "document_starts"]

# --------------------------------------------------------------------------------------------
# Gated DeltaNet
# --------------------------------------------------------------------------------------------


def document_starts(positions: Optional[Tensor], batch: int, seq_len: int) -> Optional[Tensor]:
    """(B, S) bool: where a packed document starts (its position is 0, ``models/attention.py``'s rule);
    None without positions (one document). A start on the window's first token changes nothing
    during training (the state starts at zero there); a state handed in from before the window is
    continued only by a first token whose position is not 0."""
    if positions is None:
        return None
    pos = positions if positions.dim() == 2 else positions[None]
    return (pos == 0).expand(batch, seq_len)


class DeltaRuleCore(RecurrentCore):
    """Training core of the Gated DeltaNet: short convolutions (+ SiLU) over the projected q, k, v, then
    the chunked gated delta rule, restarting both at document starts under ``block_causal``.
    Parameterless and shared by the model's DeltaNet layers (like ``AttentionCore``); generation swaps
    it for ``RecurrentCacheCore``. Under context parallelism (``handoff`` set: each cp rank holds a
    contiguous slice) it runs the two-pass form: the convolutions read the previous rank's last K-1
    inputs (and their document starts); the rule computes this slice's chunk terms and its effect on a
    handed-in state (``state_transition``: M, S from zero), the hand-off combines the previous ranks'
    into this rank's incoming state, and the scan runs from it. Cost over one process: per layer and
    rank an all-gather of nv (dk^2 + dk dv) numbers per sequence (M and S) and of 3 (K-1) tokens of
    conv inputs, and one dk x dk product per chunk for M; the chunk terms are computed once."""

    def __init__(self, attention_mask: str = "causal", chunk_size: int = 64, kernel: str = "auto") -> None:
        super().__init__()
        validate_attention_mask(attention_mask)
        self.attention_mask = attention_mask
        self.chunk_size = chunk_size
        self.kernel = kernel  # model.linear_kernel: auto | torch | fla (kernels.py)

    def resets(self, positions: Optional[Tensor], batch: int, seq_len: int) -> Optional[Tensor]:
        """Document starts under ``block_causal``, else None (one stream, as softmax attention's
        causal mask)."""
        if self.attention_mask != "block_causal":
            return None
        return document_starts(positions, batch, seq_len)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        conv: Sequence[Tensor],
        head_dims: tuple[int, int],
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        """``q``/``k`` (B, S, nk*dk), ``v`` (B, S, nv*dv) before the convolutions (weights ``conv``,
        (C, 1, K) each); ``g``/``beta`` (B, S, nv); ``head_dims`` (dk, dv) -> (B, S, nv, dv)."""
        B, S, _ = q.shape
        resets = self.resets(positions, B, S)
        dk, dv = head_dims
        if self.handoff is None and uses_fla(self.kernel, q):  # flash-linear-attention's kernels
            q, k, v = (fla_conv(t, w, resets) for t, w in zip((q, k, v), conv))
            o_fla, _ = fla_gated_delta_rule(
                q.view(B, S, -1, dk), k.view(B, S, -1, dk), v.view(B, S, -1, dv), g, beta, resets=resets
            )
            return o_fla
        if self.handoff is None:
            q, k, v = (short_conv(t, w, resets=resets)[0] for t, w in zip((q, k, v), conv))
            o, _ = chunk_gated_delta_rule(
                q.view(B, S, -1, dk),
                k.view(B, S, -1, dk),
                v.view(B, S, -1, dv),
                g,
                beta,
                chunk_size=self.chunk_size,
                resets=resets,
            )
            return o
        K = conv[0].shape[-1]
        if S < K - 1:
            raise ValueError(
                f"a context-parallel slice of {S} tokens is shorter than the convolution's window of "
                f"{K - 1}; use fewer cp ranks or longer sequences"
            )
        handoff = self.handoff
        tail_resets = None
        if resets is not None:
            before = handoff.previous(resets[:, S - (K - 1) :].float())
            tail_resets = before > 0.5 if before is not None else None
        q, k, v = (
            short_conv(t, w, handoff.previous(t[:, S - (K - 1) :]), resets, tail_resets)[0]
            for t, w in zip((q, k, v), conv)
        )
        terms = chunk_terms(
            q.view(B, S, -1, dk),
            k.view(B, S, -1, dk),
            v.view(B, S, -1, dv),
            g,
            beta,
            chunk_size=self.chunk_size,
            resets=resets,
        )
        m, s = state_transition(terms)
        o, _ = scan_chunks(terms, handoff.incoming_state(m, s))
        return o

    def extra_repr(self) -> str:
        return f"attention_mask={self.attention_mask}, chunk_size={self.chunk_size}, kernel={self.kernel}"


class RecurrentCacheCore(nn.Module):
    """Generation core of one Gated DeltaNet layer: keeps the K-1 last inputs of each convolution and
    the recurrent state (B, nv, dk, dv) of the tokens seen so far, instead of keys and values. A call
    of several tokens (a prefill) runs the chunked rule from the kept state, one token the recurrent
    step. Call ``reset()`` before a new sequence (``models/generation.py``)."""

    def __init__(self, max_len: int, chunk_size: int = 64, kernel: str = "auto") -> None:
        super().__init__()
        self.max_len = max_len
        self.chunk_size = chunk_size
        self.kernel = kernel  # the prefill's chunked rule: fla's kernel on CUDA per model.linear_kernel
        self.tails: Optional[list[Tensor]] = None
        self.state: Optional[Tensor] = None
        self.length = 0

    def reset(self) -> None:
        """Forget the sequence (the next call starts from zero state)."""
        self.tails, self.state, self.length = None, None, 0

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        *,
        conv: Sequence[Tensor],
        head_dims: tuple[int, int],
        positions: Optional[Tensor] = None,
    ) -> Tensor:
        B, S, _ = q.shape
        if self.length + S > self.max_len:
            raise ValueError(
                f"recurrent cache of {self.max_len} positions is full; reset it and prefill again"
            )
        tails = self.tails if self.tails is not None else [None, None, None]
        outs = [short_conv(t, w, tail) for t, w, tail in zip((q, k, v), conv, tails)]
        self.tails = [tail for _, tail in outs]
        dk, dv = head_dims
        qc, kc, vc = (y.view(B, S, -1, d) for (y, _), d in zip(outs, (dk, dk, dv)))
        if S == 1 and self.state is not None:
            o, self.state = recurrent_gated_delta_rule(qc, kc, vc, g, beta, initial_state=self.state)
        elif uses_fla(self.kernel, qc):
            o, last = fla_gated_delta_rule(qc, kc, vc, g, beta, initial_state=self.state, final_state=True)
            assert last is not None  # asked for
            self.state = last
        else:
            o, self.state = chunk_gated_delta_rule(
                qc, kc, vc, g, beta, chunk_size=self.chunk_size, initial_state=self.state
            )
        self.length += S
        return o


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3.5's ``linear_attn``): projections, the core (convolutions and
    delta rule), the gated per-head RMSNorm and the output projection.

    Head counts are read from tensor shapes (``wq`` / ``wv`` rows), so a tensor-parallel column shard
    of the projections, convolutions, ``A_log`` and ``dt_bias`` yields fewer local heads."""

    def __init__(self, args: Qwen3_5Args, core: Optional[nn.Module] = None) -> None:
        super().__init__()
        H, K = args.dim, args.linear_conv_kernel
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        key_dim = args.linear_num_key_heads * self.head_k_dim
        value_dim = args.linear_num_value_heads * self.head_v_dim
        nv = args.linear_num_value_heads
        self.wq = nn.Linear(H, key_dim, bias=False)
        self.wk = nn.Linear(H, key_dim, bias=False)
        self.wv = nn.Linear(H, value_dim, bias=False)
        self.wz = nn.Linear(H, value_dim, bias=False)
        self.wb = nn.Linear(H, nv, bias=False)
        self.wa = nn.Linear(H, nv, bias=False)
        self.q_conv = ShortConv(key_dim, K)
        self.k_conv = ShortConv(key_dim, K)
        self.v_conv = ShortConv(value_dim, K)
        self.decay = Decay(nv)
        self.norm = RMSNorm(self.head_v_dim, eps=args.norm_eps)
        self.wo = nn.Linear(value_dim, H, bias=False)
        self.core = (
            core
            if core is not None
            else DeltaRuleCore(args.attention_mask, args.linear_chunk_size, args.linear_kernel)
        )

    def init_weights(self, init: ParamInit, prefix: str, std: float, out_std: float) -> None:
        """Projections like Llama's attention (truncated normal, ``wo`` depth-scaled); convolutions
        uniform(+-1/sqrt(K)) (``nn.Conv1d``'s default for a depthwise kernel); the decay as ``Decay``;
        the norm gain ones."""
        for proj in ("wq", "wk", "wv", "wz", "wb", "wa"):
            init.trunc_normal(f"{prefix}.{proj}.weight", getattr(self, proj).weight, std, 2.0)
        init.trunc_normal(f"{prefix}.wo.weight", self.wo.weight, out_std, 2.0)
        for conv in ("q_conv", "k_conv", "v_conv"):
            module: ShortConv = getattr(self, conv)
            module.init_weights(init, f"{prefix}.{conv}")
        self.decay.init_weights(init, f"{prefix}.decay")
        self.norm.init_weights(init, f"{prefix}.norm")

    def forward(self, x: Tensor, *, rope_cache: Tensor, positions: Optional[Tensor] = None) -> Tensor:
        """``x`` (B, S, H) -> (B, S, H); ``rope_cache`` unused (the recurrence is position-free)."""
        B, S, _ = x.shape
        z = self.wz(x).view(B, S, -1, self.head_v_dim)  # (B, S, nv, dv)
        beta = torch.sigmoid(self.wb(x))  # (B, S, nv)
        g = self.decay(self.wa(x))  # (B, S, nv) fp32, <= 0
        o = self.core(
            self.wq(x),
            self.wk(x),
            self.wv(x),
            g,
            beta,
            conv=tuple(_local(c.weight) for c in (self.q_conv, self.k_conv, self.v_conv)),
            head_dims=(self.head_k_dim, self.head_v_dim),
            positions=positions,
        )  # (B, S, nv, dv)
        o = (self.norm(o).float() * F.silu(z.float())).type_as(o)  # gated RMSNorm of each head
        return self.wo(o.reshape(B, S, -1))


class Decay(nn.Module):
    """The per-value-head decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32, <= 0) of a token's
    ``a`` (B, S, nv): Mamba-2's discretisation. Its two vectors are per head: tensor parallelism
    shards them with the heads and this module reads its local rows."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.empty(heads))
        self.dt_bias = nn.Parameter(torch.empty(heads))

    def init_weights(self, init: ParamInit, prefix: str) -> None:
        """As flash-linear-attention initialises Gated DeltaNet (Mamba-2's scheme): ``A`` ~ U(1, 16)
        (``A_log`` its log), ``dt_bias`` the inverse softplus of ``dt`` ~ logU(1e-3, 1e-1)."""
        init.fill(f"{prefix}.A_log", self.A_log, lambda t, g: t.uniform_(1.0, 16.0, generator=g).log_())

        def dt_bias(t: Tensor, g: torch.Generator) -> None:
            dt = torch.exp(t.uniform_(generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            t.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt

        init.fill(f"{prefix}.dt_bias", self.dt_bias, dt_bias)

    def forward(self, a: Tensor) -> Tensor:
        A_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
        return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())


class ShortConv(nn.Module):
    """The weight (C, 1, K) of a causal depthwise convolution (``nn.Conv1d``'s layout); the core
    applies it (``delta_rule.short_conv``), so a cache or a context-parallel hand-off can feed it the
    inputs that came before."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def init_weights(self, init: ParamInit, prefix: str) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[-1])
        init.fill(f"{prefix}.weight", self.weight, lambda t, g: t.uniform_(-bound, bound, generator=g))
