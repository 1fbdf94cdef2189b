"""Sampling profiles of a benchmark's own busy processes, taken with py-spy while a batch runs,
and their summary by process: where each one's Python time went (top frames by own samples and
by samples under them), per thread.

``Profile(out_dir, delay_s, duration_s)`` around the batch: ``delay_s`` into it, it picks the
processes under this one (Ray's workers, vLLM's EngineCore, this process itself) that used at
least ``MIN_CPU_SHARE`` of a core over half a second, takes one ``py-spy dump`` of each and a
``py-spy record --format raw`` of ``duration_s`` (``--nonblocking``: the process is not paused).
py-spy must be on PATH (the GPU host: carried as a wheel, bench/gpu_sitting.sh); where it is not,
or the kernel refuses it ptrace, ``summary`` says so instead of giving frames."""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MIN_CPU_SHARE = 0.2  # of one core: a process the batch keeps busy, not an idle helper
MAX_PROCESSES = 5
RATE_HZ = 200
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def py_spy() -> str | None:
    """py-spy's executable: $PY_SPY, else on PATH, else beside this Python (a virtualenv's bin)."""
    beside = Path(sys.executable).parent / "py-spy"
    return os.environ.get("PY_SPY") or shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def busy_processes(min_share: float = MIN_CPU_SHARE, window_s: float = 0.5) -> list[dict[str, Any]]:
    """This process and every process under it using ``min_share`` of a core or more, busiest first."""
    import psutil

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(window_s)
    found = []
    for p in procs:
        try:
            share = p.cpu_percent(None) / 100
            if share >= min_share and "py-spy" not in p.name():
                found.append({"pid": p.pid, "cpu_share": share, "title": " ".join(p.cmdline())[:120] or p.name()})
        except psutil.Error:
            continue
    return sorted(found, key=lambda r: -r["cpu_share"])[:MAX_PROCESSES]


class Profile:
    """Profiles of the busy processes while the ``with`` block runs (see the module docstring)."""

    def __init__(self, out_dir: Path, delay_s: float = 1.0, duration_s: float = 3.0):
        self.out_dir, self.delay_s, self.duration_s = Path(out_dir), delay_s, duration_s
        self.processes: list[dict[str, Any]] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        exe = py_spy()
        if exe is None:
            self.error = "py-spy not found (PY_SPY, PATH, or beside this Python)"
            return
        time.sleep(self.delay_s)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.processes = busy_processes()
        running = []
        for p in self.processes:  # every record first, so that they cover the same seconds
            raw = self.out_dir / f"pyspy-{p['pid']}.txt"
            cmd = [exe, "record", "--pid", str(p["pid"]), "--duration", str(max(1, round(self.duration_s))), "--rate",
                   str(RATE_HZ), "--format", "raw", "--nonblocking", "--threads", "--output", str(raw)]
            running.append((p, raw, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
        for p in self.processes:
            dump = subprocess.run([exe, "dump", "--pid", str(p["pid"]), "--nonblocking"], capture_output=True,
                                  text=True, timeout=30)
            p["dump"] = (dump.stdout or dump.stderr)[-4000:]
        for p, raw, proc in running:
            out, _ = proc.communicate(timeout=self.duration_s + 60)
            p["record_rc"] = proc.returncode
            if raw.exists():
                p["raw_file"] = raw.name
            else:
                p["record_error"] = out[-1500:]

    def __enter__(self) -> "Profile":
        def run():
            try:
                self._run()
            except Exception as exc:  # a profile that failed is recorded, the batch still counts
                self.error = f"{type(exc).__name__}: {exc}"

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.delay_s + self.duration_s + 120)

    def summary(self, top: int = 12) -> dict[str, Any]:
        if self.error:
            return {"error": self.error}
        out = []
        for p in self.processes:
            row = {k: v for k, v in p.items() if k not in ("dump", "raw_file")}
            if p.get("raw_file"):
                row.update(summarize_raw((self.out_dir / p["raw_file"]).read_text(), self.duration_s, top))
            row["dump_head"] = p.get("dump", "")[:1500]
            out.append(row)
        return {"duration_s": self.duration_s, "rate_hz": RATE_HZ, "processes": out}


def _frame(text: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (to/file.py)``: one name per function, not per line."""
    m = _FRAME.match(text.strip())
    if not m:
        return text.strip()
    parts = m.group("file").split(os.sep)
    return f"{m.group('func')} ({'/'.join(parts[-2:])})"


def summarize_raw(text: str, duration_s: float, top: int = 12) -> dict[str, Any]:
    """py-spy's raw (collapsed) output, ``[thread;]frame;frame;... count`` a line, outermost frame
    first: samples per thread (its share of the run's ``duration_s`` at ``RATE_HZ``, a share that
    counts only the samples py-spy took while the thread was not idle), the functions with the
    most samples of their own (self) and with the most samples under them (inclusive)."""
    threads: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    under: collections.Counter[str] = collections.Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0] if frames[0].startswith(("thread", "process")) else "?"
        frames = [_frame(f) for f in frames if not f.startswith(("thread", "process"))]
        total += n
        threads[thread] += n
        if frames:
            own[frames[-1]] += n
        for f in set(frames):
            under[f] += n
    expected = max(1.0, duration_s * RATE_HZ)
    return {"samples": total,
            "threads": [{"thread": t, "samples": n, "active_share": round(n / expected, 3)} for t, n in threads.most_common(6)],
            "top_self": [{"frame": f, "share": round(n / total, 3)} for f, n in own.most_common(top)] if total else [],
            "top_inclusive": [{"frame": f, "share": round(n / total, 3)} for f, n in under.most_common(top)] if total else []}
