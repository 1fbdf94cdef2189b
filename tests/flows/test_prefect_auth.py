"""Prefect API authentication against real servers, and a deployment's run with widening
overrides refused before anything starts.

- The operator's server (``python -m nemo_gen.prefect_server server start`` with
  ``PREFECT_SERVER_API_AUTH_STRING``, as docs/scale-out.md says): a client without the string is
  refused (401), one with it (``PREFECT_API_AUTH_STRING``) works — raw HTTP, Prefect's CLI, and
  nemo-gen's own ``prefect_api``, which names the missing setting at once. On that server
  ``nemo-gen deploy`` registers, a process worker runs a ``generate`` run whose ``overrides``
  allow every path: the run fails naming the key, and not one task of it ran (no prompt file
  read, no Ray, no engine).
- The managed server (``nemo_gen.prefect_api``, the one ``nemo-gen run`` starts and stops):
  with either string set it asks for it, and a flow of this process — and a child process —
  reports to it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from nemo_gen.errors import ConfigError
from nemo_gen.prefect_api import CLIENT_AUTH_ENV, SERVER_AUTH_ENV, prefect_api
from nemo_gen.settings import NemoGenSettings
from tests.e2e.prefect_stack import Stack, parse_run_id

pytestmark = pytest.mark.flows

AUTH = f"nemo-gen:{uuid.uuid4().hex}"  # Prefect's convention, user:password
USER, PASSWORD = AUTH.split(":")
PREFECT = str(Path(sys.executable).parent / "prefect")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    """A Prefect server as an operator starts one, with an auth string; the stack's environment
    (every command run through it) is the clients', with the same string."""
    stack = Stack(tmp_path_factory.mktemp("prefect-auth"), tiny_model_dir, name="auth", checkpoint=False)
    stack.env.update({SERVER_AUTH_ENV: AUTH, CLIENT_AUTH_ENV: AUTH})
    try:
        proc = stack.spawn(f"{sys.executable} -m nemo_gen.prefect_server server start --analytics-off", "server.log")
        stack.wait_healthy(proc, "server.log", timeout=300)  # GET /health needs no auth: probes keep working
        yield stack
    finally:
        stack.stop()


def _without_auth(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in (SERVER_AUTH_ENV, CLIENT_AUTH_ENV)}


