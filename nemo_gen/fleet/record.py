"""The fleet's own record: a tiny detached actor (``<fleet>-record``, no CPU) that outlives
every shard, holding what must survive them all — the fleet's weight version and the
checkpoint it came from, and per slot its restart count and whether it is retired (so a restart
budget spans every process that attaches, and RETIRED stays terminal for the next heal run).

Shards remember their own versions, but a fleet whose every shard died would otherwise be
indistinguishable from no fleet at all, and its replacements would not know which weights to
load. ``attach`` reads the record; a refit writes it (``RecordWriter``); ``shutdown`` removes it.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class FleetRecord:
    def __init__(self, fleet: str, weight_version: int | None):
        self._data: dict[str, Any] = {"fleet": fleet, "weight_version": weight_version, "weight_source": None,
                                      "slots": {}}

    def get(self) -> dict[str, Any]:
        return dict(self._data)

    def update(self, **values: Any) -> dict[str, Any]:
        self._data.update(values)
        return dict(self._data)

    def update_slot(self, slot: int, **values: Any) -> None:
        self._data.setdefault("slots", {}).setdefault(str(slot), {}).update(values)


def record_name(fleet: str) -> str:
    return f"{fleet}-record"


def create_record(fleet: str, namespace: str, weight_version: int | None, timeout_s: float):
    """The record of a fleet being launched (an existing one is reused and reset)."""
    actor = FleetRecord.options(
        name=record_name(fleet), namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(fleet, weight_version)
    ray.get(actor.update.remote(weight_version=weight_version, weight_source=None, slots={}), timeout=timeout_s)
    return actor


def find_record(fleet: str, namespace: str, timeout_s: float) -> tuple[Any, dict[str, Any]] | tuple[None, None]:
    """(actor, contents) of a running fleet's record, or (None, None)."""
    try:
        actor = ray.get_actor(record_name(fleet), namespace=namespace)
        return actor, ray.get(actor.get.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None, None


class RecordWriter:
    """This process's writes to a fleet's record (no-ops without one). Sent without waiting:
    Ray runs one caller's calls on an actor in the order they were sent, so the record takes
    them in order and this process reads its own writes; what a refit's caller waits for is its
    shards, and a round trip to the record was a millisecond of a colocated GPU refit. A write
    that failed is logged when the next one is sent, or at ``flush``."""

    def __init__(self, actor: Any, timeout_s: float):
        self.actor = actor
        self._timeout_s = timeout_s
        self._pending: Any = None

    def write(self, slot: int | None = None, **values: Any) -> None:
        """``values`` into the record, or into slot ``slot``'s entry."""
        if self.actor is None:
            return
        self._check(wait=False)
        self._pending = (self.actor.update.remote(**values) if slot is None
                         else self.actor.update_slot.remote(slot, **values))

    def flush(self) -> None:
        """Wait (``fleet.control_timeout_s`` at most) until the record holds every write sent."""
        self._check(wait=True)

    def _check(self, wait: bool) -> None:
        ref, self._pending = self._pending, None
        if ref is None:
            return
        if not wait and not ray.wait([ref], timeout=0)[0]:
            return  # still on its way; the record takes the next write after it
        try:
            ray.get(ref, timeout=self._timeout_s)
        except Exception as exc:  # the shards still know; a lost record costs only all-dead recovery
            log.warning("could not update the fleet record: %s", exc)


def remove_record(actor: Any) -> None:
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
