"""Which Prefect API the flows report to, and the local server nemo-gen manages when none is set.

Ray workers must talk to a real Prefect API: in Prefect's ephemeral mode every Ray worker
would start its own temporary server on one SQLite file ("database is locked"). So, in order:
``prefect.api_url`` from settings, else ``PREFECT_API_URL`` from the environment, else a
``prefect server start`` of our own — bound to 127.0.0.1, analytics off, its database under
``<home>/prefect``, with ``nemo_gen.prefect_server``'s fix for Prefect 3.7's SQLite automations
deadlock — stopped by PID when the command ends.

Authentication is Prefect's own (3.7: HTTP Basic; ``PREFECT_SERVER_API_AUTH_STRING`` on the
server, where every route but ``GET /health`` and ``/ready`` answers 401 without it, and
``PREFECT_API_AUTH_STRING`` on each client — flow runs, workers, ``nemo-gen deploy``). The managed
server takes whichever of the two this process has (both: they must match) and hands it to its
clients — this process and its children — as ``PREFECT_API_AUTH_STRING``. An external API that
answers 401 is reported at once, naming the setting, rather than at the first run's first call.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from nemo_gen.errors import ConfigError, InfraError
from nemo_gen.settings import NemoGenSettings, is_loopback

log = logging.getLogger(__name__)

SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # the server's: the credentials it accepts
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # each client's: the credentials it sends


@dataclass(frozen=True)
class PrefectApi:
    url: str
    managed: bool
    home: Path | None = None
    log_file: Path | None = None

    @property
    def ui_url(self) -> str:
        return self.url.removesuffix("/api")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def server_env(home: Path, url: str | None = None) -> dict[str, str]:
    """Environment for a managed server and for processes that report to it.

    Run logs go to the API in Prefect's default batches (every 2 s, and once more when the
    command ends: ``_flush_logs``). Each batch is a write to the server's SQLite database, and
    a write that lands while one of the flow's own API calls (a subflow's creation, a state
    change) sits between its read and its write makes that call fail with "database is
    locked", answered 503 and retried by Prefect's client after 2 s (see ``SERVER_ONLY_ENV``).
    """
    env = {
        "PREFECT_HOME": str(home.resolve()),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    if url:
        env["PREFECT_API_URL"] = url
    return env


# Settings of the managed server's own process only (the single-command server of `nemo-gen
# run`/`generate`; an external server is configured by whoever runs it).
#
# Why: the server's API handlers write in SQLite DEFERRED transactions that read first (e.g.
# POST /task_runs reads the flow run for its labels, then inserts). A write by another
# connection in between fails the insert at once with "database is locked" — SQLite does not
# wait (busy_timeout) once a transaction holds a read snapshot — which the server answers 503,
# and Prefect's client retries after 2**1 s ± jitter. The other writers are the server's
# background services; Prefect's task-run recorder writes every client event on arrival
# (batch size 1), so the burst of events from the tasks a flow has just run is being written
# exactly when the flow makes its next API call (the launch-fleet subflow's creation: ~2 s in
# about half of the benchmark's Prefect runs).
SERVER_ONLY_ENV = {
    # Task-run states from client events, written in one transaction a second rather than one
    # per event: the UI's task runs lag by up to 1 s.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    # Events (the UI's event feed) every 5 s (Prefect's interval), not also every 20 events.
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000",
    # Services for deployments and workers, which a managed server never has: `nemo-gen deploy`
    # refuses to run without an external API. Each wakes every 5-60 s to query and update runs.
    "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_LATE_RUNS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_FOREMAN_ENABLED": "false",
}


@contextlib.contextmanager
def prefect_api(settings: NemoGenSettings) -> Iterator[PrefectApi]:
    """Yield the API to use, with ``PREFECT_API_URL`` exported for this process and its children."""
    url = settings.prefect.api_url or os.environ.get("PREFECT_API_URL")
    if url:
        auth = check_client_auth(url)
        with _exported({"PREFECT_API_URL": url, **({CLIENT_AUTH_ENV: auth} if auth else {})}):
            yield PrefectApi(url=url, managed=False)
        return
    auth = managed_auth()
    home = settings.home / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    host = settings.prefect.host
    port = settings.prefect.port or _free_port(host)
    url = f"http://{host}:{port}/api"
    log_file = home / "server.log"
    if auth is None and not is_loopback(host):
        log.warning("the managed Prefect server binds %s, not a loopback address, and %s is unset: anyone who "
                    "reaches it can read and change this command's runs; set %s (or bind prefect.host to "
                    "127.0.0.1)", host, SERVER_AUTH_ENV, SERVER_AUTH_ENV)
    env = {**os.environ, **server_env(home), **SERVER_ONLY_ENV}
    # Set explicitly (or not at all): the server runs with its own PREFECT_HOME, so a profile's
    # string would not reach it; an empty one would make it refuse every client.
    env.pop(SERVER_AUTH_ENV, None)
    if auth:
        env[SERVER_AUTH_ENV] = auth
    # `prefect server start`, with the fix for Prefect 3.7's SQLite automations deadlock
    cmd = [sys.executable, "-m", "nemo_gen.prefect_server", "server", "start", "--host", host, "--port", str(port),
           "--analytics-off"]
    with open(log_file, "ab") as out:
        # Own process group: the server's children go with it, and Ctrl-C in the terminal
        # reaches us first so we stop it in order.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_dies_with(os.getpid()))
    try:
        _wait_healthy(url, proc, settings.prefect.server_start_timeout_s, log_file)  # /health needs no auth
        with _exported({**server_env(home, url), **({CLIENT_AUTH_ENV: auth} if auth else {})}):
            try:
                yield PrefectApi(url=url, managed=True, home=home, log_file=log_file)
            finally:
                _flush_logs()
    finally:
        _stop(proc)


def _auth_setting(env_name: str, secret: Any) -> str | None:
    """A Prefect auth string as a child process would read it: the environment first (set empty:
    none), else Prefect's settings of this process (a profile, ``prefect.toml``)."""
    value = os.environ.get(env_name)
    if value is None and secret is not None:
        value = secret.get_secret_value()
    return value or None


