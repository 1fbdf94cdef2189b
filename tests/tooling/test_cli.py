"""nemo_gen.cli in-process: bad settings or input exit 2 with a message before anything starts;
``config`` prints the resolved settings; ``make-tiny-model`` makes a model."""

from __future__ import annotations

import json
import os
import subprocess
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


# The CLI runs in a fresh interpreter for every check of what it loads: in `make test` other
# collected modules have imported ray and prefect already, so a check of this process's
# sys.modules could not see the CLI load them.
_RUN_CLI = """
import json, sys
for name in json.loads(sys.argv[3]):
    __import__(name)
from nemo_gen.cli import main
code = main(json.loads(sys.argv[1]))
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(sys.argv[2])))
print("\\nCLI-RESULT " + json.dumps({"code": code, "heavy": heavy}))
"""


def _run_cli(argv: list[str], preload: tuple[str, ...] = ()) -> tuple[int, str, str, list[str]]:
    """``main(argv)`` in a fresh interpreter (this process's cwd and environment): exit code,
    stdout, stderr, and the heavy top-level modules loaded by the end."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, json.dumps(argv), json.dumps(HEAVY), json.dumps(list(preload))],
        capture_output=True, text=True, timeout=120, cwd=os.getcwd(), env=dict(os.environ),
    )
    out, _, tail = proc.stdout.rpartition("\nCLI-RESULT ")
    assert tail, f"the CLI did not return: rc={proc.returncode} {proc.stderr[-2000:]}"
    result = json.loads(tail)
    return result["code"], out, proc.stderr, result["heavy"]


def _fails_before_starting(argv: list[str]) -> str:
    """Run ``argv``; assert exit 2 and that no engine/cluster/orchestrator module got loaded."""
    code, _, err, heavy = _run_cli(argv)
    assert code == EXIT_BAD_INPUT, err
    assert err.startswith("nemo-gen: error: "), err
    assert heavy == [], f"{argv} loaded {heavy}"
    return err


def test_the_heavy_module_check_sees_what_is_loaded():
    _, _, _, heavy = _run_cli(["config"], preload=("ray",))
    assert heavy == ["ray"]


@pytest.mark.parametrize("command", ["run", "generate"])
def test_unknown_setting_exits_2_naming_it(command, tmp_path):
    argv = [command, "--set", "fleet.bogus=1", "--no-prefect"]
    if command == "generate":
        inp = tmp_path / "in.jsonl"
        inp.write_text('"hi"\n')
        argv += ["--input", str(inp), "--output", str(tmp_path / "out.jsonl")]
    err = _fails_before_starting(argv)
    assert "fleet.bogus" in err
    assert "unknown setting" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_run_without_no_prefect_also_fails_before_prefect():
    err = _fails_before_starting(["run", "--set", "fleet.bogus=1"])
    assert "fleet.bogus" in err


def test_wrong_type_exits_2_naming_the_field():
    err = _fails_before_starting(["run", "--no-prefect", "--set", "generation.vllm_cfg.tensor_parallel_size=0"])
    assert "generation.vllm_cfg.tensor_parallel_size" in err


def test_malformed_set_exits_2():
    err = _fails_before_starting(["run", "--no-prefect", "--set", "fleet.num_shards"])
    assert "--set" in err and "dotted.key=value" in err


def test_bad_settings_file_exits_2_naming_it(tmp_path):
    cfg = tmp_path / "settings.yaml"
    cfg.write_text("fleet:\n  bogus: 1\n")
    err = _fails_before_starting(["run", "--no-prefect", "--config", str(cfg)])
    assert "fleet.bogus" in err and str(cfg) in err
    missing = tmp_path / "missing.yaml"
    err = _fails_before_starting(["run", "--no-prefect", "-c", str(missing)])
    assert str(missing) in err


def test_bad_env_setting_exits_2(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_FLEET__NUM_SHARDS", "zero")
    err = _fails_before_starting(["run", "--no-prefect"])
    assert "fleet.num_shards" in err


def test_generate_missing_input_exits_2_naming_the_file(tmp_path):
    missing = tmp_path / "missing.jsonl"
    out = tmp_path / "x.jsonl"
    err = _fails_before_starting(["generate", "--input", str(missing), "--output", str(out)])
    assert str(missing) in err
    assert "cannot read" in err
    assert not out.exists()


def test_generate_relative_missing_input():
    err = _fails_before_starting(["generate", "--input", "missing.jsonl", "--output", "x.jsonl"])
    assert "missing.jsonl" in err


def test_generate_empty_input_exits_2(tmp_path):
    inp = tmp_path / "empty.jsonl"
    inp.write_text("\n\n")
    err = _fails_before_starting(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl")])
    assert str(inp) in err and "no prompts" in err


def test_generate_requires_input_and_output(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--input", "a.jsonl"])
    assert info.value.code == 2
    assert "--output" in capsys.readouterr().err


def test_no_command_is_a_usage_error():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# --------------------------------------------------------------------------------------------
# config


def test_config_prints_resolved_yaml():
    code, out, err, heavy = _run_cli(["config", "--set", "fleet.num_shards=3"])
    assert code == EXIT_OK, err
    assert "num_shards: 3" in out
    data = yaml.safe_load(out)
    assert data["fleet"]["num_shards"] == 3
    assert data["generation"]["vllm_cfg"]["gpu_memory_utilization"] == 0.6
    assert set(data) >= {"home", "model", "generation", "fleet", "health", "ray", "prefect", "run"}
    assert heavy == []


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


# --------------------------------------------------------------------------------------------
# commands that need something running first: they say what, exit 2, and start nothing


@pytest.mark.parametrize(
    "argv",
    [["fleet", "up"], ["fleet", "status"], ["fleet", "down"], ["fleet", "status", "--json"],
     ["refit", "--checkpoint", "ckpt"], ["refit", "--checkpoint", "ckpt", "--no-prefect"]],
    ids=["up", "status", "down", "status-json", "refit", "refit-no-prefect"],
)
def test_fleet_commands_without_ray_address_exit_2_naming_it(argv, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, _, err, heavy = _run_cli(argv)
    assert code == EXIT_BAD_INPUT, err
    assert err.startswith("nemo-gen: error: ray.address: a fleet that outlives one command needs a Ray cluster")
    assert "deployments/ray/start-node.sh" in err


@pytest.mark.parametrize("verb", ["up", "status", "down"])
def test_fleet_commands_without_ray_address_load_nothing_heavy(verb, monkeypatch):
    """Like every other refusal of bad settings: decided before ray is imported (refit is)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    code, _, err, heavy = _run_cli(["fleet", verb])
    assert code == EXIT_BAD_INPUT, err
    assert heavy == []


