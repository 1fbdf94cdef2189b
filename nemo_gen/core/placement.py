"""Placement planning: what Ray resources a fleet needs, and whether a cluster can hold it.

Pure arithmetic over resource dicts, so a fleet that cannot fit fails at once with a
message naming the numbers, instead of a placement group waiting forever. The Ray adapter
turns each ``ShardPlacement`` into one placement group (``bundles``, ``strategy``) and
feeds ``ClusterResources.from_ray_nodes(ray.nodes())`` to ``check_fits``.

One shard = one vLLM engine = ``tensor_parallel_size * pipeline_parallel_size`` workers,
one bundle per worker. On GPU a bundle takes one GPU, or ``1/shards_per_gpu`` of one (Ray
fractional GPUs, rounded down to Ray's 1e-4 granularity) so several small engines share a
device. PACK keeps a shard's workers on one node when possible but lets Ray spread them when
not, so the hard checks are: the totals fit, no single bundle is larger
than every node, and the nodes can hold all bundles at all (exact, since bundles are equal).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from nemo_gen.errors import ConfigError, PlacementError

Device = Literal["cpu", "gpu"]

# The settings fields each argument comes from, so errors name what the user can change.
FIELD_NUM_SHARDS = "fleet.num_shards"
FIELD_TP = "generation.vllm_cfg.tensor_parallel_size"
FIELD_PP = "generation.vllm_cfg.pipeline_parallel_size"
FIELD_DEVICE = "fleet.device"
FIELD_CPUS_PER_WORKER = "fleet.cpus_per_worker"
FIELD_SHARDS_PER_GPU = "fleet.shards_per_gpu"

# Ray accounts fractional resources in units of 1e-4.
_RAY_RESOURCE_UNIT = 10_000

# Ray reports fractional resources as floats; never fail a fit on rounding.
_EPS = 1e-9


@dataclass(frozen=True)
class ClusterResources:
    """What a Ray cluster offers: totals, and per node when known (empty: totals only)."""

    total: Mapping[str, float]
    nodes: Sequence[Mapping[str, float]] = ()
    node_ids: Sequence[str] = ()  # parallel to ``nodes`` when known

    @classmethod
    def from_nodes(cls, nodes: Iterable[Mapping[str, float]], node_ids: Sequence[str] = ()) -> ClusterResources:
        """Totals summed from per-node resource dicts."""
        node_list = [dict(node) for node in nodes]
        total: dict[str, float] = {}
        for node in node_list:
            for name, amount in node.items():
                total[name] = total.get(name, 0.0) + float(amount)
        return cls(total=total, nodes=node_list, node_ids=tuple(node_ids))

    @classmethod
    def from_ray_nodes(cls, ray_nodes: Iterable[Mapping[str, Any]]) -> ClusterResources:
        """From ``ray.nodes()`` output: alive nodes only, their ``Resources`` dicts and IDs."""
        alive = [node for node in ray_nodes if node.get("Alive", True)]
        return cls.from_nodes(
            (node.get("Resources", {}) for node in alive), [str(node.get("NodeID", "")) for node in alive]
        )


@dataclass(frozen=True)
class ShardPlacement:
    """One shard's placement group: one bundle per worker, PACKed."""

    shard: int
    bundles: tuple[Mapping[str, float], ...]
    strategy: str = "PACK"


