"""Register ``deployments/prefect.yaml`` with a Prefect API (what ``nemo-gen deploy`` does):
validate every parameter the file sets, create the process work pool if missing, register the
deployments on it, and install the automation that re-runs crashed flow runs.

Why an automation: flow ``retries`` only cover a flow that raises. A flow-run process that is
killed (OOM killer, a node going away, SIGKILL) is reported Crashed and never retried. The
automation moves such a run back to ``AwaitingRetry`` — the same run, same parameters, the UI's
"Retry" — and the worker runs it again; a run that crashes ``prefect.crash_reruns + 1`` times
stays Crashed (the event's ``prefect.run-count`` label bounds the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from flows.params import PARAMS, check_allowed_paths, validate_params
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "deployments" / "prefect.yaml"
AUTOMATION = "nemo-gen-rerun-crashed"


@dataclass
class Registered:
    deployment: str                  # flow/deployment, or the entrypoint when it did not load
    id: UUID | None = None
    error: str | None = None


def load_spec(path: Path = SPEC) -> list[dict[str, Any]]:
    data = yaml.safe_load(path.read_text()) or {}
    return list(data.get("deployments") or [])


def _schedules(entry: dict[str, Any]) -> list[Any]:
    from prefect.schedules import Cron, Interval

    out = []
    for s in entry.get("schedules") or []:
        common = dict(active=s.get("active", True), parameters=s.get("parameters") or {})
        if "interval" in s:
            # Anchored at deploy time: the first run comes one interval later, not at once.
            anchor = datetime.datetime.now(datetime.timezone.utc)
            out.append(Interval(datetime.timedelta(seconds=s["interval"]), anchor_date=anchor, **common))
        elif "cron" in s:
            out.append(Cron(s["cron"], timezone=s.get("timezone"), **common))
        else:
            raise ConfigError(f"schedule {s!r}: give `interval` (seconds) or `cron`", field=entry["entrypoint"])
    return out


def check_parameters(flow_name: str, entry: dict[str, Any], settings: NemoGenSettings) -> None:
    """Every parameter the file sets — deployment defaults (may leave required ones to each run)
    and each schedule's (must be complete) — valid and inside the allowed paths."""
    model = PARAMS.get(flow_name)
    if model is None:
        return
    defaults = entry.get("parameters") or {}
    sets = [(f"{flow_name}/{entry['name']}", defaults, True)]
    for i, s in enumerate(entry.get("schedules") or []):
        sets.append((f"{flow_name}/{entry['name']} schedule {i + 1}", {**defaults, **(s.get("parameters") or {})}, False))
    for where, values, partial in sets:
        try:
            validate_params(model, values, flow_name, allow_missing=partial)
            # Runs start in the repository root: relative paths are taken from there.
            check_allowed_paths(values, settings, base=ROOT, fields=model.path_fields)
        except ConfigError as exc:
            err = ConfigError(f"deployment {where}: {exc}")
            err.field = exc.field
            raise err from None


def deploy(settings: NemoGenSettings, spec: Path = SPEC) -> list[Registered]:
    """Register what ``spec`` declares on ``prefect.work_pool``. Parameters are all checked before
    anything is registered; an entrypoint that cannot be loaded is reported, the rest go ahead."""
    from prefect import flow as prefect_flow

    loaded, results = [], []
    for entry in load_spec(spec):
        try:
            fl = prefect_flow.from_source(source=str(ROOT), entrypoint=entry["entrypoint"])
        except Exception as exc:  # a missing file or function: say which, register the others
            results.append(Registered(entry["entrypoint"], error=f"cannot load {entry['entrypoint']}: {exc}"))
            continue
        check_parameters(fl.name, entry, settings)
        loaded.append((fl, entry))
    pool = settings.prefect.work_pool
    asyncio.run(ensure_work_pool(pool))
    for fl, entry in loaded:
        # Prefect prints a table per deployment; our caller prints one for all (or JSON).
        with contextlib.redirect_stdout(io.StringIO()):
            deployment_id = _register(fl, entry, pool)
        results.append(Registered(f"{fl.name}/{entry['name']}", id=deployment_id))
    ids = [r.id for r in results if r.id is not None]
    if ids:
        asyncio.run(ensure_crash_automation(ids, settings.prefect.crash_reruns))
    return results


def _register(fl: Any, entry: dict[str, Any], pool: str) -> UUID:
    return fl.deploy(
        name=entry["name"],
        work_pool_name=pool,
        work_queue_name=(entry.get("work_pool") or {}).get("work_queue_name"),
        parameters=entry.get("parameters") or {},
        schedules=_schedules(entry),
        tags=entry.get("tags"),
        description=entry.get("description"),
        concurrency_limit=entry.get("concurrency_limit"),
        build=False,
        push=False,
        print_next_steps=False,
        ignore_warnings=True,
    )


async def ensure_work_pool(name: str) -> bool:
    """Create the process work pool ``name`` unless it exists; True when created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    async with get_client() as client:
        try:
            await client.read_work_pool(name)
            return False
        except ObjectNotFound:
            pass
        template = ProcessWorker.get_default_base_job_template()
        await client.create_work_pool(WorkPoolCreate(name=name, type="process", base_job_template=template))
        return True


async def ensure_crash_automation(deployment_ids: list[UUID], reruns: int) -> UUID | None:
    """(Re)create the automation: a Crashed run of one of these deployments goes back to
    AwaitingRetry, at most ``reruns`` times per run."""
    from prefect.automations import Automation, EventTrigger, Posture
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState

    async with get_client() as client:
        for old in await client.read_automations_by_name(AUTOMATION):
            await client.delete_automation(old.id)
    if reruns == 0:  # prefect.crash_reruns=0: crashed runs stay Crashed
        return None
    automation = Automation(
        name=AUTOMATION,
        description="Re-runs a crashed nemo-gen flow run (same run, same parameters), "
        f"at most {reruns} times. Created by `nemo-gen deploy`.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={
                "prefect.resource.id": "prefect.flow-run.*",
                # run-count is 1 on the first attempt; later attempts that crash stay Crashed
                "prefect.run-count": [str(n) for n in range(1, reruns + 1)],
            },
            match_related={
                "prefect.resource.role": "deployment",
                "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
            },
            posture=Posture.Reactive,
            threshold=1,
            within=datetime.timedelta(0),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED, name="AwaitingRetry",
                message="Crashed: re-run by the nemo-gen-rerun-crashed automation",
            )
        ],
    )
    created = await automation.acreate()
    return created.id
