"""In-flight refit benchmark: what a refit costs a fleet that is generating, per ``refit.in_flight``
mode, measured side by side in one run.

For each arm (no refit, then drain, keep, abort) the same window of continuous load runs: client
threads that each loop ``fleet.generate`` on long batches (ignore_eos), while a refitter swaps the
weights every ``--every`` seconds (alternating two checkpoints of the same shape). Printed per arm:

- fleet tokens/s over the window, and as a ratio of the no-refit arm (target for keep: >= 0.9);
- the generation stall per refit: the longest stretch without a finished engine step that
  overlaps the refit (the engines report their stretches on the machine's monotonic clock),
  against the refit's own time on an idle fleet measured in the same run (target for keep:
  stall <= 1.5x that); and the window's longest stretch overall, refit or not (the no-refit
  arm's is the floor: a new batch's prefill);
- how many results spanned two weight versions, and refits done.

Run: ``python -m bench refit_inflight [--window 30] [--every 10] [--device cpu|gpu] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment, two_tiny_models
from bench.lib.stats import verdict


PROMPTS = [f"{w} the quick brown fox jumps over the lazy dog" for w in ("One", "Two", "Three", "Four")] * 2


def settings(home: Path, model: Path, shards: int, device: str):
    from nemo_gen.settings import NemoGenSettings

    extra = {}
    if device == "gpu":  # every shard on the one GPU, CUDA graphs on (as RL rollouts run)
        extra = {"fleet.shards_per_gpu": max(1, shards), "generation.vllm_cfg.precision": "bfloat16",
                 "generation.vllm_cfg.enforce_eager": False,
                 "generation.vllm_cfg.gpu_memory_utilization": round(0.3 / max(1, shards), 3)}
    return NemoGenSettings.load(overrides={
        "home": str(home), "model.path": str(model), "fleet.name": "bench-inflight", "fleet.device": device,
        "fleet.num_shards": shards, "generation.vllm_cfg.max_model_len": 512, "health.probe_interval_s": 60,
        "ray.num_cpus": max(2, shards), **extra,
    })


def step_gaps(fleet, reset: bool) -> tuple[float, list[tuple[float, float]]]:
    """(the longest stretch without a step on any shard, every stretch over 5 ms)."""
    import ray

    gaps = ray.get([h.actor.call.remote("step_gaps", reset) for h in fleet.shards], timeout=60)
    return max(g.max_step_gap_s for g in gaps), [tuple(x) for g in gaps for x in g.gaps]


def refit_stall(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    """The longest stretch without a step that overlaps the refit [start, end]."""
    return max((e - s for s, e in gaps if e > start and s < end), default=0.0)


def arm(fleet, mode: str | None, models: list[str], window_s: float, every_s: float, clients: int, tokens: int):
    """One window of load; ``mode`` None: no refit."""
    stop = threading.Event()
    counted = {"tokens": 0, "two_versions": 0, "results": 0}
    lock = threading.Lock()

    def client():
        while not stop.is_set():
            results = fleet.generate(PROMPTS, temperature=0, max_new_tokens=tokens, ignore_eos=True)
            with lock:
                counted["tokens"] += sum(len(r.token_ids) for r in results if r.ok)
                counted["results"] += len(results)
                counted["two_versions"] += sum(len(r.weight_versions) > 1 for r in results)

    refits = []  # (start, end) on the monotonic clock
    step_gaps(fleet, reset=True)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    n = 0
    while time.monotonic() - t0 < window_s:
        time.sleep(min(every_s, max(0.0, window_s - (time.monotonic() - t0))))
        if mode is not None and time.monotonic() - t0 < window_s:
            r0 = time.monotonic()
            fleet.refit(models[n % 2], in_flight=mode)
            refits.append((r0, time.monotonic()))
            n += 1
    stop.set()
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join()
    longest, gaps = step_gaps(fleet, reset=True)
    stalls = [refit_stall(gaps, a, b) for a, b in refits]
    return {"mode": mode or "no refit", "tokens_per_s": counted["tokens"] / elapsed, "refits": len(refits),
            "refit_s_median": statistics.median([b - a for a, b in refits]) if refits else 0.0,
            "refit_stall_s_max": max(stalls, default=0.0), "refit_stall_s_median": statistics.median(stalls) if stalls else 0.0,
            "refit_stalls_s": stalls,
            "max_stall_s": longest, "results": counted["results"], "spanning_two_versions": counted["two_versions"]}


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=30.0, help="seconds of load per arm")
    p.add_argument("--every", type=float, default=10.0, help="seconds between refits")
    p.add_argument("--clients", type=int, default=2, help="concurrent generate loops")
    p.add_argument("--tokens", type=int, default=256, help="tokens per request (ignore_eos)")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--idle-refits", type=int, default=5, help="refits on the idle fleet (their median is the yardstick)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    from nemo_gen import GenerationFleet

    work, a, b = two_tiny_models("nemo-gen-bench-inflight-")
    fleet = GenerationFleet.launch(settings(work / "home", a, args.shards, args.device))
    out = {"device": args.device, "window_s": args.window, "every_s": args.every, "clients": args.clients, "tokens": args.tokens}
    try:
        fleet.generate(PROMPTS, max_new_tokens=8)  # warm
        idle = []
        for i in range(args.idle_refits):  # the refit's own time, with nothing running
            r0 = time.monotonic()
            fleet.refit(str([b, a][i % 2]))
            idle.append(time.monotonic() - r0)
        idle_s = statistics.median(idle)
        out["idle_refit_s"] = idle_s
        print(f"refit on an idle fleet: {idle_s * 1000:.0f} ms median {[round(t * 1000) for t in idle]}")
        arms = [arm(fleet, mode, [str(b), str(a)], args.window, args.every, args.clients, args.tokens)
                for mode in (None, "drain", "keep", "abort")]
    finally:
        fleet.shutdown()
    base = arms[0]["tokens_per_s"]
    print(f"\n{'mode':<10}{'tokens/s':>10}{'vs none':>9}{'refit stall':>13}{'stall/refit':>13}{'longest':>9}"
          f"{'refits':>8}{'refit s':>9}{'2-version results':>19}")
    for r in arms:
        r["throughput_vs_no_refit"] = r["tokens_per_s"] / base
        r["stall_vs_idle_refit"] = r["refit_stall_s_max"] / idle_s
        print(f"{r['mode']:<10}{r['tokens_per_s']:>10.0f}{r['throughput_vs_no_refit']:>9.2f}"
              f"{r['refit_stall_s_max']:>12.3f}s{r['stall_vs_idle_refit']:>13.1f}{r['max_stall_s']:>8.3f}s"
              f"{r['refits']:>8}{r['refit_s_median']:>9.3f}{r['spanning_two_versions']:>19}")
    keep = next(r for r in arms if r["mode"] == "keep")
    print(f"\nkeep: throughput {keep['throughput_vs_no_refit']:.2f} of no refit (target >= 0.9); "
          f"stall {keep['stall_vs_idle_refit']:.1f}x the refit's own time at most, "
          f"{keep['refit_stall_s_median'] / idle_s:.1f}x median over {keep['refits']} refits (target <= 1.5); "
          f"load average {os.getloadavg()[0]:.1f}")
    out["arms"] = arms
    return write_result(args.json, "refit_inflight", args, out, {
        "keep_throughput": verdict(keep["throughput_vs_no_refit"], 0.9, higher_is_better=True),
        "keep_stall": verdict(keep["refit_stall_s_median"] / idle_s, 1.5, higher_is_better=False)})
