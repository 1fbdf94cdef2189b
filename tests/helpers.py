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


class SharedFleet:
    """One fleet a module's tests share without depending on their order (an engine start costs
    ~30 s, so each test cannot have its own). ``get()`` hands it to a test after ``check(fleet)``
    has passed on entry: the state every test of the module may assume (slots HEALTHY at the
    fleet's version, the original weights...), so a test that leaked state fails there, naming
    it, not later with a puzzling answer. A test that leaves the fleet unfit for the next (recovery
    switched off and every slot killed, a restart budget spent) calls ``spend()`` first: the next
    test to ask gets a fresh launch. In file order the spenders come last and nothing relaunches."""

    def __init__(self, launch, check=None, first=None):
        """``first``: a fleet already launched (beside others, in parallel) to hand out first."""
        self._launch, self._check = launch, check
        self._fleet, self._spent = first, False

    def get(self):
        if self._spent:
            self.close()
        if self._fleet is None:
            self._fleet, self._spent = self._launch(), False
        if self._check is not None:
            self._check(self._fleet)
        return self._fleet

    def take(self):
        """The fleet as it is, spent or not, unchecked (a fresh one only when there is none): for a
        test whose subject is ending it, which any running fleet serves."""
        return self._fleet if self._fleet is not None else self.get()

    def spend(self) -> None:
        """The caller's test may break the fleet for good: no later test is handed it."""
        self._spent = True

    def close(self) -> None:
        fleet, self._fleet = self._fleet, None
        if fleet is not None:
            fleet.shutdown()
