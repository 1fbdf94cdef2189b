"""What the Prefect end-to-end tests share: a Ray head started with deployments/ray/start-node.sh,
the processes an operator's documented commands start (a Prefect server, a process worker), the
environment those commands run in, and reading runs and artifacts back through the API.

Every process is started in its own process group and carries the stack's marker in its
environment (`NEMO_GEN_TEST_MARKER`), so the stack stops what it started by PID and a test can
prove nothing is left."""

from __future__ import annotations

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

import httpx
import psutil

from tests.e2e.test_cli import _marked
from tests.activity import wait_ray_nodes
from tests.helpers import wait_gone

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time", "A fleet of engines"]


def fenced_commands(doc: Path, tag: str) -> list[str]:
    """The fenced ```bash <tag> block of ``doc``, one command per line (comments dropped)."""
    block = re.search(rf"```bash {re.escape(tag)}\n(.*?)```", doc.read_text(), re.DOTALL)
    assert block, f"{doc.relative_to(ROOT)} has no ```bash {tag} block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """The processes a test started (each in its own process group) and how to reach them.

    ``name`` keeps the fleet's actors and namespace apart from other stacks on the machine;
    ``checkpoint`` makes the second tiny model that ``$CKPT`` points at (for refit)."""

    def __init__(self, tmp: Path, tiny_model: Path, name: str = "ops", checkpoint: bool = True):
        from nemo_gen.tiny_model import make_tiny_model

        self.tmp = tmp
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.ray_port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.procs: list[subprocess.Popen] = []
        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "NEMO_GEN_"))}
        self.env = {
            **env,
            "PATH": f"{BIN}:{env['PATH']}",
            "NEMO_GEN_TEST_MARKER": self.marker,  # inherited by everything started below
            # Ray 2.60's `ray start --block` drains for up to 30 s on SIGTERM, and longer when its
            # group's raylet and GCS got the same SIGTERM: nothing here needs draining.
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
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
            "NEMO_GEN_RAY__NAMESPACE": f"nemo_gen_{name}_test",
            "NEMO_GEN_RAY__LOG_TO_DRIVER": "false",
            "NEMO_GEN_FLEET__NAME": name,
            "NEMO_GEN_FLEET__NUM_SHARDS": "1",
            "NEMO_GEN_FLEET__DEVICE": "cpu",
            "NEMO_GEN_GENERATION__MAX_NEW_TOKENS": "8",
            "NEMO_GEN_GENERATION__VLLM_CFG__MAX_MODEL_LEN": "256",
            # the repository (where runs start: the eval schedule's prompt file) and our files
            "NEMO_GEN_PREFECT__ALLOWED_PATHS": json.dumps([str(ROOT), str(tmp)]),
            # the documented commands' inputs
            "RAY_HEAD": f"127.0.0.1:{self.ray_port}",
            "PROMPTS": str(prompts),
            "SAMPLES": str(tmp / "samples.jsonl"),
        }
        if checkpoint:
            self.env["CKPT"] = str(make_tiny_model(tmp / "ckpt-1", seed=3))
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
        self._wait(lambda: port_open(self.ray_port), proc, "ray.log", 90)
        wait_ray_nodes(f"127.0.0.1:{self.ray_port}", self.env, 1)  # the raylet registers after the GCS port opens

    def wait_healthy(self, proc: subprocess.Popen, log: str, timeout: float = 120) -> None:
        self._wait(lambda: _ok(f"{self.api}/health"), proc, log, timeout)

    def _wait(self, ready, proc: subprocess.Popen, log: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, (self.tmp / log).read_text()[-3000:]
            assert time.monotonic() < deadline, f"not ready within {timeout}s"
            time.sleep(0.3)

    def run_lines(self, lines: list[str], check_after, before=None) -> None:
        """Run documented commands as written: a line ending in `&` is spawned and left running
        (a Prefect `server start` is waited for until healthy), any other must exit 0.
        ``before(line)`` runs ahead of each
        line, ``check_after(line, completed)`` after each foreground one."""
        for i, line in enumerate(lines):
            if before:
                before(line)
            if line.endswith("&"):
                proc = self.spawn(line[:-1].strip(), f"line-{i}.log")
                if "server start" in line:  # prefect's own, or nemo_gen.prefect_server's
                    self.wait_healthy(proc, f"line-{i}.log")
                continue
            started = time.monotonic()
            out = self.run(line)
            # in the test's captured output: which line a slow or failed run spent its time on
            print(f"{time.monotonic() - started:6.1f}s  {line}", flush=True)
            assert out.returncode == 0, f"{line}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{self.why(out)}"
            check_after(line, out)

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
        return {a["key"] or a["type"]: a for a in found}

    def wait_run(self, run_id: str, done, timeout: float = 180) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.http.get(f"/flow_runs/{run_id}").json()
            if done(run):
                return run
            assert time.monotonic() < deadline, f"flow run {run_id} still {run['state']['name']}"
            time.sleep(0.2)

    def why(self, out: subprocess.CompletedProcess) -> str:
        """The failed run's state message and its last log lines (the CLI shows only events)."""
        match = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout)
        if not match:
            return ""
        run = self.http.get(f"/flow_runs/{match.group(1)}").json()
        logs = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}, "sort": "TIMESTAMP_ASC"})
        return run["state"]["message"] + "\n" + "\n".join(entry["message"][-1500:] for entry in logs[-5:])


def port_open(port: int) -> bool:
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


def parse_run_id(out: str) -> str:
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, out
    return match.group(1)


def environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return {}


def table_rows(artifact: dict) -> list[dict]:
    data = artifact["data"]
    return json.loads(data) if isinstance(data, str) else data
