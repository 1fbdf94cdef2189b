"""A deployment run's Prefect ``job_variables`` cannot rewrite the worker's process (the
reliability review's finding 5): nemo-gen's work pool template (``flows.pool``) fixes
``command``, ``env`` and ``working_dir``, and a run whose job variables try to set them — or
anything outside ``flows.trust.JOB_VARIABLES`` — is refused at its start, naming the variable.

The job configuration is built with Prefect's own code, as the process worker builds it for a
run (``from_template_and_values`` over the deployment's and the run's variables, then
``prepare_for_flow_run``); no server is needed for it. tests/flows/test_job_variables.py runs the
same against a real server and a real worker."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

import pytest
import yaml

from flows.deploy import SPEC, check_file
from flows.pool import base_job_template
from flows.trust import JOB_VARIABLES, REFUSED_JOB_VARIABLES, check_job_variables
from nemo_gen.errors import ConfigError

#: What the review's probe (p4_deploy_trust.py) passed as a flow run's job variables.
ATTACK = {"command": "sh -c 'id > /tmp/nemo-gen-pwned'", "working_dir": "/tmp",
          "env": {"NEMO_GEN_PREFECT__ALLOWED_PATHS": '["/"]', "LD_PRELOAD": "/tmp/x.so"}}


def _job_configuration(template: dict, job_variables: dict):
    """The process worker's configuration for a run with ``job_variables``."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.workers.process import ProcessJobConfiguration

    # client: only consulted for block and variable references, which neither side holds
    config = asyncio.run(ProcessJobConfiguration.from_template_and_values(
        base_job_template=template, values=job_variables, client=object()))
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="run", flow_id=uuid.uuid4()))
    return config


# -- the refusal ----------------------------------------------------------------------------


