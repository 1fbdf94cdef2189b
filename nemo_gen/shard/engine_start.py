"""How a shard actor starts its vLLM EngineCore process (``fleet.engine_core_start``).

vLLM starts the EngineCore with ``spawn`` whenever it runs inside a Ray actor, because forking a
process with Ray's threads is unsafe (``vllm.utils.system_utils._maybe_force_spawn``). A spawned
child is a fresh interpreter, so it imports vLLM and torch a second time, a large share of every
launch, paid again by every restart (bench/results/2026-12-03/h200.md, ``python -m bench engine_start``).
A bare ``vllm.LLM`` forks instead, and its child starts with everything imported.

``forkserver`` (the default) gets the shard the same start. The actor starts a multiprocessing
forkserver first thing: a fresh, single-threaded interpreter. While the actor imports vLLM for
itself, the server imports the EngineCore's modules (``nemo_gen.shard.engine_preload``). When
vLLM starts the EngineCore, the server forks it, already imported. Nothing is forked from the
actor.

The server's children would miss what vLLM sets around ``Process.start()``, and this module
supplies it:
- vLLM's own ``get_mp_context()`` still runs first, for its side effects on the environment (the
  Ray address, ``VLLM_WORKER_MULTIPROC_METHOD`` for the EngineCore's own workers);
- the environment at ``start()``, which vLLM changes around that call
  (``OMP_NUM_THREADS`` for a uniprocess GPU engine), is carried to the child and set before
  the EngineCore runs. torch's thread count is set to match, since a spawned child would have
  read it at import;
- NUMA binding (``numa_bind``) wraps the executable of a spawned child, which a fork cannot do:
  such engines are started with ``spawn``;
- a CPU engine's worker: vLLM's CPU backend runs the model in a worker process of the
  EngineCore's (its multiprocessing executor, for OMP's thread binding), and the spawn vLLM chose
  in the actor would make it a third fresh interpreter importing vLLM and torch (most of a CPU
  engine's start after the EngineCore's). The EngineCore forked here is no Ray actor, has no CUDA
  and starts few threads before its executor, which is where a bare ``vllm.LLM`` on CPU forks its
  worker, so its worker is forked too (``VLLM_WORKER_MULTIPROC_METHOD=fork`` in its environment);
  a GPU engine's workers keep vLLM's choice;
- fate: Ray ends a dead worker's own children, and the EngineCore is the server's, not the
  actor's. It dies with the server, which leaves with the actor (``share_the_shards_fate``).

Owns: this process's forkserver (``start_server``, ``stop_server``, ``helper_pids``) and the
patch of vLLM's EngineCore start, which is in place only inside ``engine_core_context``. No
Ray or vLLM import at module level: the child imports this module to unpickle its process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from multiprocessing import context as mp_context
from multiprocessing import forkserver, resource_tracker
from typing import Any, Iterator

from nemo_gen.core.engine_args import REAPING_FLAG
from nemo_gen.host import processes

log = logging.getLogger(__name__)

METHODS = ("forkserver", "spawn")
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
PRELOAD = "nemo_gen.shard.engine_preload"
WORKER_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"  # how vLLM's multiprocessing executor starts workers


class EngineCoreProcess(mp_context.ForkServerProcess):
    """A forkserver child that runs with the environment of the moment ``start()`` was called,
    as a spawned child would have, and that goes when the shard goes (``share_the_shards_fate``)."""

    def start(self) -> None:
        self._start_environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        apply_environ(self._start_environ)
        share_the_shards_fate()
        super().run()


def share_the_shards_fate() -> None:
    """In the server's child: die with the server, which dies with the shard actor.

    A spawned EngineCore is the actor's own child, and Ray ends a dead worker's children with it
    (a nemo-gen command SIGKILLed with its engines up left nothing running). This one is the
    server's child, so Ray never sees it: it outlived its actor, with its GPU memory. So it drops
    its copy of the server's "alive" pipe, and the server leaves when the actor's end closes. It
    then asks to be SIGKILLed when its parent, the server, is gone. Not when the operator keeps a
    dead shard's processes for debugging (``RAY_process_group_cleanup_enabled=0``): those stay,
    as a spawned EngineCore would, and the fleet reports them as orphans."""
    alive_fd, _SERVER._forkserver_alive_fd = _SERVER._forkserver_alive_fd, None
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
    if os.environ.get(REAPING_FLAG) == "0" or not sys.platform.startswith("linux"):
        return
    server = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:  # the server left before the request was in place
        os.kill(os.getpid(), signal.SIGKILL)


class EngineCoreContext(mp_context.ForkServerContext):
    Process = EngineCoreProcess


CONTEXT = EngineCoreContext()


def apply_environ(environ: dict[str, str]) -> None:
    """Make ``os.environ`` equal ``environ``, changing only what differs. Where
    ``OMP_NUM_THREADS`` differs from what torch was imported with, torch's thread count follows.

    vLLM names its processes with setproctitle (``VLLM::EngineCore``, what ``ps`` and operators
    see). setproctitle finds the memory it may rewrite from where the environment was at the
    process's start, and silently gives up once the environment has been rebuilt: it is set up
    before anything changes, and only what differs is changed."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()  # sets it up while the environment is still in place
    threads = environ.get("OMP_NUM_THREADS")
    changed = threads != os.environ.get("OMP_NUM_THREADS")
    for key in [k for k in os.environ if k not in environ]:
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    if changed and threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


