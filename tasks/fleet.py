"""Tasks that act on shards and the fleet: launch one shard, generate, shut down."""

from __future__ import annotations

from typing import Any, Sequence

from prefect import task
from prefect.cache_policies import NO_CACHE

from nemo_gen import pipeline
from nemo_gen.core.results import GenerationResult
from nemo_gen.fleet import launch
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.jsonl import PromptLine


@task(name="launch-shard", cache_policy=NO_CACHE, task_run_name="launch-shard-{spec.index}")
def launch_shard(spec: ShardSpec) -> ShardHandle:
    """A controller that places and starts one actor (in the flow's process: flows/pipeline.py)."""
    return launch.launch_shard(spec)


@task(name="generate", cache_policy=NO_CACHE)
def generate(fleet, lines: Sequence[PromptLine], batch_size: int) -> list[GenerationResult | None]:
    return pipeline.generate_lines(fleet, lines, batch_size)


@task(name="shutdown-fleet", cache_policy=NO_CACHE)
def shutdown_fleet(fleet) -> list[int]:
    """Stop every shard and wait for its engine processes to exit; returns PIDs that had to be killed."""
    return fleet.shutdown()


@task(name="load-prompts", cache_policy=NO_CACHE)
def load_prompts(settings) -> list[PromptLine]:
    return pipeline.load_prompts(settings)


@task(name="write-outputs", cache_policy=NO_CACHE)
def write_outputs(lines: Sequence[PromptLine], results: Sequence[GenerationResult | None], path) -> Any:
    return pipeline.write_outputs(lines, results, path)


@task(name="refit", cache_policy=NO_CACHE)
def refit(fleet, settings) -> dict[str, Any] | None:
    """Train mode's first refit: the real weights, before any request (None in eval mode)."""
    return pipeline.initial_refit(fleet, settings)


@task(name="attach-fleet", cache_policy=NO_CACHE)
def attach_fleet(settings):
    """Connect to the running fleet named in settings (detached actors on ray.address)."""
    from nemo_gen.fleet.fleet import GenerationFleet

    return GenerationFleet.attach(settings)


@task(name="refit-checkpoint", cache_policy=NO_CACHE)
def refit_checkpoint(fleet, checkpoint: str, version: int | None, in_flight: str | None = None) -> dict[str, Any]:
    """Push a checkpoint directory into every shard; the report as JSON."""
    return fleet.refit(checkpoint, version=version, in_flight=in_flight).to_json()
