"""The slot table: the one writer of slot state. It owns each slot's actor, ledger state and
weight version, the warm spares, and the queue of losses that recovery drains.

Only this module writes the ledger (``GenerationFleetHealth``); every other part gets the table,
reads the ledger through ``SlotTable.ledger`` (its read side only), and changes state through the
table's transactions (tests/tooling/test_structure.py holds every module to it; the model is Ray
Serve's ``DeploymentState``, the only writer of replica state). Each is all-or-nothing, under one
lock:

- ``promote``: a warm spare at the fleet's version takes a slot that is being restarted (it
  leaves the pool, serves the slot, goes STALE, and HEALTHY at that version);
- ``install_replacement``: a freshly started actor takes a slot being restarted (STALE until a
  refit);
- ``condemn``: a member is known to be gone; a slot leaves the serving set at once, and a
  ``ShardLost`` is queued for recovery;
- ``drain``: a healthy member leaves service on purpose (a planned restart, a scale-down:
  ``nemo_gen.core.drain``): DEAD with ``drained: why`` on record, no ``ShardLost`` (the drainer
  acts), and its requests move uncounted (``was_drained``); its later death is no news;
- ``quarantine``: a member that lives but cannot be trusted (a failed refit load: its weights
  are half-loaded or none) is taken out the same way, DEAD and a ``ShardLost``, so the
  self-healing fleet restarts it;
- ``record_refit`` / ``keep_stale``: a member's refit outcome (its version, HEALTHY; or STALE
  with the reason on record); ``record_probe_answer``, ``record_success``: what probes and
  requests saw; ``begin_restart``, ``retire_slot``, ``restart_failed``: recovery's steps;
  ``seed``: a fleet's opening state;
- ``begin_roll`` / ``begin_wave`` / ``end_roll``: a rolling refit (``nemo_gen.core.waves``): the
  shards in their wave take no new request while their running ones finish, the others serve on;
  each shard's version is its entry's (``versions``), recorded by ``record_refit`` as it loads;
- ``begin_sleep`` / ``record_sleep`` / ``record_wake``: the fleet's sleep state
  (``nemo_gen.core.sleep``; the colocated layout). Sleep is a state, not a fault: it leaves every
  slot's ledger state as it is (a sleeping slot keeps its version and its place), and the router,
  prober and status read it here (``sleep_state``).

The driver's record of each member's weight version is the entry here (the shard's own is its
engine's).

Losses are events, not callbacks: whoever sees one (a failed call, a probe, the death watch,
a status read) queues a ``ShardLost``; recovery drains the queue (``drain_losses``) and acts.
Reads never write. Generic over the handle type (a Ray actor handle in the fleet, anything in
tests); the model is Ray Serve's ``ReplicaStateContainer``.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Generic, Iterable, TypeVar

from nemo_gen.core.fleet_health import SERVING_STATES, GenerationFleetHealth, ShardState
from nemo_gen.core.ledger_view import LedgerView
from nemo_gen.core.members import Member
from nemo_gen.core.planner import Seed
from nemo_gen.core.waves import Roll
from nemo_gen.core.sleep import AWAKE, SleepLevel, SleepState, WakeTag, after_sleep, after_wake, draining

H = TypeVar("H")


@dataclass(frozen=True)
class ShardLost:
    """News that ``member`` is gone or wedged, for recovery to act on."""

    member: Member
    reason: str


class SlotConflict(RuntimeError):
    """A transaction's precondition does not hold (the spare was taken, the slot is not being
    restarted): nothing was changed."""


@dataclass
class _Entry(Generic[H]):
    name: str
    handle: H
    version: int | None


class SlotTable(Generic[H]):
    def __init__(self, *, health: GenerationFleetHealth, slots: Iterable[tuple[int, str, H, int | None]] = (),
                 spares: Iterable[tuple[str, H, int | None]] = ()):
        self._lock = threading.RLock()
        self._health = health
        self._slots: dict[int, _Entry[H]] = {i: _Entry(n, h, v) for i, n, h, v in slots}
        self._spares: dict[str, _Entry[H]] = {n: _Entry(n, h, v) for n, h, v in spares}
        self._losses: deque[ShardLost] = deque()
        self._news = threading.Condition(self._lock)
        self._closed = False  # the fleet is going away: its actors' deaths are no news
        self._sleep: SleepState = AWAKE  # the fleet's (every slot's engine follows it)
        self._roll: Roll | None = None  # a rolling refit under way (router and status read it)
        self._drained: dict[int, str] = {}  # slot -> the member drained out of it (until it is replaced)
        self.ledger = LedgerView(health)  # what every other part reads

    # -- reads (never write) ---------------------------------------------------------------------

    def handle(self, slot: int) -> H | None:
        with self._lock:
            entry = self._slots.get(slot)
            return entry.handle if entry else None

    def slots(self) -> dict[int, tuple[str, H]]:
        with self._lock:
            return {i: (self._slots[i].name, self._slots[i].handle) for i in sorted(self._slots)}

    def spares(self) -> dict[str, H]:
        with self._lock:
            return {n: e.handle for n, e in self._spares.items()}

    def is_current(self, member: Member) -> bool:
        """Is ``member`` still in its place? (A replaced slot actor or a taken spare is not.)"""
        with self._lock:
            entry = self._spares.get(member.name) if member.slot is None else self._slots.get(member.slot)
            return entry is not None and entry.name == member.name

    def version_of(self, member: Member) -> int | None:
        with self._lock:
            entry = self._spares.get(member.name) if member.slot is None else self._slots.get(member.slot)
            return entry.version if entry is not None and entry.name == member.name else None

    def was_drained(self, member: Member) -> bool:
        """Did ``member`` leave its slot by a drain (``drain``), not a fault?"""
        with self._lock:
            return member.slot is not None and self._drained.get(member.slot) == member.name

    def sleep_state(self) -> SleepState:
        with self._lock:
            return self._sleep

    def roll(self) -> Roll | None:
        """The rolling refit under way, if any (read without the lock: one reference)."""
        return self._roll

    def versions(self, slots: Iterable[int]) -> dict[int, int | None]:
        """Each of ``slots``' weight version as the driver recorded it."""
        with self._lock:
            return {i: self._slots[i].version for i in slots if i in self._slots}

    def ready_spares(self, version: int | None) -> list[str]:
        """Spares believed to be at ``version``."""
        with self._lock:
            return [n for n, e in self._spares.items() if e.version == version]

    # -- single writes ---------------------------------------------------------------------------

    def note_version(self, member: Member, version: int) -> bool:
        """``member`` loaded ``version``; False (nothing written) when it is no longer current."""
        with self._lock:
            entry = self._spares.get(member.name) if member.slot is None else self._slots.get(member.slot)
            if entry is None or entry.name != member.name:
                return False
            entry.version = version
            return True

    def add_spare(self, name: str, handle: H, version: int | None) -> Member:
        with self._lock:
            self._spares[name] = _Entry(name, handle, version)
        return Member(name, None)

    def pop_spare(self, name: str) -> H | None:
        """Remove spare ``name`` from the pool (None if another caller took it first)."""
        with self._lock:
            entry = self._spares.pop(name, None)
            return entry.handle if entry else None

    # -- transactions ----------------------------------------------------------------------------

    def _require_restarting(self, slot: int) -> None:
        state = self._health.state_of(slot)
        if state is not ShardState.RESTARTING:
            raise SlotConflict(f"slot {slot} is {state.value}, not restarting")

    def _swap(self, slot: int, entry: _Entry[H], ledger: Callable[[], None]) -> None:
        """Put ``entry`` in ``slot`` and run the ledger steps; if one raises, the slot's old actor is
        put back and the slot is left out of service (DEAD), then the error propagates."""
        old = self._slots.get(slot)
        self._slots[slot] = entry
        self._drained.pop(slot, None)  # (a drained member's replacement is no longer drained)
        try:
            ledger()
        except BaseException:
            if old is None:
                del self._slots[slot]
            else:
                self._slots[slot] = old
            self._health.mark_dead(slot, "slot change failed")
            raise

    def promote(self, slot: int, spare: str, version: int | None) -> Member:
        """Spare ``spare`` serves ``slot`` (being restarted), HEALTHY at ``version`` (STALE when
        there is no version yet); the caller has asked the spare that it holds ``version``.
        ``SlotConflict`` and nothing changed when the spare is gone, is not at ``version`` or the
        slot is not being restarted; any other failure puts both back."""
        with self._lock:
            self._require_restarting(slot)
            entry = self._spares.get(spare)
            if entry is None:
                raise SlotConflict(f"spare {spare} is no longer in the pool")
            if entry.version != version:  # a slot never serves weights behind the fleet's
                raise SlotConflict(f"spare {spare} holds version {entry.version}, the slot needs {version}")
            del self._spares[spare]

            def ledger() -> None:
                self._health.mark_loaded(slot)
                if version is not None:  # else: train mode before its first refit
                    self._health.report_refit(slot, version)

            try:
                self._swap(slot, _Entry(spare, entry.handle, version), ledger)
            except BaseException:
                self._spares[spare] = entry
                raise
            return Member(spare, slot)

    def install_replacement(self, slot: int, name: str, handle: H) -> Member:
        """A freshly started actor serves ``slot`` (being restarted): STALE, no version, until a
        refit. ``SlotConflict`` and nothing changed when the slot is not being restarted."""
        with self._lock:
            self._require_restarting(slot)
            self._swap(slot, _Entry(name, handle, None), lambda: self._health.mark_loaded(slot))
            return Member(name, slot)

    def condemn(self, member: Member, reason: str) -> bool:
        """``member`` is known to be gone: a slot it still holds leaves the serving set at once
        (DEAD), and a ``ShardLost`` is queued. False (nothing done) for old news."""
        return self._take_out(member, reason)

    def quarantine(self, member: Member, reason: str) -> bool:
        """``member`` lives but cannot be trusted (a refit load failed or never answered): a slot
        it holds leaves service (DEAD) and a ``ShardLost`` is queued, so recovery replaces it as
        it would a dead one. False (nothing done) when it is no longer current."""
        return self._take_out(member, reason)

    def drain(self, member: Member, reason: str) -> bool:
        """``member`` serves but leaves its slot on purpose (``nemo_gen.core.drain``): the slot
        leaves the serving set at once (DEAD, ``drained: reason`` on record) and nothing is queued
        for recovery: the drainer restarts it, or the heal flow does. False (nothing done) when it
        is no longer current or its slot does not serve."""
        with self._lock:
            if self._closed or member.slot is None or not self.is_current(member):
                return False
            if self._health.state_of(member.slot) not in SERVING_STATES:
                return False
            self._drained[member.slot] = member.name
            self._health.mark_dead(member.slot, f"drained: {reason}")
            return True

    def _take_out(self, member: Member, reason: str) -> bool:
        with self._lock:
            if self._closed or not self.is_current(member) or self.was_drained(member):
                return False  # (a drained member's death, its restart's reap: no news)
            if member.slot is not None:
                self._health.mark_dead(member.slot, reason)
            self._post(ShardLost(member, reason))
            return True

    def record_refit(self, member: Member, version: int) -> bool:
        """``member`` loaded ``version``: its entry holds it and a slot serves it (HEALTHY).
        False (nothing written) when it is no longer current."""
        with self._lock:
            if not self.note_version(member, version):
                return False
            if member.slot is not None:
                self._health.report_refit(member.slot, version)
            return True

    def keep_stale(self, slot: int) -> None:
        """``slot``'s engine is up but cannot get the fleet's weights now (STALE until a refit)."""
        with self._lock:
            self._health.mark_loaded(slot)

    def record_probe_answer(self, slot: int, alive: bool, detail: str | None) -> ShardState:
        """One probe's answer, a step of the slot's streak; returns the slot's state after it."""
        with self._lock:
            self._health.record_probe(slot, alive, detail)
            return self._health.state_of(slot)

    def record_success(self, slot: int) -> None:
        """A real request completed on ``slot`` (clears its reported-failure streak)."""
        self._health.report_success(slot)  # (the ledger's own lock: the hot path takes one)

    def confirm_loss(self, lost: ShardLost) -> bool:
        """Recovery took ``lost`` off the queue: a slot the member still holds is DEAD (a
        status read only queued it). False for old news."""
        with self._lock:
            if self._closed or lost.member.slot is None or not self.is_current(lost.member):
                return False
            self._health.mark_dead(lost.member.slot, lost.reason)
            return True

    def begin_restart(self, slot: int) -> ShardState:
        """A replacement for ``slot`` is being started (RESTARTING, or RETIRED once its attempts
        are spent); returns the state it is in."""
        with self._lock:
            self._health.mark_restarting(slot)
            return self._health.state_of(slot)

    def retire_slot(self, slot: int, reason: str) -> None:
        with self._lock:
            self._health.retire(slot, reason)

    def restart_failed(self, slot: int, reason: str, retire: bool) -> None:
        """A restart of ``slot`` failed: DEAD (another attempt may follow), RETIRED when not."""
        with self._lock:
            self._health.mark_dead(slot, reason)
            if retire:
                self._health.retire(slot, f"restart failed: {reason}")

    def seed(self, seeds: Iterable[Seed], version: int | None) -> None:
        """A fleet's opening state, slot by slot (``nemo_gen.core.planner.attach_seeds``'
        verdicts, restart budgets carried over; or every slot STALE before a first refit)."""
        with self._lock:
            for seed in seeds:
                self._health.restore_restart_attempts(seed.slot, seed.restarts)
                if seed.state is ShardState.RETIRED:
                    self._health.retire(seed.slot, seed.reason)
                elif seed.state is ShardState.DEAD:
                    self._health.mark_dead(seed.slot, seed.reason)
                elif seed.state is ShardState.STALE:
                    self._health.mark_loaded(seed.slot)
                elif version is not None:
                    self._health.report_refit(seed.slot, version)

    def begin_roll(self, old: int | None, new: int) -> Roll:
        """A rolling refit from ``old`` to ``new`` began; no shard moves yet."""
        with self._lock:
            self._roll = Roll(old, new)
            return self._roll

    def begin_wave(self, slots: Iterable[int]) -> Roll:
        """``slots`` are the roll's wave now (no new request; the previous wave's are open again)."""
        with self._lock:
            if self._roll is None:
                raise SlotConflict("no rolling refit is under way")
            self._roll = Roll(self._roll.old, self._roll.new, frozenset(slots))
            return self._roll

    def end_roll(self) -> None:
        """The roll ended (done or stopped): every shard takes new requests by its version again."""
        with self._lock:
            self._roll = None

    def begin_sleep(self, level: SleepLevel) -> SleepState:
        """A sleep began: from here the fleet admits no new request (its running ones finish)."""
        with self._lock:
            self._sleep = draining(self._sleep, level)
            return self._sleep

    def record_sleep(self, level: SleepLevel, version: int | None) -> SleepState:
        """The slots' engines sleep at ``level`` (``version``: the fleet's weights, discarded at level 2)."""
        with self._lock:
            self._sleep = after_sleep(self._sleep, level, version)
            return self._sleep

    def adopt_sleep(self, state: SleepState) -> None:
        """Attaching to a running fleet: its engines' sleep state, as they report it."""
        with self._lock:
            self._sleep = state

    def record_wake(self, tags: frozenset[WakeTag]) -> SleepState:
        """``tags`` are resident again on the slots' engines."""
        with self._lock:
            self._sleep = after_wake(self._sleep, tags)
            return self._sleep

    # -- the loss queue ----------------------------------------------------------------------------

    def report_loss(self, member: Member, reason: str) -> None:
        """Queue news of a loss without acting on it (a reader's way: recovery decides)."""
        with self._lock:
            self._post(ShardLost(member, reason))

    def _post(self, event: ShardLost) -> None:
        self._losses.append(event)
        self._news.notify_all()

    def drain_losses(self) -> list[ShardLost]:
        """Every queued loss, oldest first; the queue is left empty."""
        with self._lock:
            out = list(self._losses)
            self._losses.clear()
            return out

    def has_losses(self) -> bool:
        """Is a loss queued that recovery has not drained yet?"""
        with self._lock:
            return bool(self._losses)

    def wait_losses(self, timeout_s: float) -> bool:
        """Block until a loss is queued (True), the table is closed or ``timeout_s`` passes."""
        with self._lock:
            return self._news.wait_for(lambda: bool(self._losses) or self._closed, timeout_s) and not self._closed

    def close(self) -> None:
        """The fleet shuts down: nothing is condemned from here on; wakes ``wait_losses``."""
        with self._lock:
            self._closed = True
            self._news.notify_all()
