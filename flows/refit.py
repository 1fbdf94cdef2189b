"""The ``refit`` flow: push a checkpoint into a running fleet, as a deployment can be triggered
(``--param checkpoint=/ckpt/step_4000 --param version=4000``)."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from nemo_gen.settings import NemoGenSettings
from tasks import fleet as fleet_tasks
from tasks import setup as setup_tasks


@flow(name="refit")
def refit(
    checkpoint: str,
    version: int | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """attach to the fleet -> refit from ``checkpoint`` -> publish the timing -> detach."""
    settings = NemoGenSettings.load(config, overrides)
    setup_tasks.configure_environment(settings)
    fleet = fleet_tasks.attach_fleet(settings)
    try:
        report = fleet_tasks.refit_checkpoint(fleet, checkpoint, version)
        publish_refit(report)
        return report
    finally:
        fleet.detach()


def publish_refit(report: dict[str, Any]) -> None:
    create_table_artifact(
        key="refit-timing",
        table=[
            {"shard": s["shard"], "ok": s["ok"], "seconds": round(s["seconds"], 4), "error": s["error"]}
            for s in report["shards"]
        ]
        + [{"shard": "all", "ok": report["ok"], "seconds": round(report["seconds"], 4), "bytes": report["bytes"],
            "gb_per_s": round(report["gb_per_s"], 3)}],
        description=f"Refit to weight version {report['version']}",
    )
