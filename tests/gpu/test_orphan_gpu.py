"""An orphan on a real GPU: with Ray's process-group cleanup off
(``RAY_process_group_cleanup_enabled=0``), a SIGKILLed shard actor leaves its EngineCore running
and holding GPU memory. The fleet must report it (``fleet.status()`` orphans, with the GPU
memory NVML says it holds), and once this test kills it by PID, its memory comes back and the
report is clear.

Its own Ray cluster in a child process (``orphan_run.py``): the raylet reads the setting when it
starts. Needs CUDA (skipped elsewhere: CI has none)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
HERE = Path(__file__).resolve().parent


def test_an_orphan_engine_is_reported_with_its_gpu_memory_and_freed_when_killed(tmp_path):
    from nemo_gen.host import gpu_memory

    env = dict(os.environ, RAY_process_group_cleanup_enabled="0",
               PYTHONPATH=os.pathsep.join([str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(HERE / "orphan_run.py"), str(tmp_path)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    timer = threading.Timer(420, proc.kill)  # a child that hangs fails the test instead of the sitting
    timer.start()
    try:
        def line_with(tag: str) -> dict:
            for line in proc.stdout:
                lines.append(line)
                if line.startswith(tag + " "):
                    return json.loads(line[len(tag) + 1:])
            raise AssertionError(f"the child ended without {tag}:\n" + "".join(lines[-60:]))

        seen = line_with("ORPHANS")
        orphans = seen["orphans"]
        pids = [o["pid"] for o in orphans]
        assert pids and set(pids) <= set(seen["engine_pids"]), seen  # the dead actor's own engine process(es)
        assert all(o["shard"] == 0 for o in orphans), orphans
        # the EngineCore holds the engine's memory (its python3 helper none): reported with it
        assert max(o["gpu_bytes"] for o in orphans) > 2**30, orphans
        assert sum(seen["nvml_bytes"].values()) == sum(o["gpu_bytes"] for o in orphans)
        for pid in pids:  # started by this test: ended here, by PID
            os.kill(pid, signal.SIGKILL)
        freed = gpu_memory.wait_released(pids, timeout_s=30, poll_s=0.01)
        assert freed.released, f"GPU memory still held after the kill: {freed}"
        proc.stdin.write("killed\n")
        proc.stdin.flush()
        after = line_with("RESULT")
        assert after == {"orphans_after": [], "state": "healthy", "serves": True}, after
        assert proc.wait(timeout=120) == 0, "".join(lines[-40:])
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
        print("".join(lines[-30:]))
