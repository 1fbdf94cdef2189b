"""Shard loss: reap what a dead shard leaves, start its replacement (or promote a warm spare),
bring it to the fleet's weight version, and re-admit it.

What to do about a slot is the pure planner's decision (``nemo_gen.core.planner``); this
module carries the actions out. ``Recovery.restart_shard`` is one attempt; the retry policy
around it is Prefect's (the ``restart-shard`` task in ``tasks/recovery.py``: retries, backoff
with jitter, a condition on the infra/data taxonomy) or, when the library runs without
Prefect, ``Recovery.recover`` (the same backoff schedule, in the fleet's recovery thread).
Both walk the ledger the same way: DEAD -> RESTARTING -> STALE -> (refit to the current
version) -> HEALTHY, and RETIRED once ``health.max_restart_attempts_per_shard`` are spent.

Reaping: whatever the raylet does, a dead shard's engine processes are gone (polled until
they exit) before its replacement is placed — unless the operator set
``RAY_process_group_cleanup_enabled=0``: then they are left for debugging and reported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import psutil
from ray.util import get_node_ip_address

from nemo_gen.core.backoff import BackoffPolicy
from nemo_gen.core.fleet_health import SERVING_STATES, ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.modes import RecoveryAction
from nemo_gen.core.planner import Action, CatchUp, PromoteSpare, Retire, plan, plan_slot
from nemo_gen.core.retry import describe, is_retriable
from nemo_gen.core.slots import SlotConflict, SlotTable
from nemo_gen.environment import REAPING_FLAG
from nemo_gen.errors import ShardRetired, StaleShard
from nemo_gen.host import gpu_memory
from nemo_gen.fleet.background import Background
from nemo_gen.fleet.driver import ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.monitor import DeathWatch
from nemo_gen.host.processes import processes, wait_exit, wait_or_kill
from nemo_gen.fleet.refit import Refitter
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.fleet.spares import SparePool
from nemo_gen.fleet.weights import FleetWeights

log = logging.getLogger(__name__)

# After the actor is gone, what Ray's cleanup would have needed, so orphans are really orphans.
_ORPHAN_SETTLE_S = 0.5
# How often the loss drainer looks at whether the fleet closed (a queued loss wakes it at once).
_DRAIN_POLL_S = 0.5


@dataclass
class ReapReport:
    """What became of a dead shard's processes."""

    shard: Any
    exited: list[int] = field(default_factory=list)  # gone on their own (Ray's cleanup)
    killed: list[int] = field(default_factory=list)  # outlived the deadline: nemo_gen killed them
    orphans: list[dict[str, Any]] = field(default_factory=list)  # kept (cleanup disabled): pid, rss
    seconds: float = 0.0
    checked: bool = True  # False: the shard ran on another host, its PIDs mean nothing here
    # GPU memory (NVML) the shard's processes still held when the reaper gave up waiting for it
    # (pid -> bytes; empty: all of it came back, or the shard used no GPU).
    gpu_held: dict[int, int] = field(default_factory=dict)
    gpu_seconds: float = 0.0  # how long the reaper waited for that memory

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cleanup_disabled() -> bool:
    """The operator asked Ray to leave a dead worker's process group alone (debugging)."""
    return os.environ.get(REAPING_FLAG) == "0"


def reap_shard(driver: ShardDriver, handle: ShardHandle, timeout_s: float) -> ReapReport:
    """Kill the shard's actor (if it still runs) and wait until its processes have exited.

    Polls to a deadline, never samples once: right after a SIGKILL the EngineCore is still
    alive for a few hundred ms while the raylet tears the process group down."""
    t0 = time.monotonic()
    report = ReapReport(shard=handle.index if handle.index is not None else handle.name)
    driver.kill(handle)
    ip = handle.info.node_ip
    if ip is not None and ip != get_node_ip_address():
        report.checked = False
        log.warning("shard %s ran on node %s: its processes cannot be checked from here", report.shard, ip)
        return report
    actor = processes([handle.actor_pid] if handle.actor_pid else [])
    engine = processes(handle.engine_pids)
    if cleanup_disabled():
        # Honour the operator: wait for the actor only, then report what it left behind.
        wait_exit(actor, timeout_s)
        time.sleep(_ORPHAN_SETTLE_S)
        gpu = gpu_memory.used_by_pids([p.pid for p in engine])
        for proc in engine:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    report.orphans.append({"pid": proc.pid, "rss_bytes": proc.memory_info().rss, "name": proc.name(),
                                           "gpu_bytes": gpu.get(proc.pid, 0)})
            except psutil.NoSuchProcess:
                report.exited.append(proc.pid)
        if report.orphans:
            log.warning(
                "shard %s: %s=0 is set, so its engine processes are left running for debugging: %s",
                report.shard, REAPING_FLAG,
                ", ".join(f"pid {o['pid']} ({o['rss_bytes'] / 2**30:.2f} GiB)" for o in report.orphans),
            )
        report.seconds = time.monotonic() - t0
        return report
    report.exited, report.killed = wait_or_kill(actor + engine, timeout_s)
    if report.killed:
        log.warning("shard %s: killed engine processes that outlived their actor: %s", report.shard, report.killed)
    # A process that has exited can still hold its GPU memory for a moment (the driver frees it
    # after the last reference): the replacement is placed only once it is back.
    pids = [p.pid for p in actor + engine]
    released = gpu_memory.wait_released(pids, max(0.0, timeout_s - (time.monotonic() - t0)))
    report.gpu_held, report.gpu_seconds = released.held, released.seconds
    if released.held:
        log.warning("shard %s: GPU memory still held after health.reap_timeout_s=%g: %s", report.shard,
                    timeout_s, gpu_memory.describe(released.held))
    report.seconds = time.monotonic() - t0
    return report


