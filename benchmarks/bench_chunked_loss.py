"""Peak memory of the loss with and without ``training.loss_chunk_size``: the output head + soft-cap +
cross-entropy + z-loss over (B, S, H) hidden states, forward and backward, the whole logits against
chunks. On CUDA: ``torch.cuda.max_memory_allocated``. On the CPU (no allocator statistics; torch's
``MemTracker`` refuses a module called more than once per step, which is what chunking does): the peak
of live tensor storages created during the call, seen by a ``TorchDispatchMode`` (every op's outputs,
each storage counted once until it is freed).

    python benchmarks/bench_chunked_loss.py [--vocab 32768] [--seq 512] [--dim 256] [--batch 1] [--chunk 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from models.common import OutputHead
from trainer.step import TokenLoss


class LiveStorages(TorchDispatchMode):
    """Peak bytes of the storages that ops create while active (freed ones leave the count)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key and key not in self.live:
                    self.live[key] = st.nbytes()
                    self.now += st.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, key)
        return out


def peak_bytes(head: OutputHead, hidden: torch.Tensor, labels: torch.Tensor, chunk: int) -> tuple[int, float]:
    """(peak bytes over forward + backward, the loss value) of one loss computation."""
    loss_fn = TokenLoss(z_loss_weight=1e-4, chunk_size=chunk, head=head if chunk else None)
    cuda = hidden.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracker = LiveStorages()
    with tracker if not cuda else contextlib.nullcontext():
        out = head(hidden) if chunk == 0 else hidden  # the model's output: logits, or the hidden state
        loss = loss_fn(out, labels)
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if cuda else tracker.peak
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    return peak, float(loss.detach())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.manual_seed(0)
    head = OutputHead(a.dim, a.vocab, softcap=30.0).to(a.device)
    hidden = torch.randn(a.batch, a.seq, a.dim, device=a.device, requires_grad=True)
    labels = torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device)
    whole, loss_whole = peak_bytes(head, hidden, labels, 0)
    chunked, loss_chunked = peak_bytes(head, hidden, labels, a.chunk)
    mib = 2.0**20
    result = {
        "shape": {"batch": a.batch, "seq": a.seq, "dim": a.dim, "vocab": a.vocab, "chunk": a.chunk},
        "device": a.device,
        "fp32_logits_mib": round(a.batch * a.seq * a.vocab * 4 / mib, 1),
        "peak_whole_mib": round(whole / mib, 1),
        "peak_chunked_mib": round(chunked / mib, 1),
        "saving_mib": round((whole - chunked) / mib, 1),
        "peak_ratio": round(whole / chunked, 2),
        "loss_rel_diff": abs(loss_chunked - loss_whole) / abs(loss_whole),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
