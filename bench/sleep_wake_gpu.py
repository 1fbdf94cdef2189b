"""Sleep and wake of a colocated engine on an 8B-shaped model, against its cold launch (issue 46).

One 1-shard fleet with ``generation.colocated.enabled`` (vLLM's sleep mode; CUDA graphs captured,
as a rollout engine runs) on ``bench.rollout``'s ``8b`` model (a random Llama of Llama-3-8B's
shape, bf16, ~16 GB). Measured in one run, on one GPU:

- ``launch_s``: the fleet's cold launch (engine start, weights load, KV cache and CUDA graphs);
- per cycle (``--cycles``): ``sleep(1)`` (weights to CPU memory, KV cache dropped), then NeMo-RL's
  order ``wake(["weights"])``, ``wake(["kv_cache"])``: each call's wall seconds, and the GPU memory
  the shard's processes hold after each step (NVML, per process);
- ``freed_fraction``: 1 - asleep / awake, target >= 0.9; ``tokens_equal``: greedy tokens after
  every wake equal the ones before the first sleep; ``wake_over_launch``: (sleep + both wakes) /
  the cold launch: what a sleep cycle saves against restarting the engine.

Run on the GPU host (the 8b model is made in ``--work`` once, shared with ``bench rollout``):
``python -m bench sleep_wake_gpu --work /tmp/nemo-gen-rollout --out DIR``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment, token_prompts
from bench.lib.stats import check, verdict

NAME = "sleep_wake_gpu"
FREED_TARGET = 0.9


def summarize(launch_s: float, cycles: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over the cycles and the ratios the targets read. Each cycle: ``awake_bytes``,
    ``asleep_bytes``, ``sleep_s``, ``wake_weights_s``, ``wake_kv_cache_s``, ``tokens_equal``."""
    if not cycles:
        raise ValueError("no sleep/wake cycle ran")
    med = {k: statistics.median(c[k] for c in cycles) for k in ("sleep_s", "wake_weights_s", "wake_kv_cache_s")}
    freed = min(1 - c["asleep_bytes"] / c["awake_bytes"] for c in cycles)  # the worst cycle
    cycle_s = med["sleep_s"] + med["wake_weights_s"] + med["wake_kv_cache_s"]
    return {**med, "launch_s": launch_s, "freed_fraction": freed, "cycle_s": cycle_s,
            "wake_s": med["wake_weights_s"] + med["wake_kv_cache_s"],
            "wake_over_launch": cycle_s / launch_s, "tokens_equal": all(c["tokens_equal"] for c in cycles)}


def held(fleet) -> int:
    """GPU bytes the shard's processes hold (the actor and its EngineCore), by NVML per process."""
    from nemo_gen.host import gpu_memory

    (s,) = fleet.status()
    return sum(gpu_memory.used_by_pids({s.actor_pid, *s.engine_pids}).values())


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=3, help="sleep / wake cycles (medians)")
    p.add_argument("--util", type=float, default=0.8, help="the engine's share of GPU memory")
    p.add_argument("--layers", type=int, default=0, help="0: the 8b model; N: a smaller one of N layers")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "nemo-gen-rollout"))
    p.add_argument("--out", type=Path, required=True, help="folder for sleep_wake_gpu.json")
    args = p.parse_args(argv)
    if args.cycles < 1:
        p.error("--cycles must be at least 1")
    quiet_environment()

    import torch

    from bench.rollout import MODELS, make
    from nemo_gen import GenerationFleet, NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(args.work)
    tiny = make_tiny_model(work / "tiny")
    if args.layers:
        from bench.gpu_bench import make_model

        model_dir = work / f"sleep-llama-{args.layers}l"
        if not (model_dir / "config.json").exists():
            make_model(model_dir, args.layers, tiny)
    else:
        model_dir = make(args, "8b", work, tiny)
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "model": str(model_dir),
                           "shape": MODELS["8b"] if not args.layers else {"layers": args.layers}}
    prompts = token_prompts(8, 32)
    settings = NemoGenSettings.load(overrides={
        "home": str(work / "sleep-home"), "model.path": str(model_dir), "fleet.name": "gpu-sleep",
        "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 500,
        "ray.namespace": "nemo_gen_gpu_sleep", "generation.colocated.enabled": True,
        "generation.vllm_cfg.precision": "bfloat16", "generation.vllm_cfg.max_model_len": 512,
        "generation.vllm_cfg.gpu_memory_utilization": args.util, "generation.max_new_tokens": 32,
    })

    def greedy() -> list[list[int]]:
        results = fleet.generate(prompts, temperature=0, max_new_tokens=32, ignore_eos=True)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        return [list(r.token_ids) for r in results]

    t0 = time.perf_counter()
    fleet = GenerationFleet.launch(settings)
    launch_s = time.perf_counter() - t0
    print(f"cold launch: {launch_s:.1f} s", flush=True)
    cycles: list[dict[str, Any]] = []
    try:
        reference = greedy()
        for i in range(args.cycles):
            c: dict[str, Any] = {"awake_bytes": held(fleet)}
            t = time.perf_counter()
            report = fleet.sleep(1)
            c["sleep_s"], c["sleep_shard_s"] = time.perf_counter() - t, report.seconds.get(0)
            assert not report.failed, report.failed
            time.sleep(1.0)  # NVML's per-process figure settles after the frees
            c["asleep_bytes"] = held(fleet)
            for tag in ("weights", "kv_cache"):
                t = time.perf_counter()
                report = fleet.wake([tag])
                c[f"wake_{tag}_s"], c[f"wake_{tag}_shard_s"] = time.perf_counter() - t, report.seconds.get(0)
                assert not report.failed, report.failed
                c[f"after_{tag}_bytes"] = held(fleet)
            c["tokens_equal"] = greedy() == reference
            cycles.append(c)
            print(f"cycle {i}: {c}", flush=True)
    finally:
        fleet.shutdown()
    out["cycles"] = cycles
    out.update(summarize(launch_s, cycles))
    print(f"sleep {out['sleep_s']:.2f} s, wake weights {out['wake_weights_s']:.2f} s + kv_cache "
          f"{out['wake_kv_cache_s']:.2f} s; freed {out['freed_fraction']:.3f} of "
          f"{cycles[0]['awake_bytes'] / 2**30:.1f} GiB; cycle / cold launch {out['wake_over_launch']:.3f}", flush=True)
    verdicts = {"freed_fraction": verdict(out["freed_fraction"], FREED_TARGET, higher_is_better=True),
                "tokens_equal": check(out["tokens_equal"]),
                "wake_over_launch": verdict(out["wake_over_launch"], 1.0, higher_is_better=False)}
    args.out.mkdir(parents=True, exist_ok=True)
    return write_result(args.out / f"{NAME}.json", NAME, args, out, verdicts)


if __name__ == "__main__":
    main()
