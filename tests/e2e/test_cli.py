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

import pytest

pytestmark = pytest.mark.e2e


from tests.helpers import marked as _marked  # every process the command started  # noqa: E402


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


@pytest.mark.parametrize("prefect", [False, True], ids=["no-prefect", "prefect"])
def test_run_to_completion_with_default_output_and_summary(tiny_model_dir, tmp_path, prefect):
    """`nemo-gen run` as a person types it: built-in prompts, no --output, no --json. With
    --no-prefect the pipeline's steps run as plain calls (run_pipeline); without it, as Prefect
    flows on a server the command starts and stops."""
    from nemo_gen.settings import NemoGenSettings
    from tests.helpers import wait_gone

    home = tmp_path / "home"
    marker = uuid.uuid4().hex
    env = {**os.environ, "NEMO_GEN_TEST_MARKER": marker, "COLUMNS": "240", "NO_COLOR": "1"}
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-m", "nemo_gen.cli", "run", "--set", f"home={home}", "--set", f"model.path={tiny_model_dir}",
           "--set", "fleet.num_shards=1", "--set", "fleet.name=cli-run", "--set", "generation.max_new_tokens=8",
           "--set", "generation.vllm_cfg.max_model_len=256", *(["--no-prefect"] if not prefect else [])]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]

    n = len(NemoGenSettings.load().run.prompts)
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.split("\u2502")]
        if len(cells) == 4:  # "", name, value, ""
            rows[cells[1]] = cells[2]
    assert rows["requests"] == f"{n} ({n} ok, 0 failed)" and rows["shards"] == "1"
    assert rows["per shard"] == f"0: {n} req" and rows["weight version"] == "0"
    assert ("Prefect UI" in rows) == prefect
    # the default output path: <home>/outputs/run-<UTC time>.jsonl, one line per prompt
    (output,) = (home / "outputs").glob("run-*.jsonl")
    assert rows["output"] == str(output)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["line"] for r in lines] == list(range(1, n + 1))
    assert all(len(r["token_ids"]) == 8 and r["error"] is None for r in lines)
    assert (home / "prefect" / "prefect.db").exists() == prefect
    assert wait_gone(_marked(marker), 30) == []  # Ray, the engine (and the Prefect server) went down
