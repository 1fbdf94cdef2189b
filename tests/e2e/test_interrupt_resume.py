"""Nothing done is lost on interruption: `nemo-gen generate` killed mid-generation (SIGTERM on the
Prefect path, Ctrl-C to its process group on the plain path) prints one line, exits 143 / 130,
leaves nothing running and keeps every line it finished; SIGKILL of the nemo-gen process (no
handler runs) keeps every line that was written before it and leaves nothing running either
(Ray and the engines die with it, the managed Prefect server by its parent-death signal);
`--resume` generates only the rest, and the final output holds every input line exactly once,
in input order. The runs use examples/eval.yaml, as the README does, on the default engine
(AsyncLLM: each line is its own request and is written when it finishes)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import wait_gone
from tests.helpers import marked as _marked  # every process the command started

pytestmark = pytest.mark.e2e

N = 400
EVAL = Path(__file__).resolve().parents[2] / "examples" / "eval.yaml"




def _rows(source: Path | bytes) -> list[dict]:
    """The rows of the output file, or of a snapshot of its bytes."""
    text = source.decode() if isinstance(source, bytes) else source.read_text()
    rows = []
    for raw in text.split("\n"):  # not splitlines: JSON strings may hold U+2028, U+0085
        if not raw.strip():
            continue
        try:
            rows.append(json.loads(raw))
        except json.JSONDecodeError:
            pass  # a line cut short by the kill
    return rows


def _ok_lines(source: Path | bytes) -> dict[int, dict]:
    if isinstance(source, Path) and not source.exists():
        return {}
    return {r["line"]: r for r in _rows(source) if r.get("error") is None}


def _snapshot(path: Path) -> bytes:
    """The output file's bytes now: cheap, so a signal can follow at once (parsing the rows takes
    far longer, and far longer still in a test process starved by a loaded machine)."""
    return path.read_bytes() if path.exists() else b""


def _finished(snapshot: bytes) -> int:
    """Whole rows in a snapshot (the last row may be cut short by a kill; error rows count too:
    a poll's estimate, the parsed rows are the figure)."""
    return snapshot.count(b"\n")


def _error_rows(path: Path) -> str:
    """The rows written with an error (a line that failed and was retried later is not counted by
    ``_ok_lines`` until its retry lands): how many, and the first one's error."""
    errors = [r for r in _rows(path) if r.get("error") is not None] if path.exists() else []
    return f"{len(errors)} rows with an error" + (f", the first: {errors[0]['error']!r:.300}" if errors else "")


class _Run:
    def __init__(self, tmp: Path, tiny: Path, extra: list[str], batch_size: int = 2, max_new_tokens: int = 160):
        # Two lines in flight, 160 tokens each: a signal sent after a few lines lands mid-run, with
        # the rest ~2 minutes of work. At 16 tokens a clean clone's CI once saw the poll below
        # miss the whole run (all 400 lines were in before it looked again); at 64 (~50 s for the
        # whole run) it twice saw 400 of 400 lines reported after a signal sent when the poll had
        # seen fewer (2026-12-03, the other CI worker busy): ``interrupt`` now says how many were
        # on disk when the signal went.
        self.marker = uuid.uuid4().hex
        self.err = tmp / f"err-{self.marker[:6]}.txt"
        env = {**os.environ, "NEMO_GEN_TEST_MARKER": self.marker}
        env.pop("PREFECT_API_URL", None)  # the CLI manages its own server
        cmd = [sys.executable, "-m", "nemo_gen.cli", "generate", "--input", str(tmp / "prompts.jsonl"),
               "--output", str(tmp / "samples.jsonl"), "--json", "--config", str(EVAL),
               "--set", f"home={tmp / 'home'}", "--set", f"model.path={tiny}", "--set", "fleet.num_shards=1",
               "--set", "fleet.name=interrupt-test", "--set", f"run.batch_size={batch_size}",
               "--set", f"generation.max_new_tokens={max_new_tokens}", "--set", "generation.vllm_cfg.max_model_len=256", *extra]
        with open(self.err, "w") as err:
            # A session of its own: a Ctrl-C to "its terminal" is a SIGINT to this process group.
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                         cwd=tmp, start_new_session=True)
        self.started = time.monotonic()
        self.signalled = self.exited = None
        # What the polls saw and when ("seconds since start: lines"), each change and each poll
        # that came late: a failure then tells a poll held up by a loaded machine from a file
        # that jumped (the last ones only: a message, not a log).
        self.polls: list[str] = []
        self._last_seen: int | None = None

    def _seen(self, n: int, late: bool) -> None:
        if late or n != self._last_seen:
            entry = f"{time.monotonic() - self.started:.1f}s:{n}" + (" (late)" if late else "")
            self.polls = (self.polls + [entry])[-15:]
        self._last_seen = n

    def timeline(self) -> str:
        after = "" if self.signalled is None or self.exited is None else \
            f"; it exited {self.exited - self.signalled:.1f}s after the signal"
        return f"polls (seconds since start: lines) {', '.join(self.polls)}{after}"

    def wait_for_lines(self, path: Path, at_least: int, timeout: float = 420) -> int:
        """Wait until ``path`` holds ``at_least`` finished lines while the run is still generating.
        A run that finished every line before this poll saw it cannot be interrupted mid-run: the
        signal would land in its shutdown (exit 130, "N of N lines are in") and prove nothing."""
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited early ({self.proc.returncode}): {self.err.read_text()[-2000:]}"
            n = _finished(_snapshot(path))
            self._seen(n, late=time.monotonic() - last > 1.0)
            if n >= at_least:
                assert n < N, (f"the run had generated all {N} lines before the poll saw {at_least} (its last "
                               f"poll {time.monotonic() - last:.1f}s earlier): the signal cannot land mid-run; "
                               f"{self.timeline()}; {_error_rows(path)}")
                return n
            last = time.monotonic()
            time.sleep(0.2)
        raise AssertionError(f"fewer than {at_least} lines after {timeout}s ({self.timeline()}): "
                             f"{self.err.read_text()[-2000:]}")

    def interrupt(self, path: Path, signum: int, group: bool = False) -> dict[int, dict]:
        """Send ``signum`` to the command (``group``: to its process group, as a Ctrl-C does) at
        once, then read the rows that were on disk just before it (returned)."""
        before = _snapshot(path)
        (os.killpg if group else os.kill)(self.proc.pid, signum)
        self.signalled = time.monotonic()
        rows = _ok_lines(before)
        self.at_signal = len(rows)
        self._seen(self.at_signal, late=False)
        return rows

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        self.exited = time.monotonic()
        return self.proc.returncode, out, self.err.read_text()


