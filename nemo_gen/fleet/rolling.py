"""The rolling refit (``refit.rollout: waves``), the fleet's side: moving the shards to a staged
version a wave at a time, and routing while two versions serve. The decisions are
``nemo_gen.core.waves``'; the roll's state is the slot table's (``begin_roll`` / ``begin_wave`` /
``end_roll``), each shard's version its entry's.

A wave: its shards take no new request from the moment it begins; an open session pinned to one
of them is waited for (up to ``refit.timeout_s``) so every turn of it runs on its version; then
the shards load with ``drain`` (their running turns finish first: nothing is paused or cut).
A shard that fails its load is quarantined as in any refit and the roll goes on; a refit the
shards refuse before loading (phase 1) stops the roll, each shard on the version it holds,
named in the error.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from nemo_gen.core.fleet_health import SERVING_STATES
from nemo_gen.core.manifest import RefitError, RefitReport
from nemo_gen.core.waves import Roll, RollOutcome, WavePlan, newest
from nemo_gen.core.wire import InFlight

log = logging.getLogger(__name__)

_POLL_S = 0.02  # how often a wave looks again at its shards' open sessions


def route_new(slots: Any, health: Any, members: Any, selector: Any, roll: Roll, avoid: int | None) -> int | None:
    """A new request's shard during ``roll``, acquired: the least loaded of the serving, non-moving
    shards at the newest version (``avoid`` when another exists); None when there is none."""
    serving = [s for s in health.serving_shards() if members.has_slot(s)]
    candidates = newest(slots.versions(serving), roll)
    if not candidates:
        return None
    others = [s for s in candidates if s != avoid] or candidates
    shard = min(others, key=lambda s: (selector.inflight(s), s))
    selector.acquire(shard)
    return shard


def open_to_sessions(slots: Any, slot: int) -> bool:
    """May a bare ``session_id``'s turn go back to ``slot``? Not while it is in its wave. (An open
    session's pinned shard waits for it before loading, so its turns stay there.)"""
    roll = slots.roll()
    return roll is None or slot not in roll.moving


def placeable(slots: Any, serving: list[int]) -> list[int]:
    """Where a session opened (or moved) during a roll is placed: the newest version's shards."""
    roll = slots.roll()
    return serving if roll is None else newest(slots.versions(serving), roll)


class RollingRefit:
    """``Refitter.refit`` in waves; ``open_sessions(slot)``: the open sessions pinned to a slot."""

    def __init__(self, refitter: Any, plan: WavePlan, open_sessions: Callable[[int], int]):
        self.refitter = refitter
        self.plan = plan
        self.open_sessions = open_sessions

    def refit(self, source: Any, version: int | None, in_flight: InFlight) -> RefitReport:
        r = self.refitter
        if not in_flight.drain:
            raise RefitError(f"refit.in_flight '{in_flight.mode}' cannot act with refit.rollout waves: a shard in "
                             "its wave lets its running requests finish (drain) while the others serve")
        with r.weights.refitting():
            old = r.weights.version
            new, members, staged, report = r.prepare(source, version)
            t1 = time.perf_counter()
            by_slot = {m.slot: (m, h) for m, h in members.items() if not m.is_spare}
            spares = {m: h for m, h in members.items() if m.is_spare}
            r.slots.begin_roll(old, new)
            moved: list[int] = []
            failed: list[int] = []
            try:
                pending = self.plan.order(sorted(by_slot), {s: self.open_sessions(s) for s in by_slot})
                while pending:
                    serving = [s for s in r.health.serving_shards() if s not in failed]
                    # a STALE shard serves nothing: it takes the weights at once, costing no one
                    wave = tuple(s for s in pending if s not in serving) or self.plan.next_wave(pending, len(serving))
                    if not wave:
                        raise RefitError(RollOutcome(old, new, tuple(moved), tuple(pending), tuple(failed),
                                                     f"refit.min_serving {self.plan.min_serving}: only "
                                                     f"{len(serving)} shards serve").describe())
                    r.slots.begin_wave(wave)
                    self._wait_sessions(wave, r.driver.timeouts.refit_s)
                    try:
                        outcome = r.apply_staged(staged, dict(by_slot[s] for s in wave), in_flight)
                    except RefitError as exc:  # phase 1 refused: nothing changed on this wave
                        raise RefitError(RollOutcome(old, new, tuple(moved), tuple(pending), tuple(failed),
                                                     str(exc)).describe()) from exc
                    r.settle_outcome(report, new, outcome, may_refuse=not moved)
                    for member, (ok, _, _) in outcome.items():
                        (moved if ok else failed).append(member.slot)
                    if moved and r.weights.version != new:
                        r.weights.landed(new, staged.source, staged)  # the newest version serves from here
                    pending = [s for s in pending if s not in wave]
                    log.info("rolling refit to version %d: shards %s moved, %d to go", new, list(wave), len(pending))
                if spares:
                    r.settle_outcome(report, new, r.apply_staged(staged, spares, in_flight), may_refuse=False)
            finally:
                r.slots.end_roll()
            report.load_seconds = time.perf_counter() - t1
            if moved:
                r.count(report)
            return report

    def _wait_sessions(self, wave: tuple[int, ...], wait_s: float) -> None:
        """Until the open sessions pinned to ``wave`` end, at most ``wait_s``; those left then move
        to the newest version at their next turn."""
        deadline = time.monotonic() + wait_s
        while any(self.open_sessions(s) for s in wave) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        left = {s: n for s in wave if (n := self.open_sessions(s))}
        if left:
            log.warning("rolling refit: open sessions %s outlived the wait (refit.timeout_s); they move", left)


def serving_now(health: Any, roll: Roll | None) -> list[int]:
    """The shards serving new requests or sessions now (for ``min_serving``): serving, not moving."""
    return [s.dp_shard_idx for s in health.snapshot()
            if s.state in SERVING_STATES and (roll is None or s.dp_shard_idx not in roll.moving)]


def roll_label(roll: Roll | None, slot: int, version: int | None) -> str | None:
    """A slot's place in the roll for ``fleet.status()``: moving, moved or waiting; None: no roll."""
    if roll is None:
        return None
    if slot in roll.moving:
        return "moving"
    return "moved" if version == roll.new else "waiting"
