"""Crash consistency: `nemo-gen generate` (greedy, a fixed seed, chat and plain lines, one shard)
SIGKILLed at three random moments and resumed each time ends with the output an uninterrupted run
writes, line for line; no resumed run refuses its own partial output; nothing of a killed run
outlives it. The procedure is bench/crash_resume.py's (which runs it with 20 kills)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "bench" / "crash_resume.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_crash_resume", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


LINES = 24  # a 'mid' kill aims 1-4 lines in; it overshoots to the end only when the poller stalls
# for ~20 lines' time, so each line makes 128 tokens: 32 were short enough (a forked engine's
# worker, a quiet moment) that one stall under the full suite's load did


def test_killed_three_times_at_random_moments_then_resumed_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    result = _bench().crash_resume(tmp_path, tiny_model_dir, kills=3, lines=LINES, max_new_tokens=128, seed=3)
    events = result["events"]
    assert events[0]["mode"] == "mid", events
    # At least one kill landed while lines were being written (the subject of the 'mid' kills).
    assert any(e["exited"] is None and e["before"] < e["after"] < LINES for e in events), events
    assert result["verdicts"] == {name: True for name in result["verdicts"]}, result
    assert result["summary"]["completed"] == LINES and result["summary"]["failed"] == 0
