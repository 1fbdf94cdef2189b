"""The pure core of nemo_gen: decisions, with no I/O.

Owns the fleet ledger (shard states, serving set, least-loaded selection), the fault model
(dead / busy / slow / data), retry backoff and placement planning. Everything here imports only the
standard library and ``nemo_gen.errors`` — never ray, vllm, prefect, torch or transformers
(``tests/tooling/test_core_purity.py`` enforces it) — so it is tested in milliseconds and the
adapters that do touch those systems stay thin.
"""

from nemo_gen.core.backoff import BackoffPolicy
from nemo_gen.core.fleet_health import (
    FleetHealthPolicy,
    GenerationFleetExhausted,
    GenerationFleetHealth,
    HealthyShardSelector,
    NoHealthyShards,
    ShardHealth,
    ShardState,
)
from nemo_gen.core.placement import (
    ClusterResources,
    FleetPlacementPlan,
    ShardPlacement,
    check_fits,
    plan_fleet_placement,
)
from nemo_gen.core.retry import classify, condemns, describe, is_retriable, kind_of

__all__ = [
    "BackoffPolicy",
    "ClusterResources",
    "FleetHealthPolicy",
    "FleetPlacementPlan",
    "GenerationFleetExhausted",
    "GenerationFleetHealth",
    "HealthyShardSelector",
    "NoHealthyShards",
    "ShardHealth",
    "ShardPlacement",
    "ShardState",
    "check_fits",
    "classify",
    "condemns",
    "describe",
    "is_retriable",
    "kind_of",
    "plan_fleet_placement",
]
