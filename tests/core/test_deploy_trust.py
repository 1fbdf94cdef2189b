"""Deployment parameters are untrusted input (DESIGN.md invariant 8; the reliability review's
finding 2, probe A): in a deployment's run, ``overrides`` set only the keys of
``flows.trust.DEPLOYMENT_OVERRIDES`` — a key that would widen the run's reach is refused by name
before anything is read — and every path the run brings (parameters, the config and its
``defaults:`` files, the resolved settings) must lie inside the worker's allowed paths.

The run is a deployment's as Prefect's runtime reports it (``PREFECT__RUNTIME__DEPLOYMENT__ID``,
Prefect's own way to set its runtime values); the worker's environment is this process's, as
``NEMO_GEN_*`` variables. ``flows.params.checked`` is what every flow calls first."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from flows.generate import settings_for
from flows.params import GenerateParams, PipelineParams, RefitParams, checked, validate_params
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings


@pytest.fixture
def worker(monkeypatch, tmp_path):
    """A deployment's run whose worker allows ``tmp_path/allowed`` (home inside it); returns that
    directory, which holds a prompt file ``prompts.jsonl``."""
    allowed = tmp_path / "allowed"
    (allowed / "home").mkdir(parents=True)
    (allowed / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    for name in [n for n in os.environ if n.startswith("NEMO_GEN_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    monkeypatch.setenv("NEMO_GEN_HOME", str(allowed / "home"))
    monkeypatch.setenv("NEMO_GEN_PREFECT__ALLOWED_PATHS", json.dumps([str(allowed)]))
    return allowed


def _generate(allowed: Path, overrides: list[str], **params):
    values = {"input": str(allowed / "prompts.jsonl"), "overrides": overrides, **params}
    return checked(GenerateParams, values, "generate", settings_for)


def _refused(allowed: Path, overrides: list[str], **params) -> str:
    with pytest.raises(ConfigError) as info:
        _generate(allowed, overrides, **params)
    return str(info.value)


# -- probe A, as the review ran it ----------------------------------------------------------


@pytest.mark.parametrize("overrides, params, key", [
    (['prefect.allowed_paths=["/"]'], {"input": "/etc/passwd"}, "prefect.allowed_paths"),
    (["run.output=~/.bashrc"], {}, "run.output"),
    (['generation.vllm_cfg.env_vars={"LD_PRELOAD": "./x.so"}'], {}, "generation.vllm_cfg.env_vars"),
])
def test_probe_a_overrides_that_widen_the_run_are_refused_by_name(worker, overrides, params, key):
    message = _refused(worker, overrides, **params)
    assert f"{key}" in message and "not allowed in a deployment override" in message, message


# -- every way in ---------------------------------------------------------------------------


@pytest.mark.parametrize("override, key", [
    ('prefect.allowed_paths=["/"]', "prefect.allowed_paths"),
    ("prefect.api_url=http://elsewhere:4200/api", "prefect.api_url"),
    ("run.input=/etc/passwd", "run.input"),
    ("model.path=/etc", "model.path"),
    ("model.tokenizer=/etc", "model.tokenizer"),
    ("generation.model_name=/etc", "generation.model_name"),
    ("generation.vllm_cfg.env_vars.LD_PRELOAD=./x.so", "generation.vllm_cfg.env_vars.LD_PRELOAD"),
    ('generation={"vllm_cfg": {"env_vars": {"PYTHONPATH": "/tmp"}}}', "generation.vllm_cfg.env_vars.PYTHONPATH"),
    ("generation.vllm_cfg.env_vars={}", "generation.vllm_cfg.env_vars"),
    ('generation.vllm_kwargs={"trust_remote_code": true}', "generation.vllm_kwargs.trust_remote_code"),
    ("generation.vllm_cfg.worker_extension_cls=evil.Ext", "generation.vllm_cfg.worker_extension_cls"),
    ("generation.worker_extension_cls_fqn=evil.Ext", "generation.worker_extension_cls_fqn"),
    ("refit.staging_dir=/home", "refit.staging_dir"),
    ("refit.backend=ipc", "refit.backend"),
    ("home=/", "home"),
    ("ray.address=10.0.0.9:6379", "ray.address"),
    ("server.host=0.0.0.0", "server.host"),
    ("fleet.name=someone-elses", "fleet.name"),  # not on the list: which fleet the run acts on
    ("policy.model_name=/etc", "policy.model_name"),  # a NeMo-RL recipe's key
    ("generation.vllm_cfg.max_model_len=${oc.env:PREFECT_API_AUTH_STRING}", "generation.vllm_cfg.max_model_len"),
])
def test_every_key_off_the_list_is_refused_by_name_before_anything_is_read(worker, override, key):
    message = _refused(worker, [override])
    assert message.startswith(f"{key}: not allowed in a deployment override"), message


def test_every_refused_key_is_named_at_once(worker):
    with pytest.raises(ConfigError) as info:
        _generate(worker, ["generation.temperature=0.5", "home=/", 'prefect.allowed_paths=["/"]'])
    assert info.value.fields == ["home", "prefect.allowed_paths"]


def test_the_allowed_keys_reach_the_settings(worker):
    _, settings = _generate(worker, ["generation.temperature=0.25", "generation.max_new_tokens=7",
                                     "run.batch_size=3", "fleet.num_shards=3", "health.probe_interval_s=9",
                                     "generation.stop_strings=[\"\\n\\n\"]", "refit.in_flight=abort"])
    assert (settings.generation.temperature, settings.generation.max_new_tokens, settings.run.batch_size,
            settings.fleet.num_shards, settings.health.probe_interval_s, settings.generation.stop_strings,
            settings.refit.in_flight) == (0.25, 7, 3, 3, 9.0, ["\n\n"], "abort")


def test_the_list_names_only_settings_that_exist_and_no_path():
    from flows.trust import DEPLOYMENT_OVERRIDES, _is_path_field

    for key in DEPLOYMENT_OVERRIDES:
        model, parts = NemoGenSettings, key.split(".")
        for part in parts:
            assert part in model.model_fields, key
            model = model.model_fields[part].annotation
        assert not hasattr(model, "model_fields"), f"{key} is a section"
        assert not _is_path_field(parts), key


def test_outside_a_deployment_overrides_are_the_callers_own(worker, monkeypatch):
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID")
    _, settings = _generate(worker, ["generation.vllm_cfg.env_vars.LD_PRELOAD=./x.so"])
    assert settings.generation.vllm_cfg.env_vars == {"LD_PRELOAD": "./x.so"}


# -- files a config brings ------------------------------------------------------------------


def _config(allowed: Path, text: str, name: str = "run.yaml") -> str:
    path = allowed / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("how", ["absolute", "relative", "symlink"])
def test_a_defaults_file_outside_the_allowed_paths_is_refused_before_it_is_read(worker, tmp_path, how):
    outside = tmp_path / "outside"
    outside.mkdir()
    # what such a file could do if read: code in every engine
    (outside / "base.yaml").write_text("generation:\n  vllm_cfg:\n    env_vars: {LD_PRELOAD: /tmp/x.so}\n")
    entry = {"absolute": str(outside / "base.yaml"), "relative": "../outside/base.yaml", "symlink": "base.yaml"}[how]
    if how == "symlink":
        (worker / "base.yaml").symlink_to(outside / "base.yaml")
    config = _config(worker, f"defaults: {entry}\ngeneration: {{temperature: 0.5}}\n")
    message = _refused(worker, [], config=config)
    assert f"{config}: defaults: defaults entry {entry!r}" in message and "outside the allowed paths" in message, message


def test_a_defaults_chain_inside_the_allowed_paths_loads(worker):
    (worker / "base.yaml").write_text("generation: {top_p: 0.5}\n")
    config = _config(worker, "defaults: base.yaml\ngeneration: {temperature: 0.5}\n")
    _, settings = _generate(worker, [], config=config)
    assert (settings.generation.top_p, settings.generation.temperature) == (0.5, 0.5)


@pytest.mark.parametrize("text, key", [
    ("model: {path: /etc}\n", "model.path"),
    ("run: {output: /etc/cron.d/x}\n", "run.output"),
    ("refit: {staging_dir: /root}\n", "refit.staging_dir"),
    ("home: /\n", "home"),
])
def test_a_config_may_not_point_a_path_outside(worker, monkeypatch, text, key):
    monkeypatch.delenv("NEMO_GEN_HOME")  # the worker's environment wins over a config: leave home to it
    message = _refused(worker, [], config=_config(worker, text))
    assert message.startswith(f"{key}: ") and "outside the allowed paths" in message, message


def test_a_config_may_not_widen_the_allowed_paths(worker, monkeypatch):
    # a worker that leaves them empty allows the run's working directory and home, which holds
    # the config; the config then tries to allow everything
    monkeypatch.delenv("NEMO_GEN_PREFECT__ALLOWED_PATHS")
    home = worker / "home"
    (home / "prompts.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    config = _config(home, 'prefect: {allowed_paths: ["/"]}\n')
    message = _refused(worker, [], config=config, input=str(home / "prompts.jsonl"))
    assert message.startswith("prefect.allowed_paths: a deployment run's config may not change"), message


def test_a_path_the_workers_own_settings_hold_is_the_operators(worker, monkeypatch, tmp_path):
    # the model directory on storage every node mounts: the worker's environment names it
    monkeypatch.setenv("NEMO_GEN_MODEL__PATH", str(tmp_path / "models" / "llama"))
    _, settings = _generate(worker, [])
    assert settings.model.path == tmp_path / "models" / "llama"
    assert str(settings.refit.staging_dir) == "/dev/shm"  # the default: the operator's too


def test_a_checkpoint_outside_is_refused(worker):
    with pytest.raises(ConfigError, match="parameter checkpoint"):
        checked(RefitParams, {"checkpoint": "/etc"}, "refit")


# -- the deployments file and the pipeline flow ----------------------------------------------


def test_a_deployments_file_whose_overrides_would_be_refused_is_refused_at_deploy():
    from flows.deploy import check_parameters

    entry = {"name": "default", "entrypoint": "flows/generate.py:generate",
             "parameters": {"overrides": ["fleet.num_shards=2", "generation.vllm_kwargs.trust_remote_code=true"]}}
    with pytest.raises(ConfigError, match="deployment generate/default: generation.vllm_kwargs.trust_remote_code: "
                                          "not allowed in a deployment override"):
        check_parameters("generate", entry, NemoGenSettings.load())


@pytest.mark.parametrize("name", ["../../etc/x", ".hidden", "a/b", ""])
def test_the_pipeline_run_name_cannot_name_another_directory(name):
    with pytest.raises(ConfigError, match="name"):
        validate_params(PipelineParams, {"name": name}, "generation-pipeline")
    validate_params(PipelineParams, {"name": "bench-prefect.2"}, "generation-pipeline")
