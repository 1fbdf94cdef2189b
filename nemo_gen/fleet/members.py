"""The fleet's membership: which actor serves each slot, which warm spares wait, and the
bookkeeping around changing them (slot locks, recoveries and spare starts in progress).

Who holds each slot, with its ledger state and version, is the pure ``SlotTable``'s
(``nemo_gen.core.slots``); ``Membership`` wraps it for Ray handles and keeps the locks. A ``Member``
(``nemo_gen.core.members``) names an actor in its role, and ``is_current`` is how news about
an actor that has since been replaced is recognised as old.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterable, Iterator

from nemo_gen.core.fleet_health import GenerationFleetHealth
from nemo_gen.core.members import Member
from nemo_gen.core.slots import SlotTable
from nemo_gen.fleet.handles import ShardHandle

log = logging.getLogger(__name__)


def claimed_slots(actors: Iterable[ShardHandle], num_slots: int) -> dict[int, ShardHandle]:
    """Slot -> the actor serving it, among a running fleet's actors (found when attaching).
    Two that claim one slot (a promotion cut short): the one with newer weights wins."""
    slots: dict[int, ShardHandle] = {}
    for h in sorted(actors, key=lambda h: -1 if h.info.weight_version is None else h.info.weight_version):
        if h.index is not None and h.index < num_slots:
            if h.index in slots:
                log.warning("slot %d is claimed by %s and %s; using %s", h.index, slots[h.index].name, h.name, h.name)
            slots[h.index] = h
    return slots


class Membership:
    """The Ray side of the fleet's ``SlotTable``: it keeps each handle's ``index`` and last
    ``ShardInfo`` in step with the table, and the bookkeeping around changing members."""

    def __init__(self, *, health: GenerationFleetHealth, slots: Iterable[ShardHandle],
                 spares: Iterable[ShardHandle], first_spare_seq: int):
        self._lock = threading.RLock()
        spares = list(spares)
        self.table: SlotTable[ShardHandle] = SlotTable(
            health=health, slots=[(h.index, h.name, h, h.info.weight_version) for h in slots],
            spares=[(h.name, h, h.info.weight_version) for h in spares])
        self._slot_locks: dict[int, threading.Lock] = {}
        self._recovering: set[int] = set()
        self._draining = 0  # recovery is reading the loss queue now (``draining``)
        # A thread of this process acts on each loss as it is queued (``Recovery.start_watching``):
        # a loss not drained yet is a recovery about to begin.
        self.healer = False
        self._spares_starting = 0
        seqs = [int(h.name.rsplit("-", 1)[1]) for h in spares if h.name.rsplit("-", 1)[1].isdigit()]
        self._spare_seq = max([first_spare_seq, *[s + 1 for s in seqs]])

    # -- slots ---------------------------------------------------------------------------------

    def handle(self, slot: int) -> ShardHandle | None:
        """The actor serving ``slot`` now (it changes when the shard is replaced)."""
        return self.table.handle(slot)

    def slots(self) -> list[ShardHandle]:
        return [h for _, h in self.table.slots().values()]

    def has_slot(self, slot: int) -> bool:
        return self.table.handle(slot) is not None

    def promote(self, slot: int, spare: ShardHandle, version: int | None) -> Member:
        """Spare ``spare`` serves ``slot`` (``SlotTable.promote``: all or nothing)."""
        member = self.table.promote(slot, spare.name, version)
        spare.index = slot
        return member

    def install_replacement(self, slot: int, handle: ShardHandle) -> Member:
        """A new actor serves ``slot`` (``SlotTable.install_replacement``: all or nothing)."""
        member = self.table.install_replacement(slot, handle.name, handle)
        handle.index = slot
        return member

    def is_current(self, member: Member) -> bool:
        """Is ``member`` still in its place? (A replaced slot actor or a taken spare is not.)"""
        return self.table.is_current(member)

    def note_version(self, member: Member, version: int) -> None:
        """``member`` loaded ``version`` (its handle's last ``ShardInfo`` is replaced by one at
        that version too, so a spare's readiness is known without asking it)."""
        with self._lock:
            if self.table.note_version(member, version):
                handle = self.table.spares().get(member.name) if member.slot is None else self.table.handle(member.slot)
                if handle is not None:
                    handle.info = handle.info.with_version(version)

    def ready_spares(self, version: int | None) -> list[str]:
        return self.table.ready_spares(version)

    # -- losses (events: recovery drains them) --------------------------------------------------

    def condemn(self, member: Member, reason: str) -> bool:
        """``member`` is gone: out of service at once, and a ``ShardLost`` for recovery."""
        return self.table.condemn(member, reason)

    def report_loss(self, member: Member, reason: str) -> None:
        """A reader noticed a loss: queued for recovery, nothing else written."""
        self.table.report_loss(member, reason)

    def slot_lock(self, slot: int) -> threading.Lock:
        """Serializes recovery of one slot (the monitor and a flow may both try)."""
        with self._lock:
            return self._slot_locks.setdefault(slot, threading.Lock())

    def begin_recovery(self, slot: int) -> bool:
        """Claim ``slot`` for a background recovery; False if one already runs."""
        with self._lock:
            if slot in self._recovering:
                return False
            self._recovering.add(slot)
            return True

    @contextlib.contextmanager
    def draining(self) -> Iterator[None]:
        """Recovery takes losses off the queue and starts what they need: while it does, the
        losses are neither queued nor their recoveries begun, and ``recovering`` still says so."""
        with self._lock:
            self._draining += 1
        try:
            yield
        finally:
            with self._lock:
                self._draining -= 1

    def recovering(self) -> bool:
        """Is a background recovery under way for any slot, or about to begin (a loss queued
        for this process's healer, or being drained)? A request with no shard to serve it waits
        while this holds: a re-route right after its shard died must not find the slot empty and
        give up before the warm spare is promoted."""
        with self._lock:
            return bool(self._recovering) or self._draining > 0 or (self.healer and self.table.has_losses())

    def end_recovery(self, slot: int) -> None:
        with self._lock:
            self._recovering.discard(slot)

    # -- spares --------------------------------------------------------------------------------

    def spares(self) -> list[ShardHandle]:
        return list(self.table.spares().values())

    def add_spare(self, handle: ShardHandle) -> Member:
        return self.table.add_spare(handle.name, handle, handle.info.weight_version)

    def pop_spare(self, name: str) -> ShardHandle | None:
        """Remove spare ``name`` from the pool (None if another caller took it first)."""
        return self.table.pop_spare(name)

    def reserve_spare_starts(self, wanted: int) -> list[int]:
        """Sequence numbers for the spares to start so ``wanted`` are up or coming up."""
        with self._lock:
            missing = max(0, wanted - len(self.table.spares()) - self._spares_starting)
            self._spares_starting += missing
            seqs = list(range(self._spare_seq, self._spare_seq + missing))
            self._spare_seq += missing
            return seqs

    def spare_start_done(self) -> None:
        with self._lock:
            self._spares_starting -= 1

    # -- everyone ------------------------------------------------------------------------------

    def members(self, slots: Iterable[int] | None = None) -> dict[Member, ShardHandle]:
        """Member -> handle for ``slots`` (default: every slot) and every warm spare."""
        table = self.table.slots()
        chosen = sorted(table) if slots is None else [s for s in slots if s in table]
        out = {Member(table[s][0], s): table[s][1] for s in chosen}
        out.update({Member(name, None): h for name, h in self.table.spares().items()})
        return out
