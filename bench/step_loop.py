"""Where a CPU fleet's generation time goes, side by side in one run on one shard's engine:
``fleet.generate`` (router, Ray, the shard actor), the actor's ``generate`` called straight,
and inside the actor (``gpu_bench.in_actor_throughput``): nemo_gen's step loop on final outputs
(a batch), the same loop with every step's outputs (as a stream runs), and vLLM's own
``LLM.generate`` on the same engine. Printed: seconds of each (best of ``--rounds``, the arms
interleaved) and each in-actor loop as a ratio of ``LLM.generate`` (target for the batch loop:
<= 1.05). The GPU benchmark (``bench/gpu_bench.py``) measures the same on a CUDA engine.

``--bare`` adds ``bare_llm_generate``: ``LLM.generate`` in a plain process (no Ray) on an engine
started with the fleet's own engine arguments and environment, its runs interleaved with the
others: whether the same engine is slower inside a shard actor than outside it (on the H200 the
fleet's batch took 5.3 s where a bare process took 4.1-4.7, 2026-12-02).

Run: ``python -m bench step_loop [--prompts 256] [--tokens 64] [--rounds 3] [--bare] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import one_shard_tiny, quiet_environment, token_prompts
from bench.lib.stats import verdict



def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--bare", action="store_true", help="also LLM.generate in a plain process on the fleet's engine config")
    args = p.parse_args(argv)
    quiet_environment()

    from bench.front_end import PlainEngine
    from bench.gpu_bench import in_actor_throughput
    from nemo_gen import GenerationFleet

    settings, work = one_shard_tiny("steploop")
    prompts = token_prompts(args.prompts)
    fleet = GenerationFleet.launch(settings)
    best: dict[str, float] = {}
    bare = None
    try:
        fleet.generate(prompts[:8], temperature=0, max_new_tokens=args.tokens, ignore_eos=True)  # warm
        if args.bare:
            bare = PlainEngine(fleet.resolved.shards[0], prompts, args.tokens, work)
        for _ in range(args.rounds):
            t = time.perf_counter()
            fleet.generate(prompts, temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
            times = {"fleet_generate": time.perf_counter() - t}
            inside = in_actor_throughput(fleet.shards[0], prompts, args.tokens, 1)
            times["actor_call"] = inside.pop("actor_call")["driver_wall_s"]
            times.update({k: v["seconds"] for k, v in inside.items()})
            if bare is not None:
                times["bare_llm_generate"] = bare.ask("run")["wall_s"]
            for k, v in times.items():
                best[k] = min(best.get(k, v), v)
    finally:
        if bare is not None:
            bare.close()
        fleet.shutdown()
    ratios = {k: best[k] / best["llm_generate"] for k in ("step_loop", "step_loop_per_step")}
    for k, v in best.items():
        print(f"{k:<20}{v:8.3f} s" + (f"   {ratios[k]:.2f}x LLM.generate" if k in ratios else ""))
    if "bare_llm_generate" in best:
        print(f"LLM.generate in the shard actor / in a plain process: {best['llm_generate'] / best['bare_llm_generate']:.2f}; "
              f"fleet.generate / bare: {best['fleet_generate'] / best['bare_llm_generate']:.2f}")
    print(f"\nbatch step loop / LLM.generate: {ratios['step_loop']:.2f} (target <= 1.05); "
          f"per-step loop {ratios['step_loop_per_step']:.2f}; load average {os.getloadavg()[0]:.1f}")
    return write_result(args.json, "step_loop", args, {"best_s": best, "over_llm_generate": ratios,
                                                       "load_average": os.getloadavg()[0]},
                        {"step_loop_over_llm_generate": verdict(ratios["step_loop"], 1.05, higher_is_better=False)})
