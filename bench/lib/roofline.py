"""The floor under a decode step: the GPU's two ceilings measured in the run (device-to-device
copy bandwidth; bf16 and FP8 matrix-product rates), and what one step of a Llama-shaped model
must move and compute at a batch, so that a measured step reads as a fraction of the best the
card could do.

A decode step of ``batch`` sequences, each ``context`` tokens long on average, reads every
weight once (linear layers at the precision's bytes; the output layer stays bf16 under vLLM's
online FP8) and each sequence's KV cache, and multiplies ``2 x batch x weights`` FLOPs (plus
attention's ``4 x batch x context x layers x heads x head_dim``). Its floor is the larger of
bytes / bandwidth and FLOPs / matrix rate. Embedding reads, norms, the sampler and prefill are
left out: the floor is a lower bound, its fraction an upper one."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def shape(model_dir: Path) -> dict[str, int]:
    """A Llama's sizes from its config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    return {"hidden": hidden, "inter": cfg["intermediate_size"], "layers": cfg["num_hidden_layers"], "heads": heads,
            "kv_heads": cfg.get("num_key_value_heads") or heads, "head_dim": cfg.get("head_dim") or hidden // heads,
            "vocab": cfg["vocab_size"]}


def step_floor(s: dict[str, int], batch: int, context: float, precision: str, peaks: dict[str, float]) -> dict[str, Any]:
    """The floor of one decode step (module docstring), in ms, and which ceiling sets it."""
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    linear = s["layers"] * (s["hidden"] * (q + 2 * kv) + q * s["hidden"] + 3 * s["hidden"] * s["inter"])
    head = s["hidden"] * s["vocab"]
    fp8 = precision == "fp8"
    weight_bytes = linear * (1 if fp8 else 2) + head * 2
    kv_bytes = batch * context * s["layers"] * 2 * kv * 2  # K and V, bf16
    linear_flops = 2 * batch * linear  # at the precision's rate; the output layer and attention at bf16's
    bf16_flops = 2 * batch * head + 4 * batch * context * s["layers"] * q
    flops = linear_flops + bf16_flops
    rate, bf16 = peaks.get("fp8_tflops" if fp8 else "bf16_tflops"), peaks.get("bf16_tflops")
    memory_ms = (weight_bytes + kv_bytes) / (peaks["copy_gbps"] * 1e9) * 1e3
    math_ms = (linear_flops / (rate * 1e12) + bf16_flops / (bf16 * 1e12)) * 1e3 if rate and bf16 else 0.0
    floor = max(memory_ms, math_ms)
    return {"floor_ms": floor, "memory_ms": memory_ms, "math_ms": math_ms, "bound": "memory" if memory_ms >= math_ms
            else "math", "bytes": weight_bytes + kv_bytes, "flops": flops, "tokens_per_s": batch / floor * 1e3}


def _timed(fn, rounds: int = 10) -> float:
    """Median seconds of ``fn`` on the GPU (CUDA events), after two warm-up calls."""
    import torch

    for _ in range(2):
        fn()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def measure_peaks(copy_bytes: int = 4 << 30, n: int = 8192) -> dict[str, Any]:
    """This GPU's ceilings, measured now: copy bandwidth (bytes read + written per second, GB/s),
    bf16 and FP8 matrix products of n x n x n (TFLOP/s; FP8 through torch._scaled_mm, per-tensor
    scales, bf16 out). Random inputs (never zeros); buffers freed after."""
    import torch

    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src))
    src = dst = None  # freed before the matrices (the timed closures ran already)
    out: dict[str, Any] = {"copy_gbps": 2 * copy_bytes / copy_s / 1e9, "matmul_n": n}
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out["bf16_tflops"] = 2 * n**3 / _timed(lambda: a @ b) / 1e12
    try:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        one = torch.ones((), device="cuda", dtype=torch.float32)
        out["fp8_tflops"] = 2 * n**3 / _timed(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e12
    except Exception as exc:  # no FP8 matrix units or no such op in this torch: no FP8 ceiling
        out["fp8_error"] = f"{type(exc).__name__}: {exc}"
    a = b = None
    torch.cuda.empty_cache()
    return out
