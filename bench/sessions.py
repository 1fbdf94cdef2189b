"""Session placement: vLLM's prefix-cache hit rate, time to first token and throughput of a
multi-turn agent workload on one fleet, under each way of choosing a session's shard, in one run.

Workload (the RL tail, issue 33 item 4): ``--sessions`` conversations per arm and round, run by
``--concurrency`` agents. Agent k starts ``k x --stagger-ms`` after the first; each agent runs one
conversation after another from a shared queue, so sessions arrive over time and leave when they
end. Conversations differ in length: ``--min-turns`` to ``--turns`` turns (seeded), so long ones
outlive several short ones and at some point the live sessions are not the ones that opened
together — where sticky routing piles them onto one shard. Each turn is a chat prompt of the
whole conversation so far (a system prompt, every earlier user message and answer) plus a new
user message, sent with ``fleet.generate_stream`` — token streaming, so the time to the first
``Delta`` is the real time to first token as a caller sees it. The answer (``--max-new-tokens``,
``ignore_eos``) is appended for the next turn, after a "tool call" (a seeded random pause,
``--think-ms`` on average). The plan — lengths, pauses, the queue's order — is the same for every
arm of a round (seeded by round and conversation); the text is the arm's own (no arm hits
another's cached prefixes); every arm generates the same number of tokens.

Arms, on the same fleet of ``--shards`` vLLM CPU engines (AsyncLLM and vLLM's stats, as under
``nemo-gen serve``; prefix caching as the fleet ships it):

- ``placement``: an open session (``fleet.router.open_session``, what ``fleet.session()`` and the
  trajectory gateway do): placed when it opens on the shard with the fewest open sessions (ties:
  fewest in flight), pinned there while it lives, released when it ends (issue 33, item 4);
- ``affinity``: every turn passes ``session_id=`` (today's rule for a bare session id): the router
  keeps a session on the shard that served its previous turn while that shard serves and has at
  most ``fleet.session_affinity_slack`` more requests in flight than the least-loaded one; a new
  session goes to whichever shard is least busy at that instant;
- ``roundrobin``: every turn to the next shard in turn, whatever its session (pinned for that one
  turn through the same placement table);
- ``none``: no session, least-loaded routing.

``--arms`` picks them (default all four). Before measuring, every arm runs once on a small plan
(warm-up: no arm meets a cold engine). Round r runs the arms rotated by r (a cyclic Latin square:
over ``len(arms)`` rounds each arm is first once and in every position once), so an ordering
effect lands on every arm alike.

``--kv-blocks`` bounds each engine's KV cache (vLLM's ``num_gpu_blocks_override``); unset, the CPU
engine's default, far more than this workload uses, so nothing is ever evicted and a shard that
holds too many sessions costs queueing, not hits. Bounded, a piled-up shard evicts its
sessions' prefixes (prime-rl's 98 % -> 5 %). The engines cache prompt KV in whole blocks:
``--block-size`` (default 32) instead of the CPU backend's 128, which for conversations of a few
hundred tokens (the tiny model's ``max_model_len`` is 512) would leave most of a prefix in a
partial block; GPU engines use 16. The defaults keep the longest conversation's last prompt
under 512 tokens (an answer re-tokenized from its text is longer than the tokens sampled).

Per arm and round: the prefix-cache hit rate from vLLM's own counters (``vllm:prefix_cache_hits``
/ ``vllm:prefix_cache_queries``, summed over the shards, the arm's difference), the time to first
token p50/p90 over turns 2..N (turn 1 has nothing of its own to hit) and over all turns, vLLM's
own TTFT histogram mean (the engines' view: queue + prefill), the share of turns 2..N on the
shard of the session's previous turn, the busiest shard's share of the turns and the most open
sessions any shard held at once (the pile-up), and throughput (generated tokens / wall time). Per
arm over rounds: median, min and max. Ratios within each round, then their spread: hit rate
affinity / none, TTFT none / affinity; hit rate, throughput and TTFT p90 of placement against
affinity and against round-robin, and round-robin / affinity. The "others" column is the CPU share
of processes outside this benchmark (someone's tests on the shared machine); above 10% the round
is NOISY.

    python -m bench sessions [--shards 2] [--sessions 32] [--concurrency 8] [--turns 6] [--min-turns 1]
                             [--rounds 4] [--arms placement,affinity] [--kv-blocks N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from bench.lib.noise import NOISY_SHARE, ForeignCpu
from bench.lib.result import write_result
from bench.lib.setup import HOME, at_least_one, load, quiet_environment
from bench.lib.stats import percentile, spread, verdict

NAMESPACE = "nemo_gen_bench"
ARMS = ("placement", "affinity", "roundrobin", "none")
WORDS = ("plan tool call search file read write test build deploy check agent step result error retry "
         "cache shard token model weight batch queue route stream answer question reason verify").split()
SYSTEM = ("You are a careful coding agent. Think step by step, call one tool at a time, read each "
          "result before the next step, and answer briefly.")
# Per-arm figures reported with their spread over rounds, and the ratios taken within a round.
FIGURES = ("hit_rate", "throughput_tok_s", "ttft_p50_ms", "ttft_p90_ms", "vllm_ttft_mean_ms", "stayed",
           "busiest_share", "peak_sessions")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="shards in the fleet (default 2)")
    p.add_argument("--sessions", type=int, default=32, help="conversations per arm and round (default 32)")
    p.add_argument("--concurrency", type=int, default=8, help="agents, each one conversation at a time (default 8)")
    p.add_argument("--turns", type=int, default=6, help="most turns of a conversation (default 6)")
    p.add_argument("--min-turns", type=int, default=1, help="fewest turns of a conversation (default 1)")
    p.add_argument("--stagger-ms", type=float, default=150.0, help="between two agents' starts (default 150)")
    p.add_argument("--words", type=int, default=8, help="words per user message (default 8)")
    p.add_argument("--think-ms", type=float, default=100.0, help="mean pause between turns (default 100)")
    p.add_argument("--block-size", type=int, default=32, help="the engines' KV block size (default 32)")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV cache blocks per engine (default: vLLM's)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer (default 16)")
    p.add_argument("--rounds", type=int, default=4, help="rounds of every arm, rotated (default 4)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, comma-separated (default {','.join(ARMS)})")
    p.add_argument("--home", type=Path, default=HOME, help="working directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the summary here")
    args = p.parse_args(argv)
    args.arms = tuple(a for a in args.arms.split(",") if a)
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown or not args.arms:
        p.error(f"--arms: {unknown or 'none given'}; choose from {', '.join(ARMS)}")
    if args.min_turns > args.turns:
        p.error(f"--min-turns {args.min_turns} is more than --turns {args.turns}")
    return at_least_one(p, args, ("shards", "sessions", "concurrency", "turns", "min_turns", "words",
                                  "max_new_tokens", "rounds", "block_size"))


def user_message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def plan(round_: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The round's conversations in queue order: each one's turns and pauses (seconds), the same
    for every arm of the round."""
    out = []
    for i in range(args.sessions):
        rng = random.Random(f"plan-{round_}-{i}")
        turns = rng.randint(args.min_turns, args.turns)
        out.append({"index": i, "turns": turns,
                    "pauses": [rng.uniform(0, 2 * args.think_ms) / 1e3 for _ in range(turns)]})
    return out


