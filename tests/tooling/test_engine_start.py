"""``nemo_gen.shard.engine_start`` with real processes: a forkserver started the way a shard
actor starts it, and children started through its context. The server preloads a light module
here, where the shard's would preload vLLM, so each test takes well under a second. The patch of
vLLM's EngineCore start is tested on a stand-in module. With the real vLLM it is tested in
tests/engine/test_fleet_variants.py, where an EngineCore starts through it."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import psutil
import pytest

from nemo_gen.shard import engine_start
from nemo_gen.host import processes


def _child_report(path: str) -> None:
    """Target run in the forkserver's child: what it sees."""
    import setproctitle
    import torch

    setproctitle.setproctitle("VLLM::EngineCore")  # what vLLM names it, once the environment is applied
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "late": os.environ.get("NEMO_GEN_LATE"),
                   "gone": os.environ.get("NEMO_GEN_GONE"), "omp": os.environ.get("OMP_NUM_THREADS"),
                   "threads": torch.get_num_threads(), "preloaded": "json" in sys.modules, "name": name}, f)


# The driver of each test runs in a fresh interpreter: a forkserver belongs to the process that
# started it, and this one (pytest, xdist) must not be left with one.
_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    import torch  # the server imports it too, as the shard's imports vLLM with torch
    from nemo_gen.shard import engine_start
    from tests.tooling.test_engine_start import _child_report

    os.environ["NEMO_GEN_GONE"] = "set when the server started"
    pid = engine_start.start_server(preload=["json", "torch"])
    os.environ["NEMO_GEN_LATE"] = "set after the server started"
    del os.environ["NEMO_GEN_GONE"]
    os.environ["OMP_NUM_THREADS"] = "1"  # what vLLM sets around the EngineCore's start
    proc = engine_start.CONTEXT.Process(target=_child_report, args=(sys.argv[1],))
    proc.start()
    proc.join(60)
    report = json.load(open(sys.argv[1]))
    report.update(server=pid, exitcode=proc.exitcode, helpers=sorted(engine_start.helper_pids()),
                  running=engine_start.server_pid())
    engine_start.stop_server()
    report["after_stop"] = engine_start.server_pid()
    report["server_alive_after_stop"] = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
    print(json.dumps(report))
""")


def _run_driver(tmp_path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("NEMO_GEN_LATE", None)
    out = subprocess.run([sys.executable, "-c", _DRIVER, str(tmp_path / "child.json")], capture_output=True,
                         text=True, timeout=120, env=env, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_child_is_forked_by_the_server_with_the_environment_of_its_start(tmp_path):
    report = _run_driver(tmp_path)
    assert report["exitcode"] == 0
    assert report["ppid"] == report["server"]  # forked by the server, not by the process that asked
    assert report["preloaded"]
    assert report["name"] == "VLLM::EngineCor"  # named as vLLM names it (the kernel keeps 15 characters)
    assert report["late"] == "set after the server started"
    assert report["gone"] is None  # removed after the server started: removed in the child too
    # torch was imported by the server with 2 threads; the child runs with what start() had
    assert report["omp"] == "1" and report["threads"] == 1
    assert report["running"] == report["server"] and report["server"] in report["helpers"]
    assert report["after_stop"] is None and not report["server_alive_after_stop"]


_ORPHANING = textwrap.dedent("""
    import sys, time
    from nemo_gen.shard import engine_start
    engine_start.start_server(preload=[])
    proc = engine_start.CONTEXT.Process(target=time.sleep, args=(30,))
    proc.start()
    time.sleep(1)  # the child has set itself up
    open(sys.argv[1], "w").write(str(proc.pid))
    if sys.argv[2] == "stop":
        engine_start.stop_server()
    else:  # this process, the shard actor's stand-in, is SIGKILLed: nothing of its own runs after
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("how", ["stop", "killed"])
@pytest.mark.parametrize("cleanup", ["1", "0"])
def test_the_servers_children_go_with_it_unless_the_operator_keeps_them(tmp_path, how, cleanup):
    """A forked EngineCore is not the actor's child, so Ray does not end it with the actor: it
    dies with the server, which leaves with the actor (or is stopped). With Ray's process-group
    cleanup off (RAY_process_group_cleanup_enabled=0) an operator keeps a dead shard's processes,
    and a spawned EngineCore would stay: so does this one."""
    # Output to a file, not a pipe: the child keeps what it inherits, and a pipe would hold this
    # call until the child exits.
    env = {**os.environ, "RAY_process_group_cleanup_enabled": cleanup}
    with open(tmp_path / "stderr", "w") as err:
        out = subprocess.run([sys.executable, "-c", _ORPHANING, str(tmp_path / "pid"), how], stdin=subprocess.DEVNULL,
                             stdout=err, stderr=err, timeout=180, env=env)  # seconds alone; minutes at load 10+
    assert out.returncode == (0 if how == "stop" else -9), (tmp_path / "stderr").read_text()[-3000:]
    pid = int((tmp_path / "pid").read_text())
    try:
        if cleanup == "0":
            time.sleep(2)  # what would end it has happened by now
            assert processes.alive(pid)
        else:  # it goes; on a loaded machine its exit can take seconds, so poll to a deadline
            deadline = time.monotonic() + 20
            while processes.alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not processes.alive(pid)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(pid).kill()  # started by this test: stopped here by PID


