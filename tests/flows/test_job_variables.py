"""A deployment run's Prefect job variables cannot rewrite the worker's process, on a real Prefect
server (the test harness's) with a real process worker (the reliability review's finding 5).

- ``nemo-gen deploy``'s pool declares only ``flows.trust.JOB_VARIABLES``: the server refuses a
  deployment's run whose ``job_variables`` set ``command``, ``env`` or ``working_dir``, naming it
  (Prefect's ``POST /flow_runs/`` does not check them: hence the check at the flow's start).
- A pool left with Prefect's default template (an older ``nemo-gen deploy``) let such a run be
  created; deploying again updates the template, after which the job configuration the worker
  builds for that run holds the worker's command, environment and directory, not the run's, and
  the flow refuses the run at its start, naming the variable: its command never ran, and not one
  task of the flow did."""

from __future__ import annotations

import asyncio
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from flows.deploy import SPEC, deploy
from flows.pool import PoolChange, base_job_template
from nemo_gen.settings import NemoGenSettings

pytestmark = pytest.mark.flows


def _generate_only(tmp_path: Path) -> Path:
    """deployments/prefect.yaml with only its generate deployment (the others add nothing here)."""
    data = yaml.safe_load(SPEC.read_text())
    data["deployments"] = [e for e in data["deployments"] if e["entrypoint"] == "flows/generate.py:generate"]
    spec = tmp_path / "prefect.yaml"
    spec.write_text(yaml.safe_dump(data))
    return spec


def _deploy(pool: str, spec: Path):
    # crash_reruns=0: no automation to write, nothing here crashes
    deployed = deploy(NemoGenSettings.load(overrides={"prefect.work_pool": pool, "prefect.crash_reruns": 0}), spec)
    assert [r.error for r in deployed.deployments] == [None], deployed
    return deployed


async def _call(fn):
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        return await fn(client)


def _run(fn):
    return asyncio.run(_call(fn))


def _job_configuration(run_id, pool: str):
    """What the process worker builds for the run (``BaseWorker._submit_run_and_capture_errors``)."""
    from prefect.workers.process import ProcessJobConfiguration

    async def build(client):
        return await ProcessJobConfiguration.resolve_for_flow_run(
            await client.read_flow_run(run_id), client=client, work_pool=await client.read_work_pool(pool),
            worker_name="test")

    return _run(build)


def test_the_server_refuses_a_run_that_sets_command_env_or_working_dir(prefect_harness, tmp_path):
    from prefect.exceptions import PrefectHTTPStatusError

    pool = f"jv-{uuid.uuid4().hex[:8]}"
    assert _deploy(pool, _generate_only(tmp_path)).pool is PoolChange.CREATED
    dep = _run(lambda c: c.read_deployment_by_name("generate/default"))
    for job_variables, key in [({"command": "sh -c 'id'"}, "command"), ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "env"),
                               ({"working_dir": "/tmp"}, "working_dir")]:
        with pytest.raises(PrefectHTTPStatusError) as info:
            _run(lambda c: c.create_flow_run_from_deployment(dep.id, parameters={"input": "in.jsonl"},
                                                             job_variables=job_variables))
        assert info.value.response.status_code == 422
        assert f"'{key}' was unexpected" in info.value.response.text, info.value.response.text
    # what the pool declares is still accepted (the run is deleted: no worker here runs it)
    run = _run(lambda c: c.create_flow_run_from_deployment(dep.id, parameters={"input": "in.jsonl"},
                                                           job_variables={"stream_output": False}))
    _run(lambda c: c.delete_flow_run(run.id))
    # Prefect's other route to a flow run does not check them: why the flow checks at its start
    from prefect.settings import PREFECT_API_URL

    created = httpx.post(f"{PREFECT_API_URL.value()}/flow_runs/", timeout=30, json={
        "flow_id": str(dep.flow_id), "deployment_id": str(dep.id), "job_variables": {"command": "sh -c 'id'"}})
    assert created.status_code == 201, created.text
    _run(lambda c: c.delete_flow_run(uuid.UUID(created.json()["id"])))


def test_a_run_the_default_template_let_through_is_refused_at_its_start(prefect_harness, tmp_path):
    from prefect.client.schemas.actions import WorkPoolUpdate
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.workers.process import ProcessWorker

    pool, spec = f"jv-{uuid.uuid4().hex[:8]}", _generate_only(tmp_path)
    marker = tmp_path / "pwned"
    attack = {"command": f"sh -c 'touch {marker}'", "working_dir": str(tmp_path),
              "env": {"NEMO_GEN_PREFECT__ALLOWED_PATHS": '["/"]', "LD_PRELOAD": str(tmp_path / "x.so")}}
    _deploy(pool, spec)
    # the pool as an older `nemo-gen deploy` created it: Prefect's default process template
    default = WorkPoolUpdate(base_job_template=ProcessWorker.get_default_base_job_template())
    _run(lambda c: c.update_work_pool(pool, default))
    dep = _run(lambda c: c.read_deployment_by_name("generate/default"))
    run = _run(lambda c: c.create_flow_run_from_deployment(dep.id, parameters={"input": "in.jsonl"},
                                                           job_variables=attack))
    before = _job_configuration(run.id, pool)
    assert before.command == attack["command"] and before.env["LD_PRELOAD"] == attack["env"]["LD_PRELOAD"]

    assert _deploy(pool, spec).pool is PoolChange.UPDATED  # detected and corrected
    assert _run(lambda c: c.read_work_pool(pool)).base_job_template == base_job_template()
    after = _job_configuration(run.id, pool)
    assert after.command.split() == [sys.executable, "-m", "prefect.engine"], after.command
    assert after.working_dir is None and "LD_PRELOAD" not in after.env, (after.working_dir, after.env)
    assert after.env.get("NEMO_GEN_PREFECT__ALLOWED_PATHS") != attack["env"]["NEMO_GEN_PREFECT__ALLOWED_PATHS"]

    # a real process worker runs it: the flow starts, and refuses the run by the variables' names
    asyncio.run(ProcessWorker(work_pool_name=pool, limit=1).start(run_once=True, printer=lambda *a: None))
    final = _run(lambda c: c.read_flow_run(run.id))
    assert final.state.is_failed(), final.state
    for key in ("command", "working_dir", "env"):
        assert f"job_variables.{key}: not allowed in a deployment run" in final.state.message, final.state.message
    assert not marker.exists()  # the run's command never ran
    tasks = _run(lambda c: c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id]))))
    assert tasks == [], [t.name for t in tasks]  # nothing of the flow ran
    assert _deploy(pool, spec).pool is PoolChange.UNCHANGED
