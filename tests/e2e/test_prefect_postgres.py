"""The production path of docs/scale-out.md, for real: a PostgreSQL cluster of the test's own
(Debian's server, initdb into a temporary directory, as the `postgres` user when we are root),
a Prefect server on it, a process worker attached to a Ray head, and the deployments run
against it: fleet-up, generate, fleet-down. Both fenced blocks of the doc are run line by line
as written. Artifacts are read back through the API, and the rows the server wrote are read
from PostgreSQL with psql. Everything is stopped by PID (pg_ctl for the cluster) at the end."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

from tests.e2e.prefect_stack import ROOT, Stack, fenced_commands, free_port, table_rows
from tests.e2e.test_cli import _marked
from tests.helpers import wait_gone

DOC = ROOT / "docs" / "scale-out.md"


def _pg_bin() -> Path | None:
    """Debian's newest PostgreSQL server programs (kept out of PATH by the package)."""
    found = sorted((p for p in Path("/usr/lib/postgresql").glob("*/bin/postgres") if p.parts[-3].isdigit()),
                   key=lambda p: int(p.parts[-3]))
    return found[-1].parent if found else None


def _pg_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("postgres")
    except KeyError:
        return None


PG_BIN = _pg_bin()
AS_ROOT = os.geteuid() == 0
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(PG_BIN is None, reason="needs Debian's postgresql (make setup installs it)"),
    pytest.mark.skipif(AS_ROOT and _pg_user() is None, reason="as root, needs the postgres OS user"),
]