def managed_auth() -> str | None:
    """The auth string of the managed server and its clients: ``PREFECT_SERVER_API_AUTH_STRING``
    or ``PREFECT_API_AUTH_STRING``, whichever is set (None: the server asks for none). Both set
    and different: ConfigError, as the server would refuse its own clients."""
    from prefect.settings import get_current_settings

    current = get_current_settings()
    server = _auth_setting(SERVER_AUTH_ENV, current.server.api.auth_string)
    client = _auth_setting(CLIENT_AUTH_ENV, current.api.auth_string)
    if server and client and server != client:
        raise ConfigError(f"{SERVER_AUTH_ENV} and {CLIENT_AUTH_ENV} differ: the managed Prefect server would "
                          "refuse nemo-gen's own client; set one of them, or both to the same string",
                          field=CLIENT_AUTH_ENV)
    return server or client


def check_client_auth(url: str, timeout_s: float = 5.0) -> str | None:
    """This process's auth string for the self-hosted API at ``url`` (None: it has none), or
    ConfigError naming ``PREFECT_API_AUTH_STRING`` when the API refuses it (401), before any run
    starts. Anything else (unreachable, Prefect Cloud, which authenticates by ``PREFECT_API_KEY``)
    is left to Prefect's client to report."""
    from prefect.settings import get_current_settings

    current = get_current_settings()
    auth = _auth_setting(CLIENT_AUTH_ENV, current.api.auth_string)
    if _auth_setting("PREFECT_API_KEY", current.api.key):
        return auth
    request = urllib.request.Request(f"{url.rstrip('/')}/admin/version")
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=timeout_s):
            return auth
    except urllib.error.HTTPError as exc:
        if exc.code != 401:
            return auth
    except (OSError, ValueError):
        return auth
    raise ConfigError(
        f"the Prefect API at {url} refused this client (401 Unauthorized): "
        + (f"{CLIENT_AUTH_ENV} is not the server's {SERVER_AUTH_ENV}" if auth else
           f"the server requires {SERVER_AUTH_ENV}; set {CLIENT_AUTH_ENV} to the same string"),
        field=CLIENT_AUTH_ENV)


def _dies_with(parent: int):
    """For the server's process, before it runs: SIGTERM it when ``parent`` (this command) dies,
    of SIGKILL too, so a killed command does not leave its server running (Linux
    ``PR_SET_PDEATHSIG``; elsewhere only a command that exits stops it)."""
    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # died before the line above: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log_file: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfraError(f"the Prefect server exited with code {proc.returncode}; see {log_file}")
        if _healthy(url):
            return
        time.sleep(0.3)
    raise InfraError(f"the Prefect server at {url} was not healthy within {timeout_s:g}s; see {log_file}")


def _flush_logs() -> None:
    """Send buffered run logs while the server is still there to take them."""
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def _exported(values: dict[str, str]) -> Iterator[None]:
    """Set env vars for the duration, and Prefect's in-process settings with them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        updates: dict[Any, Any] = {PREFECT_API_URL: values.get("PREFECT_API_URL", os.environ.get("PREFECT_API_URL"))}
        if CLIENT_AUTH_ENV in values:  # this process's client reads its settings, not the environment
            updates[PREFECT_API_AUTH_STRING] = values[CLIENT_AUTH_ENV]
        with temporary_settings(updates=updates):
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
