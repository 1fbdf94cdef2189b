"""The pipeline flow under a real Prefect API (the test harness), on the session Ray cluster:
every task and the RayTaskRunner subflow complete, artifacts are published."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.flows


def _overrides(tiny_model_dir, tmp_path, **extra):
    values = {
        "home": str(tmp_path / "home"),
        "model.path": str(tiny_model_dir),
        "fleet.device": "cpu",
        "fleet.name": "flow-test",
        "fleet.num_shards": 1,
        "ray.namespace": "nemo_gen_tests",
        "generation.max_new_tokens": 8,
        "generation.vllm_cfg.max_model_len": 256,
        "run.output": str(tmp_path / "out.jsonl"),
        **extra,
    }
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in values.items()]


async def _runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        parent = await client.read_flow_run(flow_run_id)
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        subflows = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
        )
        sub_tasks = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(id={"any_": [f.id for f in subflows]})
        ) if subflows else []
        artifacts = await client.read_artifacts()
    return parent, tasks, subflows, sub_tasks, artifacts


def test_pipeline_flow_runs_every_step(prefect_harness, ray_cluster, tiny_model_dir, tmp_path):
    from flows.pipeline import generation_pipeline

    state = generation_pipeline(overrides=_overrides(tiny_model_dir, tmp_path), return_state=True)
    assert state.is_completed(), state
    summary = state.result()
    assert summary["requests"] == 8 and summary["failed"] == 0
    assert summary["weight_versions"] == [0]
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(1, 9))
    assert all(r["shard"] == 0 and r["weight_version"] == 0 and len(r["token_ids"]) == 8 for r in rows)

    parent, tasks, subflows, sub_tasks, artifacts = asyncio.run(_runs(state.state_details.flow_run_id))
    assert parent.state.is_completed()
    task_names = sorted(t.task_key.rsplit("-", 1)[0] for t in tasks)
    for step in ("configure_environment", "start_ray", "resolve_generation_config", "load_prompts",
                 "generate", "write_outputs", "shutdown_fleet"):
        assert any(step in key for key in task_names), (step, task_names)
    assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.type) for t in tasks]
    assert [f.name for f in subflows] and all(f.state.is_completed() for f in subflows)
    assert len(sub_tasks) == 1 and sub_tasks[0].name == "launch-shard-0"
    assert sub_tasks[0].state.is_completed()
    keys = {a.key for a in artifacts}
    assert {"fleet-health", "generation-throughput"} <= keys


def test_bad_settings_fail_the_flow_before_any_task(prefect_harness, tiny_model_dir, tmp_path):
    from flows.pipeline import generation_pipeline

    state = generation_pipeline(
        overrides=_overrides(tiny_model_dir, tmp_path, **{"fleet.bogus": 1}), return_state=True
    )
    assert state.is_failed()
    with pytest.raises(Exception, match="fleet.bogus"):
        state.result()
