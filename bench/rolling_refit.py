"""Rolling refit benchmark: a 4-shard fleet of the tiny model under continuous session load, a
refit every ``--every`` seconds, ``refit.rollout: all`` in each in-flight mode against ``waves``,
one run, one fleet (the rollout and in-flight mode switched between arms).

The load: ``--clients`` threads, each looping agent sessions (``fleet.session()``, 3 turns of
``--tokens`` tokens, ignore_eos). The refitter alternates two checkpoints of the same shape.
Printed per arm (no refit; all/drain; all/keep; all/abort with refit.resume_aborted false, so a
cut request comes back cut; waves):

- tokens/s over the window, and tokens/s during refits (tokens of turns finished while a refit
  ran, over the refits' time), each as a ratio of the no-refit arm's window tokens/s
  (target for waves during refits: >= 0.95);
- the longest time with no serving shard: the longest stretch in which no shard finished an
  engine step (the engines report their stretches on the machine's monotonic clock; the
  no-refit arm's is the floor), and for waves the fewest shards serving (in service, not in
  their wave) in the slot table sampled every 50 ms;
- requests aborted per refit (finish_reason "abort"; target for waves: 0) and results that
  span two versions;
- the largest version spread inside one session (newest - oldest version over its turns).

Run: ``flock /tmp/nemo_gen_engine.lock python -m bench rolling_refit [--window 30] [--every 6]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment, two_tiny_models
from bench.lib.stats import verdict

ARMS = (("no refit", "all", None), ("all/drain", "all", "drain"), ("all/keep", "all", "keep"),
        ("all/abort", "all", "abort"), ("waves", "waves", "drain"))


def settings(home: Path, model: Path, shards: int):
    from nemo_gen.settings import NemoGenSettings

    return NemoGenSettings.load(overrides={
        "home": str(home), "model.path": str(model), "fleet.name": "bench-rolling", "fleet.device": "cpu",
        "fleet.num_shards": shards, "generation.vllm_cfg.max_model_len": 512, "health.probe_interval_s": 60,
        "ray.num_cpus": max(2, shards),
    })


def no_step_stretch(gaps_by_shard: list[list[tuple[float, float]]], start: float, end: float) -> float:
    """The longest stretch inside [start, end] in which no shard finished a step: the intersection
    of every shard's step gaps."""
    common = [(start, end)]
    for gaps in gaps_by_shard:
        common = [(max(a, s), min(b, e)) for a, b in common for s, e in gaps if min(b, e) > max(a, s)]
    return max((b - a for a, b in common), default=0.0)


def shard_gaps(fleet) -> list[list[tuple[float, float]]]:
    import ray

    answers = ray.get([h.actor.call.remote("step_gaps", True) for h in fleet.shards], timeout=60)
    return [[tuple(x) for x in g.gaps] for g in answers]


