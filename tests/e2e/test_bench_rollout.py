"""``python -m bench rollout``'s CPU dry run: a one-shard fleet of the tiny model and a bare
``vllm.LLM`` in a process of its own, the same batches through each, with the logprob of every
sampled token; one result with the fleet / bare ratio per batch, vLLM's step counters for both
arms, and the verdicts. The GPU run adds the busy share, the roofline and py-spy profiles
(bench/results/2026-12-07/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.engine, pytest.mark.ray]

REPO = Path(__file__).resolve().parents[2]
BATCHES, TOKENS = (2, 4), 4


def test_cpu_dry_run_compares_the_fleet_with_a_bare_engine_batch_by_batch(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "bench", "rollout", "--device", "cpu", "--tiny", "--batches",
           ",".join(map(str, BATCHES)), "--tokens", str(TOKENS), "--rounds", "1", "--work", str(tmp_path / "work"),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((out / "rollout.json").read_text())
    assert doc["schema"] == "nemo_gen.bench/1" and doc["name"] == "rollout"
    result = doc["metrics"]["results"]["tiny/bfloat16"]
    assert "error" not in result["fleet"] and "error" not in result["bare"], result
    # the bare engine ran at the settings it was given (its CPU executor picks its own scheduling)
    assert result["bare"]["max_num_seqs"] == max(BATCHES)
    rows = {row["batch"]: row for row in result["rows"]}
    assert sorted(rows) == sorted(BATCHES)
    for batch, row in rows.items():
        for arm in ("fleet", "bare"):
            measured = result[arm]["batches"][str(batch)]
            # every sequence made TOKENS tokens, each with its logprob
            assert measured["tokens"] == measured["tokens_with_logprob"] == batch * TOKENS, measured
            # vLLM's own counters: at least one engine step a token, each step a few tokens at most
            engine = measured["engine"]
            assert engine["engine_steps"] >= TOKENS and 0 < engine["tokens_per_step"] <= batch * 32
            assert row[f"{arm}_ms_per_step"] > 0 and row[f"{arm}_tokens_per_s"] > 0
        assert row["fleet_over_bare"] == pytest.approx(row["fleet_tokens_per_s"] / row["bare_tokens_per_s"])
        assert doc["verdicts"][f"tiny_bfloat16_fleet_tokens_b{batch}"] == "PASS"
        assert doc["verdicts"][f"tiny_bfloat16_bare_tokens_b{batch}"] == "PASS"
        assert doc["verdicts"][f"tiny_bfloat16_fleet_over_bare_b{batch}"] in ("PASS", "MISS")
    assert "fleet/bare" in proc.stdout  # the table
