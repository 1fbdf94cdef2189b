"""Session placement: vLLM's prefix-cache hit rate, time to first token and throughput of a
multi-turn workload on one fleet, under each way of choosing a session's shard, in one run.

Workload: ``--sessions`` conversations x ``--turns`` turns. Each turn is a chat prompt of the whole
conversation so far (a system prompt, every earlier user message and answer) plus a new user
message, sent with ``fleet.generate_stream`` — token streaming, so the time to the first ``Delta``
is the real time to first token as a caller sees it (driver-side chat rendering and routing, the
Ray call, the engine's queue and prefill). The answer (``--max-new-tokens``, ``ignore_eos``) is
appended for the next turn. All sessions run at once, each its turns in order, as agents do, with
a "tool call" between turns (a seeded random pause, ``--think-ms`` on average): without it the
sessions move in lockstep and least-loaded routing would send each one to the same shard every
turn by accident (92-100% of turns here), which is affinity under another name.

Arms, on the same fleet of ``--shards`` vLLM CPU engines (AsyncLLM and vLLM's stats, as under
``nemo-gen serve``; prefix caching as the fleet ships it):

- ``affinity``: every turn passes ``session_id=`` — the router keeps a session on the shard that
  served its previous turn (where that prompt's KV is cached) while that shard serves and has at
  most ``fleet.session_affinity_slack`` more requests in flight than the least-loaded one;
- ``none``: no session, least-loaded routing: a turn lands on whichever shard is least busy;
- ``placement``: an open session (``fleet.router.open_session``, what ``fleet.session()`` and the
  trajectory gateway do): placed when it opens on the shard with the fewest open sessions (ties:
  fewest in flight) and pinned there until it closes (issue 33, item 4);
- ``roundrobin``: every turn to the next shard in turn, whatever its session (pinned for that one
  turn through the same placement table).

``--arms`` picks them (default all four); each round runs them in a rotated order.

The engines cache prompt KV in whole blocks: ``--block-size`` (default 32, as
``generation.vllm_kwargs.block_size``) instead of the CPU backend's 128, which for conversations of
a few hundred tokens (the tiny model's ``max_model_len`` is 512) would leave most of a turn's
prefix in a partial block; GPU engines use 16.

Each arm and round has conversations of its own (distinct text), so no arm hits another's cached
prefixes; the arms alternate (A, B, then B, A, ...) over ``--rounds`` rounds.

Per arm: the prefix-cache hit rate from vLLM's own counters (``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``: prompt tokens found in / looked up in the cache, summed over the
shards, the arm's difference), the time to first token p50/p90 over turns 2..N (turn 1 has nothing
of its own to hit) and over all turns, vLLM's own TTFT histogram mean (``vllm:time_to_first_token_
seconds``, the engines' view: queue + prefill, no routing or Ray), and the share of turns 2..N that
ran on the shard of the session's previous turn, and throughput (generated tokens / wall time).
Ratios: hit rate affinity / none, TTFT none / affinity; hit rate and throughput of placement and of
round-robin / affinity. The "others" column is the CPU share of processes outside this benchmark (someone's
tests on the shared machine); above 10% the round is NOISY.

    python -m bench sessions [--shards 2] [--sessions 32] [--turns 4] [--rounds 2] [--arms placement,affinity]
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
from bench.lib.setup import HOME, at_least_one, load, quiet_environment
from bench.lib.stats import percentile, verdict
NAMESPACE = "nemo_gen_bench"
ARMS = ("placement", "affinity", "roundrobin", "none")
WORDS = ("plan tool call search file read write test build deploy check agent step result error retry "
         "cache shard token model weight batch queue route stream answer question reason verify").split()
SYSTEM = ("You are a careful coding agent. Think step by step, call one tool at a time, read each "
          "result before the next step, and answer briefly.")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="shards in the fleet (default 2)")
    p.add_argument("--sessions", type=int, default=32, help="conversations per arm and round (default 32)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--words", type=int, default=12, help="words per user message (default 12)")
    p.add_argument("--think-ms", type=float, default=100.0, help="mean pause between turns (default 100)")
    p.add_argument("--block-size", type=int, default=32, help="the engines' KV block size (default 32)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per answer (default 24)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every arm, rotated (default 2)")
    p.add_argument("--arms", default=",".join(ARMS), help=f"arms to run, comma-separated (default {','.join(ARMS)})")
    p.add_argument("--home", type=Path, default=HOME, help="working directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the summary here")
    args = p.parse_args(argv)
    args.arms = tuple(a for a in args.arms.split(",") if a)
    unknown = sorted(set(args.arms) - set(ARMS))
    if unknown or not args.arms:
        p.error(f"--arms: {unknown or 'none given'}; choose from {', '.join(ARMS)}")
    return at_least_one(p, args, ("shards", "sessions", "turns", "words", "max_new_tokens", "rounds", "block_size"))


def user_message(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


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


async def session(fleet, tag: str, arm: str, args: argparse.Namespace,
                  rr: RoundRobin | None = None) -> list[dict[str, Any]]:
    """One conversation's turns in order: per turn, the time to its first token and its shard."""
    rng = random.Random(tag)  # its own words: no two conversations share more than the system prompt
    messages = [{"role": "system", "content": f"{SYSTEM} Session {tag}."}]
    turns = []
    if arm == "placement":
        fleet.router.open_session(tag)
    for turn in range(args.turns):
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
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(rng.uniform(0, 2 * args.think_ms) / 1e3)  # the agent's tool call
        if arm == "roundrobin":
            fleet.router.close_session(sid)
        turns.append({"turn": turn, "ttft_s": first, "shard": shard,
                      "prompt_tokens": len(event.prompt_token_ids), "tokens": len(event.token_ids)})
    if arm == "placement":
        fleet.router.close_session(tag)
    return turns


