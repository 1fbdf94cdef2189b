"""Deployment parameters without a server: per-field errors, allowed paths (``..`` and symlinks
cannot step outside), every deployment in prefect.yaml matching its flow's signature, and the
artifact redactor."""

from __future__ import annotations

import inspect

import pytest

from flows.artifacts import redact
from flows.deploy import ROOT, check_parameters, load_spec
from flows.params import PARAMS, EvalParams, GenerateParams, check_allowed_paths, validate_params
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings

pytestmark = pytest.mark.flows


def test_every_bad_parameter_is_named():
    with pytest.raises(ConfigError) as info:
        validate_params(EvalParams, {"input": "", "weight_version": -1, "batch_size": 0, "bogus": 1}, "eval")
    assert sorted(info.value.fields) == ["batch_size", "bogus", "input", "weight_version"]
    assert "bogus: unknown parameter" in str(info.value)


def test_paths_outside_the_allowed_ones_are_rejected_by_name(tmp_path):
    inside, outside = tmp_path / "ok", tmp_path / "secret"
    inside.mkdir(), outside.mkdir()
    (inside / "link").symlink_to(outside)
    settings = NemoGenSettings.load(overrides={"prefect.allowed_paths": [str(inside)]})
    check_allowed_paths(GenerateParams(input=str(inside / "p.jsonl")), settings)
    for sneaky in (str(inside / ".." / "secret" / "p.jsonl"), str(inside / "link" / "p.jsonl"), "/etc/passwd"):
        with pytest.raises(ConfigError, match="parameter output"):
            check_allowed_paths(GenerateParams(input=str(inside / "p.jsonl"), output=sneaky), settings)


def test_prefect_yaml_matches_the_flows():
    import importlib

    spec = load_spec()
    assert {e["entrypoint"].split(":")[0] for e in spec} >= {"flows/fleet.py", "flows/generate.py",
                                                             "flows/refit.py", "flows/eval.py", "flows/heal.py"}
    settings = NemoGenSettings.load()
    for entry in spec:
        path, func = entry["entrypoint"].split(":")
        if not (ROOT / path).exists():
            continue  # flows/heal.py is another issue's
        fl = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), func)
        model = PARAMS.get(fl.name)
        if model is not None:
            assert set(inspect.signature(fl.fn).parameters) == set(model.model_fields), fl.name
        check_parameters(fl.name, entry, settings)  # the file's own parameters are valid
    schedules = {e["entrypoint"]: e.get("schedules") for e in spec}
    assert schedules["flows/heal.py:heal"][0]["interval"] > 0
    assert schedules["flows/eval.py:evaluate"][0]["cron"] and "weight_version" in schedules["flows/eval.py:evaluate"][0]["parameters"]


def test_a_schedule_pointing_outside_is_rejected():
    entry = {"name": "default", "entrypoint": "flows/eval.py:evaluate",
             "schedules": [{"cron": "0 3 * * *", "parameters": {"input": "/etc/passwd", "weight_version": 1}}]}
    with pytest.raises(ConfigError, match="eval/default schedule 1: parameter input"):
        check_parameters("eval", entry, NemoGenSettings.load())


def test_redact_masks_credentials():
    text = redact("http://bob:hunter2@host/api token=abc123 Authorization: Bearer xyz hf_" + "a" * 30)
    assert "hunter2" not in text and "abc123" not in text and "xyz" not in text and "hf_aaa" not in text
    assert redact("shard 0 died: ActorDiedError") == "shard 0 died: ActorDiedError"


def test_resume_and_overwrite_reach_the_runs_settings(tmp_path):
    """A scheduled run with a fixed ``output`` is refused on its second run unless it says what to do
    with the earlier rows: continue them (``resume``) or replace them (``overwrite``)."""
    from flows.generate import settings_for

    base = {"input": str(tmp_path / "p.jsonl"), "output": str(tmp_path / "o.jsonl")}
    plain = settings_for(GenerateParams(**base))
    assert not plain.run.resume and not plain.run.overwrite
    assert settings_for(GenerateParams(**base, overwrite=True)).run.overwrite
    assert settings_for(GenerateParams(**base, resume=True)).run.resume
