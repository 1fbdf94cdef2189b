"""Two processes on one GPU, with and without CUDA MPS: how much each slows the other.

A stand-in for the GRPO loop's colocated trainer and engine (bench/rl_step.py) that needs only
torch: a "trainer" process runs forward and backward passes of a 1 B-parameter-sized MLP stack
(bf16, 8,192 tokens a pass), a "generator" process runs decode-sized steps (512 sequences, one
token each, the same layer sizes). Each runs alone, then both at once; the throughput ratio is
the slowdown that overlap costs. Run it once plain and once with the MPS control daemon up
(``nvidia-cuda-mps-control -d``; bench/gpu_sitting.sh's ``mps`` helpers): without MPS the two
contexts time-slice, with MPS their kernels may share the SMs.

    python3 -m bench mps_overlap --seconds 10 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from typing import Sequence

from bench.lib.result import write_result

HIDDEN, FFN, LAYERS = 2048, 5632, 8


def worker(role: str, seconds: float, start, out) -> None:
    import torch

    torch.manual_seed(0)
    dev = torch.device("cuda")
    layers = [(torch.randn(HIDDEN, FFN, device=dev, dtype=torch.bfloat16, requires_grad=role == "trainer") * 0.02,
               torch.randn(FFN, HIDDEN, device=dev, dtype=torch.bfloat16, requires_grad=role == "trainer") * 0.02)
              for _ in range(LAYERS)]
    layers = [(a.detach().requires_grad_(role == "trainer"), b.detach().requires_grad_(role == "trainer"))
              for a, b in layers]
    rows = 8192 if role == "trainer" else 512
    x = torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16)

    def once():
        h = x
        if role == "trainer":
            for a, b in layers:
                h = h + torch.nn.functional.silu(h @ a) @ b
            h.float().pow(2).mean().backward()
        else:
            with torch.no_grad():
                for _ in range(16):  # 16 decode steps of the stack
                    for a, b in layers:
                        h = h + torch.nn.functional.silu(h @ a) @ b

    for _ in range(3):
        once()
    torch.cuda.synchronize()
    start.wait()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        once()
        torch.cuda.synchronize()
        n += 1
    out.put((role, n / (time.perf_counter() - t0)))


def run(roles: list[str], seconds: float) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(roles)), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, seconds, start, out)) for r in roles]
    for p in procs:
        p.start()
    res = dict(out.get() for _ in roles)
    for p in procs:
        p.join()
    return res


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    alone = {**run(["trainer"], args.seconds), **run(["generator"], args.seconds)}
    both = run(["trainer", "generator"], args.seconds)
    result = {"mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "alone_per_s": alone, "both_per_s": both,
              "slowdown": {r: alone[r] / both[r] for r in alone},
              "combined_throughput": sum(both[r] / alone[r] for r in alone)}
    print(json.dumps(result))
    return write_result(args.json, "mps_overlap", args, result)


if __name__ == "__main__":
    main()
