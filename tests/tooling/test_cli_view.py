"""What a person at a terminal reads: the live view of a run (steps, shards loading, refit,
the summary table) and the tables of `fleet status` and `deploy` — every other test of the
commands reads their --json. Rendered by rich to the captured streams, as on a pipe."""

from __future__ import annotations

import re

import pytest

from nemo_gen.cli_view import LiveView, deploy_table, status_table


@pytest.fixture(autouse=True)
def _wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # a pipe is 80 wide: cells would wrap
    monkeypatch.setenv("NO_COLOR", "1")


_BOX = re.compile(r"^[\u2500-\u257f\s]+$")  # a border: box-drawing characters only


def lines(text: str) -> list:
    """A rendered table as [title, *rows]: the title's lines (rich wraps a title to the table's
    width) joined, then each row as its list of cell texts; borders dropped."""
    title, rows = [], []
    for line in text.splitlines():
        if _BOX.match(line) or not line.strip():
            continue
        cells = [c.strip() for c in re.split(r"[\u2502\u2503]", line)]  # │ ┃
        if len(cells) == 1 and not rows:
            title.append(cells[0])
        else:
            rows.append([c for c in cells if c])
    return [" ".join(title), *rows]


def test_live_view_narrates_steps_shards_refit_and_notes(capsys):
    with LiveView() as view:
        view.note("Prefect API at http://127.0.0.1:4200/api")
        view.on_event("step", {"name": "launch-fleet", "shards": 2})
        view.on_event("shard", {"index": 0, "event": "loading"})
        view.on_event("shard", {"index": 0, "event": "ready", "seconds": 31.25, "actor_pid": 11, "engine_pids": [12, 13]})
        view.on_event("shard", {"index": 1, "event": "failed", "error": "EngineStartError: out of memory"})
        view.on_event("refit", {"version": 3, "bytes": 2_500_000, "seconds": 0.5, "gb_per_s": 0.005, "shards": [0, 1]})
    said = [re.sub(r"^\s*\d+\.\ds\s+", "", line) for line in capsys.readouterr().err.splitlines()]
    assert said == [
        "Prefect API at http://127.0.0.1:4200/api",
        "launch-fleet (2 shards)",
        "shard 0 … loading engine",
        "shard 0 … ready (31.2 s, actor pid 11, engine pids [12, 13])",
        "shard 1 … failed: EngineStartError: out of memory",
        "refit to version 3: 2.5 MB in 0.50 s (0.01 GB/s) on 2 shards",
    ]


def test_live_view_disabled_says_nothing(capsys):
    with LiveView(enabled=False) as view:  # --json: stdout is the JSON, stderr stays quiet
        view.note("hello")
        view.on_event("step", {"name": "generate"})
        view.on_event("generate", {"done": 1, "total": 2})
    assert capsys.readouterr() == ("", "")


def test_live_view_progress_bar_counts_prompts(capsys):
    with LiveView() as view:
        for done in (0, 4, 8):
            view.on_event("generate", {"done": done, "total": 8})
    err = capsys.readouterr().err
    assert "generating" in err and "8/8" in err


SUMMARY = {
    "shards": 2, "requests": 14, "completed": 2, "failed": 12, "generated_tokens": 64, "tokens_per_s": 123.456,
    "per_shard": {"0": {"requests": 1, "tokens": 32}, "1": {"requests": 1, "tokens": 32}},
    "weight_versions": [4], "output": "/data/out.jsonl", "prefect_ui": "http://127.0.0.1:4200",
    "wall_seconds": 61.04, "refit": {"bytes": 3_000_000, "seconds": 0.25, "gb_per_s": 0.012},
    "errors": [{"line": n, "error": f"bad line {n}"} for n in range(1, 13)],
}


def test_summary_table_and_failed_lines(capsys):
    LiveView().summary(SUMMARY, title="nemo-gen generate")
    captured = capsys.readouterr()
    table = lines(captured.out)
    assert table[0] == "nemo-gen generate"
    assert table[1:] == [
        ["shards", "2"],
        ["requests", "14 (2 ok, 12 failed)"],
        ["generated tokens", "64"],
        ["tokens/s", "123.5"],
        ["per shard", "0: 1 req, 1: 1 req"],
        ["weight version", "4"],
        ["refit", "3.0 MB, 0.25 s, 0.01 GB/s"],
        ["output", "/data/out.jsonl"],
        ["Prefect UI", "http://127.0.0.1:4200"],
        ["wall time", "61.0 s"],
    ]
    # the first ten failed lines by number, then how many more
    err = captured.err.splitlines()
    assert err[:2] == ["line 1: bad line 1", "line 2: bad line 2"] and len(err) == 11
    assert err[-1] == "… and 2 more failed lines (see the output file)"


def test_summary_without_refit_prefect_or_versions(capsys):
    bare = {**SUMMARY, "weight_versions": [], "errors": [], "refit": None}
    del bare["prefect_ui"]
    LiveView().summary(bare)
    table = lines(capsys.readouterr().out)
    rows = {r[0]: r[1] for r in table[1:]}
    assert table[0] == "nemo-gen run" and rows["weight version"] == "-"
    assert "refit" not in rows and "Prefect UI" not in rows


def test_fleet_status_table(capsys):
    rows = [
        {"index": 0, "state": "healthy", "weight_version": 7, "actor_pid": 101, "engine_pids": [102, 103],
         "restarts": 0, "last_error": None, "orphans": []},
        {"index": 1, "state": "dead", "weight_version": 6, "actor_pid": 201, "engine_pids": [],
         "restarts": 2, "last_error": "ShardDiedError: shard 1 died",
         "orphans": [{"pid": 202, "rss_bytes": 3 * 2**30}]},
    ]
    status_table("persistent", rows)
    table = lines(capsys.readouterr().out)
    assert table == [
        "fleet persistent",
        ["shard", "state", "weight version", "actor pid", "engine pids", "restarts", "last error", "orphans"],
        ["0", "healthy", "7", "101", "102 103", "0"],
        ["1", "dead", "6", "201", "2", "ShardDiedError: shard 1 died", "202 (3.0 GiB)"],
    ]


def test_deploy_table(capsys):
    deploy_table("nemo-gen", "updated", "nemo-gen-rerun-crashed", [
        {"deployment": "heal/default", "id": "0c1d", "error": None},
        {"deployment": "eval/default", "id": None, "error": "cannot load flows/eval.py:eval"},
    ])
    table = lines(capsys.readouterr().out)
    assert table[0] == ("deployments on work pool 'nemo-gen', its job template updated (crashed runs re-run by "
                        "'nemo-gen-rerun-crashed')")
    assert table[1:] == [["deployment", "id", "error"], ["heal/default", "0c1d"],
                         ["eval/default", "cannot load flows/eval.py:eval"]]
