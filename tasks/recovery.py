"""Shard recovery as Prefect tasks: probe the shards, and ``restart-shard`` under a retry
policy — retries with exponential backoff and jitter, and a ``retry_condition_fn`` built on
nemo_gen's infra/data taxonomy, so an engine that failed to start is tried again (each
attempt an AwaitingRetry/Retrying state in the UI) while a data failure (the cluster cannot
place the shard) or a retired shard is not.

The tasks are thin: one attempt is ``nemo_gen.fleet.recovery.restart_shard``, the same
function the library's own recovery loop calls.
"""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from nemo_gen.core.retry import is_retriable
from nemo_gen.fleet import recovery
from nemo_gen.settings.policies import backoff_policy


def retry_on_infra(task, task_run, state) -> bool:
    """Retry only what another attempt can fix: infra failures (``is_retriable``)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is not None and is_retriable(exc)


def retry_options(settings) -> dict[str, Any]:
    """``with_options`` for ``restart_shard`` from the ``health.restart_*`` settings. The last
    of ``max_restart_attempts_per_shard + 1`` attempts meets the ledger's limit and retires the
    shard (ShardRetired: not retried)."""
    policy = backoff_policy(settings)
    attempts = settings.health.max_restart_attempts_per_shard
    delays = [policy.nominal_delay(a) for a in range(1, attempts + 1)] or [0.0]
    return {
        "retries": attempts,
        "retry_delay_seconds": delays,
        # Prefect draws jitter per run (the delays above are fixed when the options are made).
        "retry_jitter_factor": settings.health.restart_jitter or None,
        "retry_condition_fn": retry_on_infra,
    }


@task(name="restart-shard", cache_policy=NO_CACHE, task_run_name="restart-shard-{index}")
def restart_shard(fleet, index: int) -> dict[str, Any]:
    """One attempt: reap the dead shard, promote a spare or start a replacement, refit it to
    the fleet's weight version, re-admit it."""
    return recovery.restart_shard(fleet, index)


@task(name="probe-shards", cache_policy=NO_CACHE)
def probe_shards(fleet) -> list[dict[str, Any]]:
    """One real-generation probe round over the serving shards (up to
    ``health.unhealthy_threshold`` in a row for a shard that fails); a dead actor or engine is
    condemned at once. Returns what each shard answered."""
    return fleet.probe_once()
