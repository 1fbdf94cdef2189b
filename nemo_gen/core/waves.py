"""The rolling refit's decisions (``refit.rollout: waves``), pure: which settings can act, which
shards move next, and where a new request or a session's turn may go while two versions serve.

A roll moves the fleet from version ``old`` to ``new`` a few shards at a time. A shard in its
wave (``moving``) takes no new request: its running turns finish (drain) and it loads; the
others serve on. So, during a roll, two versions serve, each result on one of them (a shard
serves one version at a time and its requests drain before it loads): never a mix inside one
result. Once the roll ends every shard that loaded serves ``new``.

- a **new request** goes to the newest version that a serving, non-moving shard holds;
- shards move fewest open sessions first, and a wave waits for the open sessions pinned to its
  shards (the fleet bounds the wait), so a session keeps its version until it ends; one still
  open then moves at a turn boundary (a turn never changes version).

The fleet side (``nemo_gen.fleet.rolling``) reads these answers; the slot table holds each
shard's version and the roll's state (``nemo_gen.core.slots.SlotTable.begin_wave``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping, Sequence


class Rollout(str, enum.Enum):
    """How a refit reaches the shards: all at once, or in waves."""

    ALL = "all"
    WAVES = "waves"


def rollout_problem(rollout: Rollout, wave_size: int | None, min_serving: int | None,
                    num_shards: int, in_flight: str = "drain") -> tuple[str, str] | None:
    """(key, why) for a combination that cannot act; None when it can."""
    if rollout is Rollout.ALL:
        for key, value in (("wave_size", wave_size), ("min_serving", min_serving)):
            if value is not None:
                return key, (f"refit.{key} ({value}) only acts with refit.rollout=waves; "
                             "refit.rollout is all, which moves every shard at once")
        return None
    if in_flight != "drain":
        return "in_flight", (f"refit.in_flight {in_flight} cannot act with refit.rollout=waves: a shard in its "
                             "wave lets its running requests finish (drain) while the others serve")
    size = 1 if wave_size is None else wave_size
    if size >= num_shards:
        return "wave_size", (f"refit.wave_size {size} moves all {num_shards} shards (fleet.num_shards) in one "
                             "wave, so nothing serves during the refit; use refit.rollout=all or a smaller wave")
    floor = num_shards - size
    if min_serving is not None and min_serving > floor:
        return "min_serving", (f"refit.min_serving {min_serving} is more than fleet.num_shards - refit.wave_size "
                               f"= {floor}: no wave could move while keeping it")
    return None


@dataclass(frozen=True)
class WavePlan:
    """A roll's shape: at most ``wave_size`` shards at a time, never fewer than ``min_serving`` serving."""

    wave_size: int
    min_serving: int

    @classmethod
    def of(cls, wave_size: int | None, min_serving: int | None, num_shards: int) -> "WavePlan":
        size = 1 if wave_size is None else wave_size
        return cls(size, num_shards - size if min_serving is None else min_serving)

    def order(self, pending: Sequence[int], sessions: Mapping[int, int]) -> list[int]:
        """The order shards move in: those holding fewest open sessions first (the sessions of the
        others have longer to end on their version), then by slot."""
        return sorted(pending, key=lambda slot: (sessions.get(slot, 0), slot))

    def next_wave(self, pending: Sequence[int], serving: int) -> tuple[int, ...]:
        """The next shards to move out of ``pending`` (in order), given ``serving`` shards serve
        now; empty when none can move without going under the floor."""
        room = min(self.wave_size, serving - self.min_serving)
        return tuple(pending[:max(0, room)])


@dataclass(frozen=True)
class Roll:
    """A roll under way: from ``old`` to ``new``; ``moving``: the shards in their wave now."""

    old: int | None
    new: int
    moving: frozenset[int] = frozenset()


def newest(versions: Mapping[int, int | None], roll: Roll | None) -> list[int]:
    """The shards a new request may go to: of ``versions`` (serving slot -> version), those not
    moving and at the newest version among them (every one when no roll is under way)."""
    if roll is None:
        return sorted(versions)
    open_ = {slot: v for slot, v in versions.items() if slot not in roll.moving}
    if not open_:
        return []
    top = max(-1 if v is None else v for v in open_.values())
    return sorted(slot for slot, v in open_.items() if (-1 if v is None else v) == top)


@dataclass(frozen=True)
class RollOutcome:
    """Where a roll left the fleet: which shards serve which version, and why it stopped."""

    old: int | None
    new: int
    on_new: tuple[int, ...]
    on_old: tuple[int, ...]
    failed: tuple[int, ...] = ()
    error: str | None = None

    def describe(self) -> str:
        where = f"shards {list(self.on_new)} serve version {self.new}, shards {list(self.on_old)} version {self.old}"
        if self.failed:
            where += f", shards {list(self.failed)} were quarantined"
        return f"rolling refit stopped: {self.error}; {where}" if self.error else where
