"""nemo_gen.cli in-process: bad settings or input exit 2 with a message before anything starts;
``config`` prints the resolved settings; ``make-tiny-model`` makes a model."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

from nemo_gen.cli import EXIT_BAD_INPUT, EXIT_OK, main
from nemo_gen.settings import ENV_PREFIX

HEAVY = ("vllm", "ray", "prefect", "prefect_ray")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Each test runs in its own directory, with no NEMO_GEN_* variable from the shell, and any
    variable the CLI sets (``_quiet`` uses setdefault on os.environ) is undone afterwards."""
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    saved = dict(os.environ)
    yield
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    os.environ.update(saved)


def _heavy_loaded() -> set[str]:
    return {m for m in sys.modules if m.split(".")[0] in HEAVY}


def _fails_before_starting(argv: list[str], capsys) -> str:
    """Run ``argv``; assert exit 2 and that no engine/cluster/orchestrator module got loaded."""
    before = _heavy_loaded()
    # Other test modules may share a session Ray cluster; the CLI must not have changed it.
    ray_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert err.startswith("nemo-gen: error: "), err
    new = _heavy_loaded() - before
    assert new == set(), f"{argv} loaded {sorted(new)[:5]}"
    assert "vllm" not in sys.modules or "vllm" in before
    if "ray" in sys.modules:
        assert sys.modules["ray"].is_initialized() == ray_before
    return err


@pytest.mark.parametrize("command", ["run", "generate"])
def test_unknown_setting_exits_2_naming_it(command, capsys, tmp_path):
    argv = [command, "--set", "fleet.bogus=1", "--no-prefect"]
    if command == "generate":
        inp = tmp_path / "in.jsonl"
        inp.write_text('"hi"\n')
        argv += ["--input", str(inp), "--output", str(tmp_path / "out.jsonl")]
    err = _fails_before_starting(argv, capsys)
    assert "fleet.bogus" in err
    assert "unknown setting" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_run_without_no_prefect_also_fails_before_prefect(capsys):
    err = _fails_before_starting(["run", "--set", "fleet.bogus=1"], capsys)
    assert "fleet.bogus" in err


def test_wrong_type_exits_2_naming_the_field(capsys):
    err = _fails_before_starting(["run", "--no-prefect", "--set", "generation.vllm_cfg.tensor_parallel_size=0"], capsys)
    assert "generation.vllm_cfg.tensor_parallel_size" in err


def test_malformed_set_exits_2(capsys):
    err = _fails_before_starting(["run", "--no-prefect", "--set", "fleet.num_shards"], capsys)
    assert "--set" in err and "dotted.key=value" in err


def test_bad_settings_file_exits_2_naming_it(capsys, tmp_path):
    cfg = tmp_path / "settings.yaml"
    cfg.write_text("fleet:\n  bogus: 1\n")
    err = _fails_before_starting(["run", "--no-prefect", "--config", str(cfg)], capsys)
    assert "fleet.bogus" in err and str(cfg) in err
    missing = tmp_path / "missing.yaml"
    err = _fails_before_starting(["run", "--no-prefect", "-c", str(missing)], capsys)
    assert str(missing) in err


def test_bad_env_setting_exits_2(capsys, monkeypatch):
    monkeypatch.setenv("NEMO_GEN_FLEET__NUM_SHARDS", "zero")
    err = _fails_before_starting(["run", "--no-prefect"], capsys)
    assert "fleet.num_shards" in err


def test_generate_missing_input_exits_2_naming_the_file(capsys, tmp_path):
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "x.jsonl"
    err = _fails_before_starting(["generate", "--input", str(missing), "--output", str(out)], capsys)
    assert str(missing) in err
    assert "cannot read" in err
    assert not out.exists()


def test_generate_relative_missing_input(capsys):
    err = _fails_before_starting(["generate", "--input", "missing.jsonl", "--output", "x.jsonl"], capsys)
    assert "missing.jsonl" in err


def test_generate_empty_input_exits_2(capsys, tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("\n\n")
    err = _fails_before_starting(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl")], capsys)
    assert str(inp) in err and "no prompts" in err


def test_generate_requires_input_and_output(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--input", "a.jsonl"])
    assert info.value.code == 2
    assert "--output" in capsys.readouterr().err


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# --------------------------------------------------------------------------------------------
# config


def test_config_prints_resolved_yaml(capsys):
    before = _heavy_loaded()
    code = main(["config", "--set", "fleet.num_shards=3"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "num_shards: 3" in out
    data = yaml.safe_load(out)
    assert data["fleet"]["num_shards"] == 3
    assert data["generation"]["vllm_cfg"]["gpu_memory_utilization"] == 0.6
    assert set(data) >= {"home", "model", "generation", "fleet", "health", "ray", "prefect", "run"}
    assert _heavy_loaded() - before == set()


def test_config_precedence_file_env_set(capsys, monkeypatch, tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("fleet:\n  num_shards: 5\n  name: from-file\nhealth:\n  unhealthy_threshold: 9\n")
    monkeypatch.setenv("NEMO_GEN_FLEET__NAME", "from-env")
    monkeypatch.setenv("NEMO_GEN_HEALTH__UNHEALTHY_THRESHOLD", "7")
    assert main(["config", "-c", str(cfg), "--set", "fleet.name=from-set"]) == EXIT_OK
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["fleet"]["num_shards"] == 5
    assert data["fleet"]["name"] == "from-set"
    assert data["health"]["unhealthy_threshold"] == 7


def test_config_bad_setting_exits_2(capsys):
    assert main(["config", "--set", "fleet.bogus=1"]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "fleet.bogus" in captured.err


# --------------------------------------------------------------------------------------------
# make-tiny-model


def test_make_tiny_model(capsys, tmp_path):
    from nemo_gen.tiny_model import MODEL_FILES, is_tiny_model

    target = tmp_path / "tiny"
    assert main(["make-tiny-model", str(target)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "tiny model ready" in out and str(target) in out
    assert is_tiny_model(target)
    for name in MODEL_FILES:
        assert (target / name).stat().st_size > 0
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    # Idempotent: a second call finds it and rewrites nothing.
    mtimes = {p.name: p.stat().st_mtime_ns for p in target.iterdir()}
    assert main(["make-tiny-model", str(target)]) == EXIT_OK
    assert {p.name: p.stat().st_mtime_ns for p in target.iterdir()} == mtimes


def test_make_tiny_model_into_a_foreign_directory_exits_2(capsys, tmp_path):
    target = tmp_path / "taken"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert main(["make-tiny-model", str(target)]) == EXIT_BAD_INPUT
    assert str(target) in capsys.readouterr().err
    assert (target / "notes.txt").read_text() == "mine"