def run_arm(fleet, arm: str, round_: int, args: argparse.Namespace) -> dict[str, Any]:
    async def main():
        rr = RoundRobin()
        return await asyncio.gather(*(session(fleet, f"r{round_}-{arm}-s{i}", arm, args, rr)
                                      for i in range(args.sessions)))

    before = vllm_totals(fleet)
    t0 = time.perf_counter()
    sessions = asyncio.run(main())
    wall = time.perf_counter() - t0
    after = vllm_totals(fleet)
    d = {k: after[k] - before[k] for k in before}
    later = [t["ttft_s"] for s in sessions for t in s[1:]]
    every = [t["ttft_s"] for s in sessions for t in s]
    stayed = [s[i]["shard"] == s[i - 1]["shard"] for s in sessions for i in range(1, len(s))]
    return {
        "wall_s": wall, "turns": len(every),
        "throughput_tok_s": sum(t["tokens"] for s in sessions for t in s) / wall, "hit_rate": d["hits"] / d["queries"] if d["queries"] else 0.0,
        "cache_queries": d["queries"], "cache_hits": d["hits"],
        "ttft_p50_ms": percentile(later, 50) * 1e3, "ttft_p90_ms": percentile(later, 90) * 1e3,
        "ttft_all_p50_ms": percentile(every, 50) * 1e3, "ttft_all_p90_ms": percentile(every, 90) * 1e3,
        "vllm_ttft_mean_ms": d["ttft_sum"] / d["ttft_count"] * 1e3 if d["ttft_count"] else None,
        "stayed": sum(stayed) / len(stayed) if stayed else None,
        "last_prompt_tokens": statistics.mean(s[-1]["prompt_tokens"] for s in sessions),
    }


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a and b else (float("inf") if a else 0.0)


