"""Control-plane cost: the pure core driven with 100, 1,000 and 10,000 simulated shards.

No Ray, no engines: the ledger (``GenerationFleetHealth``), the selector
(``HealthyShardSelector``), the placement planner and the refit bookkeeping are fed the
event stream a real fleet produces, tick by tick (one tick stands for one second of the
control loop; the ledger keeps its default clock, ``time.monotonic``). Costs are this
thread's CPU time (``time.thread_time_ns``): the machine is shared, and time another process
held the core is not the control plane's cost. Wall-clock (``perf_counter``) figures are
printed beside them; on a quiet machine the two agree.

Each tick:

- probes: every shard is probed once per ``--probe-every`` ticks (staggered cohorts, NeMo-RL's
  5 s probes); a few probes blip (SUSPECT, then back to HEALTHY after two ok probes);
- failures: a few shards break (their probes fail until the ledger declares them DEAD), a few
  actors die outright (``mark_dead``, the death watch);
- restarts: a DEAD shard is re-planned (one-shard placement plan against the cluster) and goes
  DEAD -> RESTARTING -> (engine start, ``--restart-ticks``) STALE -> (recovery refit) HEALTHY;
- membership: the epoch is read every tick; when it moved, the serving set and its URLs are
  read (a membership push) and ``raise_if_exhausted`` runs; a status line reads the counts.

Every ``--refit-every`` ticks a fleet-wide refit lands in the same second: a new version, the
manifest checked, staging layout and buckets planned, refit targets chosen as
``nemo_gen.fleet.refit`` does (from ``snapshot()``), every target's new version reported, the
``RefitReport`` assembled. It changes the ledger the ticks see (SUSPECT and STALE shards come
back), but it is timed apart from the tick: in the product it runs in the refit task, between
the ``ray.get`` calls of a transfer that takes seconds, holding the ledger lock one report at a
time, so it never stalls the control loop or routing for its whole length. Its cost per refit
and per shard is printed beside the tick, and so is tick + refit for the seconds that have both.

Between ticks, ``--requests`` requests are routed one at a time under load (``--load``
requests in flight per shard on average): ``next_shard()`` + ``acquire()`` and the
``release()`` of the oldest in-flight request. Each request is timed on its own.

Printed per size: tick cost (median, p99), per-request routing cost (median, p99), the
fleet-wide refit bookkeeping, the launch-time placement plan (once per launch: one placement
group per shard, checked against a cluster of 8-GPU nodes); then the targets (tick < 10 ms and
routing < 20 us at 10,000 shards, each on median and p99) with PASS/MISS, and the growth ratios
100 -> 1k -> 10k measured in this run (x10 shards per step: x10 is linear). Runs in a few
seconds; the machine is shared, so the load average is printed and every figure is a median
or percentile over hundreds of samples; PASS/MISS is judged on CPU time.

Run: ``make bench-control-plane`` or
``python -m bench control_plane [--sizes 100,1000,10000] [--ticks 600] [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.stats import met
from nemo_gen.core.fleet_health import (
    FleetHealthPolicy,
    GenerationFleetHealth,
    HealthyShardSelector,
    ShardState,
)
from nemo_gen.core.placement import ClusterResources, plan_fleet_placement
from nemo_gen.core.manifest import (
    RefitReport,
    ShardRefit,
    TensorMeta,
    buckets,
    check_manifest,
    layout,
    next_version,
)

TICK_TARGET_MS = 10.0  # per control-loop tick at 10,000 shards: at most
ROUTE_TARGET_US = 20.0  # per request (next_shard + acquire + release) at 10,000 shards: at most
LINEAR_SLACK = 1.25  # a x10 size step may cost up to x12.5 and still read "linear" (noise)
GPUS_PER_NODE = 8
_REFITTABLE = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE)  # as nemo_gen.fleet.refit


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="100,1000,10000", help="shard counts, comma-separated")
    p.add_argument("--ticks", type=int, default=600, help="measured ticks per size (default 600)")
    p.add_argument("--warmup", type=int, default=30, help="unmeasured ticks first (default 30)")
    p.add_argument("--requests", type=int, default=200, help="routed requests per tick (default 200)")
    p.add_argument("--load", type=int, default=4, help="requests in flight per shard (default 4)")
    p.add_argument("--probe-every", type=int, default=5, help="ticks between probes of one shard (default 5)")
    p.add_argument("--refit-every", type=int, default=30, help="ticks between fleet-wide refits (default 30)")
    p.add_argument("--restart-ticks", type=int, default=3, help="ticks an engine takes to start (default 3)")
    p.add_argument("--blip-rate", type=float, default=1e-3, help="chance a probe fails transiently")
    p.add_argument("--break-rate", type=float, default=5e-5, help="chance per shard per tick it breaks")
    p.add_argument("--death-rate", type=float, default=2e-5, help="chance per shard per tick its actor dies")
    p.add_argument("--tensors", type=int, default=291, help="tensors in the model manifest (default 291)")
    p.add_argument("--repeats", type=int, default=5,
                   help="blocks the measured ticks are split into; medians and p99s are taken per block, "
                        "then the median across blocks (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run: 40 measured ticks per size")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.ticks, args.warmup = 40, 5
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if not args.sizes or min(args.sizes) < 1:
        p.error("--sizes must list shard counts >= 1")
    for name in ("ticks", "requests", "load", "probe_every", "refit_every", "restart_ticks", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def model_manifest(tensors: int) -> list[TensorMeta]:
    """A transformer-shaped manifest: embeddings, 9 tensors per layer, final norm and head."""
    hidden, inter, vocab = 4096, 14336, 128256
    metas = [TensorMeta.of("model.embed_tokens.weight", (vocab, hidden), "bfloat16")]
    per_layer = [
        ("self_attn.q_proj.weight", (hidden, hidden)), ("self_attn.k_proj.weight", (1024, hidden)),
        ("self_attn.v_proj.weight", (1024, hidden)), ("self_attn.o_proj.weight", (hidden, hidden)),
        ("mlp.gate_proj.weight", (inter, hidden)), ("mlp.up_proj.weight", (inter, hidden)),
        ("mlp.down_proj.weight", (hidden, inter)), ("input_layernorm.weight", (hidden,)),
        ("post_attention_layernorm.weight", (hidden,)),
    ]
    layer = 0
    while len(metas) < tensors - 2:
        for name, shape in per_layer:
            if len(metas) < tensors - 2:
                metas.append(TensorMeta.of(f"model.layers.{layer}.{name}", shape, "bfloat16"))
        layer += 1
    metas.append(TensorMeta.of("model.norm.weight", (hidden,), "bfloat16"))
    metas.append(TensorMeta.of("lm_head.weight", (vocab, hidden), "bfloat16"))
    return metas


def stochastic_round(x: float, rng: random.Random) -> int:
    """An integer whose mean is ``x`` (event counts per tick that scale with the fleet)."""
    whole = int(x)
    return whole + (1 if rng.random() < x - whole else 0)


class FleetSim:
    """One simulated fleet of ``n`` shards and the controllers that drive its ledger."""

    def __init__(self, n: int, args: argparse.Namespace, rng: random.Random) -> None:
        self.n, self.args, self.rng = n, args, rng
        self.health = GenerationFleetHealth(
            n,
            FleetHealthPolicy(max_restart_attempts_per_shard=1000),
            base_urls=[f"http://node{i // GPUS_PER_NODE}:{8000 + i % GPUS_PER_NODE}/v1" for i in range(n)],
        )
        self.selector = HealthyShardSelector(self.health)
        self.cohorts = [range(c, n, args.probe_every) for c in range(args.probe_every)]
        self.version = 0
        self.metas = model_manifest(args.tensors)
        self.expected = {m.name: m for m in self.metas}
        self.broken: set[int] = set()  # failing every probe until the ledger says DEAD
        self.dead: deque[int] = deque()  # DEAD, waiting for a restart
        self.starting: deque[tuple[int, int]] = deque()  # (ready at tick, shard): RESTARTING
        self.stale: deque[int] = deque()  # STALE, waiting for a recovery refit
        self.watched: set[int] = set()  # in a restart pipeline or broken: not picked again
        self.epoch_seen = -1
        # One node of free capacity, as a replacement's placement is checked against.
        self.free = ClusterResources.from_nodes([{"GPU": 1.0, "CPU": 16.0}])
        self.counts = {"probes": 0, "blips": 0, "broken": 0, "deaths": 0, "restarts": 0,
                       "recovered": 0, "refits": 0, "epoch_changes": 0}
        # Requests in flight: spread evenly, oldest released first.
        self.inflight: deque[int] = deque()
        for i in range(args.load * n):
            self.selector.acquire(i % n)
            self.inflight.append(i % n)

    # -- one tick of the control loop ---------------------------------------------------------

    def tick(self, t: int) -> None:
        """Feed the ledger everything the control loop saw in one second (not the refit)."""
        args, rng, health, n = self.args, self.rng, self.health, self.n
        c = self.counts

        # New failures this tick (their number scales with the fleet; which shards is random).
        for _ in range(stochastic_round(n * args.break_rate, rng)):
            idx = rng.randrange(n)
            if idx not in self.watched:
                self.broken.add(idx)
                self.watched.add(idx)
                c["broken"] += 1
        for _ in range(stochastic_round(n * args.death_rate, rng)):
            idx = rng.randrange(n)
            if idx not in self.watched:
                health.mark_dead(idx, "ActorDiedError: the actor died unexpectedly")
                self.dead.append(idx)
                self.watched.add(idx)
                c["deaths"] += 1

        # Probe results for this tick's cohort.
        cohort = self.cohorts[t % args.probe_every]
        fails = {cohort[rng.randrange(len(cohort))]
                 for _ in range(stochastic_round(len(cohort) * args.blip_rate, rng))} if len(cohort) else set()
        c["blips"] += len(fails)
        fails |= self.broken
        record = health.record_probe
        for idx in cohort:
            if idx in fails:
                record(idx, False, "TimeoutError: probe timed out after 5.0 s")
            else:
                record(idx, True)
        c["probes"] += len(cohort)
        for idx in [i for i in self.broken if health.state_of(i) is ShardState.DEAD]:
            self.broken.discard(idx)
            self.dead.append(idx)

        # Recovery: DEAD -> RESTARTING -> STALE -> (refit) HEALTHY.
        while self.stale:
            idx = self.stale.popleft()
            check_manifest(self.expected, self.metas)
            health.report_refit(idx, self.version)
            self.watched.discard(idx)
            c["recovered"] += 1
        while self.starting and self.starting[0][0] <= t:
            _, idx = self.starting.popleft()
            health.mark_loaded(idx, base_url=f"http://node{idx // GPUS_PER_NODE}:{9000 + t % 1000}/v1")
            self.stale.append(idx)
        while self.dead:
            idx = self.dead.popleft()
            plan_fleet_placement(1, 1, 1, "gpu", 4.0, self.free)
            health.mark_restarting(idx)
            if health.state_of(idx) is ShardState.RESTARTING:
                self.starting.append((t + args.restart_ticks, idx))
                c["restarts"] += 1

        # Membership: routers and the trainer compare one integer, re-read on change.
        epoch = health.membership_epoch
        if epoch != self.epoch_seen:
            self.epoch_seen = epoch
            health.serving_shards()
            health.serving_base_urls()
            health.raise_if_exhausted()
            c["epoch_changes"] += 1
        health.counts_by_state()

    def refit(self) -> RefitReport:
        """A fleet-wide refit's bookkeeping, as ``nemo_gen.fleet.refit`` does it around the
        transfer: version, manifest check, layout, buckets, targets, one report per shard."""
        self.counts["refits"] += 1
        self.version = next_version(self.version, None)
        check_manifest(self.expected, self.metas)
        _, total = layout(self.metas)
        groups = buckets(self.metas, 1 << 30)
        targets = [s.dp_shard_idx for s in self.health.snapshot() if s.state in _REFITTABLE]
        report = RefitReport(self.version, total, len(self.metas), 0.0, 0.0)
        for idx in targets:
            self.health.report_refit(idx, self.version)
            report.shards.append(ShardRefit(idx, ok=True))
        assert report.ok and len(groups) > 0
        # A STALE replacement was refit with the fleet: it serves now.
        for idx in [i for i in self.stale if self.health.state_of(i) is ShardState.HEALTHY]:
            self.stale.remove(idx)
            self.watched.discard(idx)
            self.counts["recovered"] += 1
        return report

    # -- routing --------------------------------------------------------------------------------

    def route(self, requests: int, wall: list[int], cpu: list[int]) -> None:
        """Route ``requests`` requests one at a time, each timed (ns) on both clocks."""
        sel, inflight = self.selector, self.inflight
        wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
        next_shard, acquire, release = sel.next_shard, sel.acquire, sel.release
        popleft, append = inflight.popleft, inflight.append
        for _ in range(requests):
            c0 = cpu_clock()
            t0 = wall_clock()
            shard = next_shard()
            acquire(shard)
            release(popleft())
            t1 = wall_clock()
            c1 = cpu_clock()
            append(shard)
            wall.append(t1 - t0)
            cpu.append(c1 - c0)


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def repeated(samples: Sequence[float], repeats: int) -> dict[str, float]:
    """Median and p99 over ``repeats`` consecutive blocks of the samples: each block's own
    median and p99, then the median across blocks, so one burst of another process on the
    shared machine moves one block, not the figure. The pooled p99 and the max are kept too."""
    k = max(1, min(repeats, len(samples)))
    size = len(samples) // k
    blocks = [samples[i * size:(i + 1) * size] for i in range(k)]
    return {
        "median": statistics.median(statistics.median(b) for b in blocks),
        "p99": statistics.median(percentile(b, 0.99) for b in blocks),
        "pooled_p99": percentile(samples, 0.99),
        "max": max(samples),
        "n": len(samples),
    }


def clock_overhead_ns(clock) -> float:
    samples = []
    for _ in range(20000):
        t0 = clock()
        samples.append(clock() - t0)
    return statistics.median(samples)


def measure_size(n: int, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed * 1_000_003 + n)
    gc.collect()
    t0 = time.perf_counter()
    sim = FleetSim(n, args, rng)
    setup_s = time.perf_counter() - t0
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    ticks, tick_cpu, refits, refits_cpu, both = [], [], [], [], []
    routes, routes_cpu, firsts = [], [], []
    for t in range(args.warmup + args.ticks):
        measured = t >= args.warmup
        c0, t0 = cpu_clock(), wall_clock()
        sim.tick(t)
        tick_ns, tick_cpu_ns = wall_clock() - t0, cpu_clock() - c0
        if t % args.refit_every == args.refit_every - 1:
            # A fleet-wide refit lands in this second too. Timed apart: it runs in the refit
            # task, between the transfer's ray.get calls, not in the control loop's tick.
            c0, t0 = cpu_clock(), wall_clock()
            sim.refit()
            refit_ns, refit_cpu_ns = wall_clock() - t0, cpu_clock() - c0
            if measured:
                refits.append(refit_ns / 1e6)
                refits_cpu.append(refit_cpu_ns / 1e6)
                both.append((tick_cpu_ns + refit_cpu_ns) / 1e6)
        if measured:
            ticks.append(tick_ns / 1e6)
            tick_cpu.append(tick_cpu_ns / 1e6)
            firsts.append(len(routes))
            sim.route(args.requests, routes, routes_cpu)
        else:
            sim.route(args.requests, [], [])
    route_us = [ns / 1e3 for ns in routes]
    route_cpu_us = [ns / 1e3 for ns in routes_cpu]

    # The launch-time plan: one placement group per shard, checked against a cluster of
    # 8-GPU nodes that holds the fleet (once per launch, not per tick). The planner's own
    # cost: the cyclic GC, whose passes scale with everything else alive in the process (here
    # the simulated fleet), is held off for this one-off measurement.
    cluster = ClusterResources.from_nodes(
        [{"GPU": float(GPUS_PER_NODE), "CPU": 128.0}] * max(1, -(-n // GPUS_PER_NODE))
    )
    plans = []
    gc.disable()
    try:
        for _ in range(5):
            c0 = cpu_clock()
            plan_fleet_placement(n, 1, 1, "gpu", 4.0, cluster)  # plans, then check_fits
            plans.append((cpu_clock() - c0) / 1e6)
    finally:
        gc.enable()
    return {
        "shards": n,
        "setup_s": setup_s,
        "tick_cpu_ms": repeated(tick_cpu, args.repeats),
        "tick_wall_ms": repeated(ticks, args.repeats),
        "route_cpu_us": repeated(route_cpu_us, args.repeats),
        "route_wall_us": repeated(route_us, args.repeats),
        # The first request after each tick: caches cold, and the selector replays the epoch's
        # serving-set changes.
        "first_route_cpu_us": repeated([route_cpu_us[i] for i in firsts], 1),
        "refit_cpu_ms": repeated(refits_cpu, 1) if refits else None,
        "refit_wall_ms": repeated(refits, 1) if refits else None,
        "tick_plus_refit_cpu_ms": repeated(both, 1) if both else None,
        "plan_ms": statistics.median(plans),
        "events": dict(sim.counts),
        "final_states": sim.health.state_summary(),
    }


def growth(rows: list[dict], key: str) -> list[tuple[int, int, float]]:
    """(size, next size, cost ratio) for each step between consecutive sizes."""
    out = []
    for a, b in pairwise(rows):
        if a[key] and b[key]:
            out.append((a["shards"], b["shards"], b[key] / a[key]))
    return out


def shape(steps: list[tuple[int, int, float]]) -> str:
    """How cost grows with the fleet, from the worst step (cost ratio over size ratio)."""
    if not steps:
        return "-"
    if all(r <= 2.0 for _, _, r in steps):
        return "about constant: far better than linear"
    worst = max(r / (b / a) for a, b, r in steps)
    if worst <= LINEAR_SLACK:
        return "linear or better"
    return f"WORSE than linear (x{worst:.2f} over linear at the worst step)"


def fmt_steps(steps: list[tuple[int, int, float]]) -> str:
    return ", ".join(f"{a:,} -> {b:,}: x{r:.2f}" for a, b, r in steps) + (
        f" (linear: x{steps[0][1] / steps[0][0]:g} per step)" if steps else "")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # Transitions log at INFO/WARNING; count their formatting cost, print none of it.
    ledger_log = logging.getLogger("nemo_gen.fleet_health")
    ledger_log.addHandler(logging.NullHandler())
    ledger_log.propagate = False
    ledger_log.setLevel(logging.INFO)

    one, five, _ = os.getloadavg()
    cores = os.cpu_count() or 1
    busy = one > 0.75 * cores
    print(f"control-plane cost: pure core, simulated fleet; load average {one:.2f} {five:.2f} on {cores} cores"
          f"{'  (BUSY: wall-clock figures include time other processes held the CPU)' if busy else ''}")
    print(f"per tick (1 s of control loop): probes for 1/{args.probe_every} of the shards, blips {args.blip_rate:g}/probe, "
          f"breaks {args.break_rate:g} + deaths {args.death_rate:g} per shard per tick, restarts "
          f"({args.restart_ticks} ticks to start, recovery refit), epoch read; a fleet-wide refit every "
          f"{args.refit_every} ticks; {args.requests} routed requests per tick at {args.load} in flight per shard")
    print(f"cost = this thread's CPU time (clock read ~{clock_overhead_ns(time.thread_time_ns):.0f} ns, included), "
          f"so a shared machine's other processes do not count; wall = perf_counter (read "
          f"~{clock_overhead_ns(time.perf_counter_ns):.0f} ns). p50/p99: per block of {args.ticks // args.repeats} "
          f"ticks, median over {args.repeats} blocks\n")

    print(f"{'':>7} {'tick (ms)':^26} {'routing (us)':^26} {'fleet refit':^18} {'launch':>8}")
    print(f"{'shards':>7} {'p50':>8} {'p99':>8} {'wall p99':>8} {'p50':>8} {'p99':>8} {'wall p99':>8} "
          f"{'ms':>8} {'us/shard':>9} {'plan ms':>8}  events")
    rows = []
    for n in args.sizes:
        r = measure_size(n, args)
        r["tick_median_ms"] = r["tick_cpu_ms"]["median"]
        r["route_median_us"] = r["route_cpu_us"]["median"]
        r["refit_median_ms"] = r["refit_cpu_ms"]["median"] if r["refit_cpu_ms"] else None
        rows.append(r)
        ev, tick, route = r["events"], r["tick_cpu_ms"], r["route_cpu_us"]
        refit = r["refit_median_ms"]
        refit_txt = f"{refit:>8.3f} {refit / n * 1e3:>9.2f}" if refit is not None else f"{'-':>8} {'-':>9}"
        print(f"{n:>7,} {tick['median']:>8.3f} {tick['p99']:>8.3f} {r['tick_wall_ms']['p99']:>8.3f} "
              f"{route['median']:>8.2f} {route['p99']:>8.2f} {r['route_wall_us']['p99']:>8.2f} "
              f"{refit_txt} {r['plan_ms']:>8.2f}  "
              f"{ev['probes']} probes, {ev['blips']} blips, {ev['broken']} broken, {ev['deaths']} deaths, "
              f"{ev['restarts']} restarts, {ev['recovered']} recovered, {ev['refits']} refits, "
              f"{ev['epoch_changes']} epoch changes")

    big = max(rows, key=lambda r: r["shards"])
    n_big = big["shards"]
    tick, route = big["tick_cpu_ms"], big["route_cpu_us"]
    tick_ok = tick["median"] < TICK_TARGET_MS and tick["p99"] < TICK_TARGET_MS
    route_ok = route["median"] < ROUTE_TARGET_US and route["p99"] < ROUTE_TARGET_US
    steps = {key: growth(rows, key) for key in ("tick_median_ms", "route_median_us", "refit_median_ms", "plan_ms")}

    wall_tick, wall_route = big["tick_wall_ms"], big["route_wall_us"]
    print("\nresults (all measured in this run)")
    print(f"  tick at {n_big:,} shards:    median {tick['median']:.3f} ms, p99 {tick['p99']:.3f} ms "
          f"(target < {TICK_TARGET_MS:g} ms): {met(tick_ok)}   [wall: median {wall_tick['median']:.3f} ms, "
          f"p99 {wall_tick['p99']:.3f} ms, max {wall_tick['max']:.3f} ms]")
    print(f"  routing at {n_big:,} shards: median {route['median']:.2f} us, p99 {route['p99']:.2f} us "
          f"(target < {ROUTE_TARGET_US:g} us): {met(route_ok)}   [wall: median {wall_route['median']:.2f} us, "
          f"p99 {wall_route['p99']:.2f} us, max {wall_route['max']:.1f} us]")
    first = big["first_route_cpu_us"]
    print(f"    of which the first request after each tick (caches cold after the tick, the epoch's "
          f"serving changes replayed): median {first['median']:.2f} us, p99 {first['p99']:.2f} us")
    if big["refit_median_ms"] is not None:
        both = big["tick_plus_refit_cpu_ms"]
        print(f"  fleet-wide refit bookkeeping at {n_big:,} shards: median {big['refit_median_ms']:.3f} ms "
              f"({big['refit_median_ms'] / n_big * 1e3:.2f} us per shard), in the refit task beside a transfer "
              f"of seconds, one ledger report (lock hold) per shard; tick + refit in the same second: "
              f"median {both['median']:.3f} ms, max {both['max']:.3f} ms")
    if len(rows) > 1:
        print(f"  tick growth:    {fmt_steps(steps['tick_median_ms'])} -> {shape(steps['tick_median_ms'])}")
        print(f"  routing growth: {fmt_steps(steps['route_median_us'])} -> {shape(steps['route_median_us'])}")
        if steps["refit_median_ms"]:
            print(f"  refit growth:   {fmt_steps(steps['refit_median_ms'])} -> {shape(steps['refit_median_ms'])}")
        print(f"  launch plan growth: {fmt_steps(steps['plan_ms'])} -> {shape(steps['plan_ms'])}")
    if n_big != 10_000:
        print(f"  (the targets are stated at 10,000 shards; this run's largest fleet is {n_big:,})")
    out = {"load_average": [one, five], "rows": rows, "tick_pass": tick_ok, "route_pass": route_ok, "growth": steps}
    write_result(args.json, "control_plane", args, out, {"tick": met(tick_ok), "routing": met(route_ok)})
