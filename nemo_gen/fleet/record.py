"""The fleet's own record: a tiny detached actor (``<fleet>-record``, no CPU) that outlives
every shard, holding what must survive them all — the fleet's weight version and the
checkpoint it came from, and per slot its restart count and whether it is retired (so a restart
budget spans every process that attaches, and RETIRED stays terminal for the next heal run).

Shards remember their own versions, but a fleet whose every shard died would otherwise be
indistinguishable from no fleet at all, and its replacements would not know which weights to
load. ``attach`` reads the record; a refit writes it (``RecordWriter``); ``shutdown`` removes it.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import weakref
from typing import Any

import ray

from nemo_gen.core.wire import FleetRecordState, SlotRecord

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class FleetRecord:
    def __init__(self, fleet: str, weight_version: int | None):
        self._state = FleetRecordState(fleet, weight_version)

    def get(self) -> FleetRecordState:
        return self._state

    def reset(self, weight_version: int | None) -> None:
        """A fleet being launched under this name: its version, no source, no slot entries."""
        self._state = FleetRecordState(self._state.fleet, weight_version)

    def set_version(self, weight_version: int | None, weight_source: str | None) -> None:
        self._state = dataclasses.replace(self._state, weight_version=weight_version, weight_source=weight_source)

    def set_slot(self, entry: SlotRecord) -> None:
        self._state = self._state.with_slot(entry)


def record_name(fleet: str) -> str:
    return f"{fleet}-record"


def create_record(fleet: str, namespace: str, weight_version: int | None, timeout_s: float):
    """The record of a fleet being launched (an existing one is reused and reset)."""
    actor = FleetRecord.options(
        name=record_name(fleet), namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(fleet, weight_version)
    ray.get(actor.reset.remote(weight_version), timeout=timeout_s)
    return actor


def find_record(fleet: str, namespace: str, timeout_s: float) -> tuple[Any, FleetRecordState] | tuple[None, None]:
    """(actor, contents) of a running fleet's record, or (None, None). This process's own writes
    to it are in it first."""
    for writer in list(_WRITERS.get((namespace, fleet), ())):
        writer.flush()
    try:
        actor = ray.get_actor(record_name(fleet), namespace=namespace)
        return actor, ray.get(actor.get.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None, None


class RecordWriter:
    """This process's writes to a fleet's record (no-ops without one), made by a thread of its own
    in the order they were asked for. What a refit's caller waits for is its shards: submitting the
    record's Ray call, and checking the one before, took ~0.7 ms of the ~1.1 ms answer leg of a CPU
    refit over the direct line (``bench/refit_call.py``). One thread submits every write, and Ray
    runs one caller's calls on an actor in the order they were submitted, so the record takes them
    in order. ``flush`` waits until the record holds every write asked for before it, and
    ``find_record`` in this process flushes first: a process reads its own writes. A write that
    failed is logged when the next one is sent, or at ``flush``."""

    def __init__(self, actor: Any, timeout_s: float, key: tuple[str, str] | None = None):
        """``key``: (namespace, fleet name), under which ``find_record`` finds this writer."""
        self.actor = actor
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue | None = None  # the sending thread's, while one runs
        if actor is not None and key is not None:
            _WRITERS.setdefault(key, weakref.WeakSet()).add(self)

    def write_version(self, weight_version: int | None, weight_source: str | None) -> None:
        """The version the fleet serves now and the checkpoint it came from (None: a live trainer's)."""
        self._put(("set_version", (weight_version, weight_source)))

    def write_slot(self, slot: int, restarts: int, retired: str | None) -> None:
        """Slot ``slot``'s restart count and, once retired, why."""
        self._put(("set_slot", (SlotRecord(slot, restarts, retired),)))

    def _put(self, call: tuple[str, tuple]) -> None:
        if self.actor is None:
            return
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._send, args=(self._queue,), name="nemo-gen-record", daemon=True).start()
            self._queue.put(call)

    def flush(self) -> None:
        """Wait (``fleet.control_timeout_s`` at most) until the record holds every write asked for."""
        done = threading.Event()
        with self._lock:
            if self._queue is None:
                return
            self._queue.put(done)
        if not done.wait(self._timeout_s):
            log.warning("the fleet record did not take this process's writes within %gs", self._timeout_s)

    def close(self) -> None:
        """``flush``, then end the sending thread (a later write starts another)."""
        self.flush()
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)
                self._queue = None

    def _send(self, work: queue.SimpleQueue) -> None:
        """The sending thread: each write submitted in turn; ``None`` ends it."""
        last = None
        while (item := work.get()) is not None:
            if isinstance(item, threading.Event):  # a flush: every write before it has landed
                self._settle(last, wait=True)
                last = None
                item.set()
                continue
            method, args = item
            self._settle(last, wait=False)
            last = None
            try:
                last = getattr(self.actor, method).remote(*args)
            except Exception as exc:  # noqa: BLE001 — the thread must outlive a bad write
                log.warning("could not update the fleet record: %s", exc)

    def _settle(self, ref: Any, wait: bool) -> None:
        """Log the last write if it failed; without ``wait`` only if it is already done (the
        record takes the next write after it anyway)."""
        if ref is None or (not wait and not ray.wait([ref], timeout=0)[0]):
            return
        try:
            ray.get(ref, timeout=self._timeout_s)
        except Exception as exc:  # the shards still know; a lost record costs only all-dead recovery
            log.warning("could not update the fleet record: %s", exc)


# (namespace, fleet) -> this process's writers to that fleet's record (a launched fleet's, an
# attached one's), for ``find_record``
_WRITERS: dict[tuple[str, str], "weakref.WeakSet[RecordWriter]"] = {}


def remove_record(actor: Any) -> None:
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
