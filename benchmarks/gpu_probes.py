"""The in-process measurements of ``benchmarks/gpu_check.py``: the environment, the bf16 matmul
rate, the numerics checks and KV-cache generation. Each takes a ``device`` so that the parts that
torch supports on CPU (FlexAttention forward, ``torch._grouped_mm`` in fp32, fused AdamW) are
exercised by the CPU tests too.

Only torch and this repository's ``models/`` are imported (no Hydra, no OmegaConf): these parts
run on a machine where the training stack's dependencies are missing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import platform
import subprocess
import time
from typing import Any, Optional

import torch
from torch import Tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Packages the training parts need beyond torch (trainer/main.py composes Hydra configs).
TRAINING_PACKAGES = ("hydra", "omegaconf")


def rel_err(a: Tensor, ref: Tensor) -> float:
    """Norm-relative error ``||a - ref|| / ||ref||`` in float64 (0 when both are zero)."""
    a, ref = a.detach().double(), ref.detach().double()
    denom = ref.norm().item()
    diff = (a - ref).norm().item()
    return diff / denom if denom > 0 else diff


def missing_training_packages() -> list[str]:
    """The packages of ``TRAINING_PACKAGES`` that cannot be imported here."""
    return [name for name in TRAINING_PACKAGES if importlib.util.find_spec(name) is None]


# ----------------------------------------------------------------------------------------------
# Environment and the matmul rate
# ----------------------------------------------------------------------------------------------


def _driver_version() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def environment() -> dict[str, Any]:
    """GPUs (name, memory, compute capability), torch / CUDA / cuDNN / NCCL versions, packages."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 2),
                "capability": f"{p.major}.{p.minor}",
                "sms": p.multi_processor_count,
            }
        )
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            version = torch.cuda.nccl.version()  # a tuple (major, minor, patch); an int in old builds
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # a CUDA build without NCCL
            nccl = None
    packages = {}
    for name in (
        "hydra",
        "omegaconf",
        "datasets",
        "transformers",
        "tensorboard",
        "safetensors",
        "tokenizers",
    ):
        packages[name] = importlib.util.find_spec(name) is not None
    return {
        "gpu_count": len(gpus),
        "gpu_name": gpus[0]["name"] if gpus else None,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": nccl,
        "driver": _driver_version() if gpus else None,
        "python": platform.python_version(),
        "packages_present": packages,
        "missing_for_training": missing_training_packages(),
    }


