"""Operations on Prefect, for real: a Prefect server, a process worker, a Ray head and ONE fleet of
one tiny-model shard, shared by the module. The README's operator path is run line by line as
written (server, deploy, worker, schedule, fleet-up --watch, generate/refit/eval with --param,
artifacts, fleet-down); between its lines the test checks artifacts through the API, rejected
parameters, the eval pin, and a flow run that is SIGKILLed and brought back by the automation.
Then headless Chromium loads the server's UI. Everything is stopped by PID at the end and no
process carrying the module's marker may be left."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.test_cli import _marked
from tests.helpers import wait_gone

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "test-artifacts" / "prefect-ui"
HEAL = (ROOT / "flows" / "heal.py").exists()


def readme_commands() -> list[str]:
    """The fenced ```bash operator-path block of the README, one command per line."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash operator-path\n(.*?)```", text, re.S)
    assert block, "README has no ```bash operator-path block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The processes this module started (each in its own process group) and how to reach them."""

    def __init__(self, tmp: Path, tiny_model: Path):
        from nemo_gen.tiny_model import make_tiny_model

        self.tmp = tmp
        self.marker = uuid.uuid4().hex
        self.port = _free_port()
        self.ray_port = _free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.procs: list[subprocess.Popen] = []
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                   ["Hello there", "The quick brown fox", "Once upon a time", "A fleet of engines"]))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NEMO_GEN_"))}
        self.env = {
            **env,
            "PATH": f"{BIN}:{env['PATH']}",
            "NEMO_GEN_TEST_MARKER": self.marker,  # inherited by everything started below
            "PREFECT_HOME": str(tmp / "prefect"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(self.port),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
            # the fleet, as the worker's environment configures it for every flow run
            "NEMO_GEN_HOME": str(tmp / "home"),
            "NEMO_GEN_MODEL__PATH": str(tiny_model),
            "NEMO_GEN_RAY__ADDRESS": f"127.0.0.1:{self.ray_port}",
            "NEMO_GEN_RAY__NAMESPACE": "nemo_gen_ops_test",
            "NEMO_GEN_RAY__LOG_TO_DRIVER": "false",
            "NEMO_GEN_FLEET__NAME": "ops",
            "NEMO_GEN_FLEET__NUM_SHARDS": "1",
            "NEMO_GEN_FLEET__DEVICE": "cpu",
            "NEMO_GEN_GENERATION__MAX_NEW_TOKENS": "8",
            "NEMO_GEN_GENERATION__VLLM_CFG__MAX_MODEL_LEN": "256",
            # the repository (where runs start: the eval schedule's prompt file) and our files
            "NEMO_GEN_PREFECT__ALLOWED_PATHS": json.dumps([str(ROOT), str(tmp)]),
            # the README's inputs
            "PROMPTS": str(prompts),
            "SAMPLES": str(tmp / "samples.jsonl"),
            "CKPT": str(make_tiny_model(tmp / "ckpt-1", seed=3)),
        }
        self.http = httpx.Client(base_url=self.api, timeout=30)

    # -- processes ----------------------------------------------------------------------------

    def spawn(self, cmd: str | list[str], log: str) -> subprocess.Popen:
        args = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        proc = subprocess.Popen(args, env=self.env, cwd=ROOT, stdout=open(self.tmp / log, "wb"),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, cmd: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", cmd], env=self.env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)

    def start_ray(self) -> None:
        proc = self.spawn([str(ROOT / "deployments/ray/start-node.sh"), "--head", f"--port={self.ray_port}",
                           "--num-cpus=4", f"--temp-dir=/tmp/rn{self.marker[:8]}", "--block"], "ray.log")
        self._wait(lambda: _port_open(self.ray_port), proc, "ray.log", 90)
        time.sleep(2)  # the raylet registers just after the GCS port opens

    def wait_healthy(self, proc: subprocess.Popen, log: str) -> None:
        self._wait(lambda: _ok(f"{self.api}/health"), proc, log, 120)

    def _wait(self, ready, proc: subprocess.Popen, log: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, (self.tmp / log).read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready within {timeout}s"
            time.sleep(0.3)

    def stop(self) -> None:
        """SIGTERM each group we started (the worker and server first, Ray last), then wait."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        self.procs.clear()
        for pid in wait_gone(_marked(self.marker), 30):  # stragglers that left their group: ours, by PID
            os.kill(pid, signal.SIGKILL)

    # -- the API ------------------------------------------------------------------------------

    def post(self, path: str, body: dict | None = None):
        r = self.http.post(path, json=body or {})
        r.raise_for_status()
        return r.json()

    def runs_of(self, deployment: str) -> list[dict]:
        flow, name = deployment.split("/")
        dep = self.http.get(f"/deployments/name/{flow}/{name}").json()
        return self.post("/flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [dep["id"]]}},
                                               "sort": "EXPECTED_START_TIME_DESC"})

    def artifacts(self, flow_run_id: str) -> dict[str, dict]:
        found = self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
        by_key = {a["key"] or a["type"]: a for a in found}
        return by_key

    def wait_run(self, run_id: str, done, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.http.get(f"/flow_runs/{run_id}").json()
            if done(run):
                return run
            assert time.monotonic() < deadline, f"flow run {run_id} still {run['state']['name']}"
            time.sleep(0.2)


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _run_id(out: str) -> str:
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, out
    return match.group(1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    s = Stack(tmp_path_factory.mktemp("prefect-ops"), tiny_model_dir)
    try:
        s.start_ray()
        yield s
    finally:
        s.stop()


def test_operator_path_from_the_readme(stack):
    lines = readme_commands()
    results: dict[str, subprocess.CompletedProcess] = {}
    fleet_pids: list[int] = []
    for i, line in enumerate(lines):
        if "'fleet-down/default'" in line:
            fleet_pids = _checks_before_fleet_down(stack)
        if line.endswith("&"):
            proc = stack.spawn(line[:-1].strip(), f"line-{i}.log")
            if line.startswith("prefect server start"):
                stack.wait_healthy(proc, f"line-{i}.log")
            continue
        out = stack.run(line)
        results[line] = out
        expected = (0, 3) if line == "nemo-gen deploy" and not HEAL else (0,)
        assert out.returncode in expected, f"{line}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{_why(stack, out)}"
        _check_after(stack, line, out)
    assert fleet_pids and wait_gone(fleet_pids, 30) == [], "fleet-down left engine processes"


def _check_after(stack: Stack, line: str, out: subprocess.CompletedProcess) -> None:
    if line == "nemo-gen deploy":
        deployments = {f"{d['name']}" for d in stack.post("/deployments/filter")}
        flows = {f["id"]: f["name"] for f in stack.post("/flows/filter")}
        names = {flows[d["flow_id"]] for d in stack.post("/deployments/filter")}
        assert names >= {"fleet-up", "generate", "refit", "eval", "fleet-down"} | ({"heal"} if HEAL else set())
        assert deployments == {"default"}
        assert stack.http.get("/work_pools/nemo-gen").json()["type"] == "process"
        (auto,) = stack.post("/automations/filter", {"automations": {"name": {"any_": ["nemo-gen-rerun-crashed"]}}})
        assert auto["trigger"]["expect"] == ["prefect.flow-run.Crashed"]
        if not HEAL:
            assert "flows/heal.py" in out.stdout  # reported, not silently skipped
    elif line.startswith("prefect deployment schedule ls 'eval"):
        assert "0 3 * * *" in out.stdout
    elif "'fleet-up/default'" in line:
        run = stack.runs_of("fleet-up/default")[0]
        arts = stack.artifacts(run["id"])
        assert _rows(arts["fleet-health"]) == [
            {"shard": 0, "state": "healthy", "weight_version": 0, "restarts": 0, "last_error": ""}]
        assert arts["progress"]["data"] == 100.0
    elif "'generate/default'" in line:
        samples = [json.loads(x) for x in Path(stack.env["SAMPLES"]).read_text().splitlines()]
        assert len(samples) == 4 and all(r["weight_version"] == 0 and len(r["token_ids"]) == 8 for r in samples)
        arts = stack.artifacts(stack.runs_of("generate/default")[0]["id"])
        rows = _rows(arts["generation-throughput"])
        assert rows[0]["shard"] == "0" and rows[0]["requests"] == 4 and rows[0]["tokens"] == 32
        assert rows[-1]["shard"] == "all" and rows[-1]["tokens_per_s"] > 0
        assert arts["progress"]["data"] == 100.0 and "fleet-health" in arts
    elif "'refit/default'" in line:
        arts = stack.artifacts(stack.runs_of("refit/default")[0]["id"])
        timing = _rows(arts["refit-timing"])
        assert timing[0]["ok"] and timing[0]["bytes"] > 1_000_000 and timing[0]["gb_per_s"] > 0
        assert _rows(arts["fleet-health"])[0]["weight_version"] == 1
    elif "'eval/default'" in line:
        run = stack.runs_of("eval/default")[0]
        assert run["parameters"]["weight_version"] == 1 and run["state"]["type"] == "COMPLETED"
        rows = _rows(stack.artifacts(run["id"])["generation-throughput"])
        assert rows[-1]["requests"] == 4
    elif line.startswith("prefect artifact inspect fleet-health"):
        assert "weight_version" in out.stdout
    elif "'fleet-down/default'" in line:
        arts = stack.artifacts(stack.runs_of("fleet-down/default")[0]["id"])
        assert [r["state"] for r in _rows(arts["fleet-health"])] == ["stopped"]


def _checks_before_fleet_down(stack: Stack) -> list[int]:
    """While the fleet is up: bad parameters, the eval pin, and a crashed run brought back.
    Returns the fleet's actor and engine PIDs (to see them gone after fleet-down)."""
    # Types are checked by Prefect when the run is created: nothing is scheduled.
    bad = stack.run("prefect deployment run 'refit/default' --param checkpoint=x --param version=abc")
    assert bad.returncode != 0 and "version" in (bad.stdout + bad.stderr)

    # A path outside the allowed ones, and an eval pinned to a version the fleet does not serve:
    # both runs fail before generating anything, with an error naming the parameter.
    outside = _run_id(stack.run("prefect deployment run 'generate/default' --param input=/etc/hostname").stdout)
    pinned = _run_id(stack.run("prefect deployment run 'eval/default' --param input=\"$PROMPTS\" "
                               "--param weight_version=0").stdout)
    # The crash: a generate run with enough batches to be caught running, SIGKILLed.
    long_input = stack.tmp / "long.jsonl"
    long_input.write_text("".join(json.dumps({"prompt": f"prompt {i}"}) + "\n" for i in range(40)))
    crash = _run_id(stack.run(f"prefect deployment run 'generate/default' --param input={long_input} "
                              f"--param output={stack.tmp / 'long-out.jsonl'} --param batch_size=1").stdout)
    stack.wait_run(crash, lambda r: r["state"]["type"] == "RUNNING", 120)
    victims = [p.pid for p in psutil.process_iter() if _env(p).get("PREFECT__FLOW_RUN_ID") == crash]
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

    status = stack.run("nemo-gen fleet status --json", timeout=120)
    assert status.returncode == 0, status.stderr[-2000:]
    (shard,) = json.loads(status.stdout)["shards"]
    return [shard["actor_pid"], *shard["engine_pids"]]


def _why(stack: Stack, out: subprocess.CompletedProcess) -> str:
    """The failed run's state message and its last log lines (the CLI shows only events)."""
    match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
    if not match:
        return ""
    run = stack.http.get(f"/flow_runs/{match.group(1)}").json()
    logs = stack.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "sort": "TIMESTAMP_ASC"})
    return run["state"]["message"] + "\n" + "\n".join(entry["message"][-1500:] for entry in logs[-5:])


def _env(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def _rows(artifact: dict) -> list[dict]:
    data = artifact["data"]
    return json.loads(data) if isinstance(data, str) else data


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
