"""What the fleet and the Prefect flow cost, measured side by side in one run.

Two ratios, each against a target:

1. Fleet overhead (fleet / direct generated tokens per second, target >= 0.95).
   One N-shard fleet of vLLM CPU engines (the tiny local model) serves the same fixed-length
   workload two ways: "direct" pre-tokenizes the prompts once, splits them evenly over the shard
   actors and calls ``actor.generate.remote`` on all of them at once; "fleet" calls
   ``fleet.generate(prompts, ...)`` (driver-side tokenization, least-loaded routing, health
   ledger, ``GenerationResult`` per prompt). Both arms are warmed up once, then alternated
   (A,B then B,A, ...) for ``--rounds`` rounds; the ratio is taken within each round.

2. Prefect pipeline overhead (prefect / plain wall time, target <= 1.10).
   The whole pipeline (configure environment, attach Ray, resolve config, launch a fleet,
   generate the built-in prompts, write JSONL, shut down) as plain functions
   (``nemo_gen.pipeline.run_pipeline``) against the Prefect flow as ``nemo-gen run`` runs it
   (``flows.pipeline.run_watched``) reporting to a real local Prefect server, in
   alternating order for ``--pipeline-rounds`` rounds. Every run launches and stops its own
   fleet. The Prefect server and the Ray cluster are started once, by this script, before
   any measurement, so neither arm pays for them: the server comes first (as under
   ``nemo-gen run``) so that the raylet and its workers inherit ``PREFECT_API_URL``; then Ray
   starts as a private local cluster (``ray.init(address="local")`` via ``init_ray``) that both
   arms attach to.

Each pipeline run is split into phases from the progress events both arms emit (setup, launch,
the slowest engine's own load, generate, finish); "rest" is the wall time minus engine load and
generation, the part an orchestrator can add to, and its prefect - plain difference is printed
in seconds next to the ratio.

The machine is shared and noisy: read the spread (min/max), not just the median. The "others"
column is the share of the CPUs that processes outside this benchmark's process tree used
during a round (someone's test run); a part above 10% is flagged NOISY in the summary.

Run it from the repository root::

    make bench
    python -m bench fleet_overhead [--rounds 7] [--pipeline-rounds 2] [--json out.json]

Everything it makes (tiny model, Prefect database, outputs) lives under ``.nemo-gen/bench``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.lib.result import write_result
from bench.lib.noise import ForeignCpu, noisy_note
from bench.lib.setup import HOME, at_least_one, load, make_prompts, quiet_environment
from bench.lib.stats import spread, verdict

FLEET_TARGET = 0.95  # fleet / direct tokens per second: at least
PIPELINE_TARGET = 1.10  # prefect / plain wall time: at most
NAMESPACE = "nemo_gen_bench"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="shards per fleet (default 2)")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts per fleet round (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--rounds", type=int, default=7, help="alternating direct/fleet rounds (default 7)")
    p.add_argument("--pipeline-rounds", type=int, default=2, help="plain/prefect pipeline runs each (default 2)")
    p.add_argument("--skip-pipeline", action="store_true", help="measure the fleet overhead only")
    p.add_argument("--home", type=Path, default=HOME, help="working directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the summary here")
    args = p.parse_args(argv)
    return at_least_one(p, args, ("shards", "prompts", "max_new_tokens", "rounds", "pipeline_rounds"))


def settings_overrides(args: argparse.Namespace, fleet_name: str, **extra: Any) -> dict[str, Any]:
    """Dotted overrides shared by every fleet this benchmark starts."""
    return {
        "home": str(args.home),
        "fleet.name": fleet_name,
        "fleet.num_shards": args.shards,
        "fleet.device": "cpu",
        "generation.vllm_cfg.max_model_len": 512,
        "ray.namespace": NAMESPACE,
        "ray.log_to_driver": False,
        **extra,
    }


def as_cli_overrides(values: dict[str, Any]) -> list[str]:
    """The ``--set`` form the flow takes (plain values only, as a deployment would pass them)."""
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]  # JSON is YAML: strings stay strings


# -- 1. fleet overhead -----------------------------------------------------------------------


def direct_arm(fleet, batches, sampling: Any) -> Callable[[], tuple[int, dict[str, float]]]:
    """The baseline: pre-tokenized batches straight to the shard actors, all in flight at once."""
    import ray

    actors = [handle.actor for handle in fleet.shards]

    def run() -> tuple[int, dict[str, float]]:
        outs = ray.get([actor.call.remote("generate", batch, sampling) for actor, batch in zip(actors, batches)])
        tokens = sum(len(r.samples[0].token_ids) for out in outs for r in out.results if not r.error)
        return tokens, {"engine_s": max(out.seconds for out in outs)}

    return run


def fleet_arm(fleet, prompts: list[str], sampling: dict[str, Any]) -> Callable[[], tuple[int, dict[str, float]]]:
    """The library path a user takes: strings in, ``GenerationResult`` per prompt out."""

    def run() -> tuple[int, dict[str, float]]:
        results = fleet.generate(prompts, **sampling)
        errors = [r.error for r in results if not r.ok]
        if errors:
            raise RuntimeError(f"fleet.generate returned {len(errors)} errors, first: {errors[0]}")
        return sum(len(r.token_ids) for r in results), {}

    return run


def tokenize(tokenizer, prompts: list[str]) -> list:
    """What the fleet does on the driver before dispatch, and the direct arm does once."""
    from nemo_gen.core.results import GenerationRequest

    return [
        GenerationRequest(index=i, prompt_token_ids=list(tokenizer(p, add_special_tokens=True)["input_ids"]), prompt=p)
        for i, p in enumerate(prompts)
    ]


def timed(arm: Callable[[], tuple[int, dict[str, float]]]) -> dict[str, float]:
    t0 = time.perf_counter()
    tokens, extra = arm()
    seconds = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, **extra}


def measure_fleet_overhead(args: argparse.Namespace, foreign: ForeignCpu) -> dict[str, Any]:
    from nemo_gen.core.sampling import resolve_sampling
    from nemo_gen.fleet.requests import sampling_of
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import load_tokenizer
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides=settings_overrides(args, "bench-fleet"))
    prompts = make_prompts(args.prompts)
    # ignore_eos alone does not fix the length: the resolved config's stop_token_ids holds the
    # EOS id, and vLLM stops on stop_token_ids whatever ignore_eos says. Clear them in both arms.
    keywords = dict(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True, stop_token_ids=[])
    expected = args.prompts * args.max_new_tokens

    print(f"\n== 1. fleet overhead: {args.shards} shards, {args.prompts} prompts x {args.max_new_tokens} tokens ==")
    t0 = time.monotonic()
    fleet = GenerationFleet.launch(settings)
    try:
        print(f"fleet up in {time.monotonic() - t0:.1f}s")
        tokenizer = load_tokenizer(fleet.resolved.tokenizer_dir)
        requests = tokenize(tokenizer, prompts)
        tokenize_s = []
        for _ in range(5):  # the driver-side work the fleet arm repeats on every call
            t1 = time.perf_counter()
            tokenize(tokenizer, prompts)
            tokenize_s.append(time.perf_counter() - t1)
        # Interleaved like the fleet's least-loaded routing deals them out.
        batches = [requests[s :: args.shards] for s in range(args.shards)]
        sampling = sampling_of(resolve_sampling(fleet.resolved.generation_config, keywords))
        arms = {"direct": direct_arm(fleet, batches, sampling), "fleet": fleet_arm(fleet, prompts, keywords)}

        for name, arm in arms.items():  # warm-up: first-call costs (imports, caches) stay out
            w = timed(arm)
            print(f"warm-up {name:6s} {w['seconds']:6.3f}s  {w['tokens']} tokens")
            if w["tokens"] != expected:
                print(f"  note: {w['tokens']} tokens generated, {expected} expected (fixed length not held)")

        rounds = []
        print(f"{'round':>5} {'order':>5} {'direct tok/s':>13} {'fleet tok/s':>12} {'fleet/direct':>13} {'others':>7}")
        for r in range(args.rounds):
            order = ("direct", "fleet") if r % 2 == 0 else ("fleet", "direct")
            cpu0, t0 = foreign.cpu_s(), time.perf_counter()
            got = {name: timed(arms[name]) for name in order}
            others = ForeignCpu.share(foreign.cpu_s() - cpu0, time.perf_counter() - t0)
            ratio = got["fleet"]["tokens_per_s"] / got["direct"]["tokens_per_s"]
            rounds.append({"order": list(order), **got, "ratio": ratio, "others_cpu_share": others})
            print(
                f"{r + 1:>5} {'/'.join(o[0].upper() for o in order):>5} {got['direct']['tokens_per_s']:>13.1f} "
                f"{got['fleet']['tokens_per_s']:>12.1f} {ratio:>13.3f} {others:>7.0%}"
            )
    finally:
        fleet.shutdown()

    ratio = spread([r["ratio"] for r in rounds])
    result = {
        "ratio": ratio,
        "target": FLEET_TARGET,
        "verdict": verdict(ratio["median"], FLEET_TARGET, higher_is_better=True),
        "direct_tokens_per_s": spread([r["direct"]["tokens_per_s"] for r in rounds]),
        "fleet_tokens_per_s": spread([r["fleet"]["tokens_per_s"] for r in rounds]),
        "driver_tokenize_ms": statistics.median(tokenize_s) * 1e3,
        "direct_engine_s": spread([r["direct"]["engine_s"] for r in rounds]),
        "direct_seconds": spread([r["direct"]["seconds"] for r in rounds]),
        "tokens_per_round": rounds[0]["fleet"]["tokens"],
        "others_cpu_share": statistics.mean(r["others_cpu_share"] for r in rounds),
        "rounds": rounds,
    }
    print(
        f"driver-side tokenization (the fleet arm's extra pre-dispatch work): {result['driver_tokenize_ms']:.1f} ms "
        f"per call, {result['driver_tokenize_ms'] / 1e3 / result['direct_seconds']['median']:.1%} of a direct call"
    )
    print(
        f"fleet/direct tokens/s: median {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}) "
        f"target >= {FLEET_TARGET}  {result['verdict']}"
    )
    return result


# -- 2. Prefect pipeline overhead ------------------------------------------------------------


class PhaseClock:
    """Where a pipeline run's wall time goes, from the progress events both arms emit in this
    process: shard "loading"/"ready" (with the engine's own ``load_s``) and "generate" counts."""

    PHASES = ("setup", "launch", "engine_load", "pre_generate", "generate", "finish")

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}
        self.engine_load_s = 0.0

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        now = time.perf_counter() - self.t0
        if kind == "shard" and data.get("event") == "loading":
            self.marks.setdefault("launch_start", now)
        elif kind == "shard" and data.get("event") == "ready":
            self.marks["launch_end"] = now
            self.engine_load_s = max(self.engine_load_s, data.get("load_s") or 0.0)
        elif kind == "generate":
            if data["done"] == 0:
                self.marks.setdefault("generate_start", now)
            if data["done"] == data["total"]:
                self.marks["generate_end"] = now

    def phases(self, wall: float) -> dict[str, float]:
        m = self.marks
        return {
            "setup": m["launch_start"],  # settings, prompts, environment, Ray attach, resolve
            "launch": m["launch_end"] - m["launch_start"],  # placement + actors + engines, in parallel
            "engine_load": self.engine_load_s,  # the slowest engine's own start, inside the launch
            "pre_generate": m["generate_start"] - m["launch_end"],  # GenerationFleet (tokenizer load)
            "generate": m["generate_end"] - m["generate_start"],
            "finish": wall - m["generate_end"],  # write JSONL, artifacts, stop shards, reap, return
        }


