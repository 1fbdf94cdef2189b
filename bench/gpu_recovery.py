"""Shard loss on a real GPU, in one run: SIGKILL -> full strength with a warm spare, and the
orphan a killed shard leaves when the operator disabled Ray's process-group cleanup.

    PYTHONPATH=$PWD:/tmp/nemo-gen-site python3 -m bench gpu_recovery --out DIR > DIR/recovery.log 2>&1

1. ``spare``: one shard + one warm spare of the tiny model on one GPU (``fleet.shards_per_gpu=2``),
   a batch in flight when the shard's actor is SIGKILLed: every request answered once; seconds
   to the slot serving again (the spare promoted, already at the fleet's version), to the dead
   shard's GPU memory back (NVML, per process), and to a new spare loaded.
2. ``orphan`` (a subprocess: the raylet must start with ``RAY_process_group_cleanup_enabled=0``):
   SIGKILL of the shard actor leaves its EngineCore running with its GPU memory; the fleet
   reports it (``fleet.status()`` orphans), NVML shows what it holds; then it is killed here by
   PID and the seconds until its memory is back are measured.

Results: ``DIR/gpu_recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.lib.result import write_result
from bench.lib.setup import quiet_environment
from bench.lib.stats import check


def settings(work: Path, name: str, **extra):
    from nemo_gen.settings import NemoGenSettings
    from nemo_gen.tiny_model import make_tiny_model

    return NemoGenSettings.load(overrides={
        "home": str(work / name), "model.path": str(make_tiny_model(work / "tiny")), "fleet.name": name,
        "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.shards_per_gpu": 2,
        "generation.vllm_cfg.precision": "bfloat16", "generation.vllm_cfg.enforce_eager": True,
        "generation.vllm_cfg.max_model_len": 256, "generation.vllm_cfg.gpu_memory_utilization": 0.15,
        "health.probe_interval_s": 1.0, "health.probe_timeout_s": 20.0, "health.restart_backoff_s": 0.0,
        "health.restart_jitter": 0.0, "health.reap_timeout_s": 15.0, "ray.namespace": f"nemo_gen_{name}", **extra,
    })


def wait_until(pred, timeout_s: float, what: str, poll_s: float = 0.005) -> float:
    t = time.monotonic()
    while not pred():
        if time.monotonic() - t > timeout_s:
            raise TimeoutError(f"{what} not within {timeout_s:g}s")
        time.sleep(poll_s)
    return time.monotonic()


def spare(work: Path) -> dict:
    from nemo_gen import GenerationFleet
    from nemo_gen.host import gpu_memory

    t = time.monotonic()
    fleet = GenerationFleet.launch(settings(work, "spare", **{"fleet.spares": 1}))
    out = {"launch_s": time.monotonic() - t}
    try:
        rows = fleet.status()
        victim = next(r for r in rows if r.index == 0)
        spare_row = next(r for r in rows if r.state == "spare")
        dead = [victim.actor_pid, *victim.engine_pids]
        out["held_gib"] = sum(gpu_memory.used_by_pids(dead).values()) / 2**30
        prompts = [[1, 40 + i, 41, 42] for i in range(16)]
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(fleet.generate, prompts, temperature=0, max_new_tokens=200, ignore_eos=True)
            time.sleep(0.5)
            killed = time.monotonic()
            os.kill(victim.actor_pid, signal.SIGKILL)
            freed = gpu_memory.wait_released(dead, timeout_s=30, poll_s=0.005)
            serving = wait_until(lambda: fleet.handle(0).name == spare_row.name
                                 and fleet.health.state_of(0).value == "healthy", 60, "the spare serving")
            out.update(gpu_memory_back_s=freed.seconds, released=freed.released, to_full_strength_s=serving - killed)
            try:  # recorded, not raised: the timings above stand either way
                results = running.result(timeout=120)
                out.update(answered=len(results), all_ok=all(r.ok for r in results) and len(results) == len(prompts),
                           versions={r.weight_version for r in results} == {fleet.weight_version})
            except Exception as exc:  # seen 2026-12-01: FleetExhausted while the only slot's spare was promoted
                out["in_flight_error"] = f"{type(exc).__name__}: {exc}"
        new_spare = wait_until(lambda: any(r.state == "spare" and r.weight_version == fleet.weight_version
                                           for r in fleet.status()), 240, "a new spare", poll_s=0.2)
        out["new_spare_loaded_s"] = new_spare - killed
    finally:
        fleet.shutdown()
    return out


ORPHAN = r"""
import json, os, signal, sys, time
from bench.gpu_recovery import settings, wait_until
from pathlib import Path
from nemo_gen import GenerationFleet
from nemo_gen.host import gpu_memory

fleet = GenerationFleet.launch(settings(Path(sys.argv[1]), "orphan"))
out = {}
try:
    victim = fleet.status()[0]
    killed = time.monotonic()
    os.kill(victim.actor_pid, signal.SIGKILL)
    wait_until(lambda: fleet.status()[0].orphans, 120, "the orphan reported", poll_s=0.2)
    orphans = fleet.status()[0].orphans
    pids = [o["pid"] for o in orphans]
    time.sleep(5)  # still there, still holding its memory, long after the kill
    held = gpu_memory.used_by_pids(pids)
    out.update(reported_s=time.monotonic() - killed, orphans=orphans, held_after_s=time.monotonic() - killed,
               held_gib={str(p): b / 2**30 for p, b in held.items()}, engine_pids=victim.engine_pids)
    t = time.monotonic()
    for pid in pids:  # started by this run: ended here, by PID
        os.kill(pid, signal.SIGKILL)
    freed = gpu_memory.wait_released(pids, timeout_s=30, poll_s=0.005)
    out.update(killed_by_pid=pids, gpu_memory_back_s=freed.seconds, released=freed.released,
               replacement_state=fleet.health.state_of(0).value)
finally:
    fleet.shutdown()
print("RESULT " + json.dumps(out, default=str))
"""


def start_orphan(work: Path) -> subprocess.Popen:
    """The orphan run, in a process (and Ray cluster) of its own."""
    env = dict(os.environ, RAY_process_group_cleanup_enabled="0")
    return subprocess.Popen([sys.executable, "-c", ORPHAN, str(work)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def orphan_result(proc: subprocess.Popen) -> dict:
    text, _ = proc.communicate(timeout=300)
    sys.stdout.write(text[-30000:])
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"orphan run exited {proc.returncode}: {text[-1500:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/nemo-gen-recovery")
    args = ap.parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    quiet_environment(vllm_log="INFO")
    result = {"steps": {}}
    from nemo_gen.tiny_model import make_tiny_model

    make_tiny_model(work / "tiny")  # once, before the two runs that load it
    # One after the other: engines on one GPU start one at a time anyway (seen 2026-12-01: run
    # side by side, the orphan run's three starts queued behind the spare run's and missed the
    # sitting's deadline).
    for name, fn in (("spare", spare), ("orphan", lambda w: orphan_result(start_orphan(w)))):
        t = time.monotonic()
        try:
            result["steps"][name] = {"ok": True, **fn(work)}
        except Exception as exc:
            import traceback

            result["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                     "trace": traceback.format_exc()[-3000:]}
        result["steps"][name]["seconds"] = time.monotonic() - t
        write_result(out / "gpu_recovery.json", "gpu_recovery", args, result,
                     {k: check(bool(v.get("ok"))) for k, v in result["steps"].items()})
        print(f"RECOVERY {name}: {json.dumps(result['steps'][name], default=str)[:1500]}", flush=True)
    return result
