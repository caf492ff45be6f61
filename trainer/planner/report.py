"""The plan as text: the memory and communication tables ``python -m trainer.plan`` prints."""

from __future__ import annotations

from trainer.planner.cluster import GB
from trainer.planner.context import Plan


def _gb(x: float) -> str:
    return f"{x / GB:9.2f}"


def _memory_table(plan: Plan) -> list[str]:
    lines = [
        f"{'pp rank':>7} {'blocks':>6} {'params':>9} {'grads':>9} {'optim':>9} {'activ.':>9} "
        f"{'buffers':>9} {'total':>9}   (GB per rank)"
    ]
    stages = plan.stages
    shown = stages if len(stages) <= 6 else [*stages[:3], None, *stages[-2:]]
    for s in shown:
        if s is None:
            lines.append(f"{'...':>7}")
            continue
        lines.append(
            f"{s.pp_rank:>7} {s.layers:>6} {_gb(s.params_bytes)} {_gb(s.grads_bytes)} "
            f"{_gb(s.optimizer_bytes)} {_gb(s.activations_bytes)} {_gb(sum(s.buffers.values()))} "
            f"{_gb(s.total_bytes)}"
        )
    first = stages[0]
    lines.append(
        "buffers (pp rank 0): "
        + (", ".join(f"{k} {v / GB:.2f} GB" for k, v in first.buffers.items()) or "none")
    )
    return lines


def _comm_table(plan: Plan) -> list[str]:
    lines = [
        f"{'collective':<46} {'axis':<15} {'n':>4} {'link':<5} {'calls':>6} {'per call':>9} "
        f"{'logical':>9} {'wire':>9} {'time ms':>9}  hides"
    ]
    for x in plan.collectives:
        hides = ("yes" if x.hidden else "no") + f" ({x.overlap})"
        lines.append(
            f"{x.name:<46} {x.axis:<15} {x.group_size:>4} {x.link:<5} {x.calls:>6} "
            f"{x.size_bytes / 1e6:>7.1f}MB {_gb(x.logical_bytes)} {_gb(x.wire_bytes)} {x.time_s * 1e3:>9.1f} "
            f" {hides}"
        )
    for link in ("intra", "inter"):
        wire = sum(x.wire_bytes for x in plan.collectives if x.link == link)
        lines.append(f"  {link}-node wire bytes per rank per step: {wire / GB:.2f} GB")
    return lines


def _checkpoint_table(plan: Plan) -> list[str]:
    ck = plan.checkpoint
    if ck is None:
        return []
    layout = f"{ck.files_per_rank} file(s)" if ck.files_per_rank else "one file per entry"
    lines = [
        "",
        f"checkpoint: one save (DCP; {layout} per rank, rank 0 also .metadata and checkpoint.json)",
        f"{'pp rank':>7} {'ranks':>6} {'min':>9} {'max':>9} {'files':>6}   (GB per rank; files per rank)",
    ]
    pp = plan.layout["pp"]
    for r in range(pp) if pp <= 6 else [*range(3), -1, *range(pp - 2, pp)]:
        if r < 0:
            lines.append(f"{'...':>7}")
            continue
        ranks = ck.ranks_of(r, pp)
        data = [ck.rank_bytes[i] for i in ranks]
        counts = sorted({ck.rank_files[i] for i in ranks})
        shown = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        lines.append(f"{r:>7} {len(ranks):>6} {_gb(min(data))} {_gb(max(data))} {shown:>6}")
    lines.append(
        f"rank 0 writes {ck.rank_bytes[0] / GB:.2f} GB in {ck.rank_files[0]} files (.metadata "
        f"{ck.metadata_bytes / 1e6:.2f} MB, checkpoint.json {ck.marker_bytes / 1e3:.1f} KB); the checkpoint: "
        f"{ck.total_bytes / GB:.2f} GB in {sum(ck.rank_files)} files, {ck.entries:,} entries"
    )
    return lines


def render(plan: Plan) -> str:
    """The plan as a readable report (GB = 1e9 bytes; the verdict in GiB)."""
    lay, comp, cl, v = plan.layout, plan.compute, plan.cluster, plan.verdict
    act = plan.activation_per_token_layer
    out = [
        f"plan: {plan.experiment or '(overrides)'}  model {plan.model} ({plan.params_total / 1e9:.2f}B "
        "params)  "
        f"on {lay['nodes']} x {cl.gpus_per_node} {cl.name}",
        f"layout: {plan.strategy}  (world {lay['world_size']}: pp {lay['pp']} x dp_replicate "
        f"{lay['dp_replicate']} "
        f"x dp_shard {lay['dp_shard']} x cp {lay['cp']} x tp {lay['tp']}); {lay['microbatches']} "
        "microbatch(es) "
        f"of {lay['micro_tokens']} tokens per rank; AC {lay['activation_checkpoint']}; "
        f"{lay['mixed_precision']}",
        f"activations per layer per token: {act['no_ac'] / 1e3:.2f} KB without AC, "
        f"{act['full_ac'] / 1e3:.2f} KB "
        "kept with full AC",
        "",
        "memory",
        *_memory_table(plan),
        "",
        "communication per step (ring model)",
        *_comm_table(plan),
        "",
        f"compute: {comp['flops_per_rank'] / 1e12:.1f} TFLOP per rank per step -> "
        f"{comp['compute_s'] * 1e3:.0f} ms at "
        f"{cl.mfu:.0%} of {cl.peak_tflops:g} TFLOP/s"
        + (
            f"; PP bubble {comp['pp_bubble']:.1%} ({lay['pp_schedule']}, M={lay['microbatches']}, "
            f"v={lay['pp_stages_per_rank']})"
            if lay["pp"] > 1
            else ""
        )
        + (
            f"; Muon Newton-Schulz {comp['ns_flops_per_rank'] / 1e12:.1f} TFLOP per rank -> "
            f"{comp['optimizer_s'] * 1e3:.0f} ms in the optimizer step"
            if "optimizer_s" in comp
            else ""
        ),
        *_checkpoint_table(plan),
        f"verdict: {v['memory']}",
        f"         {v['communication']}; predicted step {v['step_s'] * 1e3:.0f} ms, {v['tokens_per_s']:,.0f} "
        "tokens/s",
    ]
    return "\n".join(out)
