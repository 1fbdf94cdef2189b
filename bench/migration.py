"""Request migration (``fleet.migration``) against re-sending from the prompt, on real vLLM CPU engines.

For each mode (``on``, then ``off``), a fresh fleet of 2 shards of the tiny model (recovery off,
so no restart competes for the CPU while it is measured) generates ``--requests`` prompts of
``--tokens`` tokens each (greedy, EOS ignored). While it runs, the benchmark reads shard 1's own
count of what its requests have made (``ShardActor.unfinished``: vLLM's output processor) every
20 ms; once they are ``--kill-at`` (0.75) of the way, it reads the count once more and SIGKILLs
the shard's actor. Then:

- wasted tokens: what shard 1 had made at the kill and is generated again. Off: all of it (each
  request starts again from its prompt). On: what it had made less what the results kept (each
  moved result's first ``migrations`` entry, ``at_token``: what the driver had checkpointed);
- time to the last result, from the call's start;
- checkpoint calls made (on): what migration costs the driver and the shards, one small call per
  busy shard per ``fleet.migration.checkpoint_s``.

Before the kill run, each mode runs the same batch once uninterrupted (the greedy reference), and
the ``on`` fleet runs it ``--rounds`` more times each with its checkpointer on and off in turn:
the ratio of their median wall times is what checkpointing costs a batch that loses nothing. And
the CPU time of one checkpoint's work (the shard building it, the driver merging it) at this
batch's size is timed in-process.

Target: wasted tokens with migration <= 5% of those without; every result complete (``--tokens``
tokens), and greedy results equal to the uninterrupted run's.

    flock /tmp/nemo_gen_engine.lock .venv/bin/python -m bench migration [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lib.noise import ForeignCpu, noisy_note
from bench.lib.result import write_result
from bench.lib.setup import LocalCpu, load, quiet_environment, token_prompts
from bench.lib.stats import check, verdict

WASTE_TARGET = 0.05  # wasted tokens with migration / without: at most


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--tokens", type=int, default=512, help="tokens per request (EOS ignored)")
    p.add_argument("--kill-at", type=float, default=0.75, help="fraction of the tokens made when shard 1 is killed")
    p.add_argument("--checkpoint-s", type=float, default=None, help="fleet.migration.checkpoint_s (default: the setting's)")
    p.add_argument("--rounds", type=int, default=3, help="uninterrupted batches with checkpoints on and off, each")
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


def checkpoint_cpu(requests: int, tokens: int, every: int = 8, rounds: int = 50) -> dict[str, float]:
    """The CPU time of one checkpoint of ``requests`` requests: the shard building it from
    ``tokens`` tokens each (``every`` new since the last) and the driver merging it."""
    from nemo_gen.core.migration import Checkpoints
    from nemo_gen.shard.progress import checkpoint

    ids, lps, spans = list(range(tokens)), [-0.5] * tokens, [(1, tokens)]
    running = [(f"c0:{i}", lambda start: [(ids[start:], lps[start:], spans, None)]) for i in range(requests)]
    cp = Checkpoints()
    cp.apply(checkpoint({k: 0 for k, _ in running}, running))
    known = {k: tokens - every for k, _ in running}
    t0 = time.process_time()
    for _ in range(rounds):
        built = checkpoint(known, running)
    build_us = (time.process_time() - t0) / rounds * 1e6
    t0 = time.process_time()
    for _ in range(rounds):
        cp.apply(built)
    return {"build_us": round(build_us, 1), "merge_us": round((time.process_time() - t0) / rounds * 1e6, 1),
            "requests": requests, "new_tokens_each": every}


def made_on(actor: Any) -> tuple[int, int]:
    """(requests running on the shard, tokens they have made), by vLLM's own count."""
    import ray

    running = ray.get(actor.unfinished.remote(), timeout=10).requests
    return len(running), sum(n for _, n in running)


def cost_rounds(fleet: Any, prompts: list[list[int]], params: dict[str, Any], rounds: int) -> dict[str, Any]:
    """What checkpointing costs a batch that loses nothing, on one fleet: the same uninterrupted
    batch with the checkpointer on and off in turn (``rounds`` each, alternating, so the
    machine's drift falls on both); the median wall time of each and their ratio."""
    checkpointer, walls = fleet.router.checkpointer, {"on": [], "off": []}
    try:
        for i in range(2 * rounds):
            mode = ("on", "off")[i % 2]
            fleet.router.checkpointer = checkpointer if mode == "on" else None
            t0 = time.monotonic()
            fleet.generate(prompts, **params)
            walls[mode].append(round(time.monotonic() - t0, 3))
    finally:
        fleet.router.checkpointer = checkpointer
    on, off = statistics.median(walls["on"]), statistics.median(walls["off"])
    return {"on_s": walls["on"], "off_s": walls["off"], "ratio": round(on / off, 3)}