class Recovery:
    """Brings lost slots back. Losses reach it as ``ShardLost`` events on the slot table's queue
    (queued by the router, the prober, the death watch, refit and status), which ``drain`` turns
    into actions; while the fleet watches itself a thread drains as they come."""

    def __init__(self, *, slots: SlotTable, members: Membership, weights: FleetWeights,
                 refitter: Refitter, spares: SparePool, driver: ShardDriver, background: Background,
                 specs: Sequence[ShardSpec], fleet_name: str, reap_timeout_s: float, backoff: BackoffPolicy,
                 auto_recover: Callable[[], bool], watches: DeathWatch):
        self.slots = slots
        self.health = slots.ledger  # read only: every write is a table transaction
        self.members = members
        self.weights = weights
        self.refitter = refitter
        self.spares = spares
        self.driver = driver
        self.background = background
        self._specs = list(specs)
        self._fleet_name = fleet_name
        self._reap_timeout_s = reap_timeout_s
        self.backoff = backoff
        self._auto_recover = auto_recover
        self.watches = watches  # every member it installs is watched
        self.orphans: list[dict[str, Any]] = []  # processes left by dead shards (cleanup disabled)
        self._drainer: threading.Thread | None = None

    # -- news of a loss ----------------------------------------------------------------------------

    def shard_lost(self, member: Member, reason: str) -> None:
        """``member`` is gone or wedged: condemned (``SlotTable.condemn``), then acted on."""
        self.members.condemn(member, reason)
        self.drain()

    def drain(self) -> None:
        """Act on every queued ``ShardLost``: a lost spare is replaced; a slot still held by the
        lost actor goes DEAD (its requests are re-routed) and, with ``health.auto_recover`` in a
        fleet that watches itself, is restarted in the background. Old news is dropped."""
        with self.members.draining():
            for lost in self.slots.drain_losses():
                member = lost.member
                if member.is_spare:
                    self.spares.drop(member.name, lost.reason)
                    continue
                if self.background.closed or not self.slots.confirm_loss(lost):  # (old news: dropped)
                    continue
                # Only a fleet that watches itself heals itself; an attached one (a flow's) leaves
                # recovery to the heal flow and its retry policy.
                if self.watching and self._auto_recover() and self.health.state_of(member.slot) is ShardState.DEAD:
                    self.recover_in_background(member.slot)

    @property
    def watching(self) -> bool:
        """A monitor runs: this process heals its own fleet (``Membership.healer`` holds it, so
        that a request with no shard to serve it knows a recovery is about to begin)."""
        return self.members.healer

    def start_watching(self) -> None:
        """This process heals its own fleet: losses are drained as they are queued."""
        self.members.healer = True

        def loop() -> None:
            while not self.background.closed:
                if self.slots.wait_losses(_DRAIN_POLL_S):
                    self.drain()

        self._drainer = threading.Thread(target=loop, name=f"nemo-gen-{self._fleet_name}-losses", daemon=True)
        self._drainer.start()

    def recover_in_background(self, slot: int):
        """Start ``recover`` for ``slot`` unless it is already running."""
        if self.background.closed or not self.members.begin_recovery(slot):
            return None

        def run():
            try:
                return self.recover(slot)
            finally:
                self.members.end_recovery(slot)

        future = self.background.submit(run)
        if future is None:
            self.members.end_recovery(slot)
        return future

    # -- deciding and doing -------------------------------------------------------------------------

    def plan(self) -> list[Action]:
        """What every slot that is not serving needs now (the heal flow's worklist)."""
        self.drain()
        return plan(self.health.snapshot(), self.weights.version, self.spares.ready(self.weights.version),
                    self.health.policy.max_restart_attempts_per_shard)

    def _slot(self, index: int):
        return next(s for s in self.health.snapshot() if s.dp_shard_idx == index)

    def restart_shard(self, index: int) -> dict[str, Any]:
        """One recovery attempt for shard ``index``: the planner's action for it, carried out.

        Returns what was done (``action``: a ``RecoveryAction``, its public spelling in the
        report: "none" | "caught-up" | "promoted-spare" | "restarted" | "restarted-stale"). Raises ``ShardRetired`` when the attempts are spent,
        ``EngineStartError``/``ShardDiedError`` (infra: worth another attempt) when the
        replacement fails, ``PlacementError`` (data) when the cluster cannot hold it."""
        health = self.health
        self.drain()
        shard = self._slot(index)
        if shard.state in SERVING_STATES:
            return {"shard": index, "action": RecoveryAction.NONE, "state": shard.state.value}
        if shard.state is ShardState.RETIRED:
            raise ShardRetired(f"shard {index} is retired: {shard.last_error or 'no error recorded'}")
        action = plan_slot(shard, self.weights.version, self.spares.ready(self.weights.version),
                           health.policy.max_restart_attempts_per_shard)
        if action is None:  # STALE with no version to catch up to yet
            return {"shard": index, "action": RecoveryAction.NONE, "state": shard.state.value}
        if isinstance(action, CatchUp):  # up, but behind: a refit from what is staged is enough
            handle = self.members.handle(index)
            try:
                caught_up = handle is not None and self.refitter.catch_up(Member(handle.name, index), handle)
            except StaleShard:
                caught_up = False
            return {"shard": index, "action": RecoveryAction.CAUGHT_UP if caught_up else RecoveryAction.NONE, "state": health.state_of(index).value}
        if isinstance(action, Retire):
            self.slots.retire_slot(index, action.reason)
            self._note(index)
            raise ShardRetired(f"shard {index} {action.reason}")
        with self.members.slot_lock(index):
            self.slots.begin_restart(index)
            self._note(index)
            t0 = time.monotonic()
            old = self.members.handle(index)
            reaped = reap_shard(self.driver, old, self._reap_timeout_s) if old is not None else None
            if reaped is not None and reaped.orphans:
                self.orphans.extend({"shard": index, **o} for o in reaped.orphans)
            done = self._promote(index, action.spare) if isinstance(action, PromoteSpare) else None
            if done is None:
                done = self._restart(index)
        return {
            "shard": index, "action": done, "state": health.state_of(index).value,
            "weight_version": self.weights.version, "seconds": time.monotonic() - t0,
            "reaped": reaped.to_json() if reaped else None,
        }

    def _note(self, index: int) -> None:
        """The slot's restart count and retirement, into the fleet record (they outlive us)."""
        shard = self._slot(index)
        retired = (shard.last_error or "retired") if shard.state is ShardState.RETIRED else None
        self.weights.note_slot(index, shard.restart_attempts, retired)

    def _attempts(self, index: int) -> int:
        return self._slot(index).restart_attempts

    def _promote(self, index: int, name: str) -> RecoveryAction | None:
        """The spare takes the slot, under the refit lock: a refit in progress finishes first
        (the spare takes it too), so the slot never gets weights behind the fleet's. None when
        no spare is at the version after all (a restart follows)."""
        with self.weights.refitting():
            version = self.weights.version
            spare = self.spares.pick(version, name)
            if spare is None:
                return None
            self.driver.assign(spare, index, self._attempts(index))
            try:
                member = self.members.promote(index, spare, version)
            except SlotConflict as exc:  # dropped meanwhile: nothing changed, a restart follows
                log.warning("shard %d: spare %s not promoted: %s", index, name, exc)
                return None
            self.watches.watch(member, spare)
        self.spares.replenish()
        return RecoveryAction.PROMOTED_SPARE

    def _restart(self, index: int) -> RecoveryAction:
        attempt = self._attempts(index)
        spec = dataclasses.replace(self._specs[index], name=f"{self._fleet_name}-shard-{index}-r{attempt}")
        handle = self.driver.launch(spec)
        self.driver.assign(handle, index, attempt)
        try:
            member = self.members.install_replacement(index, handle)
        except SlotConflict:  # the slot left RESTARTING meanwhile: the new actor has no place
            self.driver.stop(handle)
            raise
        self.watches.watch(member, handle)
        try:
            self.refitter.catch_up(member, handle)
            return RecoveryAction.RESTARTED
        except StaleShard:
            return RecoveryAction.RESTARTED_STALE

    def recover(self, index: int, rng: random.Random | None = None) -> dict[str, Any] | None:
        """The library's retry policy around ``restart_shard`` (what the Prefect task does with
        ``retries``): backoff with jitter between attempts, infra failures retried, data
        failures and ``ShardRetired`` not. Returns the last attempt's result, or None."""
        rng = rng or random.Random()
        attempt = 0
        while not self.background.closed:
            attempt += 1
            try:
                return self.restart_shard(index)
            except ShardRetired as exc:
                log.error("%s", exc)
                return None
            except Exception as exc:
                if self.background.closed:
                    return None
                retire = not is_retriable(exc)
                self.slots.restart_failed(index, describe(exc).splitlines()[0], retire=retire)
                if retire:
                    log.error("shard %d: not restarting after a data failure: %s", index, describe(exc))
                    self._note(index)
                    return None
                if attempt > self.health.policy.max_restart_attempts_per_shard:
                    continue  # the next restart_shard call retires it through the planner
                delay = self.backoff.delay(attempt, rng)
                log.warning("shard %d: restart attempt %d failed (%s); next in %.1fs", index, attempt, exc, delay)
                self.background.wait_closed(delay)
        return None


def restart_shard(fleet: Any, index: int) -> dict[str, Any]:
    """One recovery attempt on ``fleet`` (a ``GenerationFleet``): the Prefect task's unit."""
    return fleet.recovery.restart_shard(index)
