"""Tasks for a fleet that outlives its flow runs: attach to it, launch it, check the weight
version a run is pinned to.

Flow runs attach with ``watch=False``: under Prefect, restarting lost shards is the ``heal``
flow's job (with its retry policy, visible in the UI), not a background thread of whichever
run happens to be attached.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from nemo_gen import progress
from nemo_gen.errors import DataError, ShardUnavailableError
from nemo_gen.fleet.fleet import GenerationFleet
from nemo_gen.server import serve
from nemo_gen.settings import NemoGenSettings


@task(name="attach-fleet", cache_policy=NO_CACHE)
def attach(settings: NemoGenSettings, missing_ok: bool = False) -> GenerationFleet | None:
    """The running fleet named in settings; None (with ``missing_ok``) when none is up."""
    try:
        return GenerationFleet.attach(settings, watch=False)
    except ShardUnavailableError:
        if missing_ok:
            return None
        raise


@task(name="launch-fleet", cache_policy=NO_CACHE)
def launch(settings: NemoGenSettings) -> GenerationFleet:
    """Start every shard (and spare) as detached, named actors; they outlive this run. Its own
    HTTP server (``generation.vllm_cfg.expose_http_server``) is composed here, in this process."""
    return serve(GenerationFleet.launch(settings, progress=progress.shard_event))


@task(name="check-weight-version", cache_policy=NO_CACHE)
def check_weight_version(fleet: GenerationFleet, pinned: int) -> int:
    """Refuse to run unless the fleet serves exactly the pinned weight version."""
    current = fleet.weight_version
    if current != pinned:
        raise DataError(
            f"parameter weight_version: this run is pinned to weight version {pinned}, but fleet "
            f"{fleet.settings.fleet.name!r} serves version {current}; refit it to {pinned} first "
            "or change the pin"
        )
    return current