def vllm_totals(fleet) -> dict[str, float]:
    """vLLM's counters and TTFT histogram, summed over the serving shards."""
    out = {"queries": 0.0, "hits": 0.0, "ttft_sum": 0.0, "ttft_count": 0.0}
    for rows in fleet.vllm_metrics().values():
        for row in rows:
            name = row["name"].removesuffix("_total")
            if name == "vllm:prefix_cache_queries":
                out["queries"] += row["value"]
            elif name == "vllm:prefix_cache_hits":
                out["hits"] += row["value"]
            elif name == "vllm:time_to_first_token_seconds" and row["kind"] == "histogram":
                out["ttft_sum"] += row["sum"]
                out["ttft_count"] += row["count"]
    return out


class RoundRobin:
    """The next shard for each turn, in turn over the serving shards."""

    def __init__(self) -> None:
        self.count = 0

    def pin(self, fleet, tag: str) -> str:
        serving = sorted(fleet.health.serving_shards())
        slot = serving[self.count % len(serving)]
        self.count += 1
        fleet.router.affinity.placement.place(tag, [slot])  # pinned for this one turn
        return tag


class Live:
    """Open conversations per shard (by the shard of each one's latest turn), and the most any
    shard held at once: how far an arm piles sessions up."""

    def __init__(self) -> None:
        self.on: dict[str, int] = {}
        self.peak = 0

    def at(self, tag: str, shard: int | None) -> None:
        if shard is None:
            self.on.pop(tag, None)
            return
        self.on[tag] = shard
        self.peak = max(self.peak, max(Counter(self.on.values()).values()))


