"""What the trajectory gateway costs: multi-turn conversations through a recorded session
(``/nemo_gen/sessions/{id}/v1/chat/completions``) against the same conversations on
``/v1/chat/completions`` directly, on one fleet, in one run (target: gateway / direct time per
turn <= 1.05, i.e. at most 5 % overhead; the wall time with each session opened and its trajectory
read is printed beside it).

Workload: ``--sessions`` conversations x ``--turns`` turns, ``--concurrency`` conversations at
once; each turn sends the whole conversation so far plus a new user message and asks for
``--max-new-tokens`` tokens (``ignore_eos``, temperature 0), so both arms generate the same number
of tokens. The gateway arm opens a session per conversation (``POST /nemo_gen/sessions``), runs its
turns there and reads its trajectory at the end (checked: one segment, the mask's sum the
completion tokens); the direct arm sends the same requests to ``/v1/chat/completions``. What
differs is the gateway's own work: the prefix check, rendering the continuation and tokenizing
it instead of the whole chat, recording the turn (``prompt_tokens``, the server's count of an
arm's prompt tokens, shows how alike the arms' prompts were). Each arm and round has conversations of its
own (distinct text: no arm hits another's cached prefixes); the arms alternate over ``--rounds``
rounds; the ratios are taken within each round and their medians printed. The client (httpx) runs in
this process's main thread for both arms alike; the server (``start_server``) and the router run in
its other threads. Per turn of an arm (its sessions are opened before and read after its turns):
``cpu_us_per_turn``, this process's CPU (client, server, router); ``server_cpu_us_per_turn``, the
same less the client's thread: the gateway's own work is the difference between the arms. "others":
CPU share of processes outside this benchmark.

``--fake``: the same arms over fake shards (tests/fakes.py: no Ray, no engines, tokens made at
once; the tiny model's tokenizer and chat template), so the time per turn is the server's and the
client's CPU alone and ``server_cpu_us_per_turn`` gateway - direct is the gateway's cost per
turn, free of the engines' noise. No engine lock is needed; it is how that cost is profiled and compared
across commits.

    python -m bench gateway [--shards 1] [--sessions 16] [--turns 4] [--concurrency 8] [--rounds 2] [--fake]
                            [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from bench.lib.noise import NOISY_SHARE, ForeignCpu
from bench.lib.result import write_result
from bench.lib.setup import HOME, at_least_one, fake_overrides, fleet_of, load, quiet_environment
from bench.lib.stats import verdict
from bench.sessions import SYSTEM, user_message

NAMESPACE = "nemo_gen_bench"
TARGET = 1.05  # gateway / direct wall time: at most
ARMS = ("direct", "gateway")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=1, help="shards in the fleet (default 1)")
    p.add_argument("--sessions", type=int, default=16, help="conversations per arm and round (default 16)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--concurrency", type=int, default=8, help="conversations at once (default 8)")
    p.add_argument("--words", type=int, default=12, help="words per user message (default 12)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--rounds", type=int, default=2, help="alternating direct/gateway rounds (default 2)")
    p.add_argument("--home", type=Path, default=HOME, help="working directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the summary here")
    p.add_argument("--fake", action="store_true", help="fake shards (tests/fakes.py): the server's CPU alone")
    args = p.parse_args(argv)
    return at_least_one(p, args, ("shards", "sessions", "turns", "concurrency", "max_new_tokens", "rounds"))


async def conversation(http, base: str, model: str, tag: str,
                       args: argparse.Namespace) -> tuple[int, float, int]:
    """One conversation's turns in order at ``base`` (``/v1``, or a session's ``url``): the tokens
    generated, the seconds its turns took, and its prompts' tokens (the server's count)."""
    rng = random.Random(tag)
    messages = [{"role": "system", "content": f"{SYSTEM} Session {tag}."}]
    tokens, turn_s, prompt_tokens = 0, 0.0, 0
    for _ in range(args.turns):
        messages.append({"role": "user", "content": user_message(rng, args.words)})
        t0 = time.perf_counter()
        r = await http.post(f"{base}/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": args.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True})
        r.raise_for_status()
        out = r.json()
        turn_s += time.perf_counter() - t0
        tokens += out["usage"]["completion_tokens"]
        prompt_tokens += out["usage"]["prompt_tokens"]
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    return tokens, turn_s, prompt_tokens


def run_arm(url: str, model: str, arm: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    """One arm's conversations, ``--concurrency`` at once. The gateway arm opens every session
    first and reads (deletes) each at the end, checking it (one segment, the mask's sum its
    completion tokens): ``wall_s`` counts that, ``turn_ms`` and ``cpu_us_per_turn`` do not."""
    import httpx

    gateway = arm == "gateway"
    cpu: list[tuple[float, float]] = []  # (this process's, this thread's: the client's) CPU seconds

    async def main():
        limit = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.concurrency)) as http:
            async def opened(i):
                async with limit:
                    return (await http.post(f"{url}/nemo_gen/sessions")).json() if gateway else None

            async def one(i, created):
                async with limit:
                    base = created["url"] if created else f"{url}/v1"
                    return await conversation(http, base, model, f"r{round_}-{arm}-{i}", args)

            async def read(created, tokens):
                async with limit:
                    traj = (await http.delete(f"{url}/nemo_gen/sessions/{created['id']}")).json()
                if len(traj["segments"]) != 1 or sum(traj["loss_mask"]) != tokens:
                    raise SystemExit(f"session {created['id']}: {len(traj['segments'])} segments, mask sum "
                                     f"{sum(traj['loss_mask'])} for {tokens} tokens")

            sessions = await asyncio.gather(*(opened(i) for i in range(args.sessions)))
            cpu.append((time.process_time(), time.thread_time()))
            done = await asyncio.gather(*(one(i, c) for i, c in enumerate(sessions)))
            cpu.append((time.process_time(), time.thread_time()))
            if gateway:
                await asyncio.gather(*(read(c, t) for c, (t, _, _) in zip(sessions, done)))
            return done

    t0 = time.perf_counter()
    done = asyncio.run(main())
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _, _ in done)
    turns = len(done) * args.turns
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "prompt_tokens": sum(p for _, _, p in done),
            "turn_ms": sum(s for _, s, _ in done) / turns * 1e3,
            "cpu_us_per_turn": (cpu[1][0] - cpu[0][0]) / turns * 1e6,
            "server_cpu_us_per_turn": ((cpu[1][0] - cpu[0][0]) - (cpu[1][1] - cpu[0][1])) / turns * 1e6}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_environment()
    from nemo_gen.server import start_server
    from nemo_gen.settings import NemoGenSettings

    overrides = {
        "home": str(args.home), "fleet.name": "bench-gateway", "fleet.num_shards": args.shards,
        "fleet.device": "cpu", "generation.vllm_cfg.max_model_len": 512, "generation.vllm_cfg.async_engine": True,
        "ray.namespace": NAMESPACE, "ray.log_to_driver": False, "server.port": 0,
    }
    if args.fake:
        overrides.update(fake_overrides(args.home, "fake-gateway-model"))
    settings = NemoGenSettings.load(overrides=overrides)
    print(f"bench gateway{' (fake shards)' if args.fake else ''}: {args.shards} shard(s), {args.sessions} "
          f"conversations x {args.turns} turns, {args.concurrency} at once, {args.max_new_tokens}-token answers, "
          f"{args.rounds} rounds; {load()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with fleet_of(settings, args.fake) as fleet, start_server(fleet) as handle, ForeignCpu() as foreign:
        model = settings.model_name()
        warm = argparse.Namespace(**{**vars(args), "sessions": 2, "turns": 2})
        for arm in ARMS:
            run_arm(handle.url, model, arm, -1, warm)
        for r in range(args.rounds):
            row: dict[str, Any] = {"round": r}
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                cpu0, t0 = foreign.cpu_s(), time.perf_counter()
                out = run_arm(handle.url, model, arm, r, args)
                out["others"] = ForeignCpu.share(foreign.cpu_s() - cpu0, time.perf_counter() - t0)
                row[arm] = out
                print(f"  round {r} {arm:8s}: {out['tokens']} tokens ({out['prompt_tokens']} prompt) in "
                      f"{out['wall_s']:.2f} s, {out['tok_s']:.0f} tok/s, "
                      f"{out['turn_ms']:.1f} ms per turn, CPU per turn {out['cpu_us_per_turn']:.0f} us "
                      f"(server's {out['server_cpu_us_per_turn']:.0f} us), "
                      f"others {out['others']:.0%}{' NOISY' if out['others'] > NOISY_SHARE else ''}", flush=True)
            row["ratio"] = row["gateway"]["turn_ms"] / row["direct"]["turn_ms"]
            row["wall_ratio"] = row["gateway"]["wall_s"] / row["direct"]["wall_s"]
            row["cpu_us_extra"] = row["gateway"]["server_cpu_us_per_turn"] - row["direct"]["server_cpu_us_per_turn"]
            rounds.append(row)
            print(f"  round {r}: gateway / direct time per turn {row['ratio']:.3f}, wall (with opening and "
                  f"reading each session) {row['wall_ratio']:.3f}, gateway - direct server CPU per "
                  f"turn {row['cpu_us_extra']:.0f} us", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    summary = {"shards": args.shards, "sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency,
               "max_new_tokens": args.max_new_tokens, "rounds": rounds, "ratio": ratio,
               "ratio_min": min(r["ratio"] for r in rounds), "ratio_max": max(r["ratio"] for r in rounds),
               "wall_ratio": statistics.median(r["wall_ratio"] for r in rounds),
               "cpu_us_per_turn": {arm: statistics.median(r[arm]["cpu_us_per_turn"] for r in rounds) for arm in ARMS},
               "server_cpu_us_per_turn": {arm: statistics.median(r[arm]["server_cpu_us_per_turn"] for r in rounds)
                                          for arm in ARMS},
               "cpu_us_extra": statistics.median(r["cpu_us_extra"] for r in rounds), "fake": args.fake, "load": load()}
    print(f"median gateway / direct time per turn {ratio:.3f} (target <= {TARGET}), wall with sessions opened "
          f"and read {summary['wall_ratio']:.3f}; server CPU per turn direct / gateway "
          f"{summary['server_cpu_us_per_turn']['direct']:.0f} / {summary['server_cpu_us_per_turn']['gateway']:.0f} us "
          f"(gateway - direct per round, median {summary['cpu_us_extra']:.0f} us); {load()}", flush=True)
    write_result(args.json, "gateway", args, summary,
                 {"gateway_overhead_within_5pct": verdict(ratio, TARGET, higher_is_better=False)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
