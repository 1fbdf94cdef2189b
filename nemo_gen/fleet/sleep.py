"""The fleet's sleep and wake (NeMo-RL's colocated layout, ``generation.colocated.enabled``): the
engines give a trainer on their GPUs the memory back between rollouts.

``FleetSleep`` drives the calls and keeps the rules; the states are ``nemo_gen.core.sleep``'s and
the fleet's state is the slot table's (``begin_sleep`` / ``record_sleep`` / ``record_wake``):

- ``sleep(level)``: new requests are refused at once (``FleetAsleep``, HTTP 503 + Retry-After);
  each shard lets its running requests finish (whatever ``refit.in_flight`` says: a sleep drops the
  KV cache they live in, so it never keeps or cuts them), resets its prefix cache and sleeps.
- ``wake(tags)``: ``weights``, ``kv_cache`` or both come back; only a fully awake fleet serves.
- A refit on a fleet whose weights sleep wakes them first (``Refitter.before_refit``): NeMo-RL's
  order, wake(weights) -> refit -> wake(kv_cache), the last step the caller's.
- A shard that fails to sleep or wake is quarantined (it would hold the memory the trainer was
  promised, or serve on none): recovery restarts it, and a newcomer is put in the fleet's state
  after it caught up with the fleet's weights (``Refitter.after_catch_up``): a shard killed while
  asleep comes back asleep, at the fleet's version.

All of it runs under the refit lock: a sleep, a wake and a refit never overlap. The state is a
state, not a fault: nothing here writes the ledger but the table's own transactions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from nemo_gen.core.fleet_health import ABSENT_STATES
from nemo_gen.core.members import Member
from nemo_gen.core.sleep import (
    ResetPrefixCache, SleepLevel, SleepOrder, SleepState, WakeOrder, WakeTag, of_shard, sleep_level, tags_to_wake,
    wake_tags,
)
from nemo_gen.core.slots import SlotTable
from nemo_gen.errors import ConfigError, ShardDiedError
from nemo_gen.fleet.driver import Outcome, ShardDriver
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.refit import Refitter
from nemo_gen.fleet.weights import FleetWeights

log = logging.getLogger(__name__)

_MARGIN_S = 1.0  # past refit.timeout_s (which bounds the drain and the sleep on the shard)


@dataclass
class SleepReport:
    """What one sleep or wake did: the fleet's state after it, each slot's seconds, the slots that
    failed (quarantined, with why)."""

    state: SleepState
    seconds: dict[int, float] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)


class FleetSleep:
    def __init__(self, *, slots: SlotTable, members: Membership, driver: ShardDriver, weights: FleetWeights,
                 refitter: Refitter, enabled: bool, fleet_name: str):
        self.slots = slots
        self.health = slots.ledger  # read only
        self.members = members
        self.driver = driver
        self.weights = weights
        self.enabled = enabled
        self.fleet_name = fleet_name
        # An attached fleet's engines may sleep already: the deepest state they report is the fleet's
        # (a wake brings every engine to the same state again).
        reported = [of_shard(h.info.sleep_level, h.info.sleep_resident) for h in members.slots()]
        if asleep := [s for s in reported if not s.awake]:
            slots.adopt_sleep(min(asleep, key=lambda s: (-int(s.level), len(s.resident))))
        # NeMo-RL's order around a refit: the weights woken before it loads; a newcomer caught up
        # while the fleet sleeps gets its weights woken for the catch-up, then sleeps as the fleet does.
        refitter.before_refit.append(self.weights_for_refit)
        refitter.before_catch_up.append(self.weights_for_catch_up)
        refitter.after_catch_up.append(self.catch_up)

    @property
    def state(self) -> SleepState:
        return self.slots.sleep_state()

    def _engines(self) -> dict[Member, ShardHandle]:
        """Every slot holding an engine (serving or STALE: a STALE one holds memory too)."""
        return self.members.members([s.dp_shard_idx for s in self.health.snapshot()
                                     if s.state not in ABSENT_STATES and self.members.has_slot(s.dp_shard_idx)])

    def sleep(self, level: int | SleepLevel = SleepLevel.OFFLOAD) -> SleepReport:
        level = sleep_level(level)
        if not self.enabled:
            raise ConfigError(
                f"fleet {self.fleet_name!r} cannot sleep: its engines started without vLLM's sleep mode; "
                "set generation.colocated.enabled=true (GPU fleets)", field="generation.colocated.enabled")
        with self.weights.refitting():
            self.slots.begin_sleep(level)  # refused from here: nothing new reaches a shard
            report = self._send(self._engines(), SleepOrder(level), "sleep")
            report.state = self.slots.record_sleep(level, self.weights.version)
        log.info("fleet %s: %s (%d shard(s) failed)", self.fleet_name, report.state.label(), len(report.failed))
        return report

    def wake(self, tags: Iterable[str | WakeTag] | None = None) -> SleepReport:
        wanted = wake_tags(tags)
        with self.weights.refitting():
            state = self.slots.sleep_state()
            if not tags_to_wake(state, wanted):  # awake already (cheap, as NeMo-RL asks): nothing sent
                return SleepReport(state)
            report = self._send(self._engines(), WakeOrder(tuple(sorted(wanted))), "wake")
            report.state = self.slots.record_wake(wanted)
        return report

    def reset_prefix_cache(self) -> bool:
        """Every engine drops its prefix cache (NeMo-RL's ``invalidate_kv_cache``); True only when all
        did. A refusal is not a fault (vLLM refuses while requests run): nothing is quarantined."""
        answers = self.driver.fan_out(self._engines(), ResetPrefixCache(), _MARGIN_S)
        return bool(answers) and all(a.ok and a.value for a in answers.values())

    def weights_for_refit(self) -> None:
        """``Refitter.before_refit``: a refit needs the weights resident; wake them (only them)."""
        if not self.slots.sleep_state().weights_resident:
            self.wake([WakeTag.WEIGHTS])

    def _send(self, handles: dict[Member, ShardHandle], order: Any, what: str) -> SleepReport:
        report = SleepReport(self.slots.sleep_state())
        t0 = time.perf_counter()
        for member, answer in self.driver.fan_out(handles, order, _MARGIN_S).items():
            if answer.ok:
                report.seconds[member.slot] = float(answer.value)
            else:
                report.failed[member.slot] = self._failed(member, answer, what)
        log.debug("fleet %s: %s took %.3fs", self.fleet_name, what, time.perf_counter() - t0)
        return report

    def _failed(self, member: Member, answer: Outcome, what: str) -> str:
        reason = f"{what} failed: {answer.error}"
        log.warning("shard %s: %s; quarantined", member.label, reason)
        if answer.infra:
            self.members.condemn(member, reason)
        else:
            self.slots.quarantine(member, reason)
        return reason

    def weights_for_catch_up(self, member: Member, handle: ShardHandle) -> None:
        """``Refitter.before_catch_up``: a newcomer a sleep reached before its catch-up (it was
        installed, so the sleep found it) needs its weights back to load the fleet's."""
        if self.slots.sleep_state().awake or member.is_spare:
            return
        answer = self.driver.fan_out({member: handle}, WakeOrder((WakeTag.WEIGHTS,)), _MARGIN_S)[member]
        if not answer.ok:
            raise ShardDiedError(member.slot, f"could not wake its weights to catch up: {answer.error}")

    def catch_up(self, member: Member, handle: ShardHandle) -> None:
        """``Refitter.after_catch_up``: a newcomer that caught up takes the fleet's sleep state
        (asleep at its level, with what the fleet has woken resident again)."""
        state = self.slots.sleep_state()
        if state.awake or member.is_spare:
            return
        orders: list[Any] = [SleepOrder(state.level)]
        if state.resident:
            orders.append(WakeOrder(tuple(sorted(state.resident))))
        for order in orders:
            answer = self.driver.fan_out({member: handle}, order, _MARGIN_S)[member]
            if not answer.ok:
                raise ShardDiedError(member.slot, f"could not take the fleet's state ({state.label()}): {answer.error}")
