"""The CLI explains itself: --version, help text on every option of every command, settings
described from their own descriptions (``config --describe``), keys read but not used listed by
``config``, and a suggestion for a misspelt key."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import yaml

from nemo_gen.cli import EXIT_BAD_INPUT, EXIT_OK, main
from nemo_gen.cli_parser import build_parser
from nemo_gen.settings import ENV_PREFIX, NemoGenSettings, describe_settings

RECIPE = Path(__file__).resolve().parents[1] / "data" / "nemo_rl" / "recipes" / "llm" / "grpo-qwen2.5-math-1.5b-2n8g-megatron.yaml"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def test_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"nemo-gen {metadata.version('nemo-gen')} (vllm ")
    assert f"ray {metadata.version('ray')}" in out and f"prefect {metadata.version('prefect')}" in out


def _parsers(parser: argparse.ArgumentParser, path: str = "nemo-gen"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_of_every_command_has_help():
    seen, missing = [], []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if not (choice.help or "").strip():
                        missing.append(f"{path} {choice.dest}")
                continue
            seen.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
            if not (action.help or "").strip() or action.help == argparse.SUPPRESS:
                missing.append(seen[-1])
    assert missing == []
    # the walk reaches the nested commands and their options
    for expected in ("nemo-gen fleet up --config/-c", "nemo-gen generate --resume", "nemo-gen config --describe",
                     "nemo-gen make-tiny-model dir", "nemo-gen deploy --json", "nemo-gen refit --checkpoint"):
        assert expected in seen


def test_describe_prints_type_default_and_description(capsys):
    assert main(["config", "--describe"]) == EXIT_OK
    out = capsys.readouterr().out
    for row in describe_settings():
        assert row["key"] in out and (row["description"] or "")[:40] in " ".join(out.split())
    assert "fleet.num_shards: int = 2\n" in out
    assert "generation.vllm_cfg.max_model_len: int | null = null\n" in out
    assert "fleet.mode: eval | train = \"eval\"\n" in out


def test_describe_a_prefix(capsys):
    assert main(["config", "--describe", "generation.vllm_cfg"]) == EXIT_OK
    out = capsys.readouterr().out
    keys = [line.split(":")[0] for line in out.splitlines() if line and not line.startswith(" ")]
    assert keys and all(k.startswith("generation.vllm_cfg") for k in keys)
    assert "generation.vllm_cfg.tensor_parallel_size" in keys
    # NeMo-RL's keys nemo_gen does not use are described as such, with what is accepted
    assert "generation.vllm_cfg.expose_http_server" in keys
    assert "not supported yet" in out and "Accepted: false or null" in out


def test_describe_an_unknown_prefix_suggests_one(capsys):
    assert main(["config", "--describe", "fleet.num_shard"]) == EXIT_BAD_INPUT
    assert "did you mean 'fleet.num_shards'" in capsys.readouterr().err


def test_a_misspelt_key_gets_a_suggestion_from_the_cli(capsys):
    assert main(["config", "--set", "generation.temprature=0"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "generation.temprature" in err and "did you mean 'temperature'" in err


def test_config_lists_the_keys_not_used_and_stays_loadable(capsys, tmp_path):
    assert main(["config", "-c", str(RECIPE)]) == EXIT_OK
    out = capsys.readouterr().out
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert "not used by nemo_gen" in comments[0]
    listed = {line.split()[1] for line in comments[1:]}
    settings = NemoGenSettings.load(RECIPE)
    assert listed == {n.key for n in settings.not_used}
    assert "policy.generation.refit_cfg.nixl" in listed and "policy.generation.mcore_generation_config.buffer_size_gb" in listed
    # the printed settings load back to the same settings (the comments are only comments)
    printed = tmp_path / "resolved.yaml"
    printed.write_text(out)
    assert yaml.safe_load(out)["generation"]["vllm_cfg"]["max_model_len"] == 4096
    assert NemoGenSettings.load(printed).model_dump() == settings.model_dump()


def test_config_of_plain_settings_has_no_not_used_block(capsys):
    assert main(["config"]) == EXIT_OK
    assert "#" not in capsys.readouterr().out
