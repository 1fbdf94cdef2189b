"""`nemo-gen deploy` registers every field a deployments file holds: the file is registered
against a real Prefect API (the test harness) and each registered deployment — and the
automation its trigger became — is compared with what the file says. A key Prefect's own loader
would silently ignore is refused, naming it, before anything is registered."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from pathlib import Path

import pytest
import yaml

from flows.deploy import ROOT, SPEC, deploy
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings

pytestmark = pytest.mark.flows

EVERY_FIELD = Path(__file__).resolve().parents[1] / "data" / "deployments" / "every_field.yaml"


def _settings(pool: str) -> NemoGenSettings:
    return NemoGenSettings.load(overrides={"prefect.work_pool": pool})


def _resolve_root(value):
    """The file's ``{{ $NEMO_GEN_ROOT }}``, as deploy fills it in."""
    if isinstance(value, str):
        return value.replace("{{ $NEMO_GEN_ROOT }}", str(ROOT))
    if isinstance(value, dict):
        return {k: _resolve_root(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_root(v) for v in value]
    return value


async def _registered(flow_and_names: list[str]) -> dict[str, tuple]:
    from prefect.client.orchestration import get_client

    out = {}
    async with get_client() as client:
        for name in flow_and_names:
            dep = await client.read_deployment_by_name(name)
            automations = await client.read_resource_related_automations(f"prefect.deployment.{dep.id}")
            out[name] = (dep, [a for a in automations if a.name != "nemo-gen-rerun-crashed"])
    return out


def _flows(spec: Path) -> dict:
    """entrypoint -> the flow, loaded as deploy loads it."""
    from prefect import flow

    return {e["entrypoint"]: flow.from_source(source=str(ROOT), entrypoint=e["entrypoint"])
            for e in yaml.safe_load(spec.read_text())["deployments"]}


def _unset_version(flow) -> str:
    """Prefect's rule for a deployment that names no version: what it infers from the checkout
    (git's commit where the tree is a git checkout, as CI's clean clone is), else the flow's."""
    from prefect._internal.versioning import get_inferred_version_info

    try:
        inferred = asyncio.run(get_inferred_version_info())
    except (ValueError, OSError):
        inferred = None
    return inferred.version if inferred is not None else flow.version


def _assert_as_written(entry: dict, flow, dep, automations: list, pool: str, pull: list) -> None:
    name = entry["name"]
    assert dep.work_pool_name == pool, name  # prefect.work_pool, whatever the file names
    wp = entry.get("work_pool") or {}
    assert dep.work_queue_name == (wp.get("work_queue_name") or "default"), name
    assert dep.job_variables == wp.get("job_variables", {}), name
    assert dep.version == entry.get("version", _unset_version(flow)), name
    assert dep.tags == entry.get("tags", []), name
    if "description" in entry:
        assert dep.description == entry["description"], name
    assert dep.parameters == entry.get("parameters", {}), name
    assert dep.paused == entry.get("paused", False), name
    assert dep.enforce_parameter_schema == entry.get("enforce_parameter_schema", True), name
    assert dep.entrypoint == entry["entrypoint"], name
    assert dep.pull_steps == _resolve_root(pull), name
    limit = entry.get("concurrency_limit")
    if isinstance(limit, dict):
        assert dep.global_concurrency_limit.limit == limit["limit"], name
        assert dep.concurrency_options.collision_strategy == limit["collision_strategy"], name
    elif limit is None:
        assert dep.global_concurrency_limit is None, name
    else:
        assert dep.global_concurrency_limit.limit == limit, name
    written = entry.get("schedules") or []
    assert len(dep.schedules) == len(written), name
    by_slug = {s.slug: s for s in dep.schedules}
    for i, s in enumerate(written):
        got = by_slug[s["slug"]] if "slug" in s else dep.schedules[i]
        assert got.active == s.get("active", True), (name, i)
        assert got.parameters == s.get("parameters", {}), (name, i)
        if "cron" in s:
            assert got.schedule.cron == s["cron"] and got.schedule.timezone == s.get("timezone"), (name, i)
        elif "interval" in s:
            assert got.schedule.interval == datetime.timedelta(seconds=s["interval"]), (name, i)
        else:
            # Prefect stores the rule with a DTSTART line in front of it
            assert got.schedule.rrule.splitlines()[-1] == s["rrule"], (name, i)
            assert got.schedule.timezone == s.get("timezone"), (name, i)
    triggers = entry.get("triggers") or []
    assert len(automations) == len(triggers), name
    for trigger, automation in zip(triggers, automations):
        assert automation.enabled == trigger.get("enabled", True), name
        assert automation.trigger.expect == set(trigger["expect"]), name
        assert automation.trigger.match.model_dump() == trigger["match"], name
        assert automation.trigger.match_related.model_dump() == trigger["match_related"], name
        (action,) = automation.actions
        assert action.type == "run-deployment" and action.deployment_id == dep.id, name
        assert action.parameters == trigger.get("parameters"), name


@pytest.mark.parametrize("spec", [EVERY_FIELD, SPEC], ids=["every-field", "deployments-prefect.yaml"])
def test_each_registered_deployment_is_the_file(prefect_harness, spec):
    pool = f"pool-{uuid.uuid4().hex[:8]}"
    results = deploy(_settings(pool), spec).deployments
    assert [r.error for r in results] == [None] * len(results)
    data = yaml.safe_load(spec.read_text())
    flows = _flows(spec)
    expected = {f"{flows[e['entrypoint']].name}/{e['name']}": e for e in data["deployments"]}
    assert {r.deployment for r in results} == set(expected)
    registered = asyncio.run(_registered(list(expected)))
    for key, entry in expected.items():
        dep, automations = registered[key]
        _assert_as_written(entry, flows[entry["entrypoint"]], dep, automations, pool, data.get("pull") or [])


def test_a_key_prefect_would_ignore_is_refused_before_anything_is_registered(prefect_harness, tmp_path):
    data = yaml.safe_load(EVERY_FIELD.read_text())
    data["deployments"][1]["concurency_limit"] = 3  # sic
    for entry in data["deployments"]:
        entry["name"] = "refused-" + entry["name"]
    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        deploy(_settings("pool-refused"), bad)
    assert "'concurency_limit' is not a field" in str(info.value) and "did you mean 'concurrency_limit'" in str(info.value)
    assert str(bad) in str(info.value)

    async def names():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return {d.name for d in await client.read_deployments()}

    assert not any(n.startswith("refused-") for n in asyncio.run(names()))


@pytest.mark.parametrize("schedule, says", [({"cron": "0 3 * * *", "interval": 60}, "Exactly one of"),
                                            ({"cron": "0 3 * * *", "timezon": "UTC"}, "timezon")])
def test_a_bad_schedule_is_refused_by_name(prefect_harness, tmp_path, schedule, says):
    data = yaml.safe_load(SPEC.read_text())
    data["deployments"][0]["schedules"] = [schedule]
    bad = tmp_path / "prefect.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        deploy(_settings("pool-bad-schedule"), bad)
    assert "schedules[0]" in str(info.value) and says in str(info.value)


def test_deploying_again_leaves_the_crash_automation_as_it_is_and_a_change_replaces_it(prefect_harness):
    async def automations():
        from prefect.client.orchestration import get_client

        from flows.deploy import AUTOMATION

        async with get_client() as client:
            return await client.read_automations_by_name(AUTOMATION)

    pool = f"pool-{uuid.uuid4().hex[:8]}"
    deploy(_settings(pool), SPEC)
    (first,) = asyncio.run(automations())
    deploy(_settings(pool), SPEC)  # the same deployments, the same reruns: nothing to write
    assert [a.id for a in asyncio.run(automations())] == [first.id]
    deploy(NemoGenSettings.load(overrides={"prefect.work_pool": pool, "prefect.crash_reruns": 3}), SPEC)
    (changed,) = asyncio.run(automations())
    assert changed.id != first.id and changed.trigger.match.model_dump()["prefect.run-count"] == ["1", "2", "3"]
    assert changed.trigger.match_related == first.trigger.match_related