async def session(fleet, tag: str, arm: str, spec: dict[str, Any], args: argparse.Namespace,
                  rr: RoundRobin, live: Live) -> list[dict[str, Any]]:
    """One conversation's turns in order: per turn, the time to its first token and its shard."""
    rng = random.Random(tag)  # its own words: no two conversations share more than the system prompt
    messages = [{"role": "system", "content": f"{SYSTEM} Session {tag}."}]
    turns = []
    if arm == "placement":
        fleet.router.open_session(tag)
    try:
        for turn in range(spec["turns"]):
            messages.append({"role": "user", "content": user_message(rng, args.words)})
            sid = None if arm == "none" else tag
            if arm == "roundrobin":
                sid = rr.pin(fleet, f"{tag}-t{turn}")
            t0, first, answer, shard = time.perf_counter(), None, "", None
            async for event in fleet.generate_stream(list(messages), session_id=sid,
                                                     max_new_tokens=args.max_new_tokens, temperature=0.0,
                                                     ignore_eos=True):
                if first is None:
                    first = time.perf_counter() - t0
                if hasattr(event, "sample"):
                    answer += event.text
                    shard = event.shard
                elif event.error:
                    raise RuntimeError(f"session {tag} turn {turn}: {event.error}")
            if arm == "roundrobin":
                fleet.router.close_session(sid)
            live.at(tag, shard)
            messages.append({"role": "assistant", "content": answer})
            turns.append({"turn": turn, "ttft_s": first, "shard": shard,
                          "prompt_tokens": len(event.prompt_token_ids), "tokens": len(event.token_ids)})
            await asyncio.sleep(spec["pauses"][turn])  # the agent's tool call
    finally:
        live.at(tag, None)
        if arm == "placement":
            fleet.router.close_session(tag)
    return turns


