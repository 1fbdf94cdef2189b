"""Recovery decisions: what to do about each slot that is not serving, from a ledger snapshot.

``plan`` is pure (no Ray, no clock): the library's recovery thread and the ``heal`` flow
both ask it, and both carry out the same actions with ``nemo_gen.fleet.recovery``:

- a serving slot needs nothing;
- a STALE slot is up but behind: ``CatchUp`` to the fleet's version — unless the fleet has
  no version yet (train mode before its first refit), when nothing can re-admit it;
- a DEAD or RESTARTING slot whose restart budget is spent is ``Retire``d; otherwise a warm
  spare at the fleet's version takes its place (``PromoteSpare``, each spare once), or a
  replacement engine is started (``Restart``);
- a RETIRED slot is final.

``attach_seeds`` is the same kind of decision for a process that attaches to a running
fleet: which version the fleet serves and how each slot enters its ledger (``SlotTable.seed``
writes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Protocol, Sequence

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.wire import FleetRecordState, ShardInfo, SlotRecord


class SlotHealth(Protocol):
    dp_shard_idx: int
    state: ShardState
    restart_attempts: int
    last_error: str


@dataclass(frozen=True)
class PromoteSpare:
    slot: int
    spare: str  # the spare's actor name


@dataclass(frozen=True)
class Restart:
    slot: int
    attempt: int  # this slot's restart attempt number (1-based)


@dataclass(frozen=True)
class CatchUp:
    slot: int
    version: int


@dataclass(frozen=True)
class Retire:
    slot: int
    reason: str


Action = PromoteSpare | Restart | CatchUp | Retire


def plan(
    snapshot: Iterable[SlotHealth], version: int | None, ready_spares: Sequence[str], max_restart_attempts: int
) -> list[Action]:
    """One action per slot that needs one, in slot order. ``ready_spares``: spares believed
    to be at ``version`` (the executor checks again before promoting one)."""
    spares = list(ready_spares)
    actions: list[Action] = []
    for shard in sorted(snapshot, key=lambda s: s.dp_shard_idx):
        action = plan_slot(shard, version, spares, max_restart_attempts)
        if isinstance(action, PromoteSpare):
            spares.remove(action.spare)
        if action is not None:
            actions.append(action)
    return actions


def plan_slot(shard: SlotHealth, version: int | None, ready_spares: Sequence[str], max_restart_attempts: int) -> Action | None:
    """The action for one slot (see the module doc); None when it needs none."""
    state, slot = shard.state, shard.dp_shard_idx
    if state is ShardState.STALE:
        return CatchUp(slot, version) if version is not None else None
    if state not in (ShardState.DEAD, ShardState.RESTARTING):
        return None  # serving, or retired for good
    if shard.restart_attempts >= max_restart_attempts:
        return Retire(slot, f"retired after {max_restart_attempts} restart attempt(s) "
                            f"(health.max_restart_attempts_per_shard): {shard.last_error or 'no error recorded'}")
    if ready_spares:
        return PromoteSpare(slot, ready_spares[0])
    return Restart(slot, shard.restart_attempts + 1)


@dataclass(frozen=True)
class Seed:
    """How a slot enters the ledger of a process that attaches to a running fleet."""

    slot: int
    state: ShardState  # HEALTHY (at its version), STALE (behind), DEAD (missing, silent) or RETIRED
    reason: str
    restarts: int  # the slot's restart count so far (the budget spans every attaching process)


def attach_seeds(num_slots: int, infos: Mapping[int, ShardInfo], recorded: FleetRecordState | None
                 ) -> tuple[int | None, str | None, list[Seed]]:
    """(the fleet's version, its source, one Seed per slot) from what each slot's actor said
    (``infos``: slot -> its ``ShardInfo``) and the fleet record. The record says which version
    the fleet serves (it outlives every shard); without one, the newest version any shard holds."""
    known = [i.weight_version for i in infos.values() if i.weight_version is not None]
    version = max(known) if known else None
    if recorded is not None:
        version = recorded.weight_version
    # The checkpoint of that version: the record's, or one a shard at that version loaded (never
    # another version's: a catch-up from it would load the wrong weights).
    source = (recorded.weight_source if recorded is not None else None) or next(
        (i.weight_source for i in infos.values() if i.weight_version == version and i.weight_source),
        None)
    seeds = []
    for slot in range(num_slots):
        info = infos.get(slot)
        kept = (recorded.slot(slot) if recorded is not None else None) or SlotRecord(slot)
        # The budget spans every process: the record's count, or the actor's if it saw more.
        restarts = max(info.restarts if info is not None else 0, kept.restarts)
        if kept.retired:
            seeds.append(Seed(slot, ShardState.RETIRED, kept.retired, restarts))
        elif info is None:
            seeds.append(Seed(slot, ShardState.DEAD, "shard actor not found when attaching", restarts))
        elif info.unresponsive:
            seeds.append(Seed(slot, ShardState.DEAD, f"not answering when attaching: {info.unresponsive}", restarts))
        elif info.weight_version is None or info.weight_version != version:
            seeds.append(Seed(slot, ShardState.STALE, "behind the fleet's weight version", restarts))
        else:
            seeds.append(Seed(slot, ShardState.HEALTHY, f"at weight version {version}", restarts))
    return version, source, seeds
