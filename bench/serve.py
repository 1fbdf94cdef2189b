"""What the OpenAI-compatible server costs: HTTP throughput / library throughput on the same fleet,
in one run, at the same concurrency (target >= 0.9).

One fleet of vLLM CPU engines (the tiny local model, ``vllm_cfg.async_engine: true`` as under
``nemo-gen serve``) with ``nemo_gen.server.start_server`` in front of it serves one fixed-length
workload (``--requests`` distinct prompts, ``--max-new-tokens`` each with ``ignore_eos``) two ways:

- library: ``fleet.generate_async`` per request from this process, ``--concurrency`` in flight
  (an asyncio semaphore), as an async RL loop calls it;
- http: ``POST /v1/completions`` per request from a separate client process (``CLIENT``: a lean
  load generator, one keep-alive connection per in-flight request, ``--concurrency`` of them), so
  the client does not share this process's interpreter with the server — the server's own cost
  (uvicorn, vLLM's protocol models, the response) is what the ratio measures, plus the client's
  CPU on this 2-core machine (printed per request, beside this process's).

Both arms run in one process after ``start_server``, so both see its ``gc.freeze`` of the heap
present at start (without it, a full collection over torch/transformers/vLLM/Ray objects — ~0.4 s
here — fired every few hundred HTTP requests and cost the http arm 10-25%).

Both arms are warmed up once, then alternated (library, http, then http, library, ...) for
``--rounds`` rounds; the ratio is taken within each round (generated tokens per second, http over
library) and its median, min and max printed. The "others" column is the CPU share of processes
outside this benchmark (someone's tests on the shared machine); above 10% the round is NOISY.

``--fake``: the same two arms over a fleet of fake shards (tests/fakes.py: no Ray, no engines,
tokens made at once), so what is left is the router's cost (library) and the server's on top of it
(http): the per-request CPU figures are the figures of interest there, not the ratio. No engine
lock is needed; it is how the server's CPU per request is profiled and compared across commits.

``--vllm-serve``: instead of the two arms above, ``nemo-gen serve`` (one shard) against ``vllm
serve`` of the same model and engine settings, under vLLM's own serving client, alternated, at
each of ``--streams`` (bench/lib/vs_vllm.py; targets: output tokens/s >= 0.95, median TTFT <= 1.1x).

    .venv/bin/python bench/serve.py [--shards 2] [--requests 1024] [--concurrency 64] [--rounds 3] [--fake] [--json out.json]
    .venv/bin/python -m bench serve --vllm-serve [--streams 16 64] [--prompts 256] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench.lib.result import write_result
from bench.lib.noise import NOISY_SHARE, ForeignCpu
from bench.lib.setup import HOME, at_least_one, fake_overrides, fleet_of, load, make_prompts, quiet_environment
from bench.lib.stats import spread, verdict

TARGET = 0.9  # http / library tokens per second: at least
NAMESPACE = "nemo_gen_bench"

# The HTTP arm's client, run in its own interpreter: its stdin is a JSON job (argv would bound the
# prompts to 128 KiB); prints one JSON result.
# A load generator as lean as wrk's: one keep-alive HTTP/1.1 connection per in-flight request on
# asyncio streams, each request's bytes built once, the response read by Content-Length and its
# JSON parsed (the usage is checked). An off-the-shelf client (aiohttp: ~0.75 ms of CPU per
# request here) would take that CPU from the engines on this 2-core machine and be measured as
# the server's cost.
CLIENT = r"""
import asyncio, json, sys, time
from urllib.parse import urlsplit

job = json.loads(sys.stdin.read())
url = urlsplit(job["url"])

