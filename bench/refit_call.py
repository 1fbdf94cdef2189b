"""The fixed cost of one refit call: a shard's direct line (``refit.control_channel``) against a Ray
actor call, side by side in one run.

A tiny model's refit (``nemo_gen_shm``, one chunk, ``apply_weight_update``) moves almost no bytes,
so its time is the call. The same staged update is applied over and over, the two transports
alternating round by round (this machine is shared and noisy), and for each it prints the median:
- the client's wall time;
- the call reaching the actor, from the client's call to the actor's entry (perf_counter is one
  clock for every process of a Linux host);
- the time in the actor, which is the same work either way;
- the answer back, from the actor's return to the client's.

Run: ``python -m bench refit_call [--rounds 40] [--shards 1] [--json out.json]``.
On the H200 the Ray call cost 1.53 ms to the actor and 1.20 ms back, inside an 8.0 ms refit of a
4.46 GB model (2026-12-03); the GPU benchmark (bench/gpu_bench.py) measures the line there.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import LocalCpu, quiet_environment
from bench.lib.stats import check, medians



def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    import ray
    import torch
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen import GenerationFleet
    from nemo_gen.vllm_ext.vllm_backend import SharedMemoryTrainerInitInfo

    local = LocalCpu("refit-call")
    settings = local.settings(**{"fleet.num_shards": args.shards})
    fleet = GenerationFleet.launch(settings)
    try:
        policy = AutoModelForCausalLM.from_pretrained(str(local.model), dtype=torch.float32)
        client = fleet.weight_sync_client()
        engine = WeightTransferTrainerFactory.trainer_init(
            SharedMemoryTrainerInitInfo(staging_dir=str(local.work)), client=client, source=ModuleSource(policy))
        staged = {}

        class Capture:  # stage once through the trainer engine, keep the one chunk it sends
            def __getattr__(self, name):
                return getattr(client, name)

            def apply_weight_update(self, info):
                staged["info"] = info
                return client.apply_weight_update(info)

        engine.client = Capture()
        engine.send_weights()
        info = staged["info"]
        arms = {"direct line": True, "Ray": False}
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for r in range(args.rounds):
            for arm in (arms if r % 2 == 0 else reversed(list(arms))):
                fleet.driver.channels = arms[arm]
                client.timings.clear()
                t0 = time.perf_counter()
                report = client.apply_weight_update(info)
                t1 = time.perf_counter()
                assert report.ok, report
                shard = next(iter(client.timings.values()))
                runs[arm].append({"wall_s": t1 - t0, "to_actor_s": shard["entered_at"] - t0,
                                  "in_actor_s": shard["actor_s"], "back_s": t1 - shard["left_at"]})
        fleet.driver.channels = True
        engine.shutdown()
        calls = [ray.get(h.actor.info.remote(), timeout=30).direct_calls for h in fleet.shards]
    finally:
        fleet.shutdown()
        ray.shutdown()

    med = {arm: medians(rs) for arm, rs in runs.items()}
    print(f"{args.rounds} refits per transport, {args.shards} shard(s), tiny model (nemo_gen_shm, one call)")
    print(f"{'':14}{'wall':>10}{'to actor':>10}{'in actor':>10}{'back':>10}   (medians, ms)")
    for arm, m in med.items():
        print(f"{arm:14}" + "".join(f"{m[k] * 1e3:10.3f}" for k in ("wall_s", "to_actor_s", "in_actor_s", "back_s")))
    ratio = {k: med["Ray"][k] / med["direct line"][k] for k in med["Ray"]}
    saved = (med["Ray"]["wall_s"] - med["direct line"]["wall_s"]) * 1e3
    print(f"Ray / direct line: wall {ratio['wall_s']:.2f}x, to actor {ratio['to_actor_s']:.2f}x, "
          f"back {ratio['back_s']:.2f}x; {saved:.2f} ms saved per refit")
    print(f"calls the shards served over their line: {calls} (expected: {args.rounds + 2} each: the set-up, the first refit and the direct rounds)")
    metrics = {"medians": med, "ray_over_direct": ratio, "saved_ms": saved, "direct_calls": calls, "runs": runs}
    return write_result(args.json, "refit_call", args, metrics, {
        "direct_line_faster": check(ratio["wall_s"] > 1.0),
        "calls_over_the_line": check(all(c == args.rounds + 2 for c in calls))})
