"""Which implementation runs the Gated DeltaNet's token mixing (``model.linear_kernel``), and the
flash-linear-attention path itself.

- ``torch``: our plain-PyTorch forms (``delta_rule.py``): the chunked rule, the short convolutions.
- ``fla``: flash-linear-attention's Triton kernels (the optional dependency ``fla-core``, import name
  ``fla``; ``pip install 'meshwright[fla]'``): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
  for the rule and ``fla.modules.causal_conv1d.causal_conv1d`` for the convolutions (SiLU fused).
  Needs CUDA; forcing it without CUDA or without the package is a ``ConfigError`` at start-up
  (``check_linear_kernel``, through ``ModelSpec.device_check``).
- ``auto`` (default): ``fla`` where the tensors are on CUDA and the package is importable, else
  ``torch``: a CPU run, a rehearsal (fake CPU tensors) and a machine without the package take the
  torch form.

The fla path computes the same function: q and k L2-normalised inside the kernel (its ``l2norm``:
``x / sqrt(sum x^2 + 1e-6)``, ours), q scaled by dk^-1/2, value head j reading key head
j // (nv / nk) (the key heads are repeated to the value heads before the call, as transformers does
for Qwen3-Next), the state (dk, dv) per value head, fp32 states. Documents (``resets``) become
fla's variable-length form: the batch flattened to one row and ``cu_seqlens`` at every document
start and row start (one host read of the starts per call). Its chunk is fla's own (64): the chunk
is a speed knob, the result is the same. Under context parallelism the core keeps the torch
two-pass form (fla's kernels return a final state but not the state transition M that the
prefix combination needs: ``DeltaRuleCore``). The comparison of the two on CUDA (forward and
gradients) is ``benchmarks/gpu_check.py``'s ``delta_rule_fla`` part.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import torch
from torch import Tensor

from models.errors import ConfigError

__all__ = [
    "LINEAR_KERNELS",
    "check_linear_kernel",
    "fla_conv",
    "fla_gated_delta_rule",
    "fla_installed",
    "uses_fla",
]

LINEAR_KERNELS = ("auto", "torch", "fla")
FLA_CHUNK = 64  # fla's chunk for the gated delta rule (16, 32 or 64)


def fla_installed() -> bool:
    """Whether flash-linear-attention (import name ``fla``) can be imported here."""
    return importlib.util.find_spec("fla") is not None


def check_linear_kernel(kernel: str, device_type: str) -> None:
    """``ConfigError`` for a ``model.linear_kernel`` that cannot run on ``device_type``: an unknown
    name, or ``fla`` forced without CUDA or without the package. ``auto`` and ``torch`` always run."""
    if kernel not in LINEAR_KERNELS:
        raise ConfigError(f"model.linear_kernel={kernel!r} must be one of {', '.join(LINEAR_KERNELS)}.")
    if kernel != "fla":
        return
    if device_type != "cuda":
        raise ConfigError(
            f"model.linear_kernel=fla needs CUDA (flash-linear-attention's Triton kernels); this run is on "
            f"{device_type}. Set model.linear_kernel=auto (fla on CUDA when installed, else the torch form) "
            "or torch."
        )
    if not fla_installed():
        raise ConfigError(
            "model.linear_kernel=fla but flash-linear-attention is not installed (import name fla): "
            "pip install 'meshwright[fla]' (fla-core), or set model.linear_kernel=auto or torch."
        )


def uses_fla(kernel: str, x: Tensor) -> bool:
    """Whether the Gated DeltaNet runs fla's kernels on ``x``: ``fla`` always (checked at start-up),
    ``auto`` when ``x`` is on CUDA and fla is importable, ``torch`` never."""
    if kernel == "torch":
        return False
    if kernel == "fla":
        if x.device.type != "cuda":
            raise ValueError(f"model.linear_kernel=fla with tensors on {x.device}: fla's kernels need CUDA")
        return True
    return x.device.type == "cuda" and fla_installed()


def _cu_seqlens(resets: Tensor) -> Tensor:
    """Document boundaries of the flattened (1, B*S) batch: every row start and every document start,
    then the end (int64, fla's ``cu_seqlens``)."""
    B, S = resets.shape
    starts = resets.clone()
    starts[:, 0] = True
    idx = starts.reshape(-1).nonzero().flatten()  # one host read (the count of documents)
    return torch.cat([idx, idx.new_tensor([B * S])])


def fla_conv(x: Tensor, weight: Tensor, resets: Optional[Tensor] = None) -> Tensor:
    """``delta_rule.short_conv`` (no tail) by fla's causal conv1d with the SiLU fused: ``x`` (B, S, C),
    ``weight`` (C, 1, K); documents restart at ``resets`` (B, S) through ``cu_seqlens``."""
    from fla.modules.causal_conv1d import causal_conv1d

    B, S, C = x.shape
    w = weight[:, 0].to(x.dtype)  # (C, K)
    if resets is None:
        y, _ = causal_conv1d(x, w, activation="silu")
        return y
    y, _ = causal_conv1d(x.reshape(1, B * S, C), w, activation="silu", cu_seqlens=_cu_seqlens(resets))
    return y.reshape(B, S, C)


def fla_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    initial_state: Optional[Tensor] = None,
    resets: Optional[Tensor] = None,
    final_state: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """``delta_rule.chunk_gated_delta_rule`` by fla's chunked kernel, same arguments (q/k (B, S, nk, dk)
    before the L2 norm, v (B, S, nv, dv), g and beta (B, S, nv), ``initial_state`` (B, nv, dk, dv),
    ``resets`` (B, S) document starts) -> (o (B, S, nv, dv) in v's dtype, the fp32 final state when
    ``final_state``, else None). With documents the state restarts at each one and no initial state
    may be given (training)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    B, S, nv, dv = v.shape
    nk = k.shape[2]
    if nv != nk:  # value head j reads key head j // (nv / nk)
        q = q.repeat_interleave(nv // nk, dim=2)
        k = k.repeat_interleave(nv // nk, dim=2)
    q, k = q.to(v.dtype), k.to(v.dtype)
    state = None if initial_state is None else initial_state.float()
    if resets is None:
        o, last = chunk_gated_delta_rule(
            q,
            k,
            v,
            g.float(),
            beta.to(v.dtype),
            initial_state=state,
            output_final_state=final_state,
            use_qk_l2norm_in_kernel=True,
        )
        return o.to(v.dtype), last
    if state is not None or final_state:
        raise ValueError("the fla path with documents (resets) takes no initial state and returns none")
    flat = [t.reshape(1, B * S, *t.shape[2:]) for t in (q, k, v, g.float(), beta.to(v.dtype))]
    o, _ = chunk_gated_delta_rule(*flat, use_qk_l2norm_in_kernel=True, cu_seqlens=_cu_seqlens(resets))
    return o.reshape(B, S, nv, dv).to(v.dtype), None
