"""The fleet's membership: which actor serves each slot, which warm spares wait, and the
bookkeeping around changing them (slot locks, recoveries and spare starts in progress).

``Membership`` is the one owner of that state; everything else asks it. A ``Member``
(``nemo_gen.core.members``) names an actor in its role, and ``is_current`` is how news about
an actor that has since been replaced is recognised as old.
"""

from __future__ import annotations

import logging
import threading
from typing import Iterable

from nemo_gen.core.members import Member
from nemo_gen.shard.actor import ShardHandle

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
    def __init__(self, slots: Iterable[ShardHandle], spares: Iterable[ShardHandle], first_spare_seq: int):
        self._lock = threading.RLock()
        self._slots: dict[int, ShardHandle] = {h.index: h for h in slots}
        self._spares: dict[str, ShardHandle] = {h.name: h for h in spares}
        self._slot_locks: dict[int, threading.Lock] = {}
        self._recovering: set[int] = set()
        self._spares_starting = 0
        seqs = [int(n.rsplit("-", 1)[1]) for n in self._spares if n.rsplit("-", 1)[1].isdigit()]
        self._spare_seq = max([first_spare_seq, *[s + 1 for s in seqs]])

    # -- slots ---------------------------------------------------------------------------------

    def handle(self, slot: int) -> ShardHandle | None:
        """The actor serving ``slot`` now (it changes when the shard is replaced)."""
        with self._lock:
            return self._slots.get(slot)

    def slots(self) -> list[ShardHandle]:
        with self._lock:
            return [self._slots[i] for i in sorted(self._slots)]

    def has_slot(self, slot: int) -> bool:
        with self._lock:
            return slot in self._slots

    def install(self, slot: int, handle: ShardHandle) -> Member:
        """Make ``handle`` the actor serving ``slot``."""
        handle.index = slot
        with self._lock:
            self._slots[slot] = handle
        return Member(handle.name, slot)

    def is_current(self, member: Member) -> bool:
        """Is ``member`` still in its place? (A replaced slot actor or a taken spare is not.)"""
        with self._lock:
            if member.slot is None:
                return member.name in self._spares
            handle = self._slots.get(member.slot)
            return handle is not None and handle.name == member.name

    def note_version(self, member: Member, version: int) -> None:
        """``member`` loaded ``version`` (its handle's last ``ShardInfo`` is replaced by one at
        that version, so a spare's readiness is known without asking it)."""
        with self._lock:
            handle = self._spares.get(member.name) if member.slot is None else self._slots.get(member.slot)
            if handle is not None and handle.name == member.name:
                handle.info = handle.info.with_version(version)

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

    def recovering(self) -> bool:
        """Is a background recovery under way for any slot?"""
        with self._lock:
            return bool(self._recovering)

    def end_recovery(self, slot: int) -> None:
        with self._lock:
            self._recovering.discard(slot)

    # -- spares --------------------------------------------------------------------------------

    def spares(self) -> list[ShardHandle]:
        with self._lock:
            return list(self._spares.values())

    def add_spare(self, handle: ShardHandle) -> Member:
        with self._lock:
            self._spares[handle.name] = handle
        return Member(handle.name, None)

    def pop_spare(self, name: str) -> ShardHandle | None:
        """Remove spare ``name`` from the pool (None if another caller took it first)."""
        with self._lock:
            return self._spares.pop(name, None)

    def reserve_spare_starts(self, wanted: int) -> list[int]:
        """Sequence numbers for the spares to start so ``wanted`` are up or coming up."""
        with self._lock:
            missing = max(0, wanted - len(self._spares) - self._spares_starting)
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
        with self._lock:
            chosen = sorted(self._slots) if slots is None else [s for s in slots if s in self._slots]
            out = {Member(self._slots[s].name, s): self._slots[s] for s in chosen}
            out.update({Member(name, None): h for name, h in self._spares.items()})
            return out