def matmul_tflops(
    device: torch.device,
    sizes: tuple[int, ...] = (4096, 8192),
    iters: int = 20,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Dense ``(n, n) @ (n, n)`` rate in TFLOP/s per size and the best (the MFU denominator)."""
    per_size: dict[str, float] = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):  # warm-up: cuBLAS heuristics, clocks
            torch.mm(a, b)
        seconds = _timed(lambda a=a, b=b: torch.mm(a, b), iters, device)
        per_size[str(n)] = round(2 * n**3 / seconds / 1e12, 2)
        del a, b
    return {
        "dtype": str(dtype).replace("torch.", ""),
        "iters": iters,
        "tflops_by_size": per_size,
        "tflops": max(per_size.values()),
    }


def _timed(fn: Any, iters: int, device: torch.device) -> float:
    """Mean seconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


# ----------------------------------------------------------------------------------------------
# Numerics
# ----------------------------------------------------------------------------------------------


def packed_positions(seq_len: int, doc_lengths: list[int], device: torch.device) -> Tensor:
    """Positions (S,) of packed documents: 0..len-1 per document, restarting at each start."""
    pos, left = [], seq_len
    for length in doc_lengths:
        take = min(length, left)
        pos.extend(range(take))
        left -= take
    while left > 0:  # the last document runs to the end of the window
        take = min(left, doc_lengths[-1])
        pos.extend(range(take))
        left -= take
    return torch.tensor(pos, device=device)


def check_flex_attention(
    device: torch.device,
    *,
    dtype: torch.dtype = torch.bfloat16,
    batch: int = 2,
    seq_len: int = 2048,
    n_heads: int = 16,
    n_kv_heads: int = 4,
    head_dim: int = 64,
    backward: bool = True,
    compiled: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """FlexAttention (``models.attention``'s block mask) vs SDPA with the dense block-causal mask.

    The reference is SDPA in float32 with ``MaskSpec.additive`` (documents from packed positions);
    the test runs ``attend`` with ``MaskSpec.block_mask`` and ``flex_attention`` (compiled, as
    ``AttentionCore`` does on CUDA; ``compiled=False`` for CPU, forward only) in ``dtype``. SDPA in
    ``dtype`` with the dense mask is reported beside it: the rounding any ``dtype`` kernel has.
    Returns norm-relative errors of the output and (``backward``) of dq, dk, dv.
    """
    from torch.nn.attention.flex_attention import flex_attention

    from models.attention import MaskSpec, attend, compiled_flex_attention, document_ids

    gen = torch.Generator().manual_seed(seed)
    shapes = ((batch, seq_len, n_heads, head_dim), (batch, seq_len, n_kv_heads, head_dim))
    q32, k32, v32 = (torch.randn(shapes[i > 0], generator=gen).to(device) for i in range(3))  # (B, S, h, D)
    index = torch.arange(seq_len, device=device)
    lengths = [seq_len // 3, seq_len // 5, seq_len // 7 + 1, seq_len]  # documents of uneven lengths
    doc = document_ids(index, packed_positions(seq_len, lengths, device)).expand(batch, seq_len)  # (B, S)
    spec = MaskSpec(index, index, doc, doc)

    def run(q: Tensor, k: Tensor, v: Tensor, mask: Any, flex: Any = None) -> tuple[Tensor, list[Tensor]]:
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]
        out = attend(*leaves, mask, flex=flex)  # (B, S, nh, D)
        if not backward:
            return out.detach(), []
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(out))
        return out.detach(), [t.grad for t in leaves]

    ref_out, ref_grads = run(q32, k32, v32, spec.additive(torch.float32))
    low = [t.to(dtype) for t in (q32, k32, v32)]
    flex = compiled_flex_attention() if compiled else flex_attention
    flex_out, flex_grads = run(*low, spec.block_mask(batch), flex=flex)
    sdpa_out, sdpa_grads = run(*low, spec.additive(dtype))
    names = ("out", "dq", "dk", "dv")
    flex_errs = [rel_err(flex_out, ref_out), *(rel_err(g, r) for g, r in zip(flex_grads, ref_grads))]
    sdpa_errs = [rel_err(sdpa_out, ref_out), *(rel_err(g, r) for g, r in zip(sdpa_grads, ref_grads))]
    return {
        "shape": {
            "batch": batch,
            "seq_len": seq_len,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "documents_per_window": int(doc[0].unique().numel()),
        },
        "dtype": str(dtype).replace("torch.", ""),
        "flex_vs_fp32_sdpa": dict(zip(names, flex_errs)),
        "sdpa_same_dtype_vs_fp32_sdpa": dict(zip(names, sdpa_errs)),
        "max_rel_err": max(flex_errs),
    }


def check_grouped_experts(
    device: torch.device,
    *,
    dtype: torch.dtype = torch.bfloat16,
    num_experts: int = 8,
    dim: int = 512,
    hidden_dim: int = 1024,
    tokens: int = 4096,
    seed: int = 0,
) -> dict[str, Any]:
    """``GroupedExperts`` with ``grouped_mm=on`` (``torch._grouped_mm``) vs ``off`` (padded ``bmm``).

    The reference is the padded path in float32. Both paths then run forward and backward in
    ``dtype`` two ways: weights in ``dtype`` (FSDP's ``param_dtype=bfloat16``) and, on CUDA, float32
    weights under ``torch.autocast`` (plain ``training.mixed_precision=bf16``). The groups are
    uneven and one expert gets no rows. Returns norm-relative errors of the output and the
    gradients of the input and of w1, w2, w3.
    """
    from models.moe.experts import GroupedExperts

    gen = torch.Generator().manual_seed(seed)
    ref_mod = GroupedExperts(num_experts, dim, hidden_dim, grouped_mm="off")
    for w in ref_mod.parameters():
        with torch.no_grad():
            w.copy_(torch.randn(w.shape, generator=gen) * dim**-0.5)
    ref_mod.to(device)
    share = torch.rand(num_experts, generator=gen)
    share[1] = 0.0  # an expert without rows
    counts = (share / share.sum() * tokens).long()
    counts[0] += tokens - int(counts.sum())
    counts = counts.to(device)
    x32 = torch.randn(tokens, dim, generator=gen).to(device)  # (N, H) grouped by expert
    dy = torch.randn(tokens, dim, generator=gen).to(device)
    ref = _experts_run(ref_mod, x32, counts, dy, None)
    results: dict[str, Any] = {"counts": counts.tolist(), "dtype": str(dtype).replace("torch.", "")}
    # (label, weight dtype, autocast dtype, grouped_mm modes): bf16 weights force each path; under
    # autocast the model's rows stay fp32 and ``auto`` picks the path (the padded bmm, as in training)
    variants = [("weights_" + results["dtype"], dtype, None, ("on", "off"))]
    if device.type == "cuda" and dtype != torch.float32:
        variants.append(("fp32_weights_autocast", torch.float32, dtype, ("auto", "off")))
    worst = 0.0
    for label, w_dtype, autocast, modes in variants:
        for mode in modes:
            key = f"{label}/{ {'on': 'grouped', 'off': 'padded', 'auto': 'auto'}[mode] }"
            mod = GroupedExperts(num_experts, dim, hidden_dim, grouped_mm=mode).to(device)
            mod.load_state_dict(ref_mod.state_dict())
            mod.to(w_dtype)
            x = x32 if autocast is not None else x32.to(dtype)
            try:
                got = _experts_run(mod, x, counts, dy.to(dtype), autocast)
            except Exception as e:  # reported with the other variants' numbers
                results[key] = {"error": f"{type(e).__name__}: {e}"[:500]}
                worst = math.inf
                continue
            errs = {k: rel_err(got[k], ref[k]) for k in ref}
            results[key] = errs
            worst = max(worst, *errs.values())
    results["max_rel_err"] = worst if math.isfinite(worst) else None  # None: a variant raised
    return results


def _experts_run(
    mod: Any, x: Tensor, counts: Tensor, dy: Tensor, autocast: Optional[torch.dtype]
) -> dict[str, Tensor]:
    x = x.detach().clone().requires_grad_(True)
    ctx = torch.autocast(x.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        y = mod(x, counts)  # (N, H)
    y.backward(dy.to(y.dtype))
    return {"out": y.detach(), "dx": x.grad, "dw1": mod.w1.grad, "dw2": mod.w2.grad, "dw3": mod.w3.grad}


def check_adamw(device: torch.device, *, steps: int = 10, seed: int = 0) -> dict[str, Any]:
    """Fused vs foreach ``torch.optim.AdamW`` (``optimizer.implementation``; the config's betas,
    eps and weight decay) on the same float32 parameters and gradients for ``steps`` steps; the
    for-loop implementation is the reference of both. Returns the worst norm-relative difference
    of the parameters over the tensors, and the parameters' relative change (what the steps moved)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(2048, 512), (512,), (4096, 256), (7,), (128, 3, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    params = {}
    for impl in ("fused", "foreach", "for-loop"):
        ps = [torch.nn.Parameter(t.clone().to(device)) for t in init]
        opt = torch.optim.AdamW(
            ps,
            lr=3e-4,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            fused=impl == "fused",
            foreach=impl == "foreach",
        )
        for step_grads in grads:
            for p, g in zip(ps, step_grads):
                p.grad = g.to(device)
            opt.step()
        params[impl] = [p.detach() for p in ps]
    ref = params["for-loop"]
    moved = max(rel_err(p, i.to(device)) for p, i in zip(ref, init))
    errs = {impl: max(rel_err(a, r) for a, r in zip(params[impl], ref)) for impl in ("fused", "foreach")}
    direct = max(rel_err(a, b) for a, b in zip(params["fused"], params["foreach"]))
    return {
        "steps": steps,
        "fused_vs_for_loop": errs["fused"],
        "foreach_vs_for_loop": errs["foreach"],
        "fused_vs_foreach": direct,
        "relative_update": moved,
        "max_rel_err": max(direct, *errs.values()),
    }


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------


_DELTA_NAMES = ("out", "dq", "dk", "dv", "d_decay", "d_beta", "d_q_conv", "d_k_conv", "d_v_conv")


def _delta_net_inputs(
    device: torch.device, B: int, S: int, nk: int, nv: int, d: int, K: int, seed: int
) -> dict[str, Any]:
    """Random inputs of a Gated DeltaNet core: q, k, v before the convolutions, the decay as the model
    computes it (``Decay``'s init), beta, the three conv weights, packed positions, an upstream grad."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> Tensor:
        return (torch.randn(shape, generator=gen) * scale).to(device)

    a_log = torch.empty(nv).uniform_(1.0, 16.0, generator=gen).log().to(device)
    a = rand(B, S, nv)
    return {
        "qkv": [rand(B, S, nk * d), rand(B, S, nk * d), rand(B, S, nv * d)],
        "decay": -a_log.exp() * torch.nn.functional.softplus(a + math.log(math.expm1(0.01))),  # <= 0
        "beta": torch.sigmoid(rand(B, S, nv)),
        "conv": [rand(c, 1, K, scale=K**-0.5) for c in (nk * d, nk * d, nv * d)],
        "positions": packed_positions(S, [S // 3, S // 5, S // 7 + 1, S], device).expand(B, S),
        "upstream": rand(B, S, nv, d),
        "state0": rand(B, nv, d, d, scale=0.1),
        "head_dim": d,
    }


def _delta_net_run(
    x: dict[str, Any], kernel: str, low: bool, mask: str, backward: bool = True
) -> tuple[Tensor, list[Tensor]]:
    """``DeltaRuleCore(mask, kernel=kernel)`` on ``x`` (q, k, v and beta in bf16 when ``low``) ->
    (output, gradients of q, k, v, decay, beta and the conv weights)."""
    from models.qwen3_5.delta_net import DeltaRuleCore

    core = DeltaRuleCore(mask, chunk_size=64, kernel=kernel)
    cast = torch.bfloat16 if low else torch.float32
    xs = [t.to(cast) for t in x["qkv"]] + [x["decay"], x["beta"].to(cast)] + x["conv"]
    leaves = [t.detach().clone().requires_grad_(backward) for t in xs]
    pos = x["positions"] if mask == "block_causal" else None
    d = x["head_dim"]
    out = core(*leaves[:5], conv=leaves[5:], head_dims=(d, d), positions=pos)
    if not backward:
        return out.detach(), []
    out.float().backward(x["upstream"])
    return out.detach(), [t.grad for t in leaves]


def _delta_state_errors(x: dict[str, Any]) -> dict[str, float]:
    """The prefill's initial / final state (the rule alone): fla from a random state vs our form."""
    from models.qwen3_5.delta_rule import chunk_gated_delta_rule
    from models.qwen3_5.kernels import fla_gated_delta_rule

    B, S, _ = x["qkv"][0].shape
    heads = [t.view(B, S, -1, x["head_dim"]) for t in x["qkv"]]
    ref_o, ref_state = chunk_gated_delta_rule(
        *heads, x["decay"], x["beta"], chunk_size=64, initial_state=x["state0"]
    )
    low = [t.to(torch.bfloat16) for t in heads]
    beta = x["beta"].to(torch.bfloat16)
    fla_o, fla_state = fla_gated_delta_rule(
        *low, x["decay"], beta, initial_state=x["state0"], final_state=True
    )
    assert fla_state is not None  # asked for
    return {"out": rel_err(fla_o, ref_o), "final_state": rel_err(fla_state, ref_state)}


def check_delta_rule_fla(
    device: torch.device,
    *,
    batch: int = 2,
    seq_len: int = 4096,
    key_heads: int = 16,
    value_heads: int = 32,
    head_dim: int = 128,
    conv_kernel: int = 4,
    iters: int = 5,
    seed: int = 0,
) -> dict[str, Any]:
    """Qwen3.5's Gated DeltaNet core with flash-linear-attention's kernels vs our torch form
    (``model.linear_kernel``: ``models/qwen3_5/kernels.py``), at Qwen3.5-4B's DeltaNet shapes.

    The reference is ``DeltaRuleCore(kernel="torch")`` (short convolutions + our chunked rule) in
    float32; the test is ``DeltaRuleCore(kernel="fla")`` on bf16 q, k, v (fp32 decay, bf16 beta, the
    convolution weights fp32 as the model keeps them), causal and block-causal (uneven documents:
    fla's ``cu_seqlens``). Norm-relative errors of the output and the gradients of q, k, v, the
    decay, beta and the three convolution weights; the torch form on the same bf16 inputs beside it
    (the inputs' own rounding). Also the prefill path's initial / final state (generation, and what
    a state hand-off needs). Speed: forward+backward (and forward alone) of both cores in bf16, ms.
    """
    x = _delta_net_inputs(device, batch, seq_len, key_heads, value_heads, head_dim, conv_kernel, seed)
    errors: dict[str, Any] = {}
    for mask in ("causal", "block_causal"):
        ref_out, ref_grads = _delta_net_run(x, "torch", False, mask)
        errors[mask] = {}
        for name, kernel in (("fla_bf16_vs_torch_fp32", "fla"), ("torch_bf16_vs_torch_fp32", "torch")):
            out, grads = _delta_net_run(x, kernel, True, mask)
            errs = [rel_err(out, ref_out), *(rel_err(g, r) for g, r in zip(grads, ref_grads))]
            errors[mask][name] = dict(zip(_DELTA_NAMES, errs))
    errors["initial_final_state"] = _delta_state_errors(x)

    def timed(kernel: str, backward: bool) -> float:
        return _timed(lambda: _delta_net_run(x, kernel, True, "causal", backward), iters, device) * 1e3

    _delta_net_run(x, "fla", True, "causal")  # compile fla's Triton kernels before timing
    speed: dict[str, Any] = {
        "fwd_bwd_ms": {"fla": timed("fla", True), "torch": timed("torch", True)},
        "fwd_ms": {"fla": timed("fla", False), "torch": timed("torch", False)},
    }
    speed["fwd_bwd_speedup"] = speed["fwd_bwd_ms"]["torch"] / speed["fwd_bwd_ms"]["fla"]
    speed["fwd_speedup"] = speed["fwd_ms"]["torch"] / speed["fwd_ms"]["fla"]
    fla_errs = [e for m in ("causal", "block_causal") for e in errors[m]["fla_bf16_vs_torch_fp32"].values()]
    shape = dict(
        batch=batch, seq_len=seq_len, key_heads=key_heads, value_heads=value_heads, head_dim=head_dim
    )
    shape["documents_per_window"] = int((x["positions"][0] == 0).sum())
    return {
        "shape": shape,
        "errors": errors,
        "speed": speed,
        "max_rel_err": max([*fla_errs, *errors["initial_final_state"].values()]),
    }


def preset_args(preset: str) -> Any:
    """Model args of ``configs/model/<preset>.yaml`` without Hydra (PyYAML; ``defaults`` dropped)."""
    import yaml

    from models import get_spec

    with open(os.path.join(REPO, "configs", "model", f"{preset}.yaml"), encoding="utf-8") as f:
        fields = yaml.safe_load(f)
    fields.pop("defaults", None)
    spec = get_spec(fields.get("family", "llama"))
    return spec, spec.make_args(fields)


def generation_speed(
    device: torch.device,
    *,
    preset: str = "1b",
    dtype: torch.dtype = torch.bfloat16,
    prompt_len: int = 128,
    new_tokens: int = 256,
    compare_tokens: int = 16,
) -> dict[str, Any]:
    """Greedy KV-cache generation (``models.generation.generate``) with ``preset``'s shapes (seeded
    random weights in ``dtype``, batch 1): prefill time, decode tokens/s, and the same first
    ``compare_tokens`` tokens without the cache (the cache-less re-run; a token mismatch in bf16 is
    reported, not failed: near-ties in random weights may flip an argmax)."""
    from models.generation import generate

    spec, args = preset_args(preset)
    with torch.device("meta"):
        model = spec.build(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    model.to(dtype)
    model.reset_rope_cache()  # back to float32 rotary rows after the cast
    model.eval()
    prompt = torch.randint(
        0, min(args.vocab_size, 258), (prompt_len,), generator=torch.Generator().manual_seed(0)
    )
    ids = prompt.tolist()

    def timed(n: int, cache: bool = True) -> tuple[float, list[int]]:
        _sync(device)
        t0 = time.perf_counter()
        out = generate(model, ids, max_new_tokens=n, temperature=0, use_cache=cache)
        _sync(device)
        return time.perf_counter() - t0, out

    timed(4)  # warm-up: kernels, allocator
    prefill_s, _ = timed(1)
    total_s, cached = timed(new_tokens)
    _, plain = timed(compare_tokens, cache=False)
    decode_s = max(total_s - prefill_s, 1e-9)
    return {
        "preset": preset,
        "dtype": str(dtype).replace("torch.", ""),
        "batch": 1,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_s": round(prefill_s, 4),
        "total_s": round(total_s, 3),
        "decode_tokens_per_s": round((new_tokens - 1) / decode_s, 1),
        "tokens_per_s": round(new_tokens / total_s, 1),
        "greedy_match_without_cache": cached[: prompt_len + compare_tokens] == plain,
        "params": sum(p.numel() for p in model.parameters()),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
