"""SIGINT / SIGTERM for a command that starts things (Ray, engines, a Prefect server).

The first signal raises ``Interrupted`` (a ``KeyboardInterrupt``) in the main thread, so every
``finally`` on the way out runs: the fleet is shut down and its engine processes waited for, a
private Ray cluster stopped, a managed Prefect server stopped. From then on logging is off —
Prefect's crash report, Ray's and vLLM's shutdown chatter — so the command's one line saying
it was interrupted is all that is printed; the exit code is 128 + the signal (130, 143). A
second signal exits at once, leaving whatever is still running.

Prefect, while a flow runs in this process, swaps SIGTERM for its own handler (it raises
``TerminationSignal``, logs each running task as crashed, then re-sends the signal to the
handler it replaced — ours). A filter on Prefect's run loggers recognises that exception in
flight, and turns logging off before the first crash report is printed.

Ray would otherwise take SIGTERM over: ``ray.init`` installs its own Python handler
(``sys.exit``) and its C++ core worker a failure-signal handler that prints a stack dump
(``*** SIGTERM received at time=... PC: @ ...``). ``SignalGuard.before_ray`` turns both off in
this process only (what the driver reads: Ray's constant ``RAY_DISABLE_FAILURE_SIGNAL_HANDLER``
and its ``set_sigterm_handler``); call it once the settings are valid and before Ray starts
(a command refused for bad settings never imports Ray). The processes Ray starts keep their
own handlers.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Callable

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the first SIGINT or SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    def __init__(self) -> None:
        self.received: int | None = None
        self._raised = False
        self._previous: dict[int, object] = {}
        self._notes: list[Callable[[], str]] = []
        self._filter = _PrefectTermination(self)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        for name in _PREFECT_RUN_LOGGERS:
            logging.getLogger(name).addFilter(self._filter)

    def before_ray(self) -> None:
        """Keep Ray's driver from replacing these handlers (call before Ray starts)."""
        if self._previous:
            _keep_ray_off_signals()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        for name in _PREFECT_RUN_LOGGERS:
            logging.getLogger(name).removeFilter(self._filter)
        if self.received is not None:
            logging.disable(logging.NOTSET)

    def on_report(self, note: Callable[[], str]) -> None:
        """Add to the interruption's line (called when it is printed, e.g. lines kept so far)."""
        self._notes.append(note)

    def _handle(self, signum: int, frame) -> None:
        if self._raised:
            # A second signal: stop waiting for the clean-up, die of the signal itself.
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._raised = True
        self.received = self.received or signum
        logging.disable(logging.CRITICAL)
        raise Interrupted(signum)

    def termination_seen(self) -> None:
        """Prefect's SIGTERM bridge is unwinding the flow (our handler runs when it is done)."""
        if self.received is None:
            self.received = signal.SIGTERM
            logging.disable(logging.CRITICAL)

    def report(self) -> int:
        """Print the one line and return the exit code."""
        signum = self.received or signal.SIGINT
        notes = []
        for note in self._notes:
            try:
                text = note()
            except Exception:  # the note is a courtesy; the line is printed regardless
                text = ""
            if text:
                notes.append(text)
        extra = "; " + "; ".join(notes) if notes else ""
        print(f"nemo-gen: interrupted by {signal.Signals(signum).name}; stopped what this command "
              f"started{extra}", file=sys.stderr, flush=True)
        return 128 + signum


# The loggers of Prefect's flow and task run loggers (``get_run_logger``): crash reports.
_PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _PrefectTermination(logging.Filter):
    def __init__(self, guard: SignalGuard):
        super().__init__()
        self._guard = guard

    def filter(self, record: logging.LogRecord) -> bool:
        exc = sys.exc_info()[1]
        if exc is not None and type(exc).__name__ == "TerminationSignal" and type(exc).__module__.startswith("prefect"):
            self._guard.termination_seen()
            return False
        return True


def _keep_ray_off_signals() -> None:
    """Ray's driver-side signal handling off, in this process (see the module docstring)."""
    try:
        import ray._private.ray_constants as ray_constants
        import ray._private.utils as ray_utils
    except ImportError:  # pragma: no cover - Ray not installed: nothing to keep off
        return
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    ray_utils.set_sigterm_handler = lambda handler: None