def ratios(row: dict[str, Any]) -> dict[str, float]:
    """The round's comparisons among the arms it ran: affinity against none (hit rate up, TTFT
    down), and placement and round-robin against affinity (hit rate, throughput)."""
    out = {}
    if "affinity" in row and "none" in row:
        a, n = row["affinity"], row["none"]
        out["hit_rate_affinity_vs_none"] = _ratio(a["hit_rate"], n["hit_rate"])
        out["ttft_p50_none_vs_affinity"] = _ratio(n["ttft_p50_ms"], a["ttft_p50_ms"])
        out["ttft_p90_none_vs_affinity"] = _ratio(n["ttft_p90_ms"], a["ttft_p90_ms"])
    for arm in ("placement", "roundrobin"):
        if arm in row and "affinity" in row:
            out[f"hit_rate_{arm}_vs_affinity"] = _ratio(row[arm]["hit_rate"], row["affinity"]["hit_rate"])
            out[f"throughput_{arm}_vs_affinity"] = _ratio(row[arm]["throughput_tok_s"],
                                                          row["affinity"]["throughput_tok_s"])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_environment()
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": str(args.home), "fleet.name": "bench-sessions", "fleet.num_shards": args.shards,
        "fleet.device": "cpu", "generation.vllm_cfg.max_model_len": 512, "generation.vllm_cfg.async_engine": True,
        "generation.vllm_cfg.enable_vllm_metrics_logger": True, "generation.vllm_kwargs": {"block_size": args.block_size},
        "ray.namespace": NAMESPACE, "ray.log_to_driver": False,
    })
    print(f"bench sessions: {args.shards} shards, {args.sessions} sessions x {args.turns} turns "
          f"({args.words}-word user messages, {args.max_new_tokens}-token answers, {args.think_ms:g} ms between "
          f"turns), arms {','.join(args.arms)}, {args.rounds} rounds, KV block size {args.block_size}, session_affinity_slack "
          f"{settings.fleet.session_affinity_slack}; {load()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with GenerationFleet.launch(settings) as fleet, ForeignCpu() as foreign:
        if not any(fleet.vllm_metrics().values()):
            raise SystemExit("the engines report no vLLM stats (generation.vllm_cfg.enable_vllm_metrics_logger)")
        warm = argparse.Namespace(**{**vars(args), "sessions": 4, "turns": 2})
        run_arm(fleet, "none", -1, warm)
        for r in range(args.rounds):
            k = r % len(args.arms)
            order = args.arms[k:] + args.arms[:k]  # rotated: no arm always first
            row: dict[str, Any] = {"round": r, "order": order}
            for arm in order:
                cpu0, t0 = foreign.cpu_s(), time.perf_counter()
                out = run_arm(fleet, arm, r, args)
                out["others"] = ForeignCpu.share(foreign.cpu_s() - cpu0, time.perf_counter() - t0)
                row[arm] = out
                print(f"  round {r} {arm:10s}: prefix-cache hit rate {out['hit_rate']:.1%} "
                      f"({out['cache_hits']:.0f}/{out['cache_queries']:.0f} tokens), TTFT turns 2-{args.turns} "
                      f"p50 {out['ttft_p50_ms']:.0f} ms p90 {out['ttft_p90_ms']:.0f} ms (all turns p50 "
                      f"{out['ttft_all_p50_ms']:.0f} / p90 {out['ttft_all_p90_ms']:.0f}), vLLM TTFT mean "
                      f"{out['vllm_ttft_mean_ms']:.0f} ms, same shard as the last turn {out['stayed']:.0%}, "
                      f"{out['throughput_tok_s']:.0f} tok/s, wall {out['wall_s']:.1f} s, others {out['others']:.0%}"
                      f"{' NOISY' if out['others'] > NOISY_SHARE else ''}", flush=True)
            row.update(ratios(row))
            rounds.append(row)
            print(f"  round {r}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios(row).items()), flush=True)
    summary: dict[str, Any] = {
        "shards": args.shards, "sessions": args.sessions, "turns": args.turns, "words": args.words,
        "max_new_tokens": args.max_new_tokens, "think_ms": args.think_ms, "block_size": args.block_size,
        "arms": list(args.arms), "rounds": rounds, "load": load()}
    for key in ratios(rounds[0]):
        summary[key] = statistics.median(r[key] for r in rounds)
    for arm in args.arms:
        summary[arm] = {k: statistics.median(r[arm][k] for r in rounds)
                        for k in ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "vllm_ttft_mean_ms", "stayed",
                                  "throughput_tok_s")}
    print(f"median over {args.rounds} rounds: " + "; ".join(
        f"{arm} hit rate {summary[arm]['hit_rate']:.1%}, TTFT p50 {summary[arm]['ttft_p50_ms']:.0f} ms, "
        f"{summary[arm]['throughput_tok_s']:.0f} tok/s" for arm in args.arms) + f"; {load()}", flush=True)
    verdicts = {}
    if "hit_rate_affinity_vs_none" in summary:
        verdicts["affinity_raises_hit_rate"] = verdict(summary["hit_rate_affinity_vs_none"], 1.0, higher_is_better=True)
        verdicts["affinity_lowers_ttft_p50"] = verdict(summary["ttft_p50_none_vs_affinity"], 1.0, higher_is_better=True)
    if "throughput_placement_vs_affinity" in summary:
        verdicts["placement_keeps_hit_rate"] = verdict(summary["hit_rate_placement_vs_affinity"], 0.95,
                                                       higher_is_better=True)
        verdicts["placement_keeps_throughput"] = verdict(summary["throughput_placement_vs_affinity"], 0.95,
                                                         higher_is_better=True)
    write_result(args.json, "sessions", args, summary, verdicts)
    return 0
