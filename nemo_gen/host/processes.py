"""PIDs a fleet started: is one alive, wait for them to exit, kill what outlives a deadline.

Always polled to a deadline: right after a SIGKILL, a process (or the EngineCore whose
process group the raylet is tearing down) is still there for a few hundred ms.
"""

from __future__ import annotations

import logging
import time
from typing import Iterable

import psutil

log = logging.getLogger(__name__)


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """Handles of the PIDs that exist now (handles, so a reused PID is not mistaken later)."""
    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return out


def wait_exit(procs: list[psutil.Process], timeout_s: float) -> tuple[list[int], list[psutil.Process]]:
    """Poll until ``procs`` have exited or ``timeout_s`` passes: (exited PIDs, still running).

    A zombie counts as exited: its memory is returned, and only its parent (or, for an
    orphan, an init process that may reap every few seconds) can remove the table entry —
    ``psutil.wait_procs`` would wait for that too."""
    left, exited = list(procs), []
    deadline = time.monotonic() + timeout_s
    while True:
        still = []
        for proc in left:
            if _running(proc):
                still.append(proc)
            else:
                exited.append(proc.pid)
        left = still
        if not left or time.monotonic() >= deadline:
            return exited, left
        time.sleep(0.02)


def wait_or_kill(procs: list[psutil.Process], timeout_s: float) -> tuple[list[int], list[int]]:
    """Wait up to ``timeout_s`` for ``procs`` to exit; SIGKILL the rest and wait for them too.
    Returns (PIDs that exited on their own, PIDs that had to be killed)."""
    exited, left = wait_exit(procs, timeout_s)
    killed = []
    for proc in left:
        try:
            proc.kill()
            killed.append(proc.pid)
        except psutil.NoSuchProcess:
            exited.append(proc.pid)
    wait_exit(left, 10)
    return sorted(exited), sorted(killed)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def reap(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until ``pids`` (processes this fleet started) have exited; returns those that had
    to be killed at the deadline."""
    _, killed = wait_or_kill(processes(pids), timeout_s)
    if killed:
        log.warning("killed engine processes that outlived their shard: %s", killed)
    return killed
