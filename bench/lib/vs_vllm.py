"""``python -m bench serve --vllm-serve``: ``nemo-gen serve`` (one shard) against a plain ``vllm
serve`` of the same model with the same engine settings, under one client, alternated in one run.

The client is vLLM's own serving benchmark (``vllm bench serve``'s ``vllm.benchmarks.serve``:
random prompts of ``--input-len`` tokens, ``--output-len`` tokens out with ``ignore_eos``,
streamed ``/v1/completions``, ``--max-concurrency`` streams), run as a process of its own for each
arm and round, so the client's CPU is the same for both servers. Both servers are up for the whole
run (each its own process tree: ``nemo-gen serve`` with its Ray cluster; ``vllm serve`` as vLLM's
OpenAI server module); at each concurrency the arms alternate (nemo-gen, vllm, then vllm,
nemo-gen, ...). The engine settings are the ones ``nemo-gen serve`` gives its shard on CPU — the
tiny model in float32, eager, ``max_model_len``, ``max_num_seqs``, one OpenMP thread bound to core 0,
``VLLM_CPU_KVCACHE_SPACE`` — passed to ``vllm serve`` as its flags and environment; everything
else is either server's default (vLLM's own, in both). Ratios are taken within a round: output
tokens/s nemo-gen / vllm (target >= 0.95) and median TTFT nemo-gen / vllm (target <= 1.1).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

from bench.lib.noise import NOISY_SHARE, ForeignCpu
from bench.lib.setup import load
from bench.lib.stats import spread, verdict

THROUGHPUT_TARGET = 0.95  # nemo-gen serve / vllm serve output tokens per second: at least
TTFT_TARGET = 1.1  # nemo-gen serve / vllm serve median time to first token: at most
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 1024  # generation.vllm_cfg.max_num_seqs's default, given to vllm serve as well
MODEL_NAME = "tiny"

# vLLM's serving benchmark client, as `vllm bench serve` runs it (its console script needs the
# package's metadata, which an editable vLLM tree may lack: the module is the same code).
CLIENT = r"""
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} before it served")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{what} did not serve {url}/v1/models within {timeout_s:.0f}s")


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to the server's process group (both servers shut down their engines on it), then
    SIGKILL to the group if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _role(p: Any) -> str:
    """What a process of a server's tree does, by its title or command line."""
    try:
        cmd = " ".join(p.cmdline())
    except Exception:
        return "other"
    for title, role in (("VLLM::EngineCore", "engine core"), ("VLLM::Worker", "engine worker"),
                        ("ray::ShardActor", "shard actor"), ("raylet", "ray (raylet, gcs, agents)"),
                        ("gcs_server", "ray (raylet, gcs, agents)"), ("ray::", "ray (raylet, gcs, agents)"),
                        ("nemo_gen.cli", "server + driver"), ("api_server", "server + driver")):
        if title in cmd:
            return role
    return "other"


def tree_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of a server's process tree, by role (a process that ended is missed:
    the servers' processes live through the run)."""
    import psutil

    out: dict[str, float] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        role = _role(p)
        out[role] = out.get(role, 0.0) + t.user + t.system
    return out


@contextlib.contextmanager
def _server(cmd: list[str], env: dict[str, str], url: str, what: str, log: Path,
            cwd: Path | None = None) -> Iterator[tuple[str, int]]:
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        try:
            _wait_ready(url, proc, f"{what} (log: {log})")
            yield url, proc.pid
        finally:
            _stop(proc)


