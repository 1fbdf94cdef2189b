"""Register ``deployments/prefect.yaml`` with a Prefect API (what ``nemo-gen deploy`` does):
check the file, create the process work pool or correct its template (``flows.pool``), hand
each deployment to Prefect's own deploy (what ``prefect deploy`` runs), and install the
automation that re-runs crashed flow runs.

Checked before anything is registered: every key of the file is one Prefect's deployment model
holds (Prefect's own loader ignores a misspelt key; here it is an error naming it), schedules and
triggers validate as Prefect's, ``work_pool.job_variables`` sets only what nemo-gen's pool lets
a run set (``flows.trust.JOB_VARIABLES``), and every parameter the file sets is valid and inside
the allowed paths, and its ``overrides`` set only keys a deployment run may override
(``flows.trust``). Then every field reaches the API as written — name, version, version_type,
description, tags, parameters, schedules (cron / interval / rrule, timezone, anchor, active,
their parameters, slug), paused, concurrency_limit (with collision_strategy), enforce_parameter_
schema, work_pool.job_variables and work_queue_name, triggers, sla, pull steps — except the
work pool's name: nemo-gen deploy uses ``prefect.work_pool``. ``{{ $NEMO_GEN_ROOT }}`` is the
repository root unless set.

Why an automation: flow ``retries`` only cover a flow that raises. A flow-run process that is
killed (OOM killer, a node going away, SIGKILL) is reported Crashed and never retried. The
automation moves such a run back to ``AwaitingRetry`` — the same run, same parameters, the UI's
"Retry" — and the worker runs it again; a run that crashes ``prefect.crash_reruns + 1`` times
stays Crashed (the event's ``prefect.run-count`` label bounds the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from flows.params import PARAMS, check_allowed_paths, validate_params
from flows.pool import PoolChange, ensure_work_pool
from flows.trust import check_overrides, job_variable_problems
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "deployments" / "prefect.yaml"
AUTOMATION = "nemo-gen-rerun-crashed"

# Top-level keys besides Prefect's own: YAML anchors live under `definitions` (Prefect's CLI
# skips it too).
_EXTRA_TOP_LEVEL = {"definitions"}


@dataclass
class Registered:
    deployment: str                  # flow/deployment, or the entrypoint when it did not load
    id: UUID | None = None
    error: str | None = None


@dataclass
class Deployed:
    pool: PoolChange                 # what became of the work pool (flows.pool)
    deployments: list[Registered]


def load_file(path: Path = SPEC) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the deployments file: {exc}", field=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("the top level must be a mapping", field=str(path))
    return data


def load_spec(path: Path = SPEC) -> list[dict[str, Any]]:
    return list(load_file(path).get("deployments") or [])


def check_file(data: dict[str, Any], path: Path = SPEC) -> None:
    """Every key is one Prefect's deployment model holds; schedules and triggers are Prefect's."""
    from prefect.cli.deploy._models import (
        ConcurrencyLimitSpec,
        DeploymentConfig,
        PrefectYamlModel,
        RawScheduleConfig,
        WorkPoolConfig,
    )
    from pydantic import TypeAdapter, ValidationError

    from nemo_gen.config.loader import suggest

    def unknown(keys, model, where: str, extra: set[str] = frozenset()) -> None:
        known = set(extra)
        for name, info in model.model_fields.items():
            known |= {name, info.alias or name}
        for key in keys:
            if key not in known:
                raise ConfigError(f"{path}: {where}: {key!r} is not a field of a Prefect deployment file"
                                  f"{suggest(str(key), known)}", field=f"{where}.{key}".lstrip("."))

    unknown(data, PrefectYamlModel, "(top level)", _EXTRA_TOP_LEVEL)
    from prefect.events import DeploymentTriggerTypes

    triggers = TypeAdapter(DeploymentTriggerTypes)
    for i, entry in enumerate(data.get("deployments") or []):
        where = f"deployments[{i}] ({entry.get('entrypoint', '?')})"
        if not isinstance(entry, dict):
            raise ConfigError(f"{path}: {where} must be a mapping", field=where)
        unknown(entry, DeploymentConfig, where)
        if isinstance(entry.get("work_pool"), dict):
            unknown(entry["work_pool"], WorkPoolConfig, f"{where}.work_pool")
            # nemo-gen's pool would ignore them (or its server refuse them): refused here, by name
            for key, why in job_variable_problems(entry["work_pool"].get("job_variables")):
                field = f"{where}.work_pool.job_variables.{key}"
                raise ConfigError(f"{path}: {field}: nemo-gen's work pool does not let a deployment set it: {why}",
                                  field=field)
        if isinstance(entry.get("concurrency_limit"), dict):
            unknown(entry["concurrency_limit"], ConcurrencyLimitSpec, f"{where}.concurrency_limit")
        checks = [(f"schedules[{j}]", RawScheduleConfig.model_validate, s)
                  for j, s in enumerate(entry.get("schedules") or [])]
        checks += [(f"triggers[{j}]", triggers.validate_python, {"name": "check", **t})
                   for j, t in enumerate(entry.get("triggers") or [])]
        for what, validate, value in checks:
            try:
                validate(value)
            except ValidationError as exc:
                problems = "; ".join(
                    (f"{'.'.join(str(p) for p in e['loc'])}: " if e["loc"] else "") + e["msg"] for e in exc.errors()
                )
                raise ConfigError(f"{path}: {where}.{what}: {problems}", field=f"{where}.{what}") from None
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{path}: {where}.{what}: {exc}", field=f"{where}.{what}") from None


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
            check_overrides(values.get("overrides"))  # what each run would refuse, refused now
            # Runs start in the repository root: relative paths are taken from there.
            check_allowed_paths(values, settings, base=ROOT, fields=model.path_fields)
        except ConfigError as exc:
            err = ConfigError(f"deployment {where}: {exc}")
            err.field = exc.field
            raise err from None


def deploy(settings: NemoGenSettings, spec: Path = SPEC) -> Deployed:
    """Register what ``spec`` declares on ``prefect.work_pool``, created or corrected to nemo-gen's
    template (``flows.pool``). The file and every parameter are checked before anything is
    registered; an entrypoint that cannot be loaded is reported, the rest go ahead. Entrypoints
    are relative to the repository root."""
    from prefect import flow as prefect_flow

    data = load_file(spec)
    check_file(data, spec)
    loaded, results = [], []
    for entry in data.get("deployments") or []:
        try:
            fl = prefect_flow.from_source(source=str(ROOT), entrypoint=entry["entrypoint"])
        except Exception as exc:  # a missing file or function: say which, register the others
            results.append(Registered(entry["entrypoint"], error=f"cannot load {entry['entrypoint']}: {exc}"))
            continue
        check_parameters(fl.name, entry, settings)
        loaded.append((fl, entry))
    pool = settings.prefect.work_pool
    change = asyncio.run(ensure_work_pool(pool))
    actions = {key: data[key] for key in ("build", "push", "pull") if data.get(key)}
    results += asyncio.run(_register_all(loaded, actions, pool, spec))
    ids = [r.id for r in results if r.id is not None]
    if ids:
        asyncio.run(ensure_crash_automation(ids, settings.prefect.crash_reruns))
    return Deployed(change, results)


async def _register_all(loaded, actions: dict[str, Any], pool: str, spec: Path) -> list[Registered]:
    from prefect.client.orchestration import get_client

    out = []
    with _at_root():
        async with get_client() as client:
            for fl, entry in loaded:
                name = f"{fl.name}/{entry['name']}"
                try:
                    await _prefect_deploy(entry, actions, pool, client, spec)
                    deployment = await client.read_deployment_by_name(name)
                except Exception as exc:  # noqa: BLE001 - one deployment's failure is reported, the rest go on
                    out.append(Registered(name, error=f"{type(exc).__name__}: {exc}"))
                    continue
                out.append(Registered(name, id=deployment.id))
    return out


async def _prefect_deploy(entry: dict[str, Any], actions: dict[str, Any], pool: str, client, spec: Path) -> None:
    """One deployment through Prefect's own deploy (``prefect deploy``'s code path), quietly.
    The work pool is nemo-gen's (``prefect.work_pool``), whatever the file names."""
    from prefect.cli.deploy._core import _run_single_deploy
    from rich.console import Console

    config = copy.deepcopy(entry)
    config["work_pool"] = {**(config.get("work_pool") or {}), "name": pool}
    # Prefect prints a panel per deployment; our caller prints one table for all (or JSON).
    with contextlib.redirect_stdout(io.StringIO()):
        await _run_single_deploy(
            config, copy.deepcopy(actions), {}, client=client, prefect_file=spec,
            console=Console(file=io.StringIO()), is_interactive=lambda: False,
        )