@pytest.mark.parametrize("job_variables, key", [
    ({"command": "sh -c 'id'"}, "command"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
    ({"env.LD_PRELOAD": "/tmp/x.so"}, "env.LD_PRELOAD"),  # Prefect reads it as env's key
    ({"working_dir": "/tmp"}, "working_dir"),
    ({"name": "x"}, "name"),
    ({"labels": {"a": "b"}}, "labels"),
    ({"image": "evil:latest"}, "image"),  # not a process pool's, refused all the same
])
def test_a_job_variable_off_the_list_is_refused_by_name(job_variables, key):
    with pytest.raises(ConfigError) as info:
        check_job_variables(job_variables)
    assert str(info.value).startswith(f"job_variables.{key}: not allowed in a deployment run"), \
        str(info.value)
    assert info.value.field == f"job_variables.{key}"


def test_every_refused_job_variable_is_named_at_once_with_its_reason():
    with pytest.raises(ConfigError) as info:
        check_job_variables({"stream_output": False, **ATTACK})
    assert info.value.fields == ["job_variables.command", "job_variables.working_dir", "job_variables.env"]
    message = str(info.value)
    assert "LD_PRELOAD" in message and "the command the worker runs" in message, message
    assert message.endswith("(a run's job_variables may set only: stream_output)"), message


@pytest.mark.parametrize("job_variables", [None, {}, {"stream_output": False}])
def test_the_listed_job_variables_pass(job_variables):
    check_job_variables(job_variables)


# -- the pool's template --------------------------------------------------------------------


def test_the_template_declares_only_the_listed_variables_and_no_other():
    # (that the server accepts it: tests/flows/test_job_variables.py creates the pool with it)
    template = base_job_template()
    assert set(template["variables"]["properties"]) == set(JOB_VARIABLES)
    assert template["variables"]["additionalProperties"] is False
    config = template["job_configuration"]
    assert "env" not in config and "working_dir" not in config, config
    assert config["command"] == "python -m prefect.engine"  # fixed: no placeholder
    assert set(REFUSED_JOB_VARIABLES) >= {"command", "env", "working_dir"}


def test_prefects_default_template_lets_a_run_rewrite_the_process():
    """The review's finding, as measured: why the template is replaced."""
    from prefect.workers.process import ProcessWorker

    config = _job_configuration(ProcessWorker.get_default_base_job_template(), ATTACK)
    assert config.command == ATTACK["command"] and str(config.working_dir) == "/tmp"
    assert config.env["LD_PRELOAD"] == "/tmp/x.so"


@pytest.mark.parametrize("job_variables", [ATTACK, {"env.LD_PRELOAD": "/tmp/x.so", "env.NEMO_GEN_HOME": "/"}],
                         ids=["nested", "dotted"])
def test_the_job_configuration_of_a_run_that_tries_holds_the_workers_own(monkeypatch, job_variables):
    monkeypatch.setenv("NEMO_GEN_PREFECT__ALLOWED_PATHS", '["/srv/data"]')  # the worker's
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    config = _job_configuration(base_job_template(), job_variables)
    # the command the process worker builds for a deployment's run: its interpreter, Prefect's engine
    assert config.command.split() == [sys.executable, "-m", "prefect.engine"], config.command
    assert config.working_dir is None  # a fresh temporary directory, then the pull step's
    assert "LD_PRELOAD" not in config.env
    assert config.env["NEMO_GEN_PREFECT__ALLOWED_PATHS"] == '["/srv/data"]'
    assert config.env.get("NEMO_GEN_HOME") == os.environ.get("NEMO_GEN_HOME")
    assert config.env["PREFECT__FLOW_RUN_ID"]  # Prefect's own run variables still reach the run


def test_a_listed_variable_still_acts():
    assert _job_configuration(base_job_template(), {"stream_output": False}).stream_output is False
    assert _job_configuration(base_job_template(), {}).stream_output is True


def test_prefects_schema_check_refuses_what_the_template_does_not_declare():
    """The check the server runs when a deployment's run (or a deployment) is created with job
    variables (``validate_job_variables_for_deployment_flow_run``)."""
    from prefect.utilities.schema_tools import ValidationError, validate

    variables = base_job_template()["variables"]
    for key, value in ATTACK.items():
        with pytest.raises(ValidationError, match=f"'{key}' was unexpected"):
            validate({key: value}, variables, raise_on_error=True, preprocess=True, allow_none_with_default=True)
    validate({"stream_output": False}, variables, raise_on_error=True, preprocess=True, allow_none_with_default=True)


# -- the deployments file and the flow's start ------------------------------------------------


def test_a_deployments_file_that_sets_env_is_refused_by_name(tmp_path):
    data = yaml.safe_load(SPEC.read_text())
    data["deployments"][2]["work_pool"] = {**data["deployments"][2]["work_pool"],
                                           "job_variables": {"stream_output": False, "env": {"A": "b"}}}
    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        check_file(data, bad)
    assert info.value.field == "deployments[2] (flows/refit.py:refit).work_pool.job_variables.env"
    assert str(bad) in str(info.value) and "does not let a deployment set it" in str(info.value)
    check_file(yaml.safe_load(SPEC.read_text()), SPEC)  # the repository's own file passes


def test_a_deployment_run_with_job_variables_is_refused_before_its_parameters_are_read(monkeypatch, tmp_path):
    import flows.params as params
    from flows.generate import settings_for

    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__ID", str(uuid.uuid4()))
    # outside a real flow run Prefect's runtime holds no job variables: this one's, as a worker's run has
    monkeypatch.setattr(params, "run_job_variables", lambda: {"working_dir": "/tmp"})
    with pytest.raises(ConfigError) as info:  # the parameters are bad too: the job variable comes first
        params.checked(params.GenerateParams, {"input": "", "config": str(tmp_path / "missing.yaml")}, "generate",
                       settings_for)
    assert info.value.field == "job_variables.working_dir", str(info.value)
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__ID")
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    params.checked(params.GenerateParams, {"input": str(prompts)}, "generate", settings_for)  # not a deployment's
