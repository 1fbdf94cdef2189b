"""The ``heal`` flow: find lost shards of a running fleet and bring them back, on a schedule.

attach (no background monitor: recovery here is this flow's, with its retry policy in the UI)
-> probe every serving shard (one real token; crashes condemned at once, hangs after
``health.unhealthy_threshold`` unanswered probes) -> ``restart-shard`` for every DEAD,
RESTARTING or lagging STALE slot, with Prefect retries (backoff + jitter, infra failures only)
-> top up the warm spares -> publish fleet health -> detach. The run fails if a shard could not be brought back, so a
person sees it; the shards that could be are serving again either way.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.artifacts import publish_fleet_health
from flows.params import fleet_settings
from nemo_gen.errors import InfraError
from tasks import lifecycle
from tasks import recovery as recovery_tasks
from tasks import setup as setup_tasks


@flow(name="heal")
def heal(config: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    settings = fleet_settings(config, overrides, "heal")
    setup_tasks.configure_environment(settings)
    fleet = lifecycle.attach(settings)
    try:
        probes = recovery_tasks.probe_shards(fleet)
        restart = recovery_tasks.restart_shard.with_options(**recovery_tasks.retry_options(settings))
        # The same planner the library's recovery thread asks: one action per slot that needs
        # one (promote a spare, restart, catch up, retire); each is carried out by restart-shard.
        needs = [action.slot for action in fleet.recovery.plan()]
        states = {i: restart(fleet, i, return_state=True) for i in needs}
        restarts, failed = [], []
        for index, state in states.items():
            if state.is_completed():
                restarts.append(state.result())
            else:
                failed.append(f"shard {index}: {state.message}")
        # Top the warm spares back up (fleet.spares); detaching waits for them to be ready.
        fleet.replenish_spares()
        rows = publish_fleet_health(settings.fleet.name, fleet.status(), "after heal")
    finally:
        fleet.detach()
    if failed:
        raise InfraError("heal could not bring back " + "; ".join(failed))
    return {"probes": probes, "restarts": restarts, "health": rows}
