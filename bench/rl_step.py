"""One GRPO step, synchronous against asynchronous: examples/grpo.py's loop at a fixed size, both
modes on one fleet in one run, and where each step's time goes.

Both modes train from the same checkpoint, with the same task, sizes and seed, on the same fleet
(launched once: one shard, ``fleet.mode: train``, ``refit.in_flight: keep``): first ``--mode
sync`` (generate, train, refit), then ``--mode async`` (the next step's rollouts run while the
trainer steps; the refit lands on them). Printed per mode (medians over every step after the
first): step time and its phases — waiting for rollouts, train, refit — and the generate call's
own time; then the ratios:

- async / sync steps per second (NeMo-RL's in-flight updates: 187 -> 478 tokens/s/GPU; PipelineRL
  ~2x, on separate GPUs);
- refit share of a step (target <= 1 % on the GPU);
- idle share: the part of a step in which neither the engines generated nor the trainer trained
  or refit (the device's idle share when they share one), and the trainer's share spent waiting;
- the logprob mismatch between the engines and the trainer on the sampled tokens (sync: numerics
  only; async: plus one step of training), and the reward over the first and the last 5 steps.

    python -m bench rl_step --json bench/results/DATE/rl_step-cpu.json       # CPU, tiny model
    python3 bench/rl_step.py --device gpu --model-size 1b --prompts 64 --group 8 --max-new-tokens 128 \
        --steps 20 --max-seconds 150 --out $OUT/rl --json $OUT/rl_step-gpu.json      # one H200

Every flag of examples/grpo.py is accepted (``--mode`` is ignored: both run). Each mode's
``steps.jsonl`` and ``run.png`` go to ``OUT/sync`` and ``OUT/async``.
"""

from __future__ import annotations

import copy
import os
import platform
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import REPO as ROOT, quiet_environment
from bench.lib.stats import check, verdict



def stack(device: str) -> dict:
    import ray
    import torch
    import transformers
    import vllm

    info = {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
            "ray": ray.__version__, "transformers": transformers.__version__, "cpus": os.cpu_count()}
    if device == "gpu":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def release_trainer() -> None:
    """The last run's trainer (module, master copy, optimizer state: ~23 GB for the 1b model) gone
    before the next one loads beside the engine on a shared GPU."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


ROWS = (("step_s", "step"), ("wait_s", "  waiting for rollouts"), ("train_s", "  train"), ("refit_s", "  refit"),
        ("rollout_s", "generate call"))


def table(modes: dict[str, dict]) -> str:
    rows = [(key, label, ".3f") for key, label in ROWS]
    rows += [("refit_share", "refit share", ".1%"), ("idle_share", "idle share", ".1%"),
             ("trainer_wait_share", "trainer waiting share", ".1%"),
             ("logprob_mismatch_mean", "logprob mismatch", ".3g"),
             ("reward_first5", "reward, first 5", ".3g"), ("reward_last5", "reward, last 5", ".3g")]
    lines = [f"{'median seconds':<24}" + "".join(f"{m:>10}" for m in modes)]
    for key, label, spec in rows:
        cells = ("-" if s.get(key) is None else format(s[key], spec) for s in modes.values())
        lines.append(f"{label:<24}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    quiet_environment()
    from examples import grpo  # the loop is the example's, as users copy it

    p = grpo.parser()
    p.description = __doc__.splitlines()[0]
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of each mode, alternating (sync, async, then async, sync, ...): the step times "
                   "are medians over all of them, on a machine whose load drifts")
    p.add_argument("--json", type=Path, help="write the results here as JSON")
    base = grpo.parse_args(argv, p)
    out = Path(base.out if base.out != p.get_default("out") else ".nemo-gen/rl_step")
    model_dir = grpo.make_model(base)
    from nemo_gen import GenerationFleet

    def args_of(mode: str, r: int):
        args = copy.copy(base)
        args.mode, args.out = mode, str(out / (mode if r == 0 else f"{mode}-{r}"))
        return args

    result = {"stack": stack(base.device),
              "size": {k: getattr(base, k) for k in ("device", "model_size", "model", "prompts", "group",
                                                     "max_new_tokens", "steps", "rounds", "lr", "shards", "max_lag",
                                                     "max_staleness_tokens", "refit", "engine", "recompute_kv")},
              "out": str(out), "errors": []}
    runs: dict[str, list[list[dict]]] = {"sync": [], "async": []}
    t0 = time.perf_counter()
    with GenerationFleet.launch(grpo.fleet_settings(args_of("async", 0), model_dir)) as fleet:
        result["launch_s"] = time.perf_counter() - t0
        for r in range(base.rounds):
            for mode in (("sync", "async") if r % 2 == 0 else ("async", "sync")):
                args = args_of(mode, r)
                try:
                    records = grpo.run(fleet, model_dir, args, Path(args.out))
                    grpo.plot(records, Path(args.out) / "run.png", grpo.title(args))
                    runs[mode].append(records)
                except Exception as exc:  # recorded, and the other mode still runs: a GPU sitting is one try
                    import traceback

                    traceback.print_exc()
                    result["errors"].append({"mode": mode, "round": r, "error": f"{type(exc).__name__}: {exc}",
                                             "trace": traceback.format_exc()[-3000:]})
                release_trainer()
                summarize(grpo, runs, result)
                save(result, base)
    print(table(result["modes"]))
    if "ratios" in result:
        print(f"async / sync steps per second: {result['ratios']['async_over_sync_steps_per_s']:.2f}")
    return result


def summarize(grpo, runs: dict[str, list[list[dict]]], result: dict) -> None:
    """Rewards and mismatch from each mode's first run; step times over every run, each without
    its first step (warm-up); the ratios once both modes have run."""
    result["modes"] = {mode: {**grpo.summary(rs[0]),
                              **grpo.summary([rec for run in rs for rec in run[1:]], timing_only=True)}
                       for mode, rs in runs.items() if rs}
    modes = result["modes"]
    if len(modes) == 2:
        result["ratios"] = {"async_over_sync_steps_per_s": modes["sync"]["step_s"] / modes["async"]["step_s"],
                            "refit_share": {m: s["refit_share"] for m, s in modes.items()},
                            "idle_share": {m: s["idle_share"] for m, s in modes.items()}}


def save(result: dict, args) -> None:
    """The result so far (a GPU sitting may be cut off: every mode's run is kept as it lands)."""
    verdicts = {"no_errors": check(not result["errors"])}
    if "ratios" in result:
        verdicts["async_faster"] = verdict(result["ratios"]["async_over_sync_steps_per_s"], 1.0, higher_is_better=True)
    write_result(args.json, "rl_step", args, result, verdicts)