def measure_pipeline_overhead(args: argparse.Namespace, foreign: ForeignCpu) -> dict[str, Any]:
    from flows.pipeline import run_watched
    from nemo_gen import progress
    from nemo_gen.pipeline import run_pipeline
    from nemo_gen.settings import NemoGenSettings

    out_dir = args.home / "outputs"

    def overrides(arm: str, r: int) -> dict[str, Any]:
        return settings_overrides(args, "bench-pipeline", **{"run.output": str(out_dir / f"bench-{arm}-{r}.jsonl")})

    def plain(r: int) -> dict[str, Any]:
        return run_pipeline(NemoGenSettings.load(overrides=overrides("plain", r)), name="bench-plain")

    def prefect(r: int) -> dict[str, Any]:
        cli_overrides = as_cli_overrides(overrides("prefect", r))
        return run_watched(config=None, overrides=cli_overrides, name="bench-prefect")  # as `nemo-gen run` does

    arms = {"plain": plain, "prefect": prefect}
    print(
        f"\n== 2. Prefect pipeline overhead: {args.shards} shards, built-in prompts, "
        f"{args.pipeline_rounds} rounds =="
    )
    header = "".join(f"{p:>13}" for p in PhaseClock.PHASES)
    print(f"{'round':>5} {'arm':>8} {'wall s':>8}{header} {'rest':>8} {'tokens':>7} {'others':>7}")
    rounds = []
    for r in range(args.pipeline_rounds):
        order = ("plain", "prefect") if r % 2 == 0 else ("prefect", "plain")
        got: dict[str, dict[str, Any]] = {}
        for name in order:
            cpu0, clock = foreign.cpu_s(), PhaseClock()
            try:
                with progress.listening(clock.on_event):
                    summary = arms[name](r)
            finally:
                stop_leftover_shards("bench-pipeline")
            wall = time.perf_counter() - clock.t0
            if summary["failed"]:
                raise RuntimeError(f"{name} pipeline: {summary['failed']} requests failed: {summary['errors'][:3]}")
            others = ForeignCpu.share(foreign.cpu_s() - cpu0, wall)
            phases = clock.phases(wall)
            # Engine start and generation dominate the wall time and vary run to run on a busy
            # machine; what is left is where an orchestrator's cost shows.
            rest = wall - phases["engine_load"] - phases["generate"]
            tokens = summary["generated_tokens"]
            got[name] = {"wall_s": wall, "phases_s": phases, "rest_s": rest, "tokens": tokens, "others_cpu_share": others}
            cols = "".join(f"{v:>13.2f}" for v in phases.values())
            print(f"{r + 1:>5} {name:>8} {wall:>8.2f}{cols} {rest:>8.2f} {tokens:>7} {others:>7.0%}")
        ratio = got["prefect"]["wall_s"] / got["plain"]["wall_s"]
        rounds.append({"order": list(order), **got, "ratio": ratio})
        print(f"{'':>5} prefect/plain {ratio:.3f}")

    ratio = spread([r["ratio"] for r in rounds])
    result = {
        "ratio": ratio,
        "target": PIPELINE_TARGET,
        "verdict": verdict(ratio["median"], PIPELINE_TARGET, higher_is_better=False),
        "plain_s": spread([r["plain"]["wall_s"] for r in rounds]),
        "prefect_s": spread([r["prefect"]["wall_s"] for r in rounds]),
        # prefect - plain, outside engine load and generation: the orchestrator's own seconds
        "prefect_extra_rest_s": spread([r["prefect"]["rest_s"] - r["plain"]["rest_s"] for r in rounds]),
        "others_cpu_share": statistics.mean(r[a]["others_cpu_share"] for r in rounds for a in ("plain", "prefect")),
        "rounds": rounds,
    }
    extra = result["prefect_extra_rest_s"]
    share = extra["median"] / result["plain_s"]["median"]
    print(
        f"Prefect's own seconds per run (rest, prefect - plain): median {extra['median']:.2f}s "
        f"(min {extra['min']:.2f}, max {extra['max']:.2f}) = {share:.1%} of a plain run"
    )
    print(
        f"prefect/plain wall: median {ratio['median']:.3f} (min {ratio['min']:.3f}, max {ratio['max']:.3f}) "
        f"target <= {PIPELINE_TARGET}  {result['verdict']}"
    )
    return result


