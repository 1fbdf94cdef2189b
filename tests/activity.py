"""Events tests synchronise on instead of sleeping: an engine that is generating, and a Ray
cluster whose nodes have registered.

An engine is generating when its processes burn CPU: measured here, an idle vLLM CPU engine
(EngineCore + Worker) uses about 0.007 CPU-seconds per second, a generating one about 1. So
``busy_since(pids, baseline)`` — the engine's processes have used ``min_cpu_s`` (0.25 s) of CPU
since ``baseline`` was read — means its batch is on it: idle, it would take ~35 s to get there.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from tests.helpers import wait_until

BUSY_CPU_S = 0.25


def cpu_s(pids) -> float:
    """User + system CPU seconds the processes ``pids`` have used (an exited one counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def wait_busy(pids, baseline: float, timeout_s: float, what: str, min_cpu_s: float = BUSY_CPU_S) -> float:
    """Wait until ``pids`` have used ``min_cpu_s`` of CPU beyond ``baseline`` (``cpu_s`` read
    before the work was sent); returns the CPU seconds used. ``timeout_s`` bounds the wait."""
    return wait_until(lambda: (used := cpu_s(pids) - baseline) >= min_cpu_s and used, timeout_s,
                      f"{what} to be generating ({min_cpu_s:g} CPU-s beyond idle)", poll_s=0.02)


_COUNT_NODES = (
    "import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
    "print('ALIVE', sum(n['Alive'] for n in ray.nodes()))"
)


def wait_ray_nodes(address: str, env: dict, count: int, timeout_s: float = 120) -> None:
    """Wait until the Ray cluster at ``address`` has ``count`` live nodes registered with its GCS
    (the GCS port opens before the head's raylet has registered: a driver attaching in between
    finds no node). Each check is a driver of its own, as the commands under test are."""
    env = {**env, "RAY_AUTH_MODE": env.get("RAY_AUTH_MODE", "token")}
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", _COUNT_NODES, address], env=env, capture_output=True,
                             text=True, timeout=120)
        alive = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("ALIVE ")]
        if out.returncode == 0 and alive == [str(count)]:
            return
        last = out.stderr[-1500:]
        time.sleep(0.5)  # between two checks: each is a new driver
    raise AssertionError(f"{count} Ray node(s) never registered at {address}: {last}")