def test_apply_environ_replaces_the_environment(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_KEEP", "old")
    monkeypatch.setenv("NEMO_GEN_DROP", "x")
    saved = dict(os.environ)
    try:
        engine_start.apply_environ({**{k: v for k, v in saved.items() if k != "NEMO_GEN_DROP"}, "NEMO_GEN_KEEP": "new"})
        assert os.environ["NEMO_GEN_KEEP"] == "new" and "NEMO_GEN_DROP" not in os.environ
    finally:
        engine_start.apply_environ(saved)


class _StandIn:
    """vLLM's ``vllm.v1.engine.utils`` as far as the patch touches it."""

    def __init__(self):
        self.calls = 0
        self.get_mp_context = self._vllm

    def _vllm(self):
        self.calls += 1
        os.environ[engine_start.WORKER_METHOD] = "spawn"  # what vLLM sets inside a Ray actor
        return "vllm's spawn context"


@pytest.fixture
def running(monkeypatch):
    monkeypatch.setattr(engine_start, "server_pid", lambda: 4242)


def test_the_context_patches_vllms_start_only_inside_it(running):
    module = _StandIn()
    original = module.get_mp_context
    with engine_start.engine_core_context("forkserver", {}, module=module, cpu=False) as used:
        assert used == "forkserver"
        assert module.get_mp_context() is engine_start.CONTEXT
        assert module.calls == 1  # vLLM's own still ran, for its environment
    assert module.get_mp_context == original
    with pytest.raises(RuntimeError), engine_start.engine_core_context("forkserver", {}, module=module, cpu=False):
        raise RuntimeError("the engine failed to start")
    assert module.get_mp_context == original


@pytest.mark.parametrize("cpu, inside", [(True, "fork"), (False, "spawn")])
def test_a_forked_cpu_engine_core_forks_its_worker_and_the_actor_keeps_vllms_choice(running, monkeypatch, cpu, inside):
    """The EngineCore's environment is the actor's at its start: a CPU engine's says fork, for the
    worker vLLM's CPU backend starts; a GPU engine's keeps what vLLM chose; after the start the
    actor's own environment is as vLLM left it."""
    monkeypatch.delenv(engine_start.WORKER_METHOD, raising=False)
    module = _StandIn()
    with engine_start.engine_core_context("forkserver", {}, module=module, cpu=cpu):
        assert module.get_mp_context() is engine_start.CONTEXT
        assert os.environ[engine_start.WORKER_METHOD] == inside
    assert os.environ[engine_start.WORKER_METHOD] == "spawn"


@pytest.mark.parametrize("method, kwargs, server, why", [
    ("spawn", {}, 4242, None),
    ("forkserver", {"numa_bind": True}, 4242, "numa_bind is set"),
    ("forkserver", {}, None, "forkserver is not running"),
])
def test_spawn_is_used_when_asked_for_numa_binding_or_without_a_server(monkeypatch, caplog, method, kwargs, server, why):
    monkeypatch.setattr(engine_start, "server_pid", lambda: server)
    module = _StandIn()
    original = module.get_mp_context
    with engine_start.engine_core_context(method, kwargs, module=module, cpu=True) as used:
        assert used == "spawn" and module.get_mp_context == original
    if why:
        assert why in caplog.text
    else:
        assert caplog.text == ""


def test_an_unknown_method_is_refused_by_its_setting_name():
    with pytest.raises(ValueError, match="fleet.engine_core_start"):
        with engine_start.engine_core_context("fork", {}, module=types.SimpleNamespace()):
            pass
