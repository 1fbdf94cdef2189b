"""The most FP8 can give a decode step's matrix multiplies over bf16 on this GPU, by batch: torch alone.

A Llama-3-8B decode step's linear layers at M sequences (one new token each): per layer the fused
QKV (4096 -> 6144), the attention output (4096 -> 4096), the fused gate/up (4096 -> 28672) and
the down projection (14336 -> 4096), ``--layers`` distinct layers (so the weights stream from
memory, as in a model, not from cache), then the output layer (4096 -> ``--vocab``). Two arms,
each captured as one CUDA graph (vLLM replays decode steps as graphs) and timed over
``--iters`` replays, alternated over ``--rounds``:

- ``bf16``: ``torch.mm`` on bf16 weights;
- ``fp8``: the weights quantized once, per tensor, to ``float8_e4m3fn``; each input quantized per
  call, per tensor (its absolute maximum, the scale, the cast: what vLLM's online FP8 does for
  ``precision: fp8``), then ``torch._scaled_mm`` with bf16 output. The output layer stays bf16
  in this arm too (vLLM does not quantize it).

Reported per M: each arm's milliseconds for the whole step's multiplies, ``linear_ratio`` (bf16 /
fp8 over the layers alone) and ``step_ratio`` (with the output layer). Everything else a real
step does (attention, norms, rotary, the sampler, the engine's own CPU work) costs the same in
both arms, so a fleet's FP8 / bf16 tokens/s is at most ``step_ratio`` at that batch and falls
toward 1 as those costs grow. This is the ceiling lora_fp8_gpu's ``fp8_speedup_bN`` target of
1.3 is measured against; it runs on the GPU host's own torch (no vLLM needed):

    python3 -m bench fp8_gemm_gpu --json out.json

Verdict: ``fp8_ceiling_bM`` is PASS where ``step_ratio`` >= 1.3 (the target is reachable at that
batch, by the multiplies), MISS where it is not.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from bench.lib.result import write_result

HIDDEN, KV, MLP = 4096, 1024, 14336  # Llama-3-8B: 32 query heads of 128, 8 KV heads of 128
LAYER_SHAPES = ((HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN))  # (in, out)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
TARGET = 1.3


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,128,256,512,1024", help="sequences per decode step (default 64..1024)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, Llama-3-8B's)")
    p.add_argument("--vocab", type=int, default=128256, help="output layer rows (default Llama-3's 128,256)")
    p.add_argument("--iters", type=int, default=20, help="graph replays per timing (default 20)")
    p.add_argument("--rounds", type=int, default=5, help="alternated timings per arm and batch (default 5)")
    p.add_argument("--json", help="write the result here")
    return p.parse_args(argv)


def quantize(x):
    """``x`` as float8_e4m3fn with one scale for the tensor (its absolute maximum over FP8_MAX)."""
    import torch

    scale = (x.abs().amax().float() / FP8_MAX).clamp(min=1e-12)
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


class Model:
    """The step's weights in both precisions (each linear layer's FP8 weight transposed to the
    column-major layout ``_scaled_mm`` takes as its second operand)."""

    def __init__(self, layers: int, head):
        import torch

        g = torch.Generator(device="cuda").manual_seed(0)
        self.bf16 = [[torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) * n_in ** -0.5
                      for n_in, n_out in LAYER_SHAPES] for _ in range(layers)]
        self.fp8 = [[(q.t(), s) for q, s in map(quantize, layer)] for layer in self.bf16]
        self.head = head

    def step(self, inputs, fp8: bool):
        """The step's multiplies; ``inputs`` holds one activation per linear layer's input width."""
        import torch

        for bf16_layer, fp8_layer in zip(self.bf16, self.fp8):
            for (n_in, _), w, (wq_t, w_scale) in zip(LAYER_SHAPES, bf16_layer, fp8_layer):
                x = inputs[n_in]
                if fp8:
                    xq, x_scale = quantize(x)
                    torch._scaled_mm(xq, wq_t, scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16,
                                     use_fast_accum=True)  # as vLLM's Hopper FP8 kernels accumulate
                else:
                    torch.mm(x, w.t())
        torch.mm(inputs[HIDDEN], self.head.t())


def timed_graph(model: Model, m: int, fp8: bool, iters: int):
    """A callable that replays the step's graph ``iters`` times and returns ms per step."""
    import torch

    inputs = {n: torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for n in (HIDDEN, MLP)}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph (cuBLAS picks its kernels)
        for _ in range(3):
            model.step(inputs, fp8)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.step(inputs, fp8)

    def run() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(iters):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    return run


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm_gpu needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    head = torch.randn(args.vocab, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
    model = Model(args.layers, head)
    head_only = Model(0, head)  # the output layer alone: the share no precision changes
    rows, verdicts = [], {}
    for m in [int(b) for b in args.batches.split(",")]:
        arms = {"bf16": timed_graph(model, m, False, args.iters), "fp8": timed_graph(model, m, True, args.iters)}
        head = timed_graph(head_only, m, False, args.iters)
        ms: dict[str, list[float]] = {k: [] for k in arms}
        head_ms = []
        for r in range(args.rounds):
            for k in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                ms[k].append(arms[k]())
            head_ms.append(head())
        bf16, fp8, out = (statistics.median(ms["bf16"]), statistics.median(ms["fp8"]), statistics.median(head_ms))
        row = {"batch": m, "bf16_ms": bf16, "fp8_ms": fp8, "output_layer_ms": out,
               "linear_ratio": (bf16 - out) / (fp8 - out), "step_ratio": bf16 / fp8, "rounds_ms": ms}
        verdicts[f"fp8_ceiling_b{m}"] = "PASS" if row["step_ratio"] >= TARGET else "MISS"
        print(f"M={m:5}: bf16 {bf16:7.3f} ms, fp8 {fp8:7.3f} ms (output layer {out:6.3f} ms in both): "
              f"linear layers {row['linear_ratio']:.2f}x, step {row['step_ratio']:.2f}x", flush=True)
        rows.append(row)
    metrics = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}
    return write_result(args.json, "fp8_gemm_gpu", args, metrics, verdicts)


if __name__ == "__main__":
    main()