def request(prompt):
    body = json.dumps({"model": job["model"], "prompt": prompt, "max_tokens": job["max_tokens"],
                       "temperature": 0, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body

async def worker(queue, totals):
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    while queue:
        writer.write(queue.pop())
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        out = json.loads(await reader.readexactly(length))
        if status != 200:
            totals["failed"] += 1
            totals["errors"].append(out)
        else:
            totals["tokens"] += out["usage"]["completion_tokens"]
    writer.close()

async def main():
    queue = [request(p) for p in reversed(job["prompts"])]
    totals = {"tokens": 0, "failed": 0, "errors": []}
    t0 = time.perf_counter()
    await asyncio.gather(*(worker(queue, totals) for _ in range(min(job["concurrency"], len(queue)))))
    wall = time.perf_counter() - t0
    print(json.dumps({"wall_s": wall, "tokens": totals["tokens"], "failed": totals["failed"],
                      "errors": totals["errors"][:3]}))

asyncio.run(main())
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", type=int, default=2, help="shards in the fleet (default 2)")
    p.add_argument("--requests", type=int, default=1024, help="requests per arm and round (default 1024)")
    p.add_argument("--concurrency", type=int, default=64, help="requests in flight (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="alternating library/http rounds (default 3)")
    p.add_argument("--home", type=Path, default=HOME, help="working directory")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the summary here")
    p.add_argument("--fake", action="store_true", help="fake shards (tests/fakes.py): the server's CPU alone")
    p.add_argument("--vllm-serve", action="store_true",
                   help="nemo-gen serve (1 shard) against vllm serve under vLLM's serving client (bench/lib/vs_vllm.py)")
    p.add_argument("--streams", type=int, nargs="+", default=[16, 64], help="--vllm-serve: concurrent streams (16 64)")
    p.add_argument("--prompts", type=int, default=256, help="--vllm-serve: prompts per arm and round, at least 4 x streams")
    p.add_argument("--input-len", type=int, default=64, help="--vllm-serve: random prompt tokens (default 64)")
    p.add_argument("--output-len", type=int, default=64, help="--vllm-serve: tokens out per request (default 64)")
    p.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                   help="--vllm-serve: also a nemo-gen serve of this checkout (e.g. `git archive` of an older commit)")
    args = p.parse_args(argv)
    if args.vllm_serve and args.fake:
        p.error("--vllm-serve runs real engines: it cannot be combined with --fake")
    if any(s < 1 for s in args.streams):
        p.error("--streams must each be at least 1")
    return at_least_one(p, args, ("shards", "requests", "concurrency", "max_new_tokens", "rounds", "prompts",
                                  "input_len", "output_len"))


def library_arm(fleet, prompts: list[str], concurrency: int, max_new_tokens: int) -> dict[str, Any]:
    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(prompt):
            async with sem:
                return await fleet.generate_async(prompt, max_new_tokens=max_new_tokens, temperature=0.0,
                                                  ignore_eos=True)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, results

    wall, results = asyncio.run(main())
    failed = [r.error for r in results if r.error]
    return {"wall_s": wall, "tokens": sum(len(r.token_ids) for r in results), "failed": len(failed),
            "errors": failed[:3]}


def http_arm(url: str, model: str, prompts: list[str], concurrency: int, max_new_tokens: int) -> dict[str, Any]:
    job = {"url": url, "model": model, "prompts": prompts, "concurrency": concurrency, "max_tokens": max_new_tokens}
    proc = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(json.dumps(job), timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"the HTTP client failed: {stderr[-2000:]}")
    out = json.loads(stdout.strip().splitlines()[-1])
    out["client_cpu_s"] = _children_cpu_s()
    return out


_seen_children = [0.0]


def _children_cpu_s() -> float:
    """CPU seconds of the client processes waited for since the last call (resource.RUSAGE_CHILDREN)."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = ru.ru_utime + ru.ru_stime
    used, _seen_children[0] = total - _seen_children[0], total
    return used


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_environment()
    if args.vllm_serve:
        from bench.lib import vs_vllm

        summary = vs_vllm.run(args)
        verdicts = {f"{k}_{m}": v[f"{m}_verdict"] for k, v in summary["by_streams"].items() for m in ("tok_s", "ttft")}
        write_result(args.json, "serve", args, summary, {**verdicts, "no_failed_requests": summary["failed"] == 0})
        return 0 if summary["failed"] == 0 else 3
    from nemo_gen.server import start_server
    from nemo_gen.settings import NemoGenSettings

    overrides = {
        "home": str(args.home), "fleet.name": "bench-serve", "fleet.num_shards": args.shards, "fleet.device": "cpu",
        "generation.vllm_cfg.max_model_len": 512, "generation.vllm_cfg.async_engine": True,
        "ray.namespace": NAMESPACE, "ray.log_to_driver": False, "server.port": 0,
    }
    if args.fake:
        overrides.update(fake_overrides(args.home, "fake-serve-model"))
    settings = NemoGenSettings.load(overrides=overrides)
    print(f"bench serve{' (fake shards)' if args.fake else ''}: {args.shards} shards, {args.requests} requests x {args.max_new_tokens} tokens, "
          f"concurrency {args.concurrency}, {args.rounds} rounds; {load()}", flush=True)
    rounds: list[dict[str, Any]] = []
    with fleet_of(settings, args.fake) as fleet, start_server(fleet) as server, ForeignCpu() as foreign:
        model = settings.model_name()
        warm = make_prompts(min(args.requests, args.concurrency))
        library_arm(fleet, warm, args.concurrency, args.max_new_tokens)
        http_arm(server.url, model, warm, args.concurrency, args.max_new_tokens)
        _children_cpu_s()
        for r in range(args.rounds):
            prompts = [f"{p} round {r}" for p in make_prompts(args.requests)]
            order = ("library", "http") if r % 2 == 0 else ("http", "library")
            row: dict[str, Any] = {"round": r, "order": order}
            for arm in order:
                before, t0, cpu0 = foreign.cpu_s(), time.perf_counter(), time.process_time()
                if arm == "library":
                    out = library_arm(fleet, prompts, args.concurrency, args.max_new_tokens)
                else:
                    out = http_arm(server.url, model, prompts, args.concurrency, args.max_new_tokens)
                out["others"] = ForeignCpu.share(foreign.cpu_s() - before, time.perf_counter() - t0)
                # This process: the driver (router, Ray calls) in both arms, plus the server in http's.
                out["driver_cpu_ms_per_request"] = (time.process_time() - cpu0) / len(prompts) * 1e3
                if "client_cpu_s" in out:
                    out["client_cpu_ms_per_request"] = out.pop("client_cpu_s") / len(prompts) * 1e3
                out["tokens_per_s"] = out["tokens"] / out["wall_s"]
                row[arm] = out
            row["ratio"] = row["http"]["tokens_per_s"] / row["library"]["tokens_per_s"]
            row["noisy"] = max(row["http"]["others"], row["library"]["others"]) > NOISY_SHARE
            rounds.append(row)
            print(f"  round {r} ({'/'.join(order)}): library {row['library']['tokens_per_s']:.0f} tok/s, "
                  f"http {row['http']['tokens_per_s']:.0f} tok/s, ratio {row['ratio']:.3f}, others "
                  f"{max(row['http']['others'], row['library']['others']):.0%}{' NOISY' if row['noisy'] else ''}; "
                  f"driver CPU {row['library']['driver_cpu_ms_per_request']:.2f} / "
                  f"{row['http']['driver_cpu_ms_per_request']:.2f} ms per request (library / http), client "
                  f"{row['http']['client_cpu_ms_per_request']:.2f} ms"
                  f"{'' if not (row['http']['failed'] or row['library']['failed']) else ' FAILED REQUESTS'}",
                  flush=True)
    ratios = [r["ratio"] for r in rounds]
    summary = {
        "shards": args.shards, "requests": args.requests, "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens, "rounds": rounds, "ratio": spread(ratios), "target": TARGET,
        "verdict": verdict(statistics.median(ratios), TARGET, higher_is_better=True), "load": load(),
        "failed": sum(r["http"]["failed"] + r["library"]["failed"] for r in rounds),
    }
    s = summary["ratio"]
    print(f"http / library throughput at concurrency {args.concurrency}: {s['median']:.3f} "
          f"(min {s['min']:.3f}, max {s['max']:.3f}; target >= {TARGET}) {summary['verdict']}", flush=True)
    write_result(args.json, "serve", args, summary, {"http_over_library": summary["verdict"],
                                                     "no_failed_requests": summary["failed"] == 0})
    return 0 if summary["failed"] == 0 else 3