def run_mode(local: LocalCpu, mode: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    from nemo_gen import GenerationFleet

    from nemo_gen.tiny_model import make_tiny_model

    long_model = make_tiny_model(local.work / "tiny-long", max_position_embeddings=2048)  # room for --tokens
    overrides = {"model.path": str(long_model), "fleet.name": f"migration-{mode}", "fleet.num_shards": 2,
                 "fleet.migration.mode": mode,
                 "health.auto_recover": False, "health.probe_interval_s": 60,
                 "generation.vllm_cfg.max_model_len": max(256, args.tokens + 64)}
    if args.checkpoint_s is not None and mode == "on":
        overrides["fleet.migration.checkpoint_s"] = args.checkpoint_s
    fleet = GenerationFleet.launch(local.settings(**overrides))
    params = dict(temperature=0, max_new_tokens=args.tokens, ignore_eos=True)
    try:
        fleet.generate(prompts[:2], temperature=0, max_new_tokens=8)  # warm
        t0 = time.monotonic()
        reference = fleet.generate(prompts, **params)
        plain_s = time.monotonic() - t0
        ab = cost_rounds(fleet, prompts, params, args.rounds) if mode == "on" else None
        victim = fleet.handle(1)
        out: list = []
        done_at: list[float] = []
        t0 = time.monotonic()

        def call() -> None:
            out.extend(fleet.generate(prompts, **params))
            done_at.append(time.monotonic())

        worker = threading.Thread(target=call)
        worker.start()
        pid = next(s.actor_pid for s in fleet.status() if s.index == 1)
        while True:  # until its requests are --kill-at of the way (the batch is split over both shards)
            held, made = made_on(victim.actor)
            if held and made >= args.kill_at * args.tokens * held:
                break
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        killed_s = time.monotonic() - t0
        worker.join(600)
        moved = [r for r in out if r.migrations]
        kept = sum(r.migrations[0].at_token for r in moved if r.migrations[0].from_shard == 1)
        calls = fleet.router.checkpointer.calls if fleet.router.checkpointer is not None else 0
        return {
            "mode": mode, "uninterrupted_s": round(plain_s, 2), "checkpoint_cost": ab, "killed_at_s": round(killed_s, 2),
            "last_result_s": round(done_at[0] - t0, 2) if done_at else None,
            "made_on_victim": made, "kept": kept, "wasted": max(0, made - kept),
            "moved": len(moved), "rerouted": fleet.router.rerouted, "checkpoint_calls": calls,
            "complete": all(r.ok and len(r.token_ids) == args.tokens for r in out) and len(out) == len(prompts),
            "same_as_uninterrupted": [r.token_ids for r in out] == [r.token_ids for r in reference],
        }
    finally:
        fleet.shutdown()


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_environment()
    import ray

    prompts = token_prompts(args.requests, 16)
    cpu = checkpoint_cpu(args.requests, args.tokens)
    print(f"one checkpoint of {args.requests} requests: built in {cpu['build_us']} us, merged in {cpu['merge_us']} us",
          flush=True)
    local = LocalCpu("migration")
    began = time.monotonic()
    try:
        with ForeignCpu() as others:
            runs = {mode: run_mode(local, mode, args, prompts) for mode in ("on", "off")}
            foreign = ForeignCpu.share(others.cpu_s(), time.monotonic() - began)
    finally:
        ray.shutdown()
    on, off = runs["on"], runs["off"]
    ratio = on["wasted"] / off["wasted"] if off["wasted"] else None
    for r in runs.values():
        print(f"migration {r['mode']:>3}: uninterrupted {r['uninterrupted_s']} s; killed at {r['killed_at_s']} s with "
              f"{r['made_on_victim']} tokens made on shard 1; kept {r['kept']}, wasted {r['wasted']}; last result "
              f"{r['last_result_s']} s; moved {r['moved']}, re-routed {r['rerouted']}, checkpoint calls "
              f"{r['checkpoint_calls']}", flush=True)
    print(f"wasted with / without migration: {ratio if ratio is None else round(ratio, 4)} (target <= {WASTE_TARGET})"
          f"{noisy_note(foreign)}; {load()}")
    cost = on["checkpoint_cost"]
    print(f"an uninterrupted batch with checkpoints / without, same fleet: {cost['ratio']} (medians of "
          f"{cost['on_s']} s and {cost['off_s']} s)", flush=True)
    metrics = {"runs": runs, "wasted_ratio": ratio, "checkpoint_cpu": cpu, "others_cpu_share": foreign,
               "checkpoint_cost_ratio": cost["ratio"]}
    verdicts = {"wasted_with_migration_le_5pct": verdict(ratio, WASTE_TARGET, higher_is_better=False),
                "every_result_complete": check(on["complete"] and off["complete"]),
                "greedy_equals_uninterrupted": check(on["same_as_uninterrupted"] and off["same_as_uninterrupted"])}
    write_result(args.json, "migration", args, metrics, verdicts)
    return metrics


if __name__ == "__main__":
    main()
