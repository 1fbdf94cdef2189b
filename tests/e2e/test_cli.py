"""`nemo-gen generate` as a user runs it: its own Ray, its own Prefect server, training mode
(dummy weights, then the pipeline's refit), a JSONL with a malformed line — and nothing left
running afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e


def _marked(marker: str) -> list[int]:
    """PIDs of processes whose environment carries ``marker`` (everything the CLI started)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("NEMO_GEN_TEST_MARKER") == marker:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_generate_cli_end_to_end(tiny_model_dir, tmp_path):
    from tests.helpers import wait_gone

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt": "Hello there", "id": "a"}\n'
        "this line is not json\n"
        '{"prompt_token_ids": [5, 6, 7], "id": "c"}\n'
        '"The quick brown fox"\n'
    )
    out = tmp_path / "samples.jsonl"
    marker = uuid.uuid4().hex
    env = {**os.environ, "NEMO_GEN_TEST_MARKER": marker}
    env.pop("PREFECT_API_URL", None)  # the CLI must manage its own server
    cmd = [
        sys.executable, "-m", "nemo_gen.cli", "generate", "--input", str(prompts), "--output", str(out),
        "--set", f"home={tmp_path / 'home'}", "--set", f"model.path={tiny_model_dir}",
        "--set", "fleet.num_shards=1", "--set", "fleet.name=cli-test",
        "--set", "generation.max_new_tokens=8", "--set", "generation.vllm_cfg.max_model_len=256",
        # Training mode: engines start on dummy weights and the pipeline's refit loads the real ones.
        "--set", "fleet.mode=train", "--json",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-3000:]  # ran, but one line was malformed
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 4 and summary["completed"] == 3 and summary["failed"] == 1
    assert summary["errors"] == [{"line": 2, "error": "not valid JSON (Expecting value at column 1)"}]
    assert summary["prefect_ui"].startswith("http://127.0.0.1:")
    refit = summary["refit"]
    assert refit["ok"] and refit["version"] == 0 and refit["bytes"] > 1_000_000 and refit["gb_per_s"] > 0
    assert [s["shard"] for s in refit["shards"]] == [0]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4]
    assert rows[0]["id"] == "a" and rows[2]["id"] == "c"
    assert rows[1]["error"] and rows[1]["text"] is None
    for r in (rows[0], rows[2], rows[3]):
        assert len(r["token_ids"]) == 8 and len(r["logprobs"]) == 8
        assert r["shard"] == 0 and r["weight_version"] == 0 and r["finish_reason"] == "length"
    assert rows[2]["prompt_token_ids"] == [5, 6, 7]
    # Ray, the engines and the Prefect server all went down with the command.
    assert wait_gone(_marked(marker), 30) == []
    assert (tmp_path / "home" / "prefect" / "prefect.db").exists()


def test_bad_settings_exit_2_before_anything_starts(tmp_path):
    cmd = [sys.executable, "-m", "nemo_gen.cli", "run", "--set", "fleet.num_shards=zero"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert "fleet.num_shards" in proc.stderr
    assert not (Path(tmp_path) / ".nemo-gen").exists()
