"""A shard as the driver knows it: what it takes to start one (``ShardSpec``, built by
``resolve_generation``), how the driver refers to a running one (``ShardHandle``, with the last
``ShardInfo`` the actor gave), and which slot an actor's name says it serves. No Ray here: the
handle only carries the actor's Ray handle for ``nemo_gen.fleet.driver`` to call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_gen.core.wire import ShardInfo


@dataclass(frozen=True)
class ShardSpec:
    """Everything needed to start shard ``index``; built by ``resolve_generation``."""

    fleet: str
    namespace: str
    index: int
    bundles: list[dict[str, float]]
    strategy: str
    engine_kwargs: dict[str, Any]
    engine_env: dict[str, str]
    async_engine: bool
    device: str
    weight_version: int | None
    placement_timeout_s: float
    engine_start_timeout_s: float
    # The actor's name; unset: "<fleet>-shard-<index>". Replacements and spares get their own
    # (a dead actor's name is not free the moment it dies), and attach finds them all by prefix.
    name: str | None = None
    spare: bool = False  # a warm spare: loaded and refit, but serves no slot until promoted
    node_hint: str | None = None  # preferred node (hex ID) when the cluster has several
    engine_core_start: str = "forkserver"  # fleet.engine_core_start

    @property
    def actor_name(self) -> str:
        return self.name or f"{self.fleet}-shard-{self.index}"


@dataclass
class ShardHandle:
    """A running shard as the driver sees it. Picklable (it crosses Prefect/Ray task results)."""

    index: int
    name: str
    actor: Any
    placement_group: Any
    info: ShardInfo = field(default_factory=lambda: ShardInfo(slot=None, weight_version=None))

    @property
    def actor_pid(self) -> int | None:
        return self.info.actor_pid

    @property
    def engine_pids(self) -> list[int]:
        return list(self.info.engine_pids)


def slot_from_name(fleet: str, name: str) -> int | None:
    """``<fleet>-shard-<i>`` and its replacements ``<fleet>-shard-<i>-r<n>`` serve slot i."""
    rest = name[len(f"{fleet}-shard-"):] if name.startswith(f"{fleet}-shard-") else ""
    head = rest.split("-r", 1)[0]
    return int(head) if head.isdigit() else None