def arm(fleet, name: str, rollout: str, mode: str | None, models: list[str], args) -> dict:
    from nemo_gen.core.waves import Rollout
    from nemo_gen.fleet.rolling import serving_now

    waves = rollout == "waves"
    fleet.settings.refit = fleet.settings.refit.model_copy(update={
        "rollout": Rollout(rollout), "wave_size": 1 if waves else None, "min_serving": args.shards - 1 if waves else None,
        "resume_aborted": mode != "abort"})
    stop = threading.Event()
    lock = threading.Lock()
    turns: list[tuple[float, int, str, tuple[int, ...]]] = []  # (finished at, tokens, finish, versions)
    spreads: list[int] = []
    errors: list[str] = []

    def client(k: int) -> None:
        while not stop.is_set():
            try:
                with fleet.session() as s:
                    messages = [{"role": "user", "content": f"Agent {k}: plan the next step."}]
                    seen: set[int] = set()
                    for t in range(3):
                        r = s.chat(messages, max_new_tokens=args.tokens, ignore_eos=True, temperature=0.0)
                        versions = tuple(v for v, _ in r.weight_versions)
                        seen.update(versions)
                        with lock:
                            turns.append((time.monotonic(), len(r.token_ids), r.finish_reason, versions))
                        messages += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"go {t}"}]
                with lock:
                    spreads.append(max(seen) - min(seen))
            except Exception as exc:  # noqa: BLE001 - counted and shown, the load goes on
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:200])

    serving: list[int] = []

    def sample() -> None:
        table = fleet.members.table
        while not stop.is_set():
            serving.append(len(serving_now(table.ledger, table.roll())))
            time.sleep(0.05)

    shard_gaps(fleet)  # reset
    refits: list[tuple[float, float]] = []
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    threads.append(threading.Thread(target=sample))
    t0 = time.monotonic()
    for t in threads:
        t.start()
    n = 0
    while time.monotonic() - t0 < args.window:
        time.sleep(min(args.every, max(0.0, args.window - (time.monotonic() - t0))))
        if mode is not None and time.monotonic() - t0 < args.window:
            r0 = time.monotonic()
            try:
                fleet.refit(models[n % 2], in_flight=mode)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"refit: {type(exc).__name__}: {exc}"[:200])
            refits.append((r0, time.monotonic()))
            n += 1
    stop.set()
    t1 = time.monotonic()
    for t in threads:
        t.join()
    gaps = shard_gaps(fleet)
    tokens = sum(tok for at, tok, _, _ in turns if at <= t1)
    in_refit = sum(tok for at, tok, _, _ in turns if any(a <= at <= b for a, b in refits))
    refit_s = sum(b - a for a, b in refits)
    return {
        "arm": name, "rollout": rollout, "in_flight": mode, "tokens_per_s": tokens / (t1 - t0),
        "tokens_per_s_during_refits": in_refit / refit_s if refit_s else None,
        "refits": len(refits), "refit_s": [round(b - a, 3) for a, b in refits],
        "no_step_s_max": no_step_stretch(gaps, t0, t1),
        "no_step_s_in_refits": max((no_step_stretch(gaps, a, b) for a, b in refits), default=0.0),
        "min_serving_sampled": min(serving, default=None), "samples": len(serving),
        "aborted": sum(f == "abort" for _, _, f, _ in turns), "two_version_results": sum(len(set(v)) > 1 for *_, v in turns),
        "turns": len(turns), "sessions": len(spreads), "max_session_version_spread": max(spreads, default=0),
        "errors": errors[:5], "error_count": len(errors),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=float, default=30.0, help="seconds of load per arm")
    p.add_argument("--every", type=float, default=6.0, help="seconds between refits")
    p.add_argument("--clients", type=int, default=8, help="concurrent session loops")
    p.add_argument("--tokens", type=int, default=48, help="tokens per turn (ignore_eos)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    quiet_environment()

    from nemo_gen import GenerationFleet

    work, a, b = two_tiny_models("nemo-gen-bench-rolling-")
    fleet = GenerationFleet.launch(settings(work / "home", a, args.shards))
    out = {"window_s": args.window, "every_s": args.every, "clients": args.clients, "tokens": args.tokens,
           "shards": args.shards}
    try:
        with fleet.session() as s:  # warm every path
            s.chat([{"role": "user", "content": "hi"}], max_new_tokens=8)
        arms = [arm(fleet, name, rollout, mode, [str(b), str(a)], args) for name, rollout, mode in ARMS]
    finally:
        fleet.shutdown()
    base = arms[0]["tokens_per_s"]
    print(f"\n{'arm':<11}{'tok/s':>8}{'vs none':>9}{'in refits':>11}{'vs none':>9}{'no step':>9}{'in refit':>10}"
          f"{'min srv':>9}{'aborted':>9}{'2-ver':>7}{'spread':>8}{'refits':>8}{'errors':>8}")
    for r in arms:
        r["vs_no_refit"] = r["tokens_per_s"] / base
        during = r["tokens_per_s_during_refits"]
        r["during_refits_vs_no_refit"] = during / base if during is not None else None
        print(f"{r['arm']:<11}{r['tokens_per_s']:>8.0f}{r['vs_no_refit']:>9.2f}"
              f"{(during or 0):>11.0f}{(r['during_refits_vs_no_refit'] or 0):>9.2f}"
              f"{r['no_step_s_max']:>8.2f}s{r['no_step_s_in_refits']:>9.2f}s{str(r['min_serving_sampled']):>9}"
              f"{r['aborted'] / max(1, r['refits']):>9.1f}{r['two_version_results']:>7}"
              f"{r['max_session_version_spread']:>8}{r['refits']:>8}{r['error_count']:>8}")
    waves = arms[-1]
    print(f"\nwaves: tokens/s during refits {waves['during_refits_vs_no_refit']:.2f} of no refit (target >= 0.95), "
          f"{waves['aborted']} aborted (target 0); load average {os.getloadavg()[0]:.1f}")
    out["arms"] = arms
    return write_result(args.json, "rolling_refit", args, out, {
        "waves_throughput_during_refits": verdict(waves["during_refits_vs_no_refit"] or 0.0, 0.95, higher_is_better=True),
        "waves_aborted": verdict(float(waves["aborted"]), 0.0, higher_is_better=False)})


if __name__ == "__main__":
    main()
