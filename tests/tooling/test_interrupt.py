"""nemo_gen.interrupt, in a child interpreter each: the first SIGTERM / SIGINT becomes one
KeyboardInterrupt (finally blocks run), one line and 128 + signal; a second signal ends the
process at once; Prefect's crash report for a SIGTERM it bridged is not printed.
(tests/e2e/test_interrupt_resume.py does this to a real `nemo-gen generate`.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

_CHILD = textwrap.dedent("""
    import logging, os, signal, sys, time
    from nemo_gen.interrupt import SignalGuard
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    guard = SignalGuard()
    guard.install()
    guard.on_report(lambda: "12 of 40 lines kept")
    mode = sys.argv[1]
    try:
        try:
            if mode == "prefect":
                class TerminationSignal(BaseException):  # what Prefect raises from its SIGTERM bridge
                    pass
                TerminationSignal.__module__ = "prefect.exceptions"
                try:
                    raise TerminationSignal()
                except TerminationSignal:
                    logging.getLogger("prefect.task_runs").error("Crash detected! aborted by a termination signal")
                logging.getLogger("prefect.flow_runs").error("Finished in state Crashed")
            os.kill(os.getpid(), getattr(signal, sys.argv[2]))
            time.sleep(10)
        finally:
            print("cleanup ran", file=sys.stderr, flush=True)
            if mode == "second":
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)
                print("not reached", file=sys.stderr)
    except KeyboardInterrupt:
        sys.exit(guard.report())
""")


def _child(mode: str, sig: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CHILD, mode, sig], capture_output=True, text=True, timeout=60)


def test_sigterm_is_one_line_and_143():
    out = _child("plain", "SIGTERM")
    assert out.returncode == 143, out.stderr
    assert out.stderr.splitlines() == [
        "cleanup ran",
        "nemo-gen: interrupted by SIGTERM; stopped what this command started; 12 of 40 lines kept",
    ]


def test_sigint_is_one_line_and_130():
    out = _child("plain", "SIGINT")
    assert out.returncode == 130, out.stderr
    assert out.stderr.splitlines()[-1].startswith("nemo-gen: interrupted by SIGINT")


def test_a_second_signal_ends_the_process_at_once():
    out = _child("second", "SIGINT")
    assert out.returncode == -signal.SIGTERM  # died of the second signal, clean-up abandoned
    assert "cleanup ran" in out.stderr and "not reached" not in out.stderr and "interrupted" not in out.stderr


def test_prefects_crash_report_for_a_bridged_sigterm_is_not_printed():
    out = _child("prefect", "SIGTERM")
    assert out.returncode == 143, out.stderr
    assert "Crash detected" not in out.stderr and "Finished in state" not in out.stderr
    assert out.stderr.splitlines()[-1].startswith("nemo-gen: interrupted by SIGTERM")
