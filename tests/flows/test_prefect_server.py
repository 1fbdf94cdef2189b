"""The Prefect server nemo-gen runs (``nemo_gen.prefect_server``) survives PrefectHQ/prefect#23055:
an automation committed while the triggers service holds the automations lock. The race is
staged for real (Prefect's own server models on SQLite, ``automation_listener_race.py``), in a
subprocess each: with the fix both commits return and the server's in-memory automations follow
them; without it — the Prefect this project pins — the first commit never returns."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_gen.prefect_server import needs_fix

pytestmark = pytest.mark.flows

RACE = Path(__file__).with_name("automation_listener_race.py")
ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(RACE), str(tmp_path), *flags], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_with_the_fix_each_commit_returns_and_the_cache_follows(tmp_path):
    proc = _start(tmp_path, "--fixed")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if line.split()[0] in ("holding", "committed", "cache")] == \
        ["holding", "committed", "cache", "committed", "cache"], out[-3000:]
    created = [line for line in lines if line.startswith("cache")]
    cached, automation_id = created[0].split(" created ")
    assert automation_id in cached  # loaded into the cache once the lock was free
    assert created[1] == "cache []"  # and forgotten after the delete


@pytest.mark.skipif(not needs_fix(), reason="this Prefect has the fix of its own (3.8+)")
def test_without_it_the_pinned_prefect_hangs_on_the_commit(tmp_path):
    proc = _start(tmp_path)
    try:
        first = proc.stdout.readline()  # imports and the database: seconds to a minute
        assert first.strip() == "holding", first
        time.sleep(5)  # ten times what the fixed run needs to commit and release
        assert proc.poll() is None  # neither finished nor failed: stuck in the commit
    finally:
        proc.kill()
    rest, _ = proc.communicate(timeout=30)
    assert "committed" not in rest, rest[-3000:]


@pytest.mark.skipif(not needs_fix(), reason="this Prefect has the fix of its own (3.8+)")
@pytest.mark.parametrize("flag", ["--background", "-b"])
def test_a_background_server_which_the_fix_cannot_reach_is_refused(tmp_path, flag):
    try:
        out = subprocess.run([sys.executable, "-m", "nemo_gen.prefect_server", "server", "start", flag],
                             cwd=ROOT, env={**os.environ, "PREFECT_HOME": str(tmp_path)},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1, out
        assert "--background" in out.stderr and "foreground" in out.stderr
        assert not list(tmp_path.glob("*.pid"))  # no server was started
    finally:  # only if the refusal broke: stop the background server it started, by its PID file
        for pid_file in tmp_path.glob("*.pid"):
            with contextlib.suppress(ValueError, ProcessLookupError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
