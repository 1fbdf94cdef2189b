"""Launch time of a one-shard CPU fleet with each ``fleet.engine_core_start``, alternating.

For each launch it prints the wall time, the engine's load time (``load_s``), the method the
shard used, each engine process's parent (the EngineCore's: the forkserver, or the actor itself
when spawned) and the greedy tokens, which are the same for both methods.

Run: ``python -m bench engine_start [--order forkserver,spawn,forkserver,spawn] [--json out.json]``.
On 2026-12-03, on a 2-core machine, it gave launches of 37.5 s (forkserver, the first and cold),
34.5 s (spawn), 26.3 s (forkserver) and 33.4 s (spawn); load_s was 23.0 / 33.1 / 15.9 / 31.7 s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import LocalCpu, quiet_environment
from bench.lib.stats import check



def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="forkserver,spawn,forkserver,spawn")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    import psutil
    import ray

    from nemo_gen import GenerationFleet

    local = LocalCpu("engine-start")
    out = []
    try:
        for i, method in enumerate(args.order.split(",")):
            settings = local.settings(**{"fleet.name": f"engine-start-{i}", "fleet.num_shards": 1,
                                         "generation.max_new_tokens": 8, "fleet.engine_core_start": method})
            t0 = time.monotonic()
            fleet = GenerationFleet.launch(settings)
            launch_s = time.monotonic() - t0
            try:
                status = fleet.status()[0]
                parents = {pid: psutil.Process(pid).ppid() for pid in status.engine_pids}
                # CPU seconds each engine process has used: a spawned one's include its own imports
                cpu_s = {pid: round(sum(psutil.Process(pid).cpu_times()[:2]), 1) for pid in status.engine_pids}
                (result,) = fleet.generate(["Hello there"], temperature=0)
                info = fleet.shards[0].info
                out.append({"method": method, "launch_s": round(launch_s, 1), "used": info.engine_core_start,
                            "actor": status.actor_pid, "parents": parents, "cpu_s": cpu_s, "tokens": result.token_ids,
                            "load_s": info.load_s})
                print(out[-1], flush=True)
            finally:
                fleet.shutdown()
    finally:
        ray.shutdown()
    same = len({tuple(r["tokens"]) for r in out}) == 1
    used = all(r["used"] == r["method"] for r in out)
    write_result(args.json, "engine_start", args, {"launches": out},
                 {"same_tokens": check(same), "method_used": check(used)})
    return out
