"""A fleet that outlives one command: a Ray head started the way clusters are
(deployments/ray/start-node.sh), `nemo-gen fleet up`, `nemo-gen refit --checkpoint` through the
Prefect refit flow, `fleet status`, `fleet down` — and every process stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_cli import _marked
from tests.activity import wait_ray_nodes
from tests.helpers import wait_gone

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head of its own (blocking `ray start`, own process group), stopped by PID, on what
    a machine that never ran Ray looks like: a HOME of its own, so no ~/.ray/auth_token (the
    head's script makes the cluster's token; every command below attaches with it)."""
    marker = uuid.uuid4().hex
    port = _free_port()
    home = tmp_path / "user-home"
    home.mkdir()
    env = {**os.environ, "NEMO_GEN_TEST_MARKER": marker, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "HOME": str(home),
           # `ray start --block` otherwise drains for 30 s on SIGTERM.
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    for var in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    temp_dir = f"/tmp/rn{marker[:8]}"
    proc = subprocess.Popen(
        [str(ROOT / "deployments/ray/start-node.sh"), "--head", f"--port={port}", "--num-cpus=4",
         f"--temp-dir={temp_dir}", "--block"],
        env=env, stdout=open(tmp_path / "ray.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, (tmp_path / "ray.log").read_text()[-2000:]
            time.sleep(0.5)
    assert (home / ".ray" / "auth_token").stat().st_size > 0  # the head made the cluster's token
    wait_ray_nodes(f"127.0.0.1:{port}", env, 1)  # the raylet registers just after the GCS port opens
    yield {"address": f"127.0.0.1:{port}", "marker": marker, "env": env}
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    left = wait_gone(_marked(marker), 30)
    for pid in left:  # stragglers that left the group: still ours, still by PID
        os.kill(pid, signal.SIGKILL)
    assert wait_gone(left, 10) == []


def nemo_gen(args, ray_head, tmp_path, timeout=400):
    env = {**ray_head["env"], "COLUMNS": "240", "NO_COLOR": "1"}  # a wide terminal: table cells do not wrap
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "nemo_gen.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path)
    return proc


def test_fleet_up_refit_status_down(ray_head, tiny_model_dir, tmp_path):
    from nemo_gen.tiny_model import make_tiny_model

    other = make_tiny_model(tmp_path / "ckpt-b", seed=3)
    common = ["--set", f"ray.address={ray_head['address']}", "--set", f"home={tmp_path / 'home'}",
              "--set", f"model.path={tiny_model_dir}", "--set", "fleet.name=persistent",
              "--set", "fleet.num_shards=2", "--set", "generation.vllm_cfg.max_model_len=256", "--json"]
    human = common[:-1]  # the same commands as a person types them: tables and text, not JSON

    staging_before = set(Path("/dev/shm").glob("nemo_gen-persistent-*"))
    up = nemo_gen(["fleet", "up", *common], ray_head, tmp_path)
    assert up.returncode == 0, up.stderr[-3000:]
    shard, second = json.loads(up.stdout)["shards"]
    assert shard["state"] == second["state"] == "healthy" and shard["weight_version"] == 0
    pids = [p for s in (shard, second) for p in [s["actor_pid"], *s["engine_pids"]]]

    # The command that launched it has exited; the fleet is still there.
    status = nemo_gen(["fleet", "status", *common], ray_head, tmp_path)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout)["shards"][0]["actor_pid"] == shard["actor_pid"]

    refit = nemo_gen(["refit", "--checkpoint", str(other), "--version", "7", *common], ray_head, tmp_path)
    assert refit.returncode == 0, refit.stderr[-3000:]
    report = json.loads(refit.stdout)
    assert report["ok"] and report["version"] == 7 and report["bytes"] > 1_000_000
    assert (tmp_path / "home" / "prefect" / "prefect.db").exists()  # it ran as a Prefect flow

    assert set(Path("/dev/shm").glob("nemo_gen-persistent-*")) <= staging_before, "refit left its staging file"

    # `fleet status` as a table: every shard healthy at the refit's version 7
    table = nemo_gen(["fleet", "status", *human], ray_head, tmp_path)
    assert table.returncode == 0, table.stderr[-3000:]
    rows = [[c.strip() for c in line.split("\u2502")][1:-1] for line in table.stdout.splitlines() if "\u2502" in line]
    assert "fleet persistent" in table.stdout
    assert rows[0][1:3] == ["healthy", "7"]  # shard 0 after the refit (its columns: state, weight version)
    assert [r[:5] for r in rows] == [
        ["0", "healthy", "7", str(shard["actor_pid"]), " ".join(map(str, shard["engine_pids"]))],
        ["1", "healthy", "7", str(second["actor_pid"]), " ".join(map(str, second["engine_pids"]))],
    ]

    # `refit --no-prefect`, as text: every shard ok, exit 0
    plain = nemo_gen(["refit", "--checkpoint", str(tiny_model_dir), "--version", "8", "--no-prefect", *human],
                     ray_head, tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    first, *per_shard = plain.stdout.strip().splitlines()
    assert re.fullmatch(r"refit to weight version 8: \d+\.\d MB in \d+\.\d\d s \(\d+\.\d\d GB/s\)", first), first
    assert per_shard == ["  shard 0: ok", "  shard 1: ok"]

    # A shard that cannot load is quarantined: listed, exit 3, the other serves v9. Its EngineCore
    # is frozen, so its actor still answers when the command attaches but the load never ends.
    # refit.timeout_s=10 is a bound with its reason: a healthy shard loads this model in ~0.03 s.
    # The command's fleet heals what it quarantined (a loss, like any other): the frozen actor and
    # its EngineCore are reaped, by the time it exits or after.
    import psutil

    core = next(p for p in second["engine_pids"] if "EngineCore" in psutil.Process(p).name())
    os.kill(core, signal.SIGSTOP)
    try:
        partial = nemo_gen(["refit", "--checkpoint", str(other), "--version", "9", "--no-prefect",
                            "--set", "refit.timeout_s=10", *human], ray_head, tmp_path)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already reaped by the heal
            os.kill(core, signal.SIGKILL)
    assert partial.returncode == 3, partial.stdout + partial.stderr[-3000:]
    first, *per_shard = partial.stdout.strip().splitlines()
    assert first.startswith("refit to weight version 9: "), first
    per_shard = sorted(per_shard)  # listed in the report's order, not by shard
    assert per_shard[0] == "  shard 0: ok" and per_shard[1].startswith("  shard 1: QUARANTINED: "), per_shard
    rows = {r["index"]: r for r in json.loads(nemo_gen(["fleet", "status", *common], ray_head, tmp_path).stdout)["shards"]}
    assert rows[0]["state"] == "healthy" and rows[0]["weight_version"] == 9
    # the quarantined actor never serves again: slot 1 is out of service, or a new actor serves v9
    assert rows[1]["state"] != "healthy" or (
        rows[1]["weight_version"] == 9 and rows[1]["actor_pid"] != second["actor_pid"]), rows[1]

    bad = nemo_gen(["refit", "--checkpoint", str(tmp_path / "nowhere"), "--no-prefect", *common], ray_head, tmp_path)
    assert bad.returncode == 2 and "nowhere" in bad.stderr

    down = nemo_gen(["fleet", "down", *common], ray_head, tmp_path)
    assert down.returncode == 0, down.stderr[-3000:]
    assert wait_gone(pids, 30) == []
    gone = nemo_gen(["fleet", "status", *common], ray_head, tmp_path)
    assert gone.returncode == 1 and "no fleet named 'persistent'" in gone.stderr
