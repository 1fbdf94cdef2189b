"""The server under four times its capacity: load is shed, nothing is lost, nothing is condemned.

One fleet of vLLM CPU engines (the tiny local model, ``vllm_cfg.async_engine: true`` as under
``nemo-gen serve``) behind ``nemo_gen.server`` on loopback, whose capacity is its admission bound
(``server.max_in_flight``: samples in flight at once). Closed-loop clients (bench/http_load.py, in
a process of their own; a 503 is waited out for its Retry-After) run for a fixed window, while
another process probes ``GET /health`` every 10 ms:

1. ``unloaded``: as many clients as the capacity — the fleet's throughput when full and unloaded;
2. ``overload``: ``--factor`` times as many (default 4) for the same window (1 and 2 alternate
   for ``--rounds`` rounds; the goodput ratio is each round's, and their median);
3. ``after``: the load gone — every shard HEALTHY, 0 restarts, a request served;
4. ``big+streams``: a second server on the same fleet, bounds raised to hold 200 concurrent
   streams and a 4 MB prompt (tokenized off the event loop, then refused for its length);
5. ``abuse``: the overload of 2 again, with abusive clients mixed in (bench/http_load.py's
   ``abuse``: streams abandoned mid-way, readers that stall, half-sent headers, token ids past the
   vocabulary), then the load gone: every well-behaved request still 200 or 503 and none lost, the
   poison ids refused with a 4xx, no engine death, no admission slot held afterwards
   (``nemo_gen_server_in_flight`` on ``/metrics``), goodput >= 0.9 of ``unloaded``.

Targets, printed side by side from one run: in ``overload`` every request is answered 200 or 503
(none lost, none 500, none hung), no shard condemned, /health p99 < 100 ms in every phase, and
goodput (tokens/s of the 200s) >= 0.9 of ``unloaded``'s; ``after`` at full strength with 0 restarts.

On a 2-core machine the engines' processes, the server (in this process, beside the fleet's
driver) and the clients share two cores: at ``fleet.engine_niceness: 0`` the engines' host side
starves the server's thread under 200 streams and /health waits for a core, not for the server's
event loop (bench/results/2026-12-04/cpu-overload.md). ``--engine-niceness`` (default 10) lets
the server go first, as an operator of such a node would set it.

    python -m bench overload [--shards 2] [--capacity 16] [--factor 4] [--window-s 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence


from bench.lib.result import write_result
from bench.lib.setup import LocalCpu, quiet_environment
from bench.lib.stats import check, met

HEALTH_P99_S = 0.1
GOODPUT_RATIO = 0.9
BIG_PROMPT_CHARS = 4 * 2**20
STREAMS = 200


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="shards in the fleet (default 2)")
    p.add_argument("--capacity", type=int, default=16, help="server.max_in_flight: the fleet's capacity (default 16)")
    p.add_argument("--factor", type=int, default=4, help="clients in the overload phase, per unit of capacity (4)")
    p.add_argument("--window-s", type=float, default=15.0, help="seconds each loaded phase runs (default 15)")
    p.add_argument("--rounds", type=int, default=2, help="unloaded/overload pairs, alternated (default 2)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--streams", type=int, default=STREAMS, help=f"streams of the last phase (default {STREAMS})")
    p.add_argument("--prompt-mb", type=float, default=BIG_PROMPT_CHARS / 2**20,
                   help="the last phase's big prompt, in MiB of characters (default 4; 0: none)")
    p.add_argument("--phases", default="unloaded,overload,big+streams,abuse",
                   help="which phases to run (comma-separated)")
    p.add_argument("--stream-idle-s", type=float, default=2.0,
                   help="server.stream_idle_timeout_s: how long a stalled reader keeps its stream (default 2)")
    p.add_argument("--abuse-pace-s", type=float, default=1.0,
                   help="abuse phase: seconds an abandoning or stalling client waits before its next stream (default 1)")
    p.add_argument("--header-timeout-s", type=float, default=2.0,
                   help="server.header_timeout_s: how long a half-sent request header keeps its connection (default 2)")
    p.add_argument("--engine-niceness", type=int, default=10,
                   help="fleet.engine_niceness of the shards (default 10: see the module doc)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    for name in ("shards", "capacity", "factor", "max_new_tokens", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.window_s <= 0:
        p.error("--window-s must be positive")
    return args


def run_clients(jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run bench/http_load.py jobs side by side, each in its own process; their results."""
    procs = [subprocess.Popen([sys.executable, "-m", "bench.http_load", json.dumps(job)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for job in jobs]
    results = []
    for proc, job in zip(procs, jobs):
        out, err = proc.communicate(timeout=job["window_s"] + job.get("timeout_s", 60) + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"the {job['mode']} client failed: {err[-2000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else (values[0] if values else float("nan"))


def phase(url: str, model: str, clients: int, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    load = {"mode": "load", "url": url, "model": model, "clients": clients, "window_s": args.window_s,
            "max_tokens": args.max_new_tokens, "timeout_s": 120.0, "max_backoff_s": 1.0, **extra}
    health = {"mode": "health", "url": url, "window_s": args.window_s, "interval_s": 0.01}
    got, probe = run_clients([load, health])
    return {"clients": clients, "sent": got["sent"], "answered": got["answered"], "hung": got["hung"],
            "lost": got["lost"], "statuses": got["statuses"], "tokens": got["tokens"],
            "goodput_tok_s": got["tokens"] / got["wall_s"], "wall_s": got["wall_s"],
            "p50_latency_s": statistics.median(got["latency_s"]) if got["latency_s"] else None,
            "health_p99_s": p99(probe["latency_s"]), "health_max_s": max(probe["latency_s"]),
            "health_probes": len(probe["latency_s"]), "health_statuses": probe["statuses"],
            "errors": got["errors"][:3], "big_prompt": got.get("big_prompt")}


def merged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Rounds of one phase as one: counts summed, goodput and latencies over all of them."""
    out = dict(runs[0])
    for key in ("sent", "answered", "hung", "lost", "tokens", "wall_s", "health_probes"):
        out[key] = sum(r[key] for r in runs)
    out["statuses"] = {k: sum(r["statuses"].get(k, 0) for r in runs) for r in runs for k in r["statuses"]}
    out["goodput_tok_s"] = out["tokens"] / out["wall_s"]
    out["health_p99_s"] = max(r["health_p99_s"] for r in runs)
    out["health_max_s"] = max(r["health_max_s"] for r in runs)
    out["rounds"] = [{k: r[k] for k in ("goodput_tok_s", "health_p99_s", "statuses")} for r in runs]
    return out


def in_flight(url: str) -> float | None:
    """The server's admission slots held now, from its own /metrics (None: no such series)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("nemo_gen_server_in_flight "):
                return float(line.split()[1])
    return None


def abuse_phase(url: str, model: str, vocab_size: int, args: argparse.Namespace) -> dict[str, Any]:
    """The overload again, abusive clients beside it; then the slots held once they are gone."""
    load = {"mode": "load", "url": url, "model": model, "clients": args.capacity * args.factor,
            "window_s": args.window_s, "max_tokens": args.max_new_tokens, "timeout_s": 120.0, "max_backoff_s": 1.0}
    health = {"mode": "health", "url": url, "window_s": args.window_s, "interval_s": 0.01}
    abuse = {"mode": "abuse", "url": url, "model": model, "window_s": args.window_s, "vocab_size": vocab_size,
             "stall_s": 4 * args.stream_idle_s, "half_headers": 50, "per_kind": 1, "pace_s": args.abuse_pace_s}
    got, probe, bad = run_clients([load, health, abuse])
    held, deadline = in_flight(url), time.monotonic() + 10 + args.stream_idle_s
    while held and time.monotonic() < deadline:  # a released stream's last step may still be landing
        time.sleep(0.2)
        held = in_flight(url)
    return {"clients": load["clients"], "sent": got["sent"], "answered": got["answered"], "hung": got["hung"],
            "lost": got["lost"], "statuses": got["statuses"], "tokens": got["tokens"],
            "goodput_tok_s": got["tokens"] / got["wall_s"], "wall_s": got["wall_s"],
            "health_p99_s": p99(probe["latency_s"]), "health_max_s": max(probe["latency_s"]),
            "errors": got["errors"][:3], "abusive": bad, "held_after": held}


def condemned(fleet) -> list[dict[str, Any]]:
    return [h for s in fleet.health.snapshot() for h in fleet.health.history(s.dp_shard_idx) if h["new"] == "dead"]


def abuse_verdicts(abuse: dict[str, Any], overload_ratio: float, unloaded: dict[str, Any]) -> dict[str, Any]:
    bad = abuse["abusive"]
    poison = set(bad["poison"]["statuses"])
    abuse["goodput_ratio"] = abuse["goodput_tok_s"] / unloaded["goodput_tok_s"]
    return {
        "abuse: every well-behaved request answered 200 or 503, none lost or hung": set(abuse["statuses"]) <= {
            "200", "503"} and abuse["sent"] == abuse["answered"] and abuse["hung"] == 0 and abuse["lost"] == 0,
        "abuse: poison token ids refused with a 4xx (or 503 while full)": "400" in poison and all(
            c != "None" and (400 <= int(c) < 500 or c == "503") for c in poison),
        "abuse: no engine died (no shard condemned, 0 restarts)": not abuse["condemned"] and not any(abuse["restarts"]),
        "abuse: no admission slot held once the load is gone": abuse["held_after"] == 0,
        "abuse: every half-sent header closed by the server": bad["half_header"].get("closed") == bad[
            "half_header"]["sent"],
        f"abuse: goodput >= {GOODPUT_RATIO} of unloaded": met(abuse["goodput_ratio"] >= GOODPUT_RATIO),
    }


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    quiet_environment()
    import ray

    from nemo_gen import GenerationFleet
    from nemo_gen.server import start_server

    cpu = LocalCpu("overload")
    fleet = server = big = None
    try:
        settings = cpu.settings(**{
            "fleet.num_shards": args.shards, "generation.vllm_cfg.async_engine": True, "server.port": 0,
            "server.max_in_flight": args.capacity, "server.retry_after_s": 1, "health.probe_interval_s": 1.0,
            "server.stream_idle_timeout_s": args.stream_idle_s, "server.header_timeout_s": args.header_timeout_s,
            "fleet.engine_niceness": args.engine_niceness})
        t0 = time.monotonic()
        fleet = GenerationFleet.launch(settings)
        print(f"fleet of {args.shards} up in {time.monotonic() - t0:.0f} s", flush=True)
        server = start_server(fleet, settings)
        model = settings.model_name()
        run_clients([{"mode": "load", "url": server.url, "model": model, "clients": args.capacity, "window_s": 3,
                      "max_tokens": args.max_new_tokens, "timeout_s": 120.0}])  # warm-up
        phases: dict[str, Any] = {}
        wanted = set(args.phases.split(","))
        rounds = []  # alternated, so a machine that slows over the run tilts neither side
        for _ in range(args.rounds if {"unloaded", "overload"} <= wanted else 0):
            calm = phase(server.url, model, args.capacity, args)
            rounds.append((calm, phase(server.url, model, args.capacity * args.factor, args)))
        if rounds:
            ratios = [o["goodput_tok_s"] / c["goodput_tok_s"] for c, o in rounds]
            phases["unloaded"] = merged([c for c, _ in rounds])
            phases["overload"] = merged([o for _, o in rounds]) | {
                "goodput_ratios": ratios, "goodput_ratio": statistics.median(ratios)}
        restarts = [s.restart_attempts for s in fleet.health.snapshot()]
        states = [s.state.value for s in fleet.health.snapshot()]
        served = fleet.generate(["after the storm"], max_new_tokens=4)[0].ok
        phases["after"] = {"states": states, "restarts": restarts, "served": served, "condemned": condemned(fleet)}
        chars = int(args.prompt_mb * 2**20)
        roomy = settings.model_copy(update={"server": settings.server.model_copy(update={
            "max_in_flight": args.streams + 8, "max_prompt_chars": max(2 * chars, settings.server.max_prompt_chars),
            "max_body_bytes": max(4 * chars, settings.server.max_body_bytes),
            # a second server beside the first: its own sessions directory (one writer each)
            "sessions_dir": settings.sessions_dir().with_name(settings.sessions_dir().name + "-big")})})
        if "big+streams" in wanted:
            big = start_server(fleet, roomy)
            phases["big+streams"] = phase(big.url, model, args.streams, args, stream=True, prompt_chars=chars)
        if "abuse" in wanted:
            phases["abuse"] = abuse_phase(server.url, model, fleet.resolved.vocab_size, args)
            phases["abuse"]["restarts"] = [s.restart_attempts for s in fleet.health.snapshot()]
            phases["abuse"]["condemned"] = condemned(fleet)
    finally:
        for handle in (big, server):
            if handle is not None:
                handle.stop()
        if fleet is not None:
            fleet.shutdown()
        ray.shutdown()

    if set(phases) != {"unloaded", "overload", "after", "big+streams", "abuse"}:  # a partial run: the numbers only
        print(json.dumps({k: {m: v for m, v in r.items() if m != "errors"} for k, r in phases.items()}, indent=1,
                         default=str))
        return write_result(args.json, "overload", args, phases, {})
    over = phases["overload"]
    codes = set(over["statuses"])
    verdicts = {
        "overload: every request answered 200 or 503": codes <= {"200", "503"} and over["sent"] == over["answered"]
        and over["hung"] == 0 and over["lost"] == 0 and "503" in codes,
        "no shard condemned": not phases["after"]["condemned"],
        f"/health p99 < {HEALTH_P99_S * 1000:.0f} ms in every phase": met(all(
            phases[k]["health_p99_s"] < HEALTH_P99_S for k in ("unloaded", "overload", "big+streams"))),
        f"goodput >= {GOODPUT_RATIO} of unloaded (median of the rounds' ratios)": met(
            over["goodput_ratio"] >= GOODPUT_RATIO),
        "after: full strength, 0 restarts": phases["after"]["served"] and set(phases["after"]["states"]) == {"healthy"}
        and not any(phases["after"]["restarts"]),
        "big+streams: the 4 MB prompt answered 400, streams all 200": (phases["big+streams"]["big_prompt"] or {}).get(
            "status") == 400 and set(phases["big+streams"]["statuses"]) == {"200"},
        **abuse_verdicts(phases["abuse"], phases["overload"]["goodput_ratio"], phases["unloaded"]),
    }
    print()
    print(f"{'phase':12} {'clients':>7} {'sent':>6} {'200':>6} {'503':>6} {'other':>6} {'hung+lost':>9} "
          f"{'tok/s':>8} {'health p99':>11} {'max':>8}")
    for name in ("unloaded", "overload", "big+streams"):
        r = phases[name]
        other = sum(v for k, v in r["statuses"].items() if k not in ("200", "503"))
        print(f"{name:12} {r['clients']:7d} {r['sent']:6d} {r['statuses'].get('200', 0):6d} "
              f"{r['statuses'].get('503', 0):6d} {other:6d} {r['hung'] + r['lost']:9d} {r['goodput_tok_s']:8.0f} "
              f"{r['health_p99_s'] * 1000:9.1f} ms {r['health_max_s'] * 1000:6.0f} ms")
    print(f"goodput overload / unloaded: median {over['goodput_ratio']:.3f} of rounds "
          f"{', '.join(f'{r:.3f}' for r in over['goodput_ratios'])}")
    big_prompt = phases["big+streams"]["big_prompt"] or {}
    print(f"4 MB prompt: HTTP {big_prompt.get('status')} after {big_prompt.get('seconds', float('nan')):.2f} s")
    print(f"after: states {phases['after']['states']}, restarts {phases['after']['restarts']}")
    abuse = phases["abuse"]
    print(f"abuse: {abuse['clients']} clients, statuses {abuse['statuses']}, goodput {abuse['goodput_tok_s']:.0f} tok/s "
          f"({abuse['goodput_ratio']:.3f} of unloaded), held after {abuse['held_after']}, restarts {abuse['restarts']}")
    for kind, seen in abuse["abusive"].items():
        print(f"  {kind:12} sent {seen['sent']:4d}  statuses {seen['statuses']}"
              + (f"  closed {seen['closed']} (max {seen['closed_after_max_s']} s)" if kind == "half_header" else ""))
    verdicts = {name: v if isinstance(v, str) else check(v) for name, v in verdicts.items()}
    for name, v in verdicts.items():
        print(f"  {v}  {name}")
    return write_result(args.json, "overload", args, phases, verdicts)
