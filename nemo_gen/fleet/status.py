"""What ``fleet.status()`` reports: one row per slot (ledger state, weight version, PIDs, node,
restarts, last error, orphans a dead actor of the slot left running, its place in a rolling
refit), then one per spare.

Live shards are asked for their own account (``info``). A read never writes: one found dead
shows as "dead" in its row and is reported to recovery as a ``ShardLost`` (queued, not acted on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nemo_gen.core.fleet_health import GenerationFleetHealth, ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.wire import ShardInfo
from nemo_gen.errors import ShardDiedError
from nemo_gen.host import gpu_memory
from nemo_gen.fleet.driver import ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.rolling import roll_label
from nemo_gen.host.processes import alive


@dataclass
class ShardStatus:
    index: int
    state: str
    weight_version: int | None
    actor_pid: int | None
    engine_pids: list[int] = field(default_factory=list)
    node_id: str | None = None
    restarts: int = 0
    last_error: str | None = None
    name: str | None = None  # the Ray actor serving the slot (a replacement or promoted spare)
    # Processes a dead actor of this slot left running (RAY_process_group_cleanup_enabled=0),
    # each with the GPU memory it still holds.
    orphans: list[dict[str, Any]] = field(default_factory=list)
    gpu_memory_bytes: int | None = None  # what the shard's processes hold on GPUs (NVML); None: no GPU
    sleep: str = "awake"  # the colocated layout's state (nemo_gen.core.sleep): "asleep (level 1)", ...
    rolling: str | None = None  # during a rolling refit: "moving" (its wave), "moved" or "waiting"; else None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def fleet_status(health: GenerationFleetHealth, members: Membership, driver: ShardDriver,
                 orphans: list[dict[str, Any]], live: bool) -> list[ShardStatus]:
    """The rows; ``live`` False (a closed fleet): what was last known, without asking anyone."""
    out = []
    snaps = health.snapshot()
    asked = {s.dp_shard_idx: h for s in snaps if (h := members.handle(s.dp_shard_idx)) is not None
             and s.state not in (ShardState.RETIRED, ShardState.DEAD)} if live else {}
    spares = {spare.name: spare for spare in members.spares()}
    sleep = members.table.sleep_state().label()  # every slot's engine is in the fleet's state
    roll = members.table.roll()
    answers = driver.infos({**asked, **(spares if live else {})})  # one wait for all of them
    for snap in snaps:
        slot = snap.dp_shard_idx
        handle = members.handle(slot)
        info = handle.info if handle else ShardInfo(slot=slot, weight_version=None)
        answer, state = answers.get(slot), health.state_of(slot).value
        if isinstance(answer, ShardDiedError):
            members.report_loss(Member(handle.name, slot), f"ShardDiedError: {answer}")
            state = ShardState.DEAD.value
        elif isinstance(answer, BaseException):
            raise answer
        elif answer is not None:
            info = answer
        left = [o for o in orphans if o["shard"] == slot and alive(o["pid"])]
        out.append(ShardStatus(
            index=slot, state=str(state), weight_version=info.weight_version,
            actor_pid=info.actor_pid, engine_pids=list(info.engine_pids),
            node_id=info.node_id, restarts=snap.restart_attempts, last_error=snap.last_error or None,
            name=handle.name if handle else None, orphans=_with_gpu(left),
            gpu_memory_bytes=_gpu_bytes([info.actor_pid, *info.engine_pids]), sleep=sleep,
            rolling=roll_label(roll, slot, members.table.versions([slot]).get(slot)),
        ))
    for spare in spares.values():
        answer = answers.get(spare.name)
        info = answer if isinstance(answer, ShardInfo) else spare.info
        out.append(ShardStatus(
            index=spare.index, state="spare", weight_version=info.weight_version,
            actor_pid=info.actor_pid, engine_pids=list(info.engine_pids),
            node_id=info.node_id, name=spare.name,
            gpu_memory_bytes=_gpu_bytes([info.actor_pid, *info.engine_pids]),
        ))
    return out


def _gpu_bytes(pids: list[int | None]) -> int | None:
    """GPU memory the PIDs hold together; None where NVML sees no GPU (a CPU machine)."""
    if not gpu_memory.available():
        return None
    return sum(gpu_memory.used_by_pids([p for p in pids if p]).values())


def _with_gpu(orphans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The orphans, each with the GPU memory it holds now."""
    held = gpu_memory.used_by_pids([o["pid"] for o in orphans]) if orphans and gpu_memory.available() else {}
    return [{**o, "gpu_bytes": held.get(o["pid"], 0)} for o in orphans]


def fleet_metrics(health: GenerationFleetHealth, version: int | None, rerouted: int,
                  refits: dict[str, float]) -> dict[str, float]:
    """The fleet's series: the ledger's (shards by state, restart attempts; NeMo-RL's names) and
    the weight version, re-routed requests, refits with their seconds and bytes."""
    return {
        **health.as_metrics(),
        "gen_fleet/weight_version": float(-1 if version is None else version),
        "gen_fleet/rerouted_requests": float(rerouted),
        "gen_fleet/refits": float(refits["refits"]),
        "gen_fleet/refit_seconds": float(refits["seconds"]),
        "gen_fleet/refit_bytes": float(refits["bytes"]),
    }
