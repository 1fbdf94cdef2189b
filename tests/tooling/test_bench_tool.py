"""bench/ as one tool: ``python -m bench`` lists and dispatches every benchmark, each benchmark is a
module with ``main(argv)`` whose ``--help`` works, none patches ``sys.path``, the result schema is
written and checked, and bench/README.md and the results index name what is there."""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import __main__ as entry
from bench.lib import result, stats
from bench.registry import BENCHMARKS, HELPERS, find

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
NAMES = [b.name for b in BENCHMARKS]


@pytest.fixture
def same_environment():
    """Benchmarks set environment defaults (offline, quiet logs) when they run: keep them out of
    the rest of this test process."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_every_module_in_bench_is_a_listed_benchmark_or_a_helper():
    modules = {p.stem for p in BENCH.glob("*.py")} - {"__init__", "__main__", "registry"}
    assert modules == set(NAMES) | set(HELPERS)
    assert len(NAMES) == len(set(NAMES))
    assert all(b.device in ("cpu", "gpu", "none") and b.target for b in BENCHMARKS)


def test_no_benchmark_patches_sys_path():
    offenders = [str(p.relative_to(REPO)) for p in BENCH.rglob("*.py") if "sys.path" in p.read_text()]
    assert offenders == []


def test_the_listing_names_every_benchmark_with_its_target(capsys):
    assert entry.run([]) == 0
    out = capsys.readouterr().out
    for b in BENCHMARKS:
        assert re.search(rf"^{b.name}\s+{b.device}\s+{re.escape(b.target)}$", out, re.M), b.name


def test_python_dash_m_bench_runs_from_the_repository_root():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout alone, from its root
    proc = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert all(name in proc.stdout for name in NAMES)


def test_an_unknown_name_is_refused_with_the_listing(capsys):
    assert entry.run(["no_such_bench"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark 'no_such_bench'" in err and "control_plane" in err
    with pytest.raises(KeyError):
        find("no_such_bench")


@pytest.mark.parametrize("name", NAMES)
def test_each_benchmark_has_main_argv_and_its_help_works(name, capsys, same_environment):
    module = importlib.import_module(f"bench.{name}")
    params = list(inspect.signature(module.main).parameters)
    assert params == ["argv"], f"bench/{name}.py: main{tuple(params)}"
    with pytest.raises(SystemExit) as exit_:
        entry.run([name, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m bench {name} "), out[:300]
    # a folder, or a file (the single-measurement GPU scripts write one JSON file)
    one_file = ("cuda_ipc_refit", "mps_overlap", "fp8_gemm_gpu")
    writes = "--out" if find(name).device == "gpu" and name not in one_file else "--json"
    assert writes in out, out


def test_dispatch_passes_the_rest_of_the_command_line_to_main(monkeypatch):
    module = importlib.import_module("bench.control_plane")
    got = []
    monkeypatch.setattr(module, "main", lambda argv: got.append(argv) or 7)
    assert entry.run(["control_plane", "--sizes", "10", "--quick"]) == 7
    assert got == [["--sizes", "10", "--quick"]]
    assert str(REPO) in os.environ["PYTHONPATH"].split(os.pathsep)  # the benchmark's child processes find bench


def test_exit_code_fails_on_a_failed_check_only():
    assert entry.exit_code(None) == 0 and entry.exit_code(3) == 3
    assert entry.exit_code({"verdicts": {"a": "PASS", "b": "MISS"}}) == 0  # a missed target is a measurement
    assert entry.exit_code({"verdicts": {"a": "PASS", "b": "FAIL"}}) == 1
    assert entry.exit_code({"verdicts": {"a": False}}) == 1


def test_a_real_benchmark_writes_a_valid_result(tmp_path, same_environment):
    path = tmp_path / "sub" / "control_plane.json"
    code = entry.run(["control_plane", "--sizes", "10,20", "--ticks", "5", "--warmup", "1", "--repeats", "1",
                      "--json", str(path)])
    assert code == 0
    doc = result.read(path)
    assert doc["name"] == "control_plane" and doc["arguments"]["sizes"] == [10, 20]
    assert set(doc["verdicts"]) == {"tick", "routing"} and [r["shards"] for r in doc["metrics"]["rows"]] == [10, 20]
    assert doc["machine"]["cpus"] == os.cpu_count() and doc["commit"]


def test_the_schema_names_every_field_and_normalizes_verdicts(tmp_path):
    doc = result.write_result(tmp_path / "x.json", "demo", {"n": 3, "home": Path("/tmp/h")},
                              {"fleet": {"ratio": 1.0, "verdict": "PASS"}, "pipe": {"verdict": "MISSED"},
                               "rounds": [{"verdict": "MISS"}]})
    assert tuple(doc) == result.FIELDS and doc["schema"] == result.SCHEMA
    assert doc["arguments"] == {"n": 3, "home": "/tmp/h"}
    assert doc["verdicts"] == {"fleet": "PASS", "pipe": "MISS"}  # per-round details are not verdicts
    assert json.loads((tmp_path / "x.json").read_text()) == doc
    explicit = result.make("demo", {}, {}, {"ok": True, "broken": False})
    assert explicit["verdicts"] == {"ok": "PASS", "broken": "FAIL"}


@pytest.mark.parametrize("break_it, message", [
    (lambda d: d.pop("commit"), "missing 'commit'"),
    (lambda d: d.update(extra=1), "unknown field 'extra'"),
    (lambda d: d.update(schema="other/9"), "schema 'other/9'"),
    (lambda d: d.update(name=""), "'name' must be a non-empty string"),
    (lambda d: d.update(metrics=[1]), "'metrics' must be an object"),
    (lambda d: d["verdicts"].update(x="OK"), "verdict 'x' is 'OK'"),
])
def test_validate_names_what_is_wrong(break_it, message):
    doc = result.make("demo", {}, {"a": 1}, {"t": "PASS"})
    result.validate(doc)
    break_it(doc)
    with pytest.raises(ValueError, match=re.escape(message)):
        result.validate(doc)
    with pytest.raises(ValueError, match="a JSON object"):
        result.validate([doc])


def test_statistics():
    assert stats.spread([3, 1, 2]) == {"median": 2, "min": 1, "max": 3}
    with pytest.raises(ValueError):
        stats.spread([])
    assert stats.medians([{"a": 1, "b": 5}, {"a": 3}, {"a": 2, "b": 7}]) == {"a": 2}  # b: not in every run
    assert stats.medians([{"a": 1, "b": 2}], keys=("b",)) == {"b": 2}
    assert stats.paired_ratios([(2, 1), (3, 4)]) == [2.0, 0.75]
    assert stats.percentile([1, 2, 3, 4], 50) == 2.5 and stats.percentile([5], 99) == 5
    assert stats.verdict(0.96, 0.95, higher_is_better=True) == "PASS"
    assert stats.verdict(1.2, 1.1, higher_is_better=False) == "MISS"
    assert stats.verdict(None, 1.0, higher_is_better=True) == "MISS"
    assert (stats.met(True), stats.met(False), stats.check(False)) == ("PASS", "MISS", "FAIL")


def test_synthetic_token_prompts_are_distinct_and_inside_the_tiny_vocabulary():
    from bench.lib.setup import token_prompts

    prompts = token_prompts(300, length=8)
    assert len(prompts) == 300 and all(len(p) == 8 and p[0] == 1 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 250  # the ids cycle every 250 prompts
    assert min(min(p[1:]) for p in prompts) >= 4 and max(max(p) for p in prompts) <= 253


def test_the_readme_lists_every_benchmark_with_its_target():
    text = (BENCH / "README.md").read_text()
    for b in BENCHMARKS:
        assert re.search(rf"^\| `{b.name}` \| {b.device} \| {re.escape(b.target)} \|", text, re.M), b.name


def test_results_live_in_dated_folders_named_by_the_index():
    results = BENCH / "results"
    loose = [p.name for p in results.iterdir() if p.is_file() and p.name not in ("README.md", "index.py")]
    assert loose == []
    index = (results / "README.md").read_text()
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", folder.name), folder.name
        assert f"]({folder.name}/)" in index, f"the index does not link {folder.name}/"
        for note in folder.glob("*.md"):  # every note, by name (python bench/results/index.py)
            assert f"]({folder.name}/{note.name})" in index, f"the index does not link {folder.name}/{note.name}"


def test_every_rerun_result_follows_the_schema():
    files = sorted((BENCH / "results" / "2026-12-06").glob("*.json"))
    assert files
    for path in files:
        result.read(path)


def test_serve_vllm_arm_refuses_fake_shards_and_takes_its_streams(capsys):
    serve = importlib.import_module("bench.serve")
    with pytest.raises(SystemExit):
        serve.parse_args(["--vllm-serve", "--fake"])
    assert "--vllm-serve runs real engines" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.parse_args(["--vllm-serve", "--streams", "16", "0"])
    args = serve.parse_args(["--vllm-serve", "--streams", "16", "64", "--baseline-src", "/tmp/old"])
    assert args.streams == [16, 64] and str(args.baseline_src) == "/tmp/old"
