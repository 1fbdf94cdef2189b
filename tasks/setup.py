"""Tasks that prepare a run: environment, Ray, generation config. They run in the flow's own
process (default task runner): the environment must be set in the process that starts Ray."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from nemo_gen import environment
from nemo_gen.fleet import cluster
from nemo_gen.fleet.resolve import ResolvedGeneration, resolve_generation
from nemo_gen.settings import NemoGenSettings


@task(name="configure-environment", cache_policy=NO_CACHE)
def configure_environment(settings: NemoGenSettings) -> dict[str, str]:
    return environment.configure_environment(settings)


@task(name="start-ray", cache_policy=NO_CACHE)
def start_ray(settings: NemoGenSettings) -> cluster.RayConnection:
    return cluster.init_ray(settings.ray)


@task(name="resolve-generation-config", cache_policy=NO_CACHE)
def resolve_generation_config(settings: NemoGenSettings) -> ResolvedGeneration:
    return resolve_generation(settings, cluster.cluster_resources())