def run_arm(fleet, arm: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    async def main():
        rr, live, queue = RoundRobin(), Live(), list(plan(round_, args))
        queue.reverse()  # pop() takes them in plan order
        done: list[list[dict[str, Any]]] = []

        async def agent(k: int):
            await asyncio.sleep(k * args.stagger_ms / 1e3)  # arrivals spread over time
            while queue:
                spec = queue.pop()
                done.append(await session(fleet, f"r{round_}-{arm}-s{spec['index']}", arm, spec, args, rr, live))

        await asyncio.gather(*(agent(k) for k in range(args.concurrency)))
        return done, live.peak

    before = vllm_totals(fleet)
    t0 = time.perf_counter()
    sessions, peak = asyncio.run(main())
    wall = time.perf_counter() - t0
    after = vllm_totals(fleet)
    d = {k: after[k] - before[k] for k in before}
    later = [t["ttft_s"] for s in sessions for t in s[1:]]
    every = [t["ttft_s"] for s in sessions for t in s]
    stayed = [s[i]["shard"] == s[i - 1]["shard"] for s in sessions for i in range(1, len(s))]
    per_shard = Counter(t["shard"] for s in sessions for t in s)
    return {
        "wall_s": wall, "turns": len(every), "tokens": sum(t["tokens"] for s in sessions for t in s),
        "throughput_tok_s": sum(t["tokens"] for s in sessions for t in s) / wall,
        "hit_rate": d["hits"] / d["queries"] if d["queries"] else 0.0,
        "cache_queries": d["queries"], "cache_hits": d["hits"],
        "ttft_p50_ms": percentile(later, 50) * 1e3, "ttft_p90_ms": percentile(later, 90) * 1e3,
        "ttft_all_p50_ms": percentile(every, 50) * 1e3, "ttft_all_p90_ms": percentile(every, 90) * 1e3,
        "vllm_ttft_mean_ms": d["ttft_sum"] / d["ttft_count"] * 1e3 if d["ttft_count"] else None,
        "stayed": sum(stayed) / len(stayed) if stayed else None,
        "turns_per_shard": {str(k): v for k, v in sorted(per_shard.items())},
        "busiest_share": max(per_shard.values()) / len(every), "peak_sessions": peak,
        "last_prompt_tokens": statistics.mean(s[-1]["prompt_tokens"] for s in sessions),
    }


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else (float("inf") if a else 0.0)


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """The round's comparisons among the arms it ran: affinity against none (hit rate up, TTFT
    down); placement against affinity and against round-robin, round-robin against affinity
    (hit rate, throughput, TTFT p90)."""
    out = {}
    if "affinity" in row and "none" in row:
        a, n = row["affinity"], row["none"]
        out["hit_rate_affinity_vs_none"] = _ratio(a["hit_rate"], n["hit_rate"])
        out["ttft_p50_none_vs_affinity"] = _ratio(n["ttft_p50_ms"], a["ttft_p50_ms"])
        out["ttft_p90_none_vs_affinity"] = _ratio(n["ttft_p90_ms"], a["ttft_p90_ms"])
    for arm, base in (("placement", "affinity"), ("placement", "roundrobin"), ("roundrobin", "affinity")):
        if arm in row and base in row:
            out[f"hit_rate_{arm}_vs_{base}"] = _ratio(row[arm]["hit_rate"], row[base]["hit_rate"])
            out[f"throughput_{arm}_vs_{base}"] = _ratio(row[arm]["throughput_tok_s"], row[base]["throughput_tok_s"])
            out[f"ttft_p90_{base}_vs_{arm}"] = _ratio(row[base]["ttft_p90_ms"], row[arm]["ttft_p90_ms"])
    return out


def verdicts_of(summary: dict[str, Any]) -> dict[str, str]:
    """Targets on the medians over rounds: affinity raises the hit rate and lowers TTFT against
    none; placement keeps >= 95 % of affinity's hit rate and throughput, and beats round-robin's
    hit rate at >= 95 % of its throughput."""
    med = {k: v["median"] for k, v in summary["ratios"].items()}
    out = {}
    if "hit_rate_affinity_vs_none" in med:
        out["affinity_raises_hit_rate"] = verdict(med["hit_rate_affinity_vs_none"], 1.0, higher_is_better=True)
        out["affinity_lowers_ttft_p50"] = verdict(med["ttft_p50_none_vs_affinity"], 1.0, higher_is_better=True)
    if "throughput_placement_vs_affinity" in med:
        out["placement_keeps_hit_rate_vs_affinity"] = verdict(med["hit_rate_placement_vs_affinity"], 0.95,
                                                              higher_is_better=True)
        out["placement_keeps_throughput_vs_affinity"] = verdict(med["throughput_placement_vs_affinity"], 0.95,
                                                                higher_is_better=True)
    if "throughput_placement_vs_roundrobin" in med:
        out["placement_raises_hit_rate_vs_roundrobin"] = verdict(med["hit_rate_placement_vs_roundrobin"], 1.0,
                                                                 higher_is_better=True)
        out["placement_keeps_throughput_vs_roundrobin"] = verdict(med["throughput_placement_vs_roundrobin"], 0.95,
                                                                  higher_is_better=True)
    return out


def fmt(s: dict[str, float], f: str = "{:.3g}") -> str:
    return f"{f.format(s['median'])} ({f.format(s['min'])}-{f.format(s['max'])})"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_environment()
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    vllm_kwargs: dict[str, Any] = {"block_size": args.block_size}
    if args.kv_blocks:
        vllm_kwargs["num_gpu_blocks_override"] = args.kv_blocks
    settings = NemoGenSettings.load(overrides={
        "home": str(args.home), "fleet.name": "bench-sessions", "fleet.num_shards": args.shards,
        "fleet.device": "cpu", "generation.vllm_cfg.max_model_len": 512, "generation.vllm_cfg.async_engine": True,
        "generation.vllm_cfg.enable_vllm_metrics_logger": True, "generation.vllm_kwargs": vllm_kwargs,
        "ray.namespace": NAMESPACE, "ray.log_to_driver": False,
    })
    print(f"bench sessions: {args.shards} shards, {args.sessions} sessions of {args.min_turns}-{args.turns} turns "
          f"by {args.concurrency} agents ({args.stagger_ms:g} ms apart), {args.words}-word user messages, "
          f"{args.max_new_tokens}-token answers, {args.think_ms:g} ms between turns; arms {','.join(args.arms)}, "
          f"{args.rounds} rounds; KV block size {args.block_size}, KV blocks {args.kv_blocks or 'vLLM default'}, "
          f"session_affinity_slack {settings.fleet.session_affinity_slack}; {load()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with GenerationFleet.launch(settings) as fleet, ForeignCpu() as foreign:
        if not any(fleet.vllm_metrics().values()):
            raise SystemExit("the engines report no vLLM stats (generation.vllm_cfg.enable_vllm_metrics_logger)")
        warm = argparse.Namespace(**{**vars(args), "sessions": args.concurrency, "turns": 2, "min_turns": 2})
        for arm in args.arms:  # every arm once, so none meets a cold engine or a cold code path
            run_arm(fleet, arm, -1, warm)
        for r in range(args.rounds):
            k = r % len(args.arms)
            order = args.arms[k:] + args.arms[:k]  # cyclic Latin square: each arm first once per len(arms) rounds
            row: dict[str, Any] = {"round": r, "order": order}
            for arm in order:
                cpu0, t0 = foreign.cpu_s(), time.perf_counter()
                out = run_arm(fleet, arm, r, args)
                out["others"] = ForeignCpu.share(foreign.cpu_s() - cpu0, time.perf_counter() - t0)
                row[arm] = out
                print(f"  round {r} {arm:10s}: hit rate {out['hit_rate']:.1%} ({out['cache_hits']:.0f}/"
                      f"{out['cache_queries']:.0f} tokens), {out['throughput_tok_s']:.0f} tok/s, TTFT turns 2+ "
                      f"p50 {out['ttft_p50_ms']:.0f} p90 {out['ttft_p90_ms']:.0f} ms (all p50 "
                      f"{out['ttft_all_p50_ms']:.0f} p90 {out['ttft_all_p90_ms']:.0f}), vLLM TTFT mean "
                      f"{out['vllm_ttft_mean_ms']:.0f} ms, stayed {out['stayed']:.0%}, turns per shard "
                      f"{out['turns_per_shard']}, peak sessions on a shard {out['peak_sessions']}, wall "
                      f"{out['wall_s']:.1f} s, others {out['others']:.0%}"
                      f"{' NOISY' if out['others'] > NOISY_SHARE else ''}", flush=True)
            row.update(ratios(row))
            rounds.append(row)
            print(f"  round {r}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios(row).items()), flush=True)
    summary: dict[str, Any] = {
        "shards": args.shards, "sessions": args.sessions, "concurrency": args.concurrency, "turns": args.turns,
        "min_turns": args.min_turns, "stagger_ms": args.stagger_ms, "words": args.words,
        "max_new_tokens": args.max_new_tokens, "think_ms": args.think_ms, "block_size": args.block_size,
        "kv_blocks": args.kv_blocks, "arms": list(args.arms), "rounds": rounds, "load": load(),
        "others_max": max(r[a]["others"] for r in rounds for a in args.arms),
        "ratios": {key: spread([r[key] for r in rounds]) for key in ratios(rounds[0])}}
    for arm in args.arms:
        summary[arm] = {k: spread([r[arm][k] for r in rounds]) for k in FIGURES}
    summary.update({k: v["median"] for k, v in summary["ratios"].items()})  # the medians, flat, as before
    print(f"over {args.rounds} rounds, median (min-max):", flush=True)
    for arm in args.arms:
        s = summary[arm]
        print(f"  {arm:10s}: hit rate {fmt(s['hit_rate'], '{:.1%}')}, {fmt(s['throughput_tok_s'], '{:.0f}')} tok/s, "
              f"TTFT p50 {fmt(s['ttft_p50_ms'], '{:.0f}')} ms p90 {fmt(s['ttft_p90_ms'], '{:.0f}')} ms, busiest "
              f"shard {fmt(s['busiest_share'], '{:.0%}')} of turns, peak {fmt(s['peak_sessions'], '{:.0f}')} sessions",
              flush=True)
    for key, s in summary["ratios"].items():
        print(f"  {key}: {fmt(s)}", flush=True)
    verdicts = verdicts_of(summary)
    print("verdicts: " + ", ".join(f"{k} {v}" for k, v in verdicts.items()) + f"; {load()}", flush=True)
    write_result(args.json, "sessions", args, summary, verdicts)
    return 0
