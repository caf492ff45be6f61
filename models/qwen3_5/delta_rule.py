"""The gated delta rule (Yang, Kautz & Hatamizadeh, "Gated Delta Networks", 2024) and its short causal
convolution, in plain PyTorch: the chunked form for training and prefill, the token-by-token recurrent
form for generation, both with document restarts. Free of any parallelism.

Per value head, with a key-sized state ``S`` (dk, dv), for each token t (q and k L2-normalised, q
scaled by dk^-1/2)::

    S_t = exp(g_t) S_{t-1}                          decay (g_t <= 0, per head)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T       delta-rule write of the correction
    o_t = S_t^T q_t

Chunked form (chunk of C tokens, state S0 at its start, gamma_i = g_1 + ... + g_i inside the chunk).
Unrolling the recurrence, the written values u_t = beta_t (v_t - (decayed state)^T k_t) satisfy the
unit lower-triangular system ``(I + A) U = beta V - (beta exp(gamma) K) S0`` with
``A_ij = beta_i exp(gamma_i - gamma_j) k_i . k_j`` for j < i; one triangular solve per chunk gives
``U0 = (I + A)^-1 beta V`` and ``W = (I + A)^-1 beta exp(gamma) K``, then, chunk after chunk::

    U   = U0 - W S0
    O   = exp(gamma) Q S0 + ((Q K^T) * exp(gamma_i - gamma_j) [j <= i]) U
    S1  = exp(gamma_C) S0 + (K * exp(gamma_C - gamma))^T U

Every exponent is <= 0 (the upper triangle is masked before ``exp``), so nothing overflows. The
intra-chunk work is batched over all chunks; only the state passes sequentially (S / C steps).

Documents (``resets``: True where a packed document starts): the state and the convolution window
restart there. Inside a chunk, ``r`` counts the resets up to each token; pairs with different ``r``
do not interact, tokens with ``r > 0`` do not read S0, and only tokens of the chunk's last document
write S1 (S0 survives only when no document starts in the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ChunkTerms",
    "chunk_gated_delta_rule",
    "chunk_terms",
    "scan_chunks",
    "state_transition",
    "recurrent_gated_delta_rule",
    "short_conv",
    "l2norm",
]


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' rule)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def short_conv(
    x: Tensor,
    weight: Tensor,
    tail: Optional[Tensor] = None,
    resets: Optional[Tensor] = None,
    tail_resets: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """Causal depthwise convolution then SiLU: ``y_t = silu(sum_s w[:, K-1-s] x_{t-s})``.

    ``x`` (B, S, C); ``weight`` (C, 1, K) (``nn.Conv1d``'s depthwise layout); ``tail`` (B, K-1, C):
    the K-1 inputs before ``x`` (a generation cache, a previous context-parallel rank), zeros when
    None; ``resets`` (B, S) bool: document starts, where the window restarts (inputs of an earlier
    document, the tail included, are not seen); ``tail_resets`` (B, K-1): the document starts among
    the tail's tokens (a tail from another rank may hold one), none when None. Returns (y (B, S, C),
    the new tail: the last K-1 inputs)."""
    B, S, C = x.shape
    K = weight.shape[-1]
    if tail is None:
        tail = x.new_zeros(B, K - 1, C)
    xx = torch.cat([tail.to(x.dtype), x], dim=1)  # (B, K-1+S, C)
    new_tail = xx[:, xx.shape[1] - (K - 1) :]
    if resets is None:
        y = F.conv1d(xx.transpose(1, 2), weight.to(x.dtype), groups=C).transpose(1, 2)  # (B, S, C)
    else:
        before = tail_resets if tail_resets is not None else resets.new_zeros(B, K - 1)
        doc_all = torch.cat([before, resets], dim=1).long().cumsum(1)  # (B, K-1+S) document of each token
        doc = doc_all[:, K - 1 :]  # (B, S)
        w = weight[:, 0].to(x.dtype)  # (C, K)
        y = x.new_zeros(B, S, C)
        for s in range(K):  # tap s reads the input s tokens back
            src = xx[:, K - 1 - s : K - 1 - s + S]  # (B, S, C)
            same = (doc_all[:, K - 1 - s : K - 1 - s + S] == doc).unsqueeze(-1)  # (B, S, 1)
            y = y + src * same.to(x.dtype) * w[:, K - 1 - s]
    return F.silu(y), new_tail


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fp32 (B, h, S, .) tensors: q/k L2-normalised, q scaled by dk^-1/2, q/k heads repeated to the
    value heads (value head j reads key head j // (nv / nk))."""
    nk, nv = k.shape[2], v.shape[2]
    q, k = l2norm(q.float()), l2norm(k.float())
    q = q * q.shape[-1] ** -0.5
    if nv != nk:
        q = q.repeat_interleave(nv // nk, dim=2)
        k = k.repeat_interleave(nv // nk, dim=2)
    return (
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.float().transpose(1, 2),
        g.float().transpose(1, 2),
        beta.float().transpose(1, 2),
    )


@dataclass
class ChunkTerms:
    """The intra-chunk quantities of the chunked rule (module doc), computed at once for every chunk of
    a sequence, fp32, (B, h, n, C, .): what the sequential pass over the chunks needs."""

    u0: Tensor  # (I + A)^-1 beta V
    w: Tensor  # (I + A)^-1 beta exp(gamma) K (rows of tokens that read the incoming state)
    attn: Tensor  # (Q K^T) * exp(gamma_i - gamma_j) [j <= i, same document]
    q_read: Tensor  # Q * exp(gamma) (tokens that read the incoming state)
    k_write: Tensor  # K * exp(gamma_C - gamma) (tokens of the chunk's last document)
    keep: Tensor  # (B, h, n): the chunk's decay of the incoming state (0 if a document starts in it)
    seq_len: int
    out_dtype: torch.dtype

    def initial(self, state: Optional[Tensor]) -> Tensor:
        B, h, _, _, dk = self.w.shape
        dv = self.u0.shape[-1]
        return self.w.new_zeros(B, h, dk, dv) if state is None else state.to(self.w.dtype)


def chunk_terms(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    resets: Optional[Tensor] = None,
) -> ChunkTerms:
    """``ChunkTerms`` of a sequence (arguments as ``chunk_gated_delta_rule``)."""
    out_dtype = v.dtype
    B, S, nv, dv = v.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # (B, h, S, d), g/beta (B, h, S)
    C = chunk_size
    pad = (-S) % C
    if pad:  # zero keys, values, beta and decay leave the state as it is
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (S + pad) // C
    q, k, v = (t.reshape(B, nv, n, C, -1) for t in (q, k, v))  # (B, h, n, C, d)
    g, beta = g.reshape(B, nv, n, C), beta.reshape(B, nv, n, C)

    gamma = g.cumsum(-1)  # (B, h, n, C)
    diff = gamma[..., :, None] - gamma[..., None, :]  # (B, h, n, C, C): gamma_i - gamma_j
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # j <= i
    strict = lower.clone().fill_diagonal_(False)  # j < i
    cont: Optional[Tensor] = None
    to_last: Optional[Tensor] = None
    if resets is not None:
        r = F.pad(resets.long(), (0, pad)).reshape(B, 1, n, C).cumsum(-1)  # resets so far in the chunk
        same = r[..., :, None] == r[..., None, :]  # (B, 1, n, C, C)
        lower_m, strict_m = lower & same, strict & same
        cont = (r == 0).float()  # (B, 1, n, C): the token reads the chunk's incoming state
        to_last = (r == r[..., -1:]).float()  # the token is of the chunk's last document
    else:
        lower_m, strict_m = lower, strict
    neg_inf = float("-inf")
    decay_lower = diff.masked_fill(~lower_m, neg_inf).exp()  # (B, h, n, C, C)
    decay_strict = diff.masked_fill(~strict_m, neg_inf).exp()

    k_beta = k * beta[..., None]
    a = (k_beta @ k.transpose(-1, -2)) * decay_strict  # (B, h, n, C, C), strictly lower
    eye = torch.eye(C, dtype=a.dtype, device=a.device)
    read_decay = gamma.exp() if cont is None else gamma.exp() * cont  # (B, h, n, C)
    rhs = torch.cat([v * beta[..., None], k_beta * read_decay[..., None]], dim=-1)  # (B, h, n, C, dv+dk)
    solved = torch.linalg.solve_triangular(a + eye, rhs, upper=False, unitriangular=True)
    write_decay = (gamma[..., -1:] - gamma).exp()  # (B, h, n, C)
    if to_last is not None:
        write_decay = write_decay * to_last
    keep = gamma[..., -1].exp()  # (B, h, n)
    if cont is not None:
        keep = keep * cont[..., -1]
    return ChunkTerms(
        u0=solved[..., :dv],
        w=solved[..., dv:],
        attn=(q @ k.transpose(-1, -2)) * decay_lower,
        q_read=q * read_decay[..., None],
        k_write=k * write_decay[..., None],
        keep=keep,
        seq_len=S,
        out_dtype=out_dtype,
    )


def scan_chunks(t: ChunkTerms, initial_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The sequential pass: chunk after chunk from ``initial_state`` -> (o (B, S, h, dv), final state)."""
    state = t.initial(initial_state)  # (B, h, dk, dv)
    n = t.keep.shape[2]
    outs = []
    for i in range(n):
        u = t.u0[:, :, i] - t.w[:, :, i] @ state  # (B, h, C, dv)
        outs.append(t.q_read[:, :, i] @ state + t.attn[:, :, i] @ u)
        state = state * t.keep[:, :, i, None, None] + t.k_write[:, :, i].transpose(-1, -2) @ u
    B, h, _, C, dv = t.u0.shape
    o = torch.stack(outs, dim=2).reshape(B, h, n * C, dv)[:, :, : t.seq_len]  # (B, h, S, dv)
    return o.transpose(1, 2).to(t.out_dtype), state


def state_transition(t: ChunkTerms) -> tuple[Tensor, Tensor]:
    """The sequence's effect on a state handed in: ``final = M @ S0 + S`` for any initial state S0, as
    (M (B, h, dk, dk), S (B, h, dk, dv)). Per chunk ``S1 = A S0 + k_write^T u0`` with
    ``A = keep I - k_write^T W``; M and S compose the chunks in order. The two-pass form of context
    parallelism: each rank's (M, S) from zero, a prefix combination over the ranks gives each rank its
    incoming state, then ``scan_chunks`` from it (the chunk terms are computed once)."""
    B, h, n, C, dk = t.w.shape
    eye = torch.eye(dk, dtype=t.w.dtype, device=t.w.device)
    m = eye.expand(B, h, dk, dk)
    s = t.w.new_zeros(B, h, dk, t.u0.shape[-1])
    for i in range(n):
        kw = t.k_write[:, :, i].transpose(-1, -2)  # (B, h, dk, C)
        a = t.keep[:, :, i, None, None] * eye - kw @ t.w[:, :, i]  # (B, h, dk, dk)
        m = a @ m
        s = a @ s + kw @ t.u0[:, :, i]
    return m, s


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    chunk_size: int = 64,
    initial_state: Optional[Tensor] = None,
    resets: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The chunked gated delta rule (module doc). ``q``/``k`` (B, S, nk, dk), ``v`` (B, S, nv, dv),
    ``g`` (log decay, <= 0) and ``beta`` (B, S, nv); ``initial_state`` (B, nv, dk, dv) or None (zeros);
    ``resets`` (B, S) bool or None. Returns (o (B, S, nv, dv) in v's dtype, final state fp32)."""
    terms = chunk_terms(q, k, v, g, beta, chunk_size=chunk_size, resets=resets)
    return scan_chunks(terms, initial_state)


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Optional[Tensor] = None,
    resets: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token (generation: one token per call), same arguments and
    results as ``chunk_gated_delta_rule``."""
    out_dtype = v.dtype
    B, S, nv, dv = v.shape
    q, k, v, g, beta = _prepare(q, k, v, g, beta)  # (B, h, S, d)
    state = (
        q.new_zeros(B, nv, k.shape[-1], dv) if initial_state is None else initial_state.to(q.dtype)
    )  # (B, h, dk, dv)
    decay = g.exp()  # (B, h, S)
    if resets is not None:
        decay = decay * (~resets).to(decay.dtype)[:, None, :]  # a document start forgets the state
    outs = []
    for t in range(S):
        state = state * decay[:, :, t, None, None]
        k_t = k[:, :, t]  # (B, h, dk)
        delta = (v[:, :, t] - (state * k_t[..., None]).sum(-2)) * beta[:, :, t, None]  # (B, h, dv)
        state = state + k_t[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))  # (B, h, dv)
    o = torch.stack(outs, dim=2)  # (B, h, S, dv)
    return o.transpose(1, 2).to(out_dtype), state
