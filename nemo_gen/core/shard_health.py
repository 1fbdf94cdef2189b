"""One shard's place in the ledger: its lifecycle states (``ShardState``), the sets of states that
serve or cannot join a refit, its record (``ShardHealth``), a recorded transition, and the
thresholds that move it (``FleetHealthPolicy``). ``nemo_gen.core.fleet_health`` keeps the fleet's
ledger of them and re-exports these names, as NeMo-RL's ``fleet_health`` does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class ShardState(enum.StrEnum):
    """Lifecycle of one generation data-parallel shard."""

    HEALTHY = "healthy"  # serving, with current weights
    SUSPECT = "suspect"  # failing, but still serving: one blip must not drain a shard
    DEAD = "dead"  # quarantined; no replacement started yet
    RESTARTING = "restarting"  # a replacement engine is coming up
    STALE = "stale"  # up, but holding old weights: NOT serving until refit
    RETIRED = "retired"  # terminal: restarts exhausted or removed for good


SERVING_STATES: frozenset[ShardState] = frozenset({ShardState.HEALTHY, ShardState.SUSPECT})

# How many serving-set changes ``serving_changes_since`` can replay; a reader further behind
# re-reads the whole set.
SERVING_LOG_LIMIT = 4096

# Processes that cannot join a collective (refit). Not the complement of SERVING_STATES:
# a STALE shard is withheld from traffic but alive, and refitting it is how it recovers.
ABSENT_STATES: frozenset[ShardState] = frozenset(
    {ShardState.DEAD, ShardState.RESTARTING, ShardState.RETIRED}
)


@dataclass
class ShardHealth:
    """Everything known about one shard."""

    dp_shard_idx: int
    base_url: str | None = None
    state: ShardState = ShardState.HEALTHY
    consecutive_probe_failures: int = 0
    consecutive_probe_successes: int = 0
    # Failures seen on real requests, a separate streak on purpose: a wedged engine still
    # answers liveness probes, and if probe successes cleared these the shard would swing
    # HEALTHY <-> SUSPECT forever. Only report_success or a refit clears it.
    consecutive_reported_failures: int = 0
    restart_attempts: int = 0  # over the whole run, never reset
    weight_version: int = 0
    last_ok_at: float = 0.0
    last_error: str = ""

    @property
    def is_serving(self) -> bool:
        return self.state in SERVING_STATES


@dataclass(frozen=True)
class Transition:
    """One state change, as kept in the ledger's history."""

    time: float
    shard: int
    old: ShardState | None  # None when the shard was added
    new: ShardState
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "shard": self.shard,
            "old": self.old.value if self.old is not None else None,
            "new": self.new.value,
            "reason": self.reason,
        }


@dataclass
class FleetHealthPolicy:
    """Thresholds for the transitions (resolved from the ``health`` settings section)."""

    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    max_restart_attempts_per_shard: int = 5
    min_healthy_shards: int = 1

    def __post_init__(self) -> None:
        if self.unhealthy_threshold < 1 or self.healthy_threshold < 1:
            raise ValueError(
                "FleetHealthPolicy thresholds must be >= 1; got "
                f"unhealthy_threshold={self.unhealthy_threshold}, "
                f"healthy_threshold={self.healthy_threshold}"
            )
        if self.min_healthy_shards < 1:
            raise ValueError(
                "FleetHealthPolicy.min_healthy_shards must be >= 1; a fleet with zero serving "
                f"shards cannot generate. Got {self.min_healthy_shards}"
            )
        if self.max_restart_attempts_per_shard < 0:
            raise ValueError(
                "FleetHealthPolicy.max_restart_attempts_per_shard must be >= 0; got "
                f"{self.max_restart_attempts_per_shard}"
            )


def copy_of(shard: ShardHealth) -> ShardHealth:
    """A field-for-field copy (what ``dataclasses.replace`` gives, 5x cheaper: no __init__)."""
    copy = object.__new__(type(shard))
    copy.__dict__.update(shard.__dict__)
    return copy
