"""Warm spares: engines loaded and refit with the fleet that serve no slot until one is lost.

``SparePool`` takes a spare that is at the fleet's version for a dead slot, drops one that
died or failed a refit, and keeps ``fleet.spares`` of them up (started in the background,
caught up to the fleet's version before they count). The spares themselves are members of
``Membership``; this module decides what happens to them: a new one is handed to the death
watch (``monitor.DeathWatch``), a dropped one is stopped and its processes reaped here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

from nemo_gen.core.members import Member
from nemo_gen.core.retry import describe
from nemo_gen.errors import ShardDiedError
from nemo_gen.fleet.background import Background
from nemo_gen.fleet.driver import ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.monitor import DeathWatch
from nemo_gen.fleet.refit import Refitter
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.host.processes import reap

log = logging.getLogger(__name__)


class SparePool:
    def __init__(self, *, members: Membership, driver: ShardDriver, refitter: Refitter, background: Background,
                 template: ShardSpec, fleet_name: str, num_slots: int, wanted: Callable[[], int],
                 watches: DeathWatch, reap_timeout_s: float):
        self.members = members
        self.driver = driver
        self.refitter = refitter
        self.background = background
        self._template = template
        self._fleet_name = fleet_name
        self._num_slots = num_slots
        self._wanted = wanted  # fleet.spares, read each time: an operator may change it on a live fleet
        self.watches = watches
        self._reap_timeout_s = reap_timeout_s

    def ready(self, version: int | None) -> list[str]:
        """Spares believed to be at ``version`` (from what they last said; ``pick`` asks again)."""
        return self.members.ready_spares(version)

    def pick(self, version: int | None, name: str | None = None) -> ShardHandle | None:
        """A spare that says it is at ``version`` (``name`` first, when given), left in the pool
        (``Membership.promote`` takes it); None if none is. One that does not answer is dropped."""
        spares = sorted(self.members.spares(), key=lambda h: h.name != name)
        for spare in spares:
            try:
                info = self.driver.info(spare)
            except ShardDiedError as exc:
                self.drop(spare.name, str(exc))
                continue
            if info.weight_version != version:
                continue  # still catching up
            return spare
        return None

    def drop(self, name: str, reason: str) -> None:
        """Remove a spare that died or failed a refit, stop it, and start another."""
        handle = self.members.pop_spare(name)
        if handle is None:
            return
        log.warning("spare %s dropped: %s", name, reason)
        self.background.submit(self._stop_and_reap, handle)
        self.replenish()

    def _stop_and_reap(self, handle: ShardHandle) -> None:
        """A dropped spare's engine stopped, then its processes gone (``health.reap_timeout_s``)."""
        pids = self.driver.stop(handle) + ([handle.actor_pid] if handle.actor_pid else [])
        reap(pids, self._reap_timeout_s)

    def replenish(self) -> None:
        """Start spares in the background until ``fleet.spares`` are up (or coming up)."""
        for seq in self.members.reserve_spare_starts(self._wanted()):
            if self.background.submit(self._start, seq) is None:
                self.members.spare_start_done()

    def _start(self, seq: int) -> None:
        spec = dataclasses.replace(
            self._template, index=self._num_slots + seq, name=f"{self._fleet_name}-spare-{seq}", spare=True
        )
        try:
            handle = self.driver.launch(spec)
            if self.background.closed and not self.background.detached:  # shut down meanwhile: it has no fleet
                self.driver.stop(handle)
                return
            self.refitter.catch_up(Member(handle.name, None), handle)
        except Exception as exc:
            log.warning("could not start spare %s: %s", spec.actor_name, describe(exc).splitlines()[0])
            return
        finally:
            self.members.spare_start_done()
        self.watches.watch(self.members.add_spare(handle), handle)
