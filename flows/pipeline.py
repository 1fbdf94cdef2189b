"""The generation pipeline as Prefect flows.

``generation_pipeline`` (parent, default task runner) configures the environment and starts
Ray in its own process — the raylet must inherit the environment — then resolves the
generation config and calls ``launch_fleet``, a subflow whose ``launch-shard`` controller tasks
(one per shard, in parallel) place and start the shard actors from this process, the Ray
driver.

The controllers run on Prefect's default thread pool, not on prefect-ray's ``RayTaskRunner``:
they only talk to actors, and as Ray tasks each paid for a Ray worker that imports Prefect and
nemo_gen and opens its own Prefect client — 2-3 s per run with the workers warm, about 10 s
with them cold (measured on the 2-core CPU machine; bench/results/2026-12-01/cpu-fleet-overhead.md),
the largest part of the Prefect pipeline's overhead over the plain one. In this process they
cost milliseconds.

Parameters are plain values (a config path and ``--set`` overrides), never a settings object:
a BaseSettings parameter would freeze the environment of whoever registered a deployment.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow
from prefect.futures import as_completed

from flows.artifacts import publish_fleet_health, publish_throughput
from flows.params import PipelineParams, checked, in_deployment
from flows.refit import publish_refit
from nemo_gen import pipeline, progress
from nemo_gen.fleet.fleet import GenerationFleet
from nemo_gen.fleet.resolve import ResolvedGeneration
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.driver import shard_driver
from nemo_gen.settings import NemoGenSettings
from tasks import fleet as fleet_tasks
from tasks import setup as setup_tasks


@flow(name="launch-fleet")
def launch_fleet(resolved: ResolvedGeneration) -> list[ShardHandle]:
    """Start every shard in parallel on the Ray cluster (a controller thread each); all of them or none."""
    started = time.monotonic()
    futures = [fleet_tasks.launch_shard.submit(spec) for spec in resolved.shards]
    for spec in resolved.shards:
        progress.shard_event(spec.index, "loading", {})
    handles: list[ShardHandle] = []
    errors: list[BaseException] = []
    for fut in as_completed(futures):
        try:
            handle = fut.result(timeout=resolved.settings.fleet.engine_start_timeout_s + 60)
        except Exception as exc:  # keep collecting: the started shards must be stopped
            errors.append(exc)
            continue
        handles.append(handle)
        progress.shard_event(handle.index, "ready", {**handle.info.as_dict(), "seconds": time.monotonic() - started})
    if errors:
        for handle in handles:
            shard_driver(resolved.settings).stop(handle)
        raise errors[0]
    return sorted(handles, key=lambda h: h.index)


@flow(name="generation-pipeline")
def generation_pipeline(
    config: str | None = None,
    overrides: list[str] | None = None,
    name: str = "run",
) -> dict[str, Any]:
    """configure environment -> start Ray -> resolve config -> launch fleet -> refit (train
    mode) -> generate -> write outputs -> shut down. Returns the run summary."""
    if in_deployment():  # not in deployments/prefect.yaml, but a deployment's run is untrusted wherever it comes from
        _, settings = checked(PipelineParams, dict(config=config, overrides=overrides, name=name),
                              "generation-pipeline", deployment=True)
    else:
        settings = NemoGenSettings.load(config, overrides)
    lines = fleet_tasks.load_prompts(settings)
    pipeline.resumable(settings, lines)  # run.resume: a bad output to continue fails before anything starts
    settings = pipeline.with_output(settings, name)  # each line is written there as it finishes
    progress.emit("step", name="configure-environment", status="running")
    setup_tasks.configure_environment(settings)
    progress.emit("step", name="start-ray", status="running")
    conn = setup_tasks.start_ray(settings)
    fleet = None
    try:
        progress.emit("step", name="resolve-generation-config", status="running")
        resolved = setup_tasks.resolve_generation_config(settings)
        progress.emit("step", name="launch-fleet", status="running", shards=len(resolved.shards))
        handles = launch_fleet(resolved)
        fleet = GenerationFleet(resolved, handles, ray_connection=conn if conn.owned else None)
        refit = fleet_tasks.refit(fleet, settings)
        progress.emit("step", name="generate", status="running")
        t0 = time.perf_counter()
        results = fleet_tasks.generate(fleet, lines, settings.run.batch_size)
        seconds = time.perf_counter() - t0
        path = fleet_tasks.write_outputs(lines, results, settings.run.output)
        summary = {**pipeline.summarize(fleet, lines, results, path, seconds), "refit": refit}
        _publish(fleet, summary)
        return summary
    finally:
        progress.emit("step", name="shutdown-fleet", status="running")
        if fleet is not None:
            fleet_tasks.shutdown_fleet(fleet)
        elif conn.owned:
            from nemo_gen.fleet.cluster import shutdown_ray

            shutdown_ray(conn)


def run_watched(config: str | None = None, overrides: list[str] | None = None, name: str = "run") -> dict[str, Any]:
    """``generation_pipeline`` run in this process by a caller that watches it to the end
    (``nemo-gen run``, the benchmark): without flow heartbeats. They detect zombie runs of
    deployments, which such a run cannot become, and each flow run (the pipeline and its
    ``launch-fleet`` subflow) paid about 1 s at its end joining the heartbeat thread."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        return generation_pipeline(config=config, overrides=overrides, name=name)


def _publish(fleet: GenerationFleet, summary: dict[str, Any]) -> None:
    """Artifacts a person reads instead of logs: fleet health, throughput, refit timing."""
    publish_fleet_health(fleet.settings.fleet.name, fleet.status())
    publish_throughput(summary)
    if summary.get("refit"):
        publish_refit(summary["refit"])