class Postgres:
    """A PostgreSQL cluster in a temporary directory, run by the doc's own commands. PostgreSQL
    refuses root: as root, every command runs as the `postgres` OS user (runuser)."""

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="nemo-gen-pg-"))  # not under pytest's 0700 tmp
        if AS_ROOT:
            user = _pg_user()
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self.marker = uuid.uuid4().hex
        self.port = free_port()
        self.password = uuid.uuid4().hex
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PG"))},
            "PATH": f"{PG_BIN}:{os.environ['PATH']}",
            "NEMO_GEN_TEST_MARKER": self.marker,  # the cluster's processes, apart from the stack's
            "PGDATA": str(self.root / "data"),
            "PGHOST": str(self.root),
            "PGPORT": str(self.port),
            "PREFECT_DB_PASSWORD": self.password,
        }

    def run(self, cmd: str | list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        args = ["bash", "-c", cmd] if isinstance(cmd, str) else cmd
        if AS_ROOT:
            args = ["runuser", "-u", "postgres", "--", *args]
        return subprocess.run(args, env=self.env, cwd=self.root, capture_output=True, text=True, timeout=timeout)

    def query(self, sql: str, db: str = "prefect") -> list[str]:
        out = self.run(["psql", "-d", db, "-v", "ON_ERROR_STOP=1", "-At", "-c", sql])
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    def postmaster_pid(self) -> int | None:
        pidfile = self.root / "data" / "postmaster.pid"
        return int(pidfile.read_text().split()[0]) if pidfile.exists() else None

    def stop(self) -> None:
        pid = self.postmaster_pid()
        if pid is not None:
            out = self.run("pg_ctl stop --mode=fast --wait", timeout=60)
            assert out.returncode == 0 or not psutil.pid_exists(pid), out.stderr
            for left in wait_gone([pid, *_marked(self.marker)], 30):  # by PID, never by name
                os.kill(left, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def pg():
    """The cluster, started by the doc's postgres-cluster block (stopped after the stack, so the
    Prefect server never outlives its database)."""
    cluster = Postgres()
    try:
        for line in fenced_commands(DOC, "postgres-cluster"):
            out = cluster.run(line)
            assert out.returncode == 0, f"{line}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def stack(pg, tmp_path_factory, tiny_model_dir):
    s = Stack(tmp_path_factory.mktemp("prefect-pg"), tiny_model_dir, name="pg", checkpoint=False)
    s.env.update(PGPORT=pg.env["PGPORT"], PREFECT_DB_PASSWORD=pg.password)  # the doc's inputs
    try:
        s.start_ray()
        yield s
    finally:
        s.stop()


def _engines(marker: str) -> list[int]:
    """The fleet's vLLM engine processes (they carry the Ray head's marker)."""
    out = []
    for pid in _marked(marker):
        try:
            if "VLLM" in " ".join(psutil.Process(pid).cmdline()):
                out.append(pid)
        except psutil.Error:
            continue
    return out


def test_deployments_on_a_prefect_server_backed_by_postgres(stack, pg):
    engines: list[int] = []

    def check_after(line: str, out: subprocess.CompletedProcess) -> None:
        if line == "nemo-gen deploy":
            # The server keeps its state in PostgreSQL, and nowhere else.
            tables = set(pg.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'"))
            assert {"flow_run", "deployment", "artifact", "work_pool", "alembic_version"} <= tables, tables
            assert not list(Path(stack.env["PREFECT_HOME"]).glob("*.db")), "the server wrote SQLite"
            api = {d["id"] for d in stack.post("/deployments/filter")}
            assert len(api) >= 5 and set(pg.query("SELECT id FROM deployment")) == api
            assert pg.query("SELECT type FROM work_pool WHERE name = 'nemo-gen'") == ["process"]
        elif " ray status " in f" {line} ":
            assert re.search(r"Active:\s*\n\s*1 node_", out.stdout), out.stdout
        elif "'fleet-up/default'" in line:
            run = _completed_in_pg(stack, pg, "fleet-up/default")
            assert table_rows(stack.artifacts(run)["fleet-health"]) == [
                {"shard": 0, "state": "healthy", "weight_version": 0, "restarts": 0, "last_error": ""}]
            engines.extend(_engines(stack.marker))
            assert engines, "fleet-up completed but no vLLM engine process carries the Ray head's marker"
        elif "'generate/default'" in line:
            samples = [json.loads(x) for x in Path(stack.env["SAMPLES"]).read_text().splitlines()]
            assert len(samples) == 4 and all(r["weight_version"] == 0 and len(r["token_ids"]) == 8 and not r["error"]
                                             for r in samples)
            run = _completed_in_pg(stack, pg, "generate/default")
            rows = table_rows(stack.artifacts(run)["generation-throughput"])
            assert rows[0]["requests"] == 4 and rows[0]["tokens"] == 32 and rows[-1]["tokens_per_s"] > 0
        elif "'fleet-down/default'" in line:
            run = _completed_in_pg(stack, pg, "fleet-down/default")
            assert [r["state"] for r in table_rows(stack.artifacts(run)["fleet-health"])] == ["stopped"]
            assert wait_gone(engines, 30) == [], "fleet-down left engine processes"

    stack.run_lines(fenced_commands(DOC, "prefect-on-postgres"), check_after)
    assert engines  # the fleet-up and fleet-down checks ran


def _completed_in_pg(stack: Stack, pg: Postgres, deployment: str) -> str:
    """The deployment's latest run: COMPLETED through the API and in PostgreSQL's flow_run
    table, with the same artifact keys in both. Returns its id."""
    run = stack.runs_of(deployment)[0]
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert pg.query(f"SELECT state_type FROM flow_run WHERE id = '{run['id']}'") == ["COMPLETED"]
    in_pg = set(pg.query(f"SELECT coalesce(key, type) FROM artifact WHERE flow_run_id = '{run['id']}'"))
    assert in_pg and in_pg == set(stack.artifacts(run["id"])), in_pg
    return run["id"]


def test_nothing_left_running(stack, pg):
    postmaster = pg.postmaster_pid()
    assert postmaster and psutil.pid_exists(postmaster)
    stack.stop()
    pg.stop()
    assert wait_gone([postmaster, *_marked(stack.marker), *_marked(pg.marker)], 30) == []
    assert not pg.root.exists()
