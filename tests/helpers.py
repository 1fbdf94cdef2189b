"""Small helpers for tests that check processes by PID."""

from __future__ import annotations

import time

import psutil


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids, timeout_s: float = 30.0) -> list[int]:
    """PIDs still alive after polling up to ``timeout_s`` (empty when all exited)."""
    deadline = time.monotonic() + timeout_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    return left
