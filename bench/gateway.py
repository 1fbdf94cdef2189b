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
it instead of the whole chat, recording the turn. Each arm and round has conversations of its
own (distinct text: no arm hits another's cached prefixes); the arms alternate over ``--rounds``
rounds; the ratios are taken within each round and their medians printed. The client (httpx) runs in
this process for both arms alike. "others": CPU share of processes outside this benchmark.

    python -m bench gateway [--shards 1] [--sessions 16] [--turns 4] [--concurrency 8] [--rounds 2] [--json out.json]
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
from bench.lib.setup import HOME, at_least_one, load, quiet_environment
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
    args = p.parse_args(argv)
    return at_least_one(p, args, ("shards", "sessions", "turns", "concurrency", "max_new_tokens", "rounds"))


async def conversation(http, url: str, model: str, tag: str, gateway: bool,
                       args: argparse.Namespace) -> tuple[int, float]:
    """One conversation's turns in order: the tokens generated, and the seconds its turns took
    (the chat requests alone: not opening the session, nor reading its trajectory)."""
    rng = random.Random(tag)
    messages = [{"role": "system", "content": f"{SYSTEM} Session {tag}."}]
    base, sid = f"{url}/v1", None
    if gateway:
        created = (await http.post(f"{url}/nemo_gen/sessions")).json()
        base, sid = created["url"], created["id"]
    tokens, turn_s = 0, 0.0
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
        messages.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    if gateway:
        traj = (await http.delete(f"{url}/nemo_gen/sessions/{sid}")).json()
        if len(traj["segments"]) != 1 or sum(traj["loss_mask"]) != tokens:
            raise SystemExit(f"session {tag}: {len(traj['segments'])} segments, mask sum {sum(traj['loss_mask'])} "
                             f"for {tokens} tokens")
    return tokens, turn_s


def run_arm(url: str, model: str, arm: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    async def main():
        limit = asyncio.Semaphore(args.concurrency)
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.concurrency)) as http:
            async def one(i):
                async with limit:
                    return await conversation(http, url, model, f"r{round_}-{arm}-{i}", arm == "gateway", args)
            return await asyncio.gather(*(one(i) for i in range(args.sessions)))

    t0 = time.perf_counter()
    done = asyncio.run(main())
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in done)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "turn_ms": sum(s for _, s in done) / (len(done) * args.turns) * 1e3}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_environment()
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.server import start_server
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": str(args.home), "fleet.name": "bench-gateway", "fleet.num_shards": args.shards,
        "fleet.device": "cpu", "generation.vllm_cfg.max_model_len": 512, "generation.vllm_cfg.async_engine": True,
        "ray.namespace": NAMESPACE, "ray.log_to_driver": False, "server.port": 0,
    })
    print(f"bench gateway: {args.shards} shard(s), {args.sessions} conversations x {args.turns} turns, "
          f"{args.concurrency} at once, {args.max_new_tokens}-token answers, {args.rounds} rounds; {load()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with GenerationFleet.launch(settings) as fleet, start_server(fleet) as handle, ForeignCpu() as foreign:
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
                print(f"  round {r} {arm:8s}: {out['tokens']} tokens in {out['wall_s']:.2f} s, {out['tok_s']:.0f} tok/s, "
                      f"{out['turn_ms']:.1f} ms per turn, "
                      f"others {out['others']:.0%}{' NOISY' if out['others'] > NOISY_SHARE else ''}", flush=True)
            row["ratio"] = row["gateway"]["turn_ms"] / row["direct"]["turn_ms"]
            row["wall_ratio"] = row["gateway"]["wall_s"] / row["direct"]["wall_s"]
            rounds.append(row)
            print(f"  round {r}: gateway / direct time per turn {row['ratio']:.3f}, wall (with opening and "
                  f"reading each session) {row['wall_ratio']:.3f}", flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    summary = {"shards": args.shards, "sessions": args.sessions, "turns": args.turns, "concurrency": args.concurrency,
               "max_new_tokens": args.max_new_tokens, "rounds": rounds, "ratio": ratio,
               "ratio_min": min(r["ratio"] for r in rounds), "ratio_max": max(r["ratio"] for r in rounds),
               "wall_ratio": statistics.median(r["wall_ratio"] for r in rounds), "load": load()}
    print(f"median gateway / direct time per turn {ratio:.3f} (target <= {TARGET}), wall with sessions opened "
          f"and read {summary['wall_ratio']:.3f}; {load()}", flush=True)
    write_result(args.json, "gateway", args, summary,
                 {"gateway_overhead_within_5pct": verdict(ratio, TARGET, higher_is_better=False)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