def _assert_one_line_interrupted(stderr: str, signame: str, run: _Run) -> None:
    assert "Traceback" not in stderr and "*** SIG" not in stderr and "PC: @" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "interrupted" in line]
    assert len(said) == 1 and said[0].startswith(f"nemo-gen: interrupted by {signame}"), stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == said[0]
    assert "--resume continues" in said[0]
    kept = int(re.search(r"; (\d+) of (\d+) lines are in ", said[0]).group(1))
    assert kept < N, (f"interrupted after the last line was written, not mid-run: {said[0]} ({run.at_signal} "
                      f"lines were on disk when the signal was sent; {run.timeline()})")


# Each signal follows a cheap poll (``_snapshot``: the file's bytes, rows counted by newline) at
# once, and the rows are parsed after it: on a loaded machine a starved test process takes long
# enough over a parse of the whole file for the run to finish every line in between, and a signal
# sent after such a poll lands after the last line.
def test_killed_twice_then_resumed_every_line_exactly_once(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Prompt number {i} says", "id": f"p{i}"}) + "\n"
                               for i in range(1, N + 1)))
    out = tmp_path / "samples.jsonl"

    # 1. Prefect path (its own Prefect server), SIGTERM mid-generation.
    run = _Run(tmp_path, tiny_model_dir, [])
    run.wait_for_lines(out, 10)
    run.interrupt(out, signal.SIGTERM)
    code, _, err = run.finish()
    assert code == 143, err[-3000:]
    _assert_one_line_interrupted(err, "SIGTERM", run)
    assert wait_gone(_marked(run.marker), 60) == []  # engines, Ray, the Prefect server: all gone
    first = _ok_lines(out)
    assert 10 <= len(first) < N
    assert f"{len(first)} of {N} lines are in" in err

    # 2. Plain path, resumed, then Ctrl-C (SIGINT to the process group) mid-generation.
    run = _Run(tmp_path, tiny_model_dir, ["--resume", "--no-prefect"])
    run.wait_for_lines(out, len(first) + 10)
    run.interrupt(out, signal.SIGINT, group=True)
    code, _, err = run.finish()
    assert code == 130, err[-3000:]
    _assert_one_line_interrupted(err, "SIGINT", run)
    assert wait_gone(_marked(run.marker), 60) == []
    second = _ok_lines(out)
    assert len(second) < N
    assert all(second[line] == row for line, row in first.items())  # what was kept stays as it was

    # 3. Prefect path, resumed, then SIGKILL of the nemo-gen process: nothing of ours runs after it.
    run = _Run(tmp_path, tiny_model_dir, ["--resume"])
    try:
        run.wait_for_lines(out, len(second) + 10)
        before = run.interrupt(out, signal.SIGKILL)  # on disk just before the kill (more may land before it hits)
        code, _, err = run.finish()
        assert code == -signal.SIGKILL
        assert wait_gone(_marked(run.marker), 60) == []  # Ray, engines, the Prefect server: all gone
    finally:
        for pid in _marked(run.marker):  # only on failure: leave nothing of this test running
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    third = _ok_lines(out)
    assert len(second) + 10 <= len(before) <= len(third) < N, (
        f"before the kill {len(before)}, after it {len(third)} of {N} lines; {run.timeline()}; {_error_rows(out)}; "
        f"its stderr: {err[-1500:]}")
    assert all(third[line] == row for line, row in before.items())  # kept as they were written

    # 4. Plain path, resumed to the end. Nothing is interrupted now: 32 lines in flight finish the
    # rest sooner (the batch size is not part of what a resume keeps; the sampling settings are,
    # and a resume with other ones is refused: tests/core/test_resume.py).
    run = _Run(tmp_path, tiny_model_dir, ["--resume", "--no-prefect"], batch_size=32)
    code, stdout, err = run.finish(timeout=600)
    assert code == 0, err[-3000:]
    summary = json.loads(stdout)
    assert summary["resumed"] == len(third) and summary["completed"] == N and summary["failed"] == 0
    assert summary["per_shard"]["0"]["requests"] == N - len(third)  # only the rest was generated
    rows = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert [r["line"] for r in rows] == list(range(1, N + 1))  # every line exactly once, in order
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(1, N + 1)]
    assert all(r["error"] is None and len(r["token_ids"]) >= 1 for r in rows)
    final = {r["line"]: r for r in rows}
    assert all(final[line] == row for line, row in third.items())
    assert wait_gone(_marked(run.marker), 60) == []
