"""The noise guard: how much of the machine other people's processes used while a benchmark
measured (``ForeignCpu``), and the share above which a result is flagged NOISY. The machine the
CPU benchmarks run on is shared; a figure taken while others used more than ``NOISY_SHARE`` of
the CPUs is reported, but flagged."""

from __future__ import annotations

import os
import threading
import time

NOISY_SHARE = 0.10  # other processes' share of the CPUs above which a result is flagged


def noisy_note(share: float) -> str:
    """The flag a summary line carries when others used more than ``NOISY_SHARE`` of the CPUs."""
    return f"  NOISY: other processes used {share:.0%} of the CPUs" if share > NOISY_SHARE else ""


class ForeignCpu:
    """CPU used by processes outside this benchmark's process tree (someone's test run on the
    same machine), sampled every ``interval`` seconds. Ray's cluster, the engines and the Prefect
    server are all descendants of this process, so they count as ours. An estimate: a process
    that starts and ends between two samples is missed."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._first: dict[tuple[int, float], float] = {}  # (pid, create_time) -> cpu seconds
        self._ours: set[tuple[int, float]] = set()  # once ours, always: a stopped shard's engine
        # processes are orphaned (re-parented to init) for a moment before they exit
        self._last: dict[tuple[int, float], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._since = time.time()
        self._thread = threading.Thread(target=self._run, name="foreign-cpu", daemon=True)

    def __enter__(self) -> "ForeignCpu":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _sample(self) -> None:
        import psutil

        procs = list(psutil.process_iter(["ppid", "create_time", "cpu_times"]))
        parent = {p.pid: p.info["ppid"] for p in procs}
        mine = {os.getpid()}
        for pid in parent:  # walk up to init: ours if we pass through this process
            chain, up = [], pid
            while up and up not in mine and up in parent and len(chain) < 64:
                chain.append(up)
                up = parent[up]
            if up in mine:
                mine.update(chain)
        with self._lock:
            for p in procs:
                times, created = p.info["cpu_times"], p.info["create_time"]
                if times is None or created is None:
                    continue
                key, used = (p.pid, created), times.user + times.system
                if p.pid in mine:
                    self._ours.add(key)
                if key in self._ours:
                    continue
                # A process born after we started counts from zero; older ones from first sight.
                self._first.setdefault(key, 0.0 if created > self._since else used)
                self._last[key] = used

    def cpu_s(self) -> float:
        """Foreign CPU seconds used since the monitor started (read it twice for a window)."""
        self._sample()  # up to date at the window's edge, not up to ``interval`` old
        with self._lock:
            return sum(self._last[k] - self._first[k] for k in self._last)

    @staticmethod
    def share(cpu_s: float, wall_s: float) -> float:
        """As a fraction of the machine: 1.0 means every core was busy with someone else's work."""
        return cpu_s / (wall_s * (os.cpu_count() or 1)) if wall_s > 0 else 0.0