def test_an_unauthenticated_client_is_refused_and_an_authenticated_one_works(server, monkeypatch):
    # raw HTTP: the API, not only the UI, is behind the string
    assert server.http.post("/flow_runs/filter", json={}).status_code == 401
    assert server.http.post("/flow_runs/filter", json={}, auth=(USER, "wrong")).status_code == 401
    assert server.http.post("/flow_runs/filter", json={}, auth=(USER, PASSWORD)).status_code == 200
    # Prefect's own client, as workers and `prefect deployment run` use it
    refused = subprocess.run([PREFECT, "work-pool", "ls"], env=_without_auth(server.env), capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "Unauthorized" in refused.stdout + refused.stderr, refused
    assert server.run("prefect work-pool ls", timeout=120).returncode == 0
    # nemo-gen's commands (`run`, `deploy`, `generate`): refused at once, naming the setting
    settings = NemoGenSettings.load(overrides={"prefect.api_url": server.api})
    for value in (None, f"{USER}:wrong"):
        if value is None:
            monkeypatch.delenv(CLIENT_AUTH_ENV, raising=False)
        else:
            monkeypatch.setenv(CLIENT_AUTH_ENV, value)
        with pytest.raises(ConfigError, match=f"^{CLIENT_AUTH_ENV}: the Prefect API at .* refused this client"):
            with prefect_api(settings):
                pass
    monkeypatch.setenv(CLIENT_AUTH_ENV, AUTH)
    with prefect_api(settings) as api:
        assert _flow_runs_seen(api.url) >= 0


def _flow_runs_seen(url: str) -> int:
    from prefect.client.orchestration import get_client

    async def read() -> int:
        async with get_client() as client:
            assert client.api_url.host == httpx.URL(url).host
            return len(await client.read_flow_runs())

    return asyncio.run(read())


def test_a_deployment_run_whose_overrides_widen_the_allowed_paths_fails_before_anything_starts(server):
    pool = f"auth-{uuid.uuid4().hex[:8]}"
    deployed = server.run(f"nemo-gen deploy --set prefect.work_pool={pool}", timeout=300)
    assert deployed.returncode == 0, deployed.stdout[-3000:] + deployed.stderr[-3000:]
    params = {"input": "/etc/hostname", "overrides": ['prefect.allowed_paths=["/"]']}
    created = server.run(f"prefect deployment run generate/default --params '{json.dumps(params)}'")
    assert created.returncode == 0, created.stdout[-3000:] + created.stderr[-3000:]
    run_id = parse_run_id(created.stdout)
    worker = server.run(f"prefect worker start --pool {pool} --run-once", timeout=300)
    assert worker.returncode == 0, worker.stdout[-3000:] + worker.stderr[-3000:]
    auth = httpx.BasicAuth(USER, PASSWORD)
    run = _final(server, run_id, auth)  # Stack.wait_run's client has no credentials
    assert run["state"]["type"] == "FAILED", run["state"]
    assert "prefect.allowed_paths: not allowed in a deployment override" in run["state"]["message"], run["state"]
    tasks = server.http.post("/task_runs/filter", json={"flow_runs": {"id": {"any_": [run_id]}}}, auth=auth)
    assert tasks.status_code == 200 and tasks.json() == [], [t["name"] for t in tasks.json()]  # not one task ran


def _final(server: Stack, run_id: str, auth) -> dict:
    deadline = time.monotonic() + 120
    while True:
        run = server.http.get(f"/flow_runs/{run_id}", auth=auth).json()
        if run["state"]["type"] in ("FAILED", "COMPLETED", "CRASHED", "CANCELLED"):
            return run
        assert time.monotonic() < deadline, f"flow run {run_id} still {run['state']['name']}"
        time.sleep(0.3)


@pytest.mark.parametrize("given", [SERVER_AUTH_ENV, CLIENT_AUTH_ENV])
def test_the_managed_server_asks_for_the_string_and_its_clients_send_it(tmp_path, monkeypatch, given):
    from prefect import flow

    for name in (SERVER_AUTH_ENV, CLIENT_AUTH_ENV, "PREFECT_API_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(given, AUTH)
    settings = NemoGenSettings.load(overrides={"home": str(tmp_path / "home")})

    @flow(name="auth-ping")
    def ping() -> int:
        return 7

    with prefect_api(settings) as api:
        assert api.managed
        assert httpx.post(f"{api.url}/flow_runs/filter", json={}, timeout=10).status_code == 401
        state = ping(return_state=True)  # this process: events, logs, states all authenticated
        assert state.is_completed() and state.result() == 7, state
        child = subprocess.run([PREFECT, "flow-run", "ls"], env={**os.environ, "COLUMNS": "300"}, capture_output=True,
                               text=True, timeout=120)
        assert child.returncode == 0 and "auth-ping" in child.stdout, child  # its children: the same


def test_the_managed_server_refuses_two_strings_that_differ(tmp_path, monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv(SERVER_AUTH_ENV, AUTH)
    monkeypatch.setenv(CLIENT_AUTH_ENV, f"{USER}:other")
    settings = NemoGenSettings.load(overrides={"home": str(tmp_path / "home")})
    with pytest.raises(ConfigError, match=f"^{CLIENT_AUTH_ENV}: {SERVER_AUTH_ENV} and {CLIENT_AUTH_ENV} differ"):
        with prefect_api(settings):
            pass
    assert not (tmp_path / "home" / "prefect" / "server.log").exists()  # refused before any server started