@contextlib.contextmanager
def _at_root():
    """Entrypoints and relative paths resolve from the repository root; ``{{ $NEMO_GEN_ROOT }}``
    (the pull step's working directory) is that root unless the caller set it."""
    old_cwd, old_root = os.getcwd(), os.environ.get("NEMO_GEN_ROOT")
    os.environ.setdefault("NEMO_GEN_ROOT", str(ROOT))
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_root is None:
            os.environ.pop("NEMO_GEN_ROOT", None)


async def ensure_crash_automation(deployment_ids: list[UUID], reruns: int) -> UUID | None:
    """(Re)create the automation: a Crashed run of one of these deployments goes back to
    AwaitingRetry, at most ``reruns`` times per run. One already as wanted is left as it is: each
    write is a commit the server must survive (Prefect 3.7 on SQLite can hang there,
    ``nemo_gen.prefect_server``), and a deploy run again changes nothing."""
    from prefect.client.orchestration import get_client

    wanted = _crash_automation(deployment_ids, reruns) if reruns > 0 else None  # 0: crashed runs stay Crashed
    async with get_client() as client:
        existing = await client.read_automations_by_name(AUTOMATION)
        if wanted is not None and len(existing) == 1 and _same_automation(existing[0], wanted):
            return existing[0].id
        for old in existing:
            await client.delete_automation(old.id)
    if wanted is None:
        return None
    created = await wanted.acreate()
    return created.id


def _crash_automation(deployment_ids: list[UUID], reruns: int):
    from prefect.automations import Automation, EventTrigger, Posture
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState

    return Automation(
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


def _same_automation(registered, wanted) -> bool:
    """Whether the server's automation says what ``wanted`` says (ids, which each side makes
    its own — the automation's, its trigger's — aside)."""
    def meaning(value):
        if isinstance(value, dict):
            return {k: meaning(v) for k, v in value.items() if k not in ("id", "created", "updated")}
        if isinstance(value, list):
            return [meaning(v) for v in value]
        return value

    fields = set(type(wanted).model_fields)
    return meaning(registered.model_dump(include=fields)) == meaning(wanted.model_dump(include=fields))
