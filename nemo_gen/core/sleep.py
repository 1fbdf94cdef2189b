"""Sleep and wake, the colocated layout's states (NeMo-RL's ``finish_generation`` /
``prepare_for_generation``): what a sleep level and a wake tag mean, and which state a fleet or a
shard is in after each call. Pure rules; the slot table keeps the fleet's state
(``nemo_gen.core.slots``), the shard its own (``nemo_gen.shard.rules``), and
``nemo_gen.fleet.sleep`` drives the calls.

A sleeping engine is a state, not a fault: it serves nothing (requests are refused with the
state's name, never sent), it is not probed (its scheduler is paused: a probe would hang), and it
still holds its weight version. vLLM's levels: 1 offloads the weights to CPU memory and drops the
KV cache (a wake restores the weights as they were); 2 drops both (a wake gives the memory back
with nothing in it: the fleet's weights must be refit before it serves again). Waking takes tags:
``weights`` first (what a refit needs), then ``kv_cache`` (what generation needs), NeMo-RL's
refit order; no tags wakes both. Only a fully awake fleet serves.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Iterable


class SleepLevel(enum.IntEnum):
    """vLLM's ``sleep(level=...)``."""

    OFFLOAD = 1  # weights to CPU memory, KV cache dropped: a wake restores the weights
    DISCARD = 2  # weights and KV cache dropped: a refit must refill the weights


class WakeTag(enum.StrEnum):
    """vLLM's ``wake_up(tags=...)``: which memory comes back."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


ALL_TAGS: frozenset[WakeTag] = frozenset(WakeTag)


class SleepPhase(enum.StrEnum):
    AWAKE = "awake"  # serving
    DRAINING = "draining"  # going to sleep: new requests refused, running ones finish first
    ASLEEP = "asleep"  # some memory (weights, KV cache or both) is not resident


def sleep_level(value: int | SleepLevel) -> SleepLevel:
    """``level`` as a ``SleepLevel``; ``ValueError`` naming the argument otherwise."""
    try:
        return SleepLevel(int(value))
    except (TypeError, ValueError):
        raise ValueError(f"sleep level must be 1 or 2 (vLLM's levels), got {value!r}") from None


def wake_tags(tags: Iterable[str | WakeTag] | None) -> frozenset[WakeTag]:
    """The tags a wake names (None: all of them); ``ValueError`` naming a bad one."""
    if tags is None:
        return ALL_TAGS
    if isinstance(tags, str):
        raise ValueError(f"tags must be a list of wake tags, got the string {tags!r}; e.g. ['weights']")
    out = set()
    for tag in tags:
        try:
            out.add(WakeTag(tag))
        except ValueError:
            raise ValueError(f"unknown wake tag {tag!r}; use {[t.value for t in WakeTag]} or None") from None
    if not out:
        raise ValueError("tags must name at least one of ['weights', 'kv_cache'] (None wakes both)")
    return frozenset(out)


@dataclass(frozen=True)
class SleepState:
    """A fleet's (or a shard's) sleep state. ``discarded``: the weight version a level-2 sleep
    threw away (None when nothing was thrown away); it serves again only once a refit moved the
    fleet past it."""

    phase: SleepPhase = SleepPhase.AWAKE
    level: SleepLevel | None = None
    resident: frozenset[WakeTag] = ALL_TAGS
    discarded: int | None = None

    @property
    def awake(self) -> bool:
        return self.phase is SleepPhase.AWAKE

    @property
    def weights_resident(self) -> bool:
        return self.phase is not SleepPhase.ASLEEP or WakeTag.WEIGHTS in self.resident

    def label(self) -> str:
        """How status shows it: ``awake``, ``draining (level 1)``, ``asleep (level 1)``,
        ``asleep (level 2; weights resident)``."""
        if self.awake:
            return "awake"
        text = f"{self.phase.value} (level {int(self.level or 0)}"  # (set whenever not awake)
        woken = sorted(t.value for t in self.resident) if self.phase is SleepPhase.ASLEEP else []
        return text + (f"; {', '.join(woken)} resident)" if woken else ")")

    def refusal(self, fleet: str, version: int | None) -> str | None:
        """Why a request cannot be served now (None: it can). ``version``: the fleet's now."""
        if self.phase is SleepPhase.DRAINING:
            return (f"fleet {fleet!r} is going to sleep ({self.label()}): it admits no new request; "
                    "wake it with fleet.wake() (VllmGeneration.prepare_for_generation())")
        if self.phase is SleepPhase.ASLEEP:
            missing = sorted(t.value for t in ALL_TAGS - self.resident)
            return (f"fleet {fleet!r} is {self.label()}: its {' and '.join(missing)} memory is released; "
                    f"wake it with fleet.wake(tags={missing!r}) (VllmGeneration.prepare_for_generation())")
        if self.discarded is not None and version == self.discarded:
            return (f"fleet {fleet!r} slept at level 2, which discarded weight version {version}: "
                    "refit it before generating")
        return None


AWAKE = SleepState()


def of_shard(level: int | None, resident: tuple[str, ...]) -> SleepState:
    """A shard's state as its info reports it (``ShardInfo.sleep_level`` / ``sleep_resident``)."""
    if level is None:
        return AWAKE
    return SleepState(SleepPhase.ASLEEP, SleepLevel(level), frozenset(WakeTag(t) for t in resident))


def draining(state: SleepState, level: SleepLevel) -> SleepState:
    """A sleep began: requests are refused from here while the running ones finish."""
    return replace(state, phase=SleepPhase.DRAINING, level=level)


def after_sleep(state: SleepState, level: SleepLevel, version: int | None) -> SleepState:
    """Asleep at ``level`` (an engine already asleep stays at its deeper level); level 2 discards
    ``version``'s weights."""
    deeper = level if state.level is None or state.phase is SleepPhase.DRAINING else max(level, state.level)
    discarded = version if deeper is SleepLevel.DISCARD else state.discarded
    return SleepState(SleepPhase.ASLEEP, deeper, frozenset(), discarded)


def after_wake(state: SleepState, tags: frozenset[WakeTag]) -> SleepState:
    """``tags`` are resident again; with all of them the engine is awake (and serves, unless a
    level-2 sleep left it without weights: ``refusal`` says so)."""
    if state.phase is SleepPhase.AWAKE:
        return state
    resident = state.resident | tags
    if resident == ALL_TAGS:
        return SleepState(discarded=state.discarded)
    return replace(state, phase=SleepPhase.ASLEEP, resident=resident)


def tags_to_wake(state: SleepState, tags: frozenset[WakeTag]) -> list[str]:
    """The tags of ``tags`` that are asleep, in vLLM's order (weights before KV cache): waking a
    resident tag is a no-op vLLM warns about, so it is never asked."""
    if state.phase is SleepPhase.AWAKE:
        return []
    return [t.value for t in (WakeTag.WEIGHTS, WakeTag.KV_CACHE) if t in tags and t not in state.resident]


@dataclass(frozen=True)
class SleepOrder:
    """The fleet tells a shard to sleep at ``level`` (after its running requests finish)."""

    level: SleepLevel


@dataclass(frozen=True)
class WakeOrder:
    """The fleet tells a shard to bring ``tags`` back (empty: all of them)."""

    tags: tuple[WakeTag, ...] = ()


@dataclass(frozen=True)
class ResetPrefixCache:
    """The fleet tells a shard to drop its prefix cache (NeMo-RL's ``invalidate_kv_cache``, and a
    non-colocated ``finish_generation``): cached blocks computed on old weights are not reused."""
