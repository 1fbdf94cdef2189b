"""The ``refit`` flow: push a checkpoint into a running fleet, as a deployment can be triggered
(``--param checkpoint=/ckpt/step_4000 --param version=4000``)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.artifacts import publish_fleet_health, publish_table
from flows.params import RefitParams, checked
from tasks import fleet as fleet_tasks
from tasks import setup as setup_tasks


@flow(name="refit")
def refit(
    checkpoint: str,
    version: int | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    in_flight: str | None = None,
) -> dict[str, Any]:
    """attach to the fleet -> refit from ``checkpoint`` -> publish the timing -> detach.
    ``in_flight``: drain | abort | keep (default: the settings' ``refit.in_flight``)."""
    _, settings = checked(RefitParams, dict(checkpoint=checkpoint, version=version, config=config,
                                            overrides=overrides, in_flight=in_flight), "refit")
    setup_tasks.configure_environment(settings)
    fleet = fleet_tasks.attach_fleet(settings)
    try:
        report = fleet_tasks.refit_checkpoint(fleet, checkpoint, version, in_flight)
        publish_refit(report)
        publish_fleet_health(settings.fleet.name, fleet.status(), "after the refit")
        return report
    finally:
        fleet.detach()


def publish_refit(report: dict[str, Any]) -> None:
    """Refit timing: bytes, seconds and GB/s per shard, and staging + load over the fleet."""
    publish_table(
        "refit-timing",
        [
            # every shard loads the whole checkpoint: its bytes are the report's
            {"shard": s["shard"], "ok": s["ok"], "bytes": report["bytes"] if s["ok"] else 0,
             "seconds": round(s["seconds"], 4),
             "gb_per_s": round(report["bytes"] / s["seconds"] / 1e9, 3) if s["ok"] and s["seconds"] > 0 else 0.0,
             "error": s["error"] or ""}
            for s in report["shards"]
        ]
        + [{"shard": "all", "ok": report["ok"], "seconds": round(report["seconds"], 4), "bytes": report["bytes"],
            "gb_per_s": round(report["gb_per_s"], 3)}],
        f"Refit to weight version {report['version']}",
    )
