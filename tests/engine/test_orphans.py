"""An operator's explicit ``RAY_process_group_cleanup_enabled=0`` is honoured: a killed shard's
engine processes are left running for debugging, and reported (PIDs, memory) in status and
logs, while the slot is restarted beside them. Runs in its own process: the flag must reach a
raylet started after it is set, so this test owns a private Ray cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import alive, wait_gone

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": sys.argv[2], "model.path": sys.argv[1], "fleet.device": "cpu", "fleet.name": "orphans",
        "fleet.num_shards": 1, "ray.num_cpus": 2, "generation.vllm_cfg.max_model_len": 256,
        "health.restart_backoff_s": 0.2,
    })
    fleet = GenerationFleet.launch(settings)
    try:
        victim = fleet.status()[0]
        os.kill(victim.actor_pid, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            row = fleet.status()[0]
            if row.state == "healthy" and row.name != victim.name:
                break
            time.sleep(0.2)
        results = fleet.generate(["The quick brown fox"], temperature=0)
        print("REPORT " + json.dumps({"victim": victim.to_json(), "after": row.to_json(), "ok": results[0].ok}), flush=True)
    finally:
        fleet.shutdown()
    """
)


def test_cleanup_disabled_keeps_and_reports_the_orphans(tiny_model_dir, tmp_path):
    env = {**os.environ, "RAY_process_group_cleanup_enabled": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(tmp_path / "home")],
        env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("REPORT ")))
    victim, after = report["victim"], report["after"]
    orphans = after["orphans"]
    try:
        assert report["ok"] and after["state"] == "healthy"
        # Every engine process of the killed shard is still running, reported with its memory.
        assert sorted(o["pid"] for o in orphans) == sorted(victim["engine_pids"])
        assert max(o["rss_bytes"] for o in orphans) > 100 * 2**20
        assert alive([o["pid"] for o in orphans]) == sorted(victim["engine_pids"])
        assert "left running for debugging" in proc.stderr
        assert str(orphans[0]["pid"]) in proc.stderr
    finally:
        # Ours to clean up: this test made them, by PID.
        for pid in alive([o["pid"] for o in orphans] + victim["engine_pids"]):
            os.kill(pid, signal.SIGKILL)
    assert wait_gone(victim["engine_pids"], 10) == []
