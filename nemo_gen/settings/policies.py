"""Settings -> the objects that act on them: every builder from ``NemoGenSettings`` to a core
policy lives here, so each default is read from ``nemo_gen.settings`` and from nowhere else (no
parameter defaults or literal timeouts further down). The driver's deadlines are built beside the
driver (``nemo_gen.fleet.driver.shard_driver``): settings never import the fleet.
"""

from __future__ import annotations

from nemo_gen.core.backoff import BackoffPolicy
from nemo_gen.core.fleet_health import FleetHealthPolicy
from nemo_gen.core.modes import RefitMode, parse
from nemo_gen.errors import ConfigError
from nemo_gen.settings.root import NemoGenSettings


def health_policy(settings: NemoGenSettings) -> FleetHealthPolicy:
    """The ledger's thresholds from the ``health`` section."""
    h = settings.health
    return FleetHealthPolicy(
        unhealthy_threshold=h.unhealthy_threshold,
        healthy_threshold=h.healthy_threshold,
        max_restart_attempts_per_shard=h.max_restart_attempts_per_shard,
        min_healthy_shards=h.min_healthy_shards,
    )


def backoff_policy(settings: NemoGenSettings) -> BackoffPolicy:
    """The restart schedule from ``health.restart_*`` (shared by Prefect's retries and the
    library's recovery thread)."""
    h = settings.health
    return BackoffPolicy(
        base_s=h.restart_backoff_s,
        max_s=max(h.restart_backoff_max_s, h.restart_backoff_s),
        jitter=min(h.restart_jitter, 1.0),
        max_attempts=max(1, h.max_restart_attempts_per_shard),
    )


def request_limits(settings: NemoGenSettings):
    """The fleet's request deadline, tries after a dead or busy shard, and pending bound (``fleet.*``)."""
    from nemo_gen.core.attempts import RequestLimits, TryPolicy

    f = settings.fleet
    tries = TryPolicy(max_reroutes=f.max_reroutes, busy_retries=f.busy_retries, busy_backoff_s=f.busy_backoff_s,
                      retry_after_s=float(settings.server.retry_after_s))
    from nemo_gen.core.migration import MigrationMode

    m = f.migration
    return RequestLimits(timeout_s=f.request_timeout_s, tries=tries, max_pending=f.max_pending_requests,
                         checkpoint_s=m.checkpoint_s if m.mode == MigrationMode.ON else None)


def in_flight(settings: NemoGenSettings, mode: RefitMode | str | None = None):
    """What a refit does to running requests (``refit.in_flight`` unless ``mode`` is given: a
    caller's spelling, from the CLI, the HTTP API or a flow's parameter, parsed here into the
    ``RefitMode``), as the shards take it (``nemo_gen.core.wire.InFlight``)."""
    from nemo_gen.core.wire import InFlight

    r = settings.refit
    try:
        parsed = r.in_flight if mode is None else parse(RefitMode, mode, "refit.in_flight")
    except ValueError as exc:
        raise ConfigError(str(exc).removeprefix("refit.in_flight: "), field="refit.in_flight") from None
    return InFlight(mode=parsed, resume_aborted=r.resume_aborted, max_staleness=r.max_staleness,
                    recompute_kv=r.recompute_kv)
