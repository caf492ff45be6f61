"""Tensor-parallel communication per rank per step, counted, against the seed article's formula.

Article (section 5, "TP"): every layer does 4 all_reduces of its (B, S, H) activation per
training step (2 forward at g, 2 backward at f); sequence parallel replaces each all_reduce
by a reduce_scatter + all_gather of the same tensor, so the volume is unchanged.

This script spawns ``--tp`` gloo ranks, shards the Llama model with ``apply_tp`` exactly as
training does, runs one forward + backward (cross-entropy under ``loss_parallel()``) inside
torch's ``CommDebugMode`` and records every collective with its tensor size and the module
it ran in. Volumes are expressed two ways:

* all_reduce-equivalent bytes: an all_reduce of an n-byte tensor counts n; an all_gather or
  reduce_scatter whose full (gathered / unreduced) tensor has n bytes counts n / 2;
* ring wire bytes each rank sends: all_reduce 2 (N-1)/N n, all_gather / reduce_scatter (N-1)/N n.

The formula is ``4 * L * B * S * H * bytes_per_element`` all_reduce-equivalents per step. The
blocks alone should match it exactly; the whole model adds the embedding's and the head's
boundary (one all_reduce-equivalent each) and loss parallel's (B, S)-sized reductions.

    python benchmarks/bench_tp_comm.py [--tp 2] [--layers 16] [--dim 256] [--batch 2] [--seq 128]

Prints JSON; ``within_5pct`` is true when the whole-model volume is within 5% of the formula.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback
import warnings
from collections import defaultdict
from typing import Any

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, here and in the spawned ranks

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from models.llama import LLAMA_SPEC, LlamaArgs, Transformer  # noqa: E402
from parallelisms.config import ParallelismConfig  # noqa: E402
from parallelisms.tensor_parallel import apply_tp  # noqa: E402
from parallelisms.utils import copy_full_into  # noqa: E402

# Native functional collectives (what DTensor issues) -> kind.
_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}


class CommBytesMode(CommDebugMode):
    """``CommDebugMode`` that also records, per collective, its kind, the module it ran in,
    forward or backward, and the bytes of its full (logical) tensor."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.group_size = group_size
        self.records: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is NotImplemented or isinstance(func, torch._ops.HigherOrderOperator):
            return out
        packet = func._overloadpacket
        if packet not in self.comm_registry:
            return out
        kind = _KINDS.get(packet.__name__)
        if kind is None:
            return out
        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if kind == "all_gather":  # the input is this rank's shard; the full tensor is N of them
            nbytes *= self.group_size
        tracker = self.advanced_module_tracker
        self.records.append(
            {"kind": kind, "module": tracker.name, "backward": bool(tracker.is_bw), "bytes": nbytes}
        )
        return out


def _ar_equivalent(kind: str, nbytes: int) -> float:
    return float(nbytes) if kind == "all_reduce" else nbytes / 2.0


def _wire(kind: str, nbytes: int, n: int) -> float:
    return (2.0 if kind == "all_reduce" else 1.0) * (n - 1) / n * nbytes


def _measure(args: LlamaArgs, mesh: Any, batch: int, seq: int, sequence_parallel: bool) -> dict[str, Any]:
    tp = mesh.size()
    with torch.device("meta"):
        model = Transformer(args)
    apply_tp(model, LLAMA_SPEC, mesh, ParallelismConfig(tp=mesh.size(), sequence_parallel=sequence_parallel))
    model.to_empty(device="cpu")
    model.init_weights(seed=0, copy_fn=copy_full_into)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)
    labels = torch.randint(0, args.vocab_size, (batch, seq), generator=gen)

    with CommBytesMode(tp) as mode, loss_parallel(), warnings.catch_warnings():
        # The mode's module tracker puts full backward hooks on the embedding, whose input
        # (token ids) needs no gradient; torch warns about that, harmlessly.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        logits = model(tokens)  # (B, S, V) sharded over V
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        loss.backward()

    elem = torch.tensor([], dtype=torch.float32).element_size()
    bsh = batch * seq * args.dim * elem  # bytes of one (B, S, H) activation
    formula = 4 * args.n_layers * bsh
    counts: dict[str, dict[str, int]] = {"forward": defaultdict(int), "backward": defaultdict(int)}
    blocks = total = wire = 0.0
    for r in mode.records:
        counts["backward" if r["backward"] else "forward"][r["kind"]] += 1
        eq = _ar_equivalent(r["kind"], r["bytes"])
        total += eq
        wire += _wire(r["kind"], r["bytes"], tp)
        if ".layers." in r["module"]:
            blocks += eq
    return {
        "sequence_parallel": sequence_parallel,
        "collectives": {k: dict(v) for k, v in counts.items()},
        "num_collectives": len(mode.records),
        "comm_debug_mode_total_counts": mode.get_total_counts(),
        "bsh_bytes": bsh,
        "formula_ar_equiv_bytes": formula,
        "blocks_ar_equiv_bytes": blocks,
        "total_ar_equiv_bytes": total,
        "ar_equiv_per_layer_in_bsh": blocks / args.n_layers / bsh,
        "ratio_blocks_vs_formula": blocks / formula,
        "ratio_total_vs_formula": total / formula,
        "wire_bytes_sent_per_rank": wire,
        "formula_wire_bytes_per_rank": formula * 2 * (tp - 1) / tp,
        "within_5pct": abs(total / formula - 1) <= 0.05,
    }


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        args = LlamaArgs(
            dim=cfg["dim"],
            n_layers=cfg["layers"],
            n_heads=cfg["heads"],
            n_kv_heads=cfg["kv_heads"],
            ffn_hidden_dim=cfg["ffn"],
            vocab_size=cfg["vocab"],
            max_seq_len=cfg["seq"],
        )
        queue.put(("ok", [_measure(args, mesh, cfg["batch"], cfg["seq"], sp) for sp in (True, False)]))
    except BaseException:
        queue.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
        raise
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    cfg = vars(parser.parse_args())

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, cfg["tp"], port, cfg, queue)) for r in range(cfg["tp"])]
    for p in procs:
        p.start()
    replies = []
    for _ in procs:
        replies.append(queue.get())
        if replies[-1][0] == "error":
            break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = [payload for status, payload in replies if status == "error"]
    if errors:
        raise SystemExit("a rank failed:\n" + errors[0])
    variants = replies[0][1]  # every rank measures the same volumes
    print(
        json.dumps(
            {
                "config": cfg,
                "formula": "4 all_reduce-equivalents of B*S*H per layer per step",
                "variants": variants,
                "within_5pct": all(v["within_5pct"] for v in variants),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