@pytest.mark.parametrize("verb", ["status", "down"])
def test_fleet_status_and_down_attach_without_watching(verb, monkeypatch, capsys):
    """Neither heals: a watching attach would restart a dead shard in the background, and the
    command would wait for that engine to load before exiting (down: only to stop it)."""
    from nemo_gen.fleet.fleet import GenerationFleet

    calls = []

    class Attached:
        def status(self):
            return []

        def detach(self):
            calls.append("detach")

        def shutdown(self):
            calls.append("shutdown")
            return []

    def attach(cls, settings, watch=True):
        calls.append(("attach", watch))
        return Attached()

    monkeypatch.setattr(GenerationFleet, "attach", classmethod(attach))
    assert main(["fleet", verb, "--set", "ray.address=127.0.0.1:1", "--json"]) == EXIT_OK
    assert calls == [("attach", False), "detach" if verb == "status" else "shutdown"]
    assert json.loads(capsys.readouterr().out)["shards"] == []


@pytest.mark.parametrize("prefect", [[], ["--no-prefect"]], ids=["prefect", "no-prefect"])
def test_refit_of_a_missing_checkpoint_exits_2_naming_it_before_ray(prefect, tmp_path):
    """A mistyped checkpoint is refused before the command attaches to the cluster (which costs
    seconds, and a Prefect server on the Prefect path)."""
    err = _fails_before_starting(["refit", "--checkpoint", str(tmp_path / "nowhere"), *prefect,
                                  "--set", "ray.address=127.0.0.1:1", "--set", f"home={tmp_path / 'home'}"])
    assert f"checkpoint {tmp_path / 'nowhere'} is not a directory" in err


def test_deploy_without_a_prefect_api_exits_2_and_starts_no_server(monkeypatch, tmp_path):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    err = _fails_before_starting(["deploy"])
    assert "prefect.api_url" in err and "python -m nemo_gen.prefect_server server start" in err and "PREFECT_API_URL" in err
    assert not (tmp_path / "prefect-home").exists()  # no managed server was started for it


# --------------------------------------------------------------------------------------------
# an existing output: refused before anything starts unless --resume (same fingerprint) or --overwrite


def _made_output(tmp_path) -> tuple:
    """An input, and an output of it with one row and the fingerprint of a run with default settings."""
    from nemo_gen.core.results import GenerationResult
    from nemo_gen.jsonl import read_prompts, result_row, write_fingerprint
    from nemo_gen.pipeline import run_fingerprint
    from nemo_gen.settings import NemoGenSettings

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('"hi"\n"there"\n')
    lines = read_prompts(inp)
    out.write_text(json.dumps(result_row(lines[0], GenerationResult(0, "hi", [1], "x", [2]))) + "\n")
    write_fingerprint(out, run_fingerprint(NemoGenSettings.load(overrides={"run.input": str(inp)}), lines, 0))
    return inp, out


@pytest.mark.parametrize("prefect", [[], ["--no-prefect"]], ids=["prefect", "no-prefect"])
def test_generate_onto_an_existing_output_exits_2_before_anything_starts(prefect, tmp_path):
    inp, out = _made_output(tmp_path)
    before = out.read_bytes()
    err = _fails_before_starting(["generate", "--input", str(inp), "--output", str(out), *prefect])
    assert f"run.output: {out} already exists" in err and "--resume" in err and "--overwrite" in err
    assert out.read_bytes() == before
    assert not (tmp_path / ".nemo-gen").exists()  # no Prefect home, no tiny model: nothing was made


def test_generate_with_resume_and_overwrite_exits_2_naming_run_overwrite(tmp_path):
    inp, out = _made_output(tmp_path)
    err = _fails_before_starting(["generate", "--input", str(inp), "--output", str(out), "--resume", "--overwrite"])
    assert "run.overwrite" in err


def test_generate_resume_with_other_sampling_exits_2_naming_the_field(tmp_path):
    inp, out = _made_output(tmp_path)
    before = out.read_bytes()
    err = _fails_before_starting(["generate", "--input", str(inp), "--output", str(out), "--resume",
                                  "--no-prefect", "--set", "generation.temperature=0.5"])
    assert err.startswith("nemo-gen: error: generation.temperature: ")
    assert "was made with 1.0, this run has 0.5" in err and f"{out}.fingerprint.json" in err
    assert out.read_bytes() == before
