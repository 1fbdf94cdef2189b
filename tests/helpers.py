"""Small helpers for tests: processes by PID, polling, the examples' Python files."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from nemo_gen.host.processes import alive as running


def alive(pids) -> list[int]:
    """The PIDs still running (a zombie has exited: it holds no memory)."""
    return [pid for pid in pids if running(pid)]


def wait_gone(pids, timeout_s: float = 30.0) -> list[int]:
    """PIDs still alive after polling up to ``timeout_s`` (empty when all exited)."""
    deadline = time.monotonic() + timeout_s
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(left)
    return left


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.1):
    """``predicate()``'s first truthy value, polled until ``timeout_s``; AssertionError naming
    ``what`` when it never comes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def shutdown_all(fleets) -> None:
    """Shut the fleets down side by side: most of a clean stop is waiting for the engine's
    processes to exit (~4-5 s a fleet here), not work."""
    from concurrent.futures import ThreadPoolExecutor

    fleets = list(fleets)
    with ThreadPoolExecutor(max(1, len(fleets))) as pool:
        list(pool.map(lambda f: f.shutdown(), fleets))


def marked(marker: str) -> list[int]:
    """PIDs of processes whose environment carries ``NEMO_GEN_TEST_MARKER=marker`` (everything a
    command under test started)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("NEMO_GEN_TEST_MARKER") == marker:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def load_example(name: str):
    """``examples/<name>.py`` as a module (examples/ is no package: users copy from it)."""
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up while the class is made)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def served_fake_fleet(settings):
    """A fake-tier fleet (tests/fakes.py) behind the real HTTP server: yields (fleet, handle)."""
    from nemo_gen.server import start_server
    from tests.fakes import FakeDriver, fake_fleet

    driver = FakeDriver()
    fleet = fake_fleet(settings, driver)
    handle = start_server(fleet)
    try:
        yield fleet, handle
    finally:
        handle.stop()
        fleet.shutdown()
        driver.close()
