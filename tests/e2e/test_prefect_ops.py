"""Operations on Prefect, for real: a Prefect server, a process worker, a Ray head and ONE fleet of
one tiny-model shard, shared by the module. docs/operations.md's operator path is run line by line as
written (server, deploy, worker, schedule, fleet-up --watch, generate/refit/eval with --param,
artifacts, fleet-down); between its lines the test checks artifacts through the API, rejected
parameters, the eval pin, and a flow run that is SIGKILLed and brought back by the automation.
Then headless Chromium loads the server's UI. Everything is stopped by PID at the end and no
process carrying the module's marker may be left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest

from tests.e2e.prefect_stack import ROOT, Stack, environ, fenced_commands, parse_run_id, table_rows
from tests.e2e.test_cli import _marked
from tests.helpers import wait_gone

pytestmark = pytest.mark.e2e

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "test-artifacts" / "prefect-ui"


def operator_path_commands() -> list[str]:
    """The fenced ```bash operator-path block of docs/operations.md, one command per line."""
    return fenced_commands(ROOT / "docs" / "operations.md", "operator-path")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    s = Stack(tmp_path_factory.mktemp("prefect-ops"), tiny_model_dir)
    try:
        s.start_ray()
        yield s
    finally:
        s.stop()


def test_operator_path_from_the_docs(stack):
    fleet_pids: list[int] = []

    def before(line: str) -> None:
        if "'heal/default'" in line:
            # The fleet's only shard dies: heal must bring it back at the current version.
            killed.extend(_fleet_pids(stack))
            os.kill(killed[0], signal.SIGKILL)
            assert wait_gone(killed, 30) == []
        if "'fleet-down/default'" in line:
            fleet_pids.extend(_checks_before_fleet_down(stack))

    killed: list[int] = []

    stack.run_lines(operator_path_commands(), lambda line, out: _check_after(stack, line, out), before)
    assert fleet_pids and wait_gone(fleet_pids, 30) == [], "fleet-down left engine processes"


def _check_after(stack: Stack, line: str, out: subprocess.CompletedProcess) -> None:
    if line == "nemo-gen deploy":
        deployments = {f"{d['name']}" for d in stack.post("/deployments/filter")}
        flows = {f["id"]: f["name"] for f in stack.post("/flows/filter")}
        names = {flows[d["flow_id"]] for d in stack.post("/deployments/filter")}
        assert names >= {"fleet-up", "generate", "refit", "eval", "heal", "fleet-down"}
        assert deployments == {"default"}
        assert stack.http.get("/work_pools/nemo-gen").json()["type"] == "process"
        (auto,) = stack.post("/automations/filter", {"automations": {"name": {"any_": ["nemo-gen-rerun-crashed"]}}})
        assert auto["trigger"]["expect"] == ["prefect.flow-run.Crashed"]
    elif line.startswith("prefect deployment schedule ls 'eval"):
        assert "0 3 * * *" in out.stdout
    elif "'fleet-up/default'" in line:
        run = stack.runs_of("fleet-up/default")[0]
        arts = stack.artifacts(run["id"])
        assert table_rows(arts["fleet-health"]) == [
            {"shard": 0, "state": "healthy", "weight_version": 0, "restarts": 0, "last_error": ""}]
        assert arts["progress"]["data"] == 100.0
    elif "'generate/default'" in line:
        samples = [json.loads(x) for x in Path(stack.env["SAMPLES"]).read_text().splitlines()]
        assert len(samples) == 4 and all(r["weight_version"] == 0 and len(r["token_ids"]) == 8 for r in samples)
        arts = stack.artifacts(stack.runs_of("generate/default")[0]["id"])
        rows = table_rows(arts["generation-throughput"])
        assert rows[0]["shard"] == "0" and rows[0]["requests"] == 4 and rows[0]["tokens"] == 32
        assert rows[-1]["shard"] == "all" and rows[-1]["tokens_per_s"] > 0
        assert arts["progress"]["data"] == 100.0 and "fleet-health" in arts
    elif "'refit/default'" in line:
        arts = stack.artifacts(stack.runs_of("refit/default")[0]["id"])
        timing = table_rows(arts["refit-timing"])
        assert timing[0]["ok"] and timing[0]["bytes"] > 1_000_000 and timing[0]["gb_per_s"] > 0
        assert table_rows(arts["fleet-health"])[0]["weight_version"] == 1
    elif "'eval/default'" in line:
        run = stack.runs_of("eval/default")[0]
        assert run["parameters"]["weight_version"] == 1 and run["state"]["type"] == "COMPLETED"
        rows = table_rows(stack.artifacts(run["id"])["generation-throughput"])
        assert rows[-1]["requests"] == 4
    elif "'heal/default'" in line:
        run = stack.runs_of("heal/default")[0]
        assert run["state"]["type"] == "COMPLETED", run["state"]
        (shard,) = table_rows(stack.artifacts(run["id"])["fleet-health"])
        assert (shard["state"], shard["weight_version"], shard["restarts"]) == ("healthy", 1, 1), shard
        tasks = stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
        (restart,) = [t for t in tasks if t["name"] == "restart-shard-0"]
        assert restart["state"]["type"] == "COMPLETED"
    elif line.startswith("prefect artifact inspect fleet-health"):
        assert "weight_version" in out.stdout
    elif "'fleet-down/default'" in line:
        arts = stack.artifacts(stack.runs_of("fleet-down/default")[0]["id"])
        assert [r["state"] for r in table_rows(arts["fleet-health"])] == ["stopped"]


def _checks_before_fleet_down(stack: Stack) -> list[int]:
    """While the fleet is up: bad parameters, the eval pin, and a crashed run brought back.
    Returns the fleet's actor and engine PIDs (to see them gone after fleet-down)."""
    # Types are checked by Prefect when the run is created: nothing is scheduled.
    bad = stack.run("prefect deployment run 'refit/default' --param checkpoint=x --param version=abc")
    assert bad.returncode != 0 and "version" in (bad.stdout + bad.stderr)

    # A path outside the allowed ones, and an eval pinned to a version the fleet does not serve:
    # both runs fail before generating anything, with an error naming the parameter.
    outside = parse_run_id(stack.run("prefect deployment run 'generate/default' --param input=/etc/hostname").stdout)
    pinned = parse_run_id(stack.run("prefect deployment run 'eval/default' --param input=\"$PROMPTS\" "
                                    "--param weight_version=0").stdout)
    # The crash: a generate run with enough batches to be caught running, SIGKILLed.
    long_input = stack.tmp / "long.jsonl"
    long_input.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(40)))
    crash = parse_run_id(stack.run(f"prefect deployment run 'generate/default' --param input={long_input} "
                                   f"--param output={stack.tmp / 'long-out.jsonl'} --param batch_size=1").stdout)
    stack.wait_run(crash, lambda r: r["state"]["type"] == "RUNNING", 120)
    victims = [p.pid for p in psutil.process_iter() if environ(p).get("PREFECT__FLOW_RUN_ID") == crash]
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)

    for run_id, needle in ((outside, "parameter input"), (pinned, "weight_version")):
        run = stack.wait_run(run_id, lambda r: r["state"]["type"] in ("FAILED", "COMPLETED", "CRASHED"))
        assert run["state"]["type"] == "FAILED" and needle in run["state"]["message"], run["state"]

    run = stack.wait_run(crash, lambda r: r["state"]["type"] == "COMPLETED" and r["run_count"] >= 2, 180)
    history = [s["name"] for s in stack.http.get("/flow_run_states/", params={"flow_run_id": crash}).json()]
    assert "Crashed" in history and "AwaitingRetry" in history and history[-1] == "Completed", history
    assert len((stack.tmp / "long-out.jsonl").read_text().splitlines()) == 40

    return _fleet_pids(stack)


def _fleet_pids(stack: Stack) -> list[int]:
    """The fleet's one shard: actor PID first, then its engine PIDs."""
    status = stack.run("nemo-gen fleet status --json", timeout=120)
    assert status.returncode == 0, status.stderr[-2000:]
    (shard,) = [s for s in json.loads(status.stdout)["shards"] if s["state"] != "spare"]
    return [shard["actor_pid"], *shard["engine_pids"]]


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (make setup installs it)")
def test_ui_shows_deployments_runs_and_fleet_health(stack):
    """Headless Chromium renders the test server's UI: the deployments, a completed flow run,
    and its fleet-health artifact. Screenshots are kept under test-artifacts/."""
    run = stack.runs_of("fleet-up/default")[0]
    assert run["state"]["type"] == "COMPLETED"
    artifact_id = stack.artifacts(run["id"])["fleet-health"]["id"]
    ui = stack.api.removesuffix("/api")
    SHOTS.mkdir(parents=True, exist_ok=True)
    pages = {
        "deployments": (f"{ui}/deployments", ["fleet-up", "generate", "refit", "eval", "fleet-down"]),
        "flow-run": (f"{ui}/runs/flow-run/{run['id']}", [run["name"], "Completed"]),
        "fleet-health": (f"{ui}/artifacts/artifact/{artifact_id}", ["fleet-health", "weight_version", "healthy"]),
    }
    for name, (url, expected) in pages.items():
        dom = _chromium(stack, ["--dump-dom", url])
        missing = [text for text in expected if text not in dom]
        _chromium(stack, [f"--screenshot={SHOTS / (name + '.png')}", url])
        assert not missing, f"{url}: {missing} not on the page (screenshot: {SHOTS / (name + '.png')})"
        assert (SHOTS / f"{name}.png").stat().st_size > 10_000


def _chromium(stack: Stack, args: list[str]) -> str:
    profile = stack.tmp / f"chromium-{uuid.uuid4().hex[:8]}"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1400,1000",
           "--virtual-time-budget=15000", *args]
    proc = subprocess.Popen(cmd, env=stack.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)
    return out


def test_nothing_left_running(stack):
    stack.stop()
    assert wait_gone(_marked(stack.marker), 30) == []