def stop_leftover_shards(fleet_name: str) -> None:
    """Safety net: both pipelines stop their fleet in ``finally``; if one did not (a crash inside
    the flow engine), kill its named shard actors so the next run can place its own."""
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(f"{fleet_name}-shard-"):
            print(f"  leftover shard actor {entry['name']}: killing it")
            try:
                ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass  # went away meanwhile


# -- main ------------------------------------------------------------------------------------


def print_summary(summary: dict[str, Any]) -> None:
    print("\n== summary ==")
    rows = [("fleet overhead", "fleet/direct tok/s", ">=", summary.get("fleet"))]
    rows.append(("pipeline overhead", "prefect/plain wall", "<=", summary.get("pipeline")))
    for title, what, op, res in rows:
        if res is None:
            print(f"{title:18s} {what:19s} skipped")
            continue
        r, others = res["ratio"], res["others_cpu_share"]
        noisy = noisy_note(others)
        print(
            f"{title:18s} {what:19s} median {r['median']:.3f}  [min {r['min']:.3f}, max {r['max']:.3f}]  "
            f"target {op} {res['target']:.2f}  {res['verdict']}{noisy}"
        )
    print(f"{summary['load_before']}  ->  {summary['load_after']};  total {summary['wall_s']:.0f}s")


def main(argv: Sequence[str] | None = None) -> int:
    import contextlib

    args = parse_args(argv)
    quiet_environment()  # before anything imports vLLM, Ray, transformers or Prefect
    args.home = args.home.resolve()
    args.home.mkdir(parents=True, exist_ok=True)

    from nemo_gen.environment import configure_environment
    from nemo_gen.fleet.cluster import init_ray, shutdown_ray
    from nemo_gen.prefect_api import prefect_api
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    started = time.monotonic()
    summary: dict[str, Any] = {}
    summary["load_before"] = load()
    print(f"nemo-gen fleet overhead benchmark; {summary['load_before']}")

    settings = NemoGenSettings.load(overrides=settings_overrides(args, "bench"))
    make_tiny_model(settings.model_dir())  # made once, here, not inside either arm
    with contextlib.ExitStack() as stack:
        if not args.skip_pipeline:
            api = stack.enter_context(prefect_api(settings))
            print(f"Prefect API at {api.url} ({'started here' if api.managed else 'external'})")
        configure_environment(settings)  # the reaping flag, before the raylet starts
        conn = init_ray(settings.ray)
        stack.callback(shutdown_ray, conn)

        foreign = stack.enter_context(ForeignCpu())
        summary["fleet"] = measure_fleet_overhead(args, foreign)
        summary["pipeline"] = None if args.skip_pipeline else measure_pipeline_overhead(args, foreign)

    summary["load_after"] = load()
    summary["wall_s"] = time.monotonic() - started
    print_summary(summary)
    write_result(args.json, "fleet_overhead", args, summary)
    return 0  # a MISS is a measurement, not an error: read the verdicts


if __name__ == "__main__":  # vLLM and Ray spawn processes that re-import the main module
    sys.exit(main(sys.argv[1:]))
