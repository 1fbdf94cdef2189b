"""``fleet-up`` and ``fleet-down``: a fleet that outlives the flow run that started it.

``fleet-up`` launches the shards as detached, named Ray actors (``<fleet.name>-shard-<i>`` in
``ray.namespace``) on the cluster at ``ray.address`` and leaves them running; generate, refit,
eval, heal and ``fleet-down`` attach to them by name. Re-running ``fleet-up`` (by hand, or the
crash automation after its process was killed) attaches to what is already up instead of
starting a second fleet; shards missing from it are ``heal``'s to restart.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.artifacts import progress_artifact, publish_fleet_health
from flows.params import fleet_settings
from tasks import fleet as fleet_tasks
from tasks import lifecycle
from tasks import setup as setup_tasks


@flow(name="fleet-up")
def fleet_up(config: str | None = None, overrides: list[str] | None = None) -> list[dict[str, Any]]:
    """configure environment -> attach, or launch every shard -> (train mode: first refit) ->
    publish fleet health -> detach, leaving the shards running."""
    settings = fleet_settings(config, overrides, "fleet-up")
    setup_tasks.configure_environment(settings)
    fleet = lifecycle.attach(settings, missing_ok=True)
    if fleet is None:
        engines = settings.fleet.num_shards + getattr(settings.fleet, "spares", 0)
        with progress_artifact(f"Starting {engines} engine(s) of fleet {settings.fleet.name!r}",
                               kinds=("shard",), total=engines):
            fleet = lifecycle.launch(settings)
        fleet_tasks.refit(fleet, settings)  # train mode: real weights before anything is served
    try:
        return publish_fleet_health(settings.fleet.name, fleet.status(), "after fleet-up")
    finally:
        fleet.detach()


@flow(name="fleet-down")
def fleet_down(config: str | None = None, overrides: list[str] | None = None) -> dict[str, Any]:
    """attach -> stop every shard and wait for its engine processes -> publish fleet health."""
    settings = fleet_settings(config, overrides, "fleet-down")
    setup_tasks.configure_environment(settings)
    fleet = lifecycle.attach(settings)
    rows = [s.to_json() for s in fleet.status()]
    killed = fleet_tasks.shutdown_fleet(fleet)
    publish_fleet_health(settings.fleet.name, [{**r, "state": "stopped"} for r in rows], "after fleet-down")
    return {"fleet": settings.fleet.name, "shards": rows, "killed_pids": killed}