def nemo_gen_serve(model: Path, home: Path, log: Path, src: Path | None = None,
                   name: str = "bench-serve-vs-vllm") -> contextlib.AbstractContextManager[tuple[str, int]]:
    """``nemo-gen serve``, one CPU shard; ``src``: run another checkout's nemo_gen (a commit
    before a change, measured in the same run)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "nemo_gen.cli", "serve", "--port", str(port),
           "--set", f"model.path={model}", "--set", f"home={home}", "--set", f"fleet.name={name}",
           "--set", "fleet.num_shards=1", "--set", "fleet.device=cpu", "--set", f"ray.namespace={name.replace('-', '_')}",
           "--set", f"generation.vllm_cfg.max_model_len={MAX_MODEL_LEN}",
           "--set", f"generation.vllm_cfg.max_num_seqs={MAX_NUM_SEQS}",
           "--set", "health.probe_interval_s=60", "--set", "server.max_in_flight=4096"]
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(src), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    # its own directory too: ``-m`` puts the working directory first on the path (and Ray's workers')
    return _server(cmd, env, f"http://127.0.0.1:{port}", "nemo-gen serve", log, cwd=src)


def vllm_serve(model: Path, log: Path) -> contextlib.AbstractContextManager[tuple[str, int]]:
    """vLLM's OpenAI server with what nemo-gen's one CPU shard is given (nemo_gen.core.engine_args
    on a 1-shard fleet: float32, eager, one OpenMP thread on core 0, 1 GiB of KV cache)."""
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0", VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", MODEL_NAME, "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
           "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--seed", "0", "--logprobs-mode", "processed_logprobs"]
    return _server(cmd, env, f"http://127.0.0.1:{port}", "vllm serve", log)


def client(url: str, model_name: str, tokenizer: Path, concurrency: int, prompts: int, input_len: int,
           output_len: int, seed: int, out_dir: Path) -> dict[str, Any]:
    name = f"c{concurrency}-{seed}-{int(time.time() * 1e3)}.json"
    cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model_name, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--ignore-eos",
           "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", str(seed),
           "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", name,
           "--ready-check-timeout-sec", "0", "--temperature", "0"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {url}: {done.stderr[-2000:]}")
    r = json.loads((out_dir / name).read_text())
    return {"output_tok_s": r["output_throughput"], "median_ttft_ms": r["median_ttft_ms"],
            "median_tpot_ms": r["median_tpot_ms"], "completed": r["completed"], "failed": r.get("failed", 0),
            "duration_s": r["duration"]}


def run(args: Any) -> dict[str, Any]:
    """The arm: both servers up, each concurrency's rounds alternated; the summary."""
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="nemo-gen-bench-serve-vs-vllm-"))
    model = make_tiny_model(work / MODEL_NAME)
    concurrencies = args.streams
    print(f"bench serve --vllm-serve: nemo-gen serve (1 shard) / vllm serve, vllm bench serve client, random "
          f"{args.input_len} tokens in, {args.output_len} out, streams {concurrencies}, {args.rounds} rounds; "
          f"{load()}; work {work}", flush=True)
    rows: list[dict[str, Any]] = []
    base = getattr(args, "baseline_src", None)
    with contextlib.ExitStack() as stack:
        servers = {"nemo_gen": stack.enter_context(nemo_gen_serve(model, work / "home", work / "nemo-gen-serve.log")),
                   "vllm": stack.enter_context(vllm_serve(model, work / "vllm-serve.log"))}
        if base is not None:  # the same nemo-gen serve from another checkout (before a change)
            servers["nemo_gen_base"] = stack.enter_context(nemo_gen_serve(
                model, work / "home-base", work / "nemo-gen-serve-base.log", Path(base), "bench-serve-base"))
        foreign = stack.enter_context(ForeignCpu())
        urls = {arm: (url, MODEL_NAME) for arm, (url, _) in servers.items()}
        pids = {arm: pid for arm, (_, pid) in servers.items()}
        for arm, (url, name) in urls.items():  # warm-up: each server's first requests
            client(url, name, model, 16, 32, args.input_len, args.output_len, 1, work)
        for c in concurrencies:
            prompts = max(args.prompts, 4 * c)
            for r in range(args.rounds):
                order = tuple(urls) if r % 2 == 0 else tuple(reversed(urls))
                row: dict[str, Any] = {"streams": c, "round": r, "order": order}
                for arm in order:
                    before, t0, cpu0 = foreign.cpu_s(), time.perf_counter(), tree_cpu(pids[arm])
                    out = client(*urls[arm], model, c, prompts, args.input_len, args.output_len, 100 + r, work)
                    out["others"] = ForeignCpu.share(foreign.cpu_s() - before, time.perf_counter() - t0)
                    # CPU per output token by process (the server's tree; the client's start-up is not in it)
                    tokens = prompts * args.output_len
                    out["cpu_us_per_token"] = {k: round((v - cpu0.get(k, 0.0)) / tokens * 1e6, 1)
                                               for k, v in tree_cpu(pids[arm]).items()}
                    row[arm] = out
                row["tok_s_ratio"] = row["nemo_gen"]["output_tok_s"] / row["vllm"]["output_tok_s"]
                row["ttft_ratio"] = row["nemo_gen"]["median_ttft_ms"] / row["vllm"]["median_ttft_ms"]
                if "nemo_gen_base" in row:
                    row["base_tok_s_ratio"] = row["nemo_gen_base"]["output_tok_s"] / row["vllm"]["output_tok_s"]
                    row["base_ttft_ratio"] = row["nemo_gen_base"]["median_ttft_ms"] / row["vllm"]["median_ttft_ms"]
                row["noisy"] = max(row[a]["others"] for a in order) > NOISY_SHARE
                rows.append(row)
                print(f"  {c:3d} streams, round {r} ({'/'.join(order)}): output tok/s nemo-gen "
                      f"{row['nemo_gen']['output_tok_s']:.0f}, vllm {row['vllm']['output_tok_s']:.0f} "
                      f"(ratio {row['tok_s_ratio']:.3f}); median TTFT {row['nemo_gen']['median_ttft_ms']:.0f} / "
                      f"{row['vllm']['median_ttft_ms']:.0f} ms (ratio {row['ttft_ratio']:.2f}); median TPOT "
                      f"{row['nemo_gen']['median_tpot_ms']:.1f} / {row['vllm']['median_tpot_ms']:.1f} ms; others "
                      f"{max(row[a]['others'] for a in order):.0%}{' NOISY' if row['noisy'] else ''}"
                      f"{' FAILED REQUESTS' if row['nemo_gen']['failed'] or row['vllm']['failed'] else ''}",
                      flush=True)
                if "nemo_gen_base" in row:
                    print(f"      baseline nemo-gen ({base}): {row['nemo_gen_base']['output_tok_s']:.0f} tok/s "
                          f"(ratio {row['base_tok_s_ratio']:.3f}), median TTFT "
                          f"{row['nemo_gen_base']['median_ttft_ms']:.0f} ms (ratio {row['base_ttft_ratio']:.2f})", flush=True)
                for arm in order:
                    per = row[arm]["cpu_us_per_token"]
                    print(f"      {arm} CPU us per token: {sum(per.values()):.0f} = "
                          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(per.items(), key=lambda kv: -kv[1])), flush=True)
    by_streams: dict[str, Any] = {}
    for c in concurrencies:
        mine = [r for r in rows if r["streams"] == c]
        tok = spread([r["tok_s_ratio"] for r in mine])
        ttft = spread([r["ttft_ratio"] for r in mine])
        by_streams[str(c)] = {
            "tok_s_ratio": tok, "ttft_ratio": ttft,
            "tok_s_verdict": verdict(tok["median"], THROUGHPUT_TARGET, higher_is_better=True),
            "ttft_verdict": verdict(ttft["median"], TTFT_TARGET, higher_is_better=False),
            "nemo_gen_tok_s": statistics.median(r["nemo_gen"]["output_tok_s"] for r in mine),
            "vllm_tok_s": statistics.median(r["vllm"]["output_tok_s"] for r in mine),
        }
        if base is not None:
            by_streams[str(c)]["base_tok_s_ratio"] = spread([r["base_tok_s_ratio"] for r in mine])
            by_streams[str(c)]["base_ttft_ratio"] = spread([r["base_ttft_ratio"] for r in mine])
        b = by_streams[str(c)]
        print(f"{c} streams: output tok/s nemo-gen / vllm serve {tok['median']:.3f} (min {tok['min']:.3f}, max "
              f"{tok['max']:.3f}; target >= {THROUGHPUT_TARGET}) {b['tok_s_verdict']}; median TTFT ratio "
              f"{ttft['median']:.2f} (min {ttft['min']:.2f}, max {ttft['max']:.2f}; target <= {TTFT_TARGET}) "
              f"{b['ttft_verdict']}"
              + (f"; baseline {b['base_tok_s_ratio']['median']:.3f} / {b['base_ttft_ratio']['median']:.2f}"
                 if base is not None else ""), flush=True)
    failed = sum(r[a]["failed"] for r in rows for a in r["order"])
    return {"arm": "vllm_serve", "baseline_src": str(base) if base else None, "streams": concurrencies, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": rows, "by_streams": by_streams, "failed": failed, "load": load(),
            "targets": {"tok_s_ratio": THROUGHPUT_TARGET, "ttft_ratio": TTFT_TARGET}}
