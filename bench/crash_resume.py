"""Crash consistency of `nemo-gen generate`: SIGKILLed at random moments, resumed each time, its final
output equals an uninterrupted run's, line for line.

One input of chat lines (``messages``) and plain lines; one shard of the tiny local model on CPU,
greedy (temperature 0) with a fixed vLLM seed. First an uninterrupted run writes the reference
output. Then the same command with ``--resume`` (the first without) is started ``--kills`` times and
each one is SIGKILLed — the nemo-gen process only, by PID: nothing of ours runs after it, and its
Ray cluster and engines must go with it — at a random moment of one of two kinds, alternating
``mid`` twice then ``any``:

- ``mid``: once the output holds a random few more finished lines than it did at the start, plus
  a random 0-30 ms, so the kill lands while lines are being written (often within a row);
- ``any``: a uniform time in [0, the reference run's duration] after the start: engine start,
  generation, the final ordered rewrite or the shutdown, wherever it falls.

A last ``--resume`` runs to the end. Verdicts: every final line equals the reference's; no run
refused its own partial output (none exited 2, and the last exited 0); nothing of a run (Ray, the
engine) outlived it by ``GONE_S`` but Ray's own agents (``RAY_AGENTS``: they hold no engine or
device, and exit on their own once they have told the dead cluster's GCS that their raylet died,
which waits out Ray's GCS request timeout, as long as ``GONE_S`` by default); none is left running
``ORPHAN_S`` after, the agents included (an orphan, not a slow exit on a loaded machine: each
leftover is listed with its command and when it was gone). The next run does not wait for the
agents: they are watched while it runs, and the verdicts wait for the last of them.

Each line is its own request with one in flight (``run.batch_size=1``) and vLLM's prefix cache
off: a line's tokens and logprobs then come from the same computation whichever lines ran before
it or beside it — the engine on CPU is not batch-invariant, and what is under test is the resume,
not that.

    python -m bench crash_resume [--kills 20] [--lines 48] [--max-new-tokens 24] [--seed 0] [--json out.json]

``crash_resume(...)`` is the whole procedure; tests/e2e/test_crash_resume.py runs it with 3 kills.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Sequence


from bench.lib.result import write_result
from bench.lib.setup import REPO, quiet_environment
from bench.lib.stats import check
from tests.helpers import alive, marked  # processes by their marker

EVAL = REPO / "examples" / "eval.yaml"
GONE_S = 60.0  # a killed run's Ray cluster and engines must be gone within this


def write_input(path: Path, n: int) -> Path:
    """``n`` lines, every other one a chat (two of them with a system message), ids on all."""
    rows = []
    for i in range(1, n + 1):
        if i % 2:
            rows.append({"prompt": f"Line {i} of the crash test says", "id": f"p{i}"})
        else:
            messages = [{"role": "user", "content": f"Tell me about number {i}."}]
            if i % 4 == 0:
                messages.insert(0, {"role": "system", "content": "Be brief."})
            rows.append({"messages": messages, "id": f"c{i}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def finished(path: Path) -> int:
    """Rows of ``path`` that parse and carry no error (a cut row does not count)."""
    n = 0
    with contextlib.suppress(FileNotFoundError):
        for raw in path.read_bytes().split(b"\n"):
            with contextlib.suppress(ValueError):
                n += json.loads(raw).get("error", "") is None
    return n


class Generate:
    """One `nemo-gen generate` in a session of its own, everything it starts marked."""

    def __init__(self, work: Path, model: Path, inp: Path, out: Path, extra: Sequence[str], max_new_tokens: int):
        self.marker = uuid.uuid4().hex
        self.err = work / f"stderr-{self.marker[:8]}.txt"
        env = {**os.environ, "NEMO_GEN_TEST_MARKER": self.marker}
        env.pop("PREFECT_API_URL", None)
        cmd = [sys.executable, "-m", "nemo_gen.cli", "generate", "--no-prefect", "--json", "--config", str(EVAL),
               "--input", str(inp), "--output", str(out),
               "--set", f"home={work / 'home'}", "--set", f"model.path={model}", "--set", "fleet.num_shards=1",
               "--set", "fleet.name=crash-resume", "--set", "run.batch_size=1",
               "--set", "generation.temperature=0", "--set", "generation.vllm_kwargs.seed=1234",
               "--set", f"generation.max_new_tokens={max_new_tokens}",
               "--set", "generation.vllm_cfg.max_model_len=256",
               "--set", "generation.vllm_cfg.enable_prefix_caching=false", *extra]
        self.started = time.monotonic()
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True, cwd=work,
                                         start_new_session=True)

    def stderr(self) -> str:
        return self.err.read_text()[-3000:]

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out

    def kill(self) -> float:
        """SIGKILL the nemo-gen process (its own processes must go with it); when it was killed."""
        self.proc.kill()
        killed = time.monotonic()
        self.proc.communicate(timeout=60)
        return killed

    def reap(self) -> None:
        """Kill whatever of this run is left (only when something failed: nothing should be)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for pid in marked(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


ORPHAN_S = 180.0  # one still running this long after the kill is an orphan, not a slow exit
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # bound by ORPHAN_S only (see above)


def _command(pid: int) -> str | None:
    """``pid``'s command line (None once it is gone)."""
    import psutil

    try:
        return " ".join(psutil.Process(pid).cmdline())[:100]
    except psutil.Error:
        return None


class Leftovers:
    """What each killed or finished run left running, watched until it is gone.

    ``after(marker, since)`` waits up to ``GONE_S`` for the run's processes, but no longer than
    only Ray's agents are left (they are bound by ``ORPHAN_S`` alone, and waiting them out after
    every kill would make each one cost up to a minute of nothing): the next run starts while they
    wind down. A thread notes when each leftover is gone; ``settle()`` waits until every one is
    gone or ``ORPHAN_S`` past its run's end (then it is an orphan: ``gone_after_s`` None)."""

    def __init__(self):
        import threading

        self._entries: list[tuple[dict[str, Any], float]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="crash-resume-leftovers", daemon=True)
        self._thread.start()

    def after(self, marker: str, since: float) -> list[dict[str, Any]]:
        """The run's processes still alive once only agents are left or ``GONE_S`` passed, each
        with its command; their ``gone_after_s`` is filled in as they go."""
        deadline = since + GONE_S
        pids = marked(marker)  # one scan of every process's environment: an ended run starts no more
        while True:
            running = {pid: cmd for pid in pids if (cmd := _command(pid)) is not None}
            if all(cmd.startswith(RAY_AGENTS) for cmd in running.values()) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        entries = [{"pid": pid, "cmd": cmd, "gone_after_s": None} for pid, cmd in running.items()]
        with self._lock:
            self._entries += [(entry, since) for entry in entries]
        return entries

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                waiting = [(e, since) for e, since in self._entries if e["gone_after_s"] is None]
            for entry, since in waiting:
                if time.monotonic() - since <= ORPHAN_S and not alive([entry["pid"]]):
                    entry["gone_after_s"] = round(time.monotonic() - since, 1)

    def settle(self) -> None:
        """Wait until every leftover is gone or has run ``ORPHAN_S`` past its run's end."""
        while True:
            with self._lock:
                waiting = [since for e, since in self._entries if e["gone_after_s"] is None]
            if not waiting or time.monotonic() > max(waiting) + ORPHAN_S + 0.5:
                break
            time.sleep(0.2)
        self._stop.set()
        self._thread.join()


def _kill_at(run: Generate, out: Path, mode: str, rng: random.Random, total: int, reference_s: float,
             leftovers: Leftovers, timeout: float = 600) -> dict[str, Any]:
    """Wait for the moment ``mode`` picks, then SIGKILL ``run``: what the kill found and left."""
    before = finished(out)
    left = total - before
    if mode == "mid" and left < 2:
        mode = "any"  # fewer than two lines to go: no 'mid' of the generation left to land in
    target = before + rng.randint(1, min(left - 1, 4)) if mode == "mid" else None
    at_s = rng.uniform(0, reference_s) if mode == "any" else None
    deadline = run.started + timeout
    while True:
        if run.proc.poll() is not None:  # ended on its own: a refusal, a failure, or done first
            return {"mode": mode, "exited": run.proc.returncode, "stderr": run.stderr(), "before": before,
                    "after": finished(out), "leftover": leftovers.after(run.marker, time.monotonic())}
        now = time.monotonic()
        if (target is not None and finished(out) >= target) or (at_s is not None and now - run.started >= at_s):
            break
        if now > deadline:
            raise TimeoutError(f"no kill moment within {timeout:.0f}s ({mode}): {run.stderr()}")
        time.sleep(0.01)
    if mode == "mid":
        time.sleep(rng.uniform(0, 0.03))
    seconds = time.monotonic() - run.started
    leftover = leftovers.after(run.marker, run.kill())
    data = out.read_bytes() if out.exists() else b""
    return {"mode": mode, "exited": None, "at_s": round(seconds, 2), "before": before, "after": finished(out),
            "cut_row": bool(data) and not data.endswith(b"\n"),
            "temp_left": sorted(p.name for p in out.parent.glob(f".{out.name}.*.tmp")), "leftover": leftover}


def crash_resume(work: Path, model: Path, kills: int, lines: int = 48, max_new_tokens: int = 24, seed: int = 0,
                 log=print) -> dict[str, Any]:
    """The reference run, ``kills`` killed runs, the last resumed run; the result and its verdicts."""
    rng = random.Random(seed)
    inp = write_input(work / "prompts.jsonl", lines)
    ref, out = work / "reference.jsonl", work / "samples.jsonl"
    runs: list[Generate] = []
    leftovers = Leftovers()

    def start(output: Path, extra: Sequence[str]) -> Generate:
        runs.append(Generate(work, model, inp, output, extra, max_new_tokens))
        return runs[-1]

    try:
        t0 = time.monotonic()
        first = start(ref, [])
        code, _ = first.finish()
        reference_s = time.monotonic() - t0
        if code != 0:
            raise RuntimeError(f"the uninterrupted run failed ({code}): {first.stderr()}")
        log(f"reference: {lines} lines in {reference_s:.1f} s")
        events = []
        for i in range(kills):
            mode = "any" if i % 3 == 2 else "mid"
            event = _kill_at(start(out, ["--resume"] if i else []), out, mode, rng, lines, reference_s,
                             leftovers)
            events.append(event)
            log(f"kill {i + 1}/{kills}: {event['mode']:3} " + (
                f"at {event['at_s']:6.2f} s, finished lines {event['before']:3} -> {event['after']:3}"
                f"{', a cut row at the end' if event['cut_row'] else ''}"
                f"{', during the final rewrite' if event['temp_left'] else ''}" if event["exited"] is None else
                f"EXITED {event['exited']} before the kill: {event['stderr'][-300:]}")
                + (f", still running: {', '.join(x['cmd'].split()[0] for x in event['leftover'])}"
                   if event["leftover"] else ""))
        last = start(out, ["--resume"])
        code, stdout = last.finish()
        summary = json.loads(stdout) if code == 0 else None
        log(f"last resume: exit {code}" + (f", {summary['resumed']} lines resumed, {lines - summary['resumed']} "
                                           f"generated" if summary else f": {last.stderr()}"))
        leftover = leftovers.after(last.marker, time.monotonic())
        leftovers.settle()
    finally:
        for run in runs:
            run.reap()
    want = ref.read_text().split("\n")
    got = out.read_text().split("\n") if code == 0 else []
    differ = [i + 1 for i, (a, b) in enumerate(zip(want, got)) if a != b] + (
        [min(len(want), len(got)) + 1] if len(want) != len(got) else [])
    if any(e["exited"] not in (None, 0, 2) for e in events):
        log(f"note: {sum(e['exited'] not in (None, 0, 2) for e in events)} killed runs failed before their kill "
            "(not a refusal)")
    verdicts = {
        "every final line equals the uninterrupted run's": code == 0 and not differ,
        # A refusal is exit 2 (the output, its fingerprint or a row refused before anything starts);
        # a killed run that ended first for another reason (exit 1: e.g. Ray not starting on a loaded
        # machine) is listed above, and the next run resumes after it all the same.
        "no run refused its own partial output": code == 0 and all(e["exited"] != 2 for e in events),
        f"nothing of a run outlived it by {GONE_S:.0f} s": not [
            x for x in [*leftover, *(x for e in events for x in e["leftover"])] if not x["cmd"].startswith(RAY_AGENTS)],
        f"no orphan ({ORPHAN_S:.0f} s after its run ended)": all(
            x["gone_after_s"] is not None for x in [*leftover, *(x for e in events for x in e["leftover"])]),
    }
    return {"lines": lines, "kills": kills, "reference_s": round(reference_s, 1), "events": events,
            "last_exit": code, "summary": summary, "differing_lines": differ[:10], "verdicts": verdicts}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="runs SIGKILLed before the last resume (default 20)")
    p.add_argument("--lines", type=int, default=48, help="input lines, every other one a chat (default 48)")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per line (default 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments (default 0)")
    p.add_argument("--json", type=Path, help="write the result here as JSON")
    args = p.parse_args(argv)
    quiet_environment()
    from nemo_gen.tiny_model import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="nemo-gen-crash-resume-"))
    model = make_tiny_model(work / "tiny")
    t0 = time.monotonic()
    result = crash_resume(work, model, args.kills, args.lines, args.max_new_tokens, args.seed)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    modes = [e["mode"] for e in result["events"]]
    print(f"\n{args.kills} kills ({modes.count('mid')} mid, {modes.count('any')} any; "
          f"{sum(bool(e.get('cut_row')) for e in result['events'])} left a cut row, "
          f"{sum(bool(e.get('temp_left')) for e in result['events'])} landed in the final rewrite) in "
          f"{result['wall_s']:.0f} s; work directory {work}")
    if result["differing_lines"]:
        print(f"differing lines (first 10): {result['differing_lines']}")
    verdicts = {name: check(ok) for name, ok in result.pop("verdicts").items()}
    for name, v in verdicts.items():
        print(f"  {v}  {name}")
    return write_result(args.json, "crash_resume", args, result, verdicts)