@dataclass(frozen=True)
class FleetPlacementPlan:
    """Per-shard placement groups for a whole fleet, with the arithmetic behind them."""

    shards: tuple[ShardPlacement, ...]
    num_shards: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    device: Device
    cpus_per_worker: float
    bundle: Mapping[str, float] = field(default_factory=dict)
    shards_per_gpu: int = 1

    @property
    def workers_per_shard(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def total_bundles(self) -> int:
        return self.num_shards * self.workers_per_shard

    @property
    def totals(self) -> dict[str, float]:
        """Resources the whole fleet reserves."""
        return {name: amount * self.total_bundles for name, amount in self.bundle.items()}

    def describe_need(self, resource: str) -> str:
        """``"8 GPU (2 shards x tensor_parallel_size 2 x pipeline_parallel_size 2)"``."""
        shards = f"{self.num_shards} shard" + ("" if self.num_shards == 1 else "s")
        parts = (
            f"{shards} x tensor_parallel_size {self.tensor_parallel_size}"
            f" x pipeline_parallel_size {self.pipeline_parallel_size}"
        )
        per_worker = self.bundle.get(resource, 0.0)
        if per_worker != 1:
            parts += f" x {_fmt(per_worker)} {resource} per worker"
        return f"{_fmt(self.totals.get(resource, 0.0))} {resource} ({parts})"


def _fmt(amount: float) -> str:
    return str(int(amount)) if float(amount).is_integer() else f"{amount:g}"


def _require_at_least_one(value: int, field_name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"must be an integer >= 1, got {value!r}", field=field_name)


def plan_fleet_placement(
    num_shards: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    device: Device,
    cpus_per_worker: float,
    cluster: ClusterResources | None = None,
    shards_per_gpu: int = 1,
) -> FleetPlacementPlan:
    """Plan one PACKed placement group per shard; check it against ``cluster`` when given.
    ``shards_per_gpu`` (GPU only; ignored on CPU): each bundle takes that fraction of a GPU."""
    _require_at_least_one(num_shards, FIELD_NUM_SHARDS)
    _require_at_least_one(shards_per_gpu, FIELD_SHARDS_PER_GPU)
    _require_at_least_one(tensor_parallel_size, FIELD_TP)
    _require_at_least_one(pipeline_parallel_size, FIELD_PP)
    if device not in ("cpu", "gpu"):
        raise ConfigError(f"must be 'cpu' or 'gpu' when planning, got {device!r}", FIELD_DEVICE)
    if not isinstance(cpus_per_worker, (int, float)) or isinstance(cpus_per_worker, bool):
        raise ConfigError(f"must be a number, got {cpus_per_worker!r}", FIELD_CPUS_PER_WORKER)
    if device == "cpu" and cpus_per_worker <= 0:
        # A CPU bundle with no CPU is empty, which Ray rejects.
        raise ConfigError(f"must be > 0 on cpu, got {cpus_per_worker}", FIELD_CPUS_PER_WORKER)
    if cpus_per_worker < 0:
        raise ConfigError(f"must be >= 0, got {cpus_per_worker}", FIELD_CPUS_PER_WORKER)

    workers = tensor_parallel_size * pipeline_parallel_size
    if device == "gpu" and shards_per_gpu > 1 and workers > 1:
        # Ray hands fractional GPUs out per bundle: two ranks of one engine could land on the
        # same device, which vLLM's collectives refuse.
        raise ConfigError(
            f"{shards_per_gpu} shards per GPU needs one worker per shard, but "
            f"{FIELD_TP} x {FIELD_PP} = {workers}",
            FIELD_SHARDS_PER_GPU,
        )
    bundle: dict[str, float] = {}
    if device == "gpu":
        bundle["GPU"] = gpu_share(shards_per_gpu)
    if cpus_per_worker > 0:
        bundle["CPU"] = float(cpus_per_worker)
    shards = tuple(
        ShardPlacement(shard=idx, bundles=tuple(dict(bundle) for _ in range(workers)))
        for idx in range(num_shards)
    )
    plan = FleetPlacementPlan(
        shards=shards,
        num_shards=num_shards,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        device=device,
        cpus_per_worker=float(cpus_per_worker),
        bundle=bundle,
        shards_per_gpu=shards_per_gpu if device == "gpu" else 1,
    )
    if cluster is not None:
        check_fits(plan, cluster)
    return plan


def gpu_share(shards_per_gpu: int) -> float:
    """The GPU one worker bundle takes: 1/k, rounded down to Ray's resource unit so that k of
    them always fit one GPU (1/3 -> 0.3333)."""
    if shards_per_gpu <= 1:
        return 1.0
    return math.floor(_RAY_RESOURCE_UNIT / shards_per_gpu) / _RAY_RESOURCE_UNIT


def _bundles_on_node(bundle: Mapping[str, float], node: Mapping[str, float]) -> int:
    """How many copies of ``bundle`` one node can hold."""
    return min(
        (
            math.floor((node.get(name, 0.0) + _EPS) / amount)
            for name, amount in bundle.items()
            if amount > 0
        ),
        default=0,
    )


def check_fits(plan: FleetPlacementPlan, cluster: ClusterResources) -> None:
    """Raise PlacementError naming every shortfall when ``cluster`` cannot hold ``plan``."""
    problems: list[str] = []
    for name, needed in plan.totals.items():
        have = float(cluster.total.get(name, 0.0))
        if needed > have + _EPS:
            need = plan.describe_need(name)
            problems.append(f"fleet needs {need} but the Ray cluster has {_fmt(have)} {name}")
    if cluster.nodes:
        per_node = [_bundles_on_node(plan.bundle, node) for node in cluster.nodes]
        if max(per_node) == 0:
            problems.append(
                f"one worker bundle {dict(plan.bundle)} is larger than every node of the Ray "
                f"cluster (nodes offer {[_offer(plan.bundle, n) for n in cluster.nodes]})"
            )
        elif not problems and sum(per_node) < plan.total_bundles:
            # Totals fit but are split so that whole bundles don't: Ray would wait forever.
            problems.append(
                f"fleet needs {plan.total_bundles} worker bundles of {dict(plan.bundle)} but "
                f"the Ray cluster's nodes can hold only {sum(per_node)} "
                f"(per node: {per_node}); resources are split across nodes"
            )
    if problems:
        raise PlacementError("; ".join(problems))


def _offer(bundle: Mapping[str, float], node: Mapping[str, float]) -> dict[str, float]:
    """A node's resources, restricted to those a bundle asks for (readable errors)."""
    return {name: float(node.get(name, 0.0)) for name in bundle}


def spread_shards(plan: FleetPlacementPlan, cluster: ClusterResources) -> dict[int, str]:
    """A node for each shard that one node can hold whole, spread across nodes: each shard
    goes to the node with the most whole-shard room left (ties: the earlier node). Losing a
    node then costs the fewest shards. Shards no node can hold whole get no entry (Ray may
    split them across nodes). Empty when nodes are unknown or there is only one."""
    if len(cluster.nodes) < 2 or len(cluster.node_ids) != len(cluster.nodes):
        return {}
    room = [
        _bundles_on_node(plan.bundle, node) // plan.workers_per_shard if plan.bundle else 0
        for node in cluster.nodes
    ]
    out: dict[int, str] = {}
    for shard in plan.shards:
        best = max(range(len(room)), key=lambda i: (room[i], -i))
        if room[best] <= 0:
            continue
        room[best] -= 1
        out[shard.shard] = cluster.node_ids[best]
    return out