# multiprocessing's own forkserver and resource tracker of this process: the forkserver Popen
# connects to that one server, so it is the one started here. Their PIDs and the server's stop
# have no public form (nor a type in typeshed).
_SERVER: Any = forkserver._forkserver
_TRACKER: Any = resource_tracker._resource_tracker


def start_server(preload: list[str] | None = None) -> int:
    """Start this process's forkserver, which imports ``preload`` (default: the EngineCore's
    modules) at once; this returns without waiting for it. Returns its PID."""
    forkserver.set_forkserver_preload([PRELOAD] if preload is None else preload)
    forkserver.ensure_running()
    pid: int = _SERVER._forkserver_pid
    return pid


def server_pid() -> int | None:
    """The forkserver's PID while it runs, else None. (It is not reaped here: multiprocessing
    reaps it, and would fail on a PID reaped behind its back.)"""
    pid: int | None = _SERVER._forkserver_pid
    if pid is None or not processes.alive(pid):
        return None
    return pid


def helper_pids() -> set[int]:
    """This process's children that are not an engine's: the forkserver and multiprocessing's
    resource tracker. Neither's exit is the engine's, and neither holds what an engine holds."""
    return {p for p in (_SERVER._forkserver_pid, _TRACKER._pid) if p is not None}


def stop_server() -> None:
    """Stop the forkserver, if one was started: after the engine has stopped, since the
    EngineCore it forked dies with it (``share_the_shards_fate``). The server is killed rather
    than asked: one still importing its preload would not look at its pipe until the import is
    done, and it has nothing to finish."""
    pid = _SERVER._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _SERVER._stop()  # closes its pipe and reaps it


@contextlib.contextmanager
def engine_core_context(method: str, engine_kwargs: dict[str, Any], module: Any = None,
                        cpu: bool | None = None) -> Iterator[str]:
    """While an engine starts inside it, vLLM starts the EngineCore with ``method``. Yields the
    method that is used: ``spawn`` when asked, when the engine binds NUMA nodes, or when this
    process has no forkserver running. A forked EngineCore of a CPU engine (``cpu``; default: vLLM's
    platform says so) forks its worker too (the module doc says why). ``module``: where vLLM's
    ``get_mp_context`` is looked up (default: ``vllm.v1.engine.utils``, whose
    ``CoreEngineProcManager`` starts the EngineCore)."""
    if method not in METHODS:
        raise ValueError(f"fleet.engine_core_start must be one of {METHODS}, not {method!r}")
    if method == "spawn" or engine_kwargs.get("numa_bind") or server_pid() is None:
        if method != "spawn":
            log.warning("the EngineCore starts with spawn: %s", "numa_bind is set" if engine_kwargs.get("numa_bind")
                        else "this shard's forkserver is not running")
        yield "spawn"
        return
    if module is None:
        module = importlib.import_module("vllm.v1.engine.utils")
    if cpu is None:
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
    engine_utils = module
    vllm_context = engine_utils.get_mp_context
    vllms_choice: list[str | None] = []

    def get_mp_context() -> multiprocessing.context.BaseContext:
        vllm_context()  # its environment: the Ray address, the workers' start method
        if cpu:  # the EngineCore's environment is this one at its start (EngineCoreProcess)
            vllms_choice.append(os.environ.get(WORKER_METHOD))
            os.environ[WORKER_METHOD] = "fork"
        return CONTEXT

    engine_utils.get_mp_context = get_mp_context
    try:
        yield "forkserver"
    finally:
        engine_utils.get_mp_context = vllm_context
        if vllms_choice:  # the actor's own environment as vLLM left it
            _set_env(WORKER_METHOD, vllms_choice[0])


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value
