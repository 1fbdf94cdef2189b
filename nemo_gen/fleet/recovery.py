"""Shard loss: reap what a dead shard leaves, start its replacement (or promote a warm spare),
bring it to the fleet's weight version, and re-admit it.

``restart_shard`` is one attempt; the retry policy around it is Prefect's (the
``restart-shard`` task in ``tasks/recovery.py``: retries, backoff with jitter, a condition on
the infra/data taxonomy) or, when the library runs without Prefect, ``recover`` (the same
backoff schedule, in the fleet's recovery thread). Both walk the ledger the same way:
DEAD -> RESTARTING -> STALE -> (refit to the current version) -> HEALTHY, and RETIRED once
``health.max_restart_attempts_per_shard`` attempts are spent.

Reaping: whatever the raylet does, a dead shard's engine processes are gone (polled until
they exit) before its replacement is placed — unless the operator set
``RAY_process_group_cleanup_enabled=0``: then they are left for debugging and reported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psutil
import ray
from ray.util import get_node_ip_address

from nemo_gen.core.backoff import BackoffPolicy
from nemo_gen.core.fleet_health import SERVING_STATES, ShardState
from nemo_gen.core.retry import describe, is_retriable
from nemo_gen.environment import REAPING_FLAG
from nemo_gen.errors import NemoGenError, ShardDiedError, ShardRetired, StaleShard
from nemo_gen.fleet.processes import processes, wait_exit, wait_or_kill
from nemo_gen.fleet.refit import apply_staged, stage
from nemo_gen.fleet.shard import ShardHandle, launch_shard, stop_actor

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.fleet.fleet import GenerationFleet

log = logging.getLogger(__name__)


@dataclass
class ReapReport:
    """What became of a dead shard's processes."""

    shard: Any
    exited: list[int] = field(default_factory=list)  # gone on their own (Ray's cleanup)
    killed: list[int] = field(default_factory=list)  # outlived the deadline: nemo_gen killed them
    orphans: list[dict[str, Any]] = field(default_factory=list)  # kept (cleanup disabled): pid, rss
    seconds: float = 0.0
    checked: bool = True  # False: the shard ran on another host, its PIDs mean nothing here

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cleanup_disabled() -> bool:
    """The operator asked Ray to leave a dead worker's process group alone (debugging)."""
    return os.environ.get(REAPING_FLAG) == "0"


def reap_shard(handle: ShardHandle, timeout_s: float) -> ReapReport:
    """Kill the shard's actor (if it still runs) and wait until its processes have exited.

    Polls to a deadline, never samples once: right after a SIGKILL the EngineCore is still
    alive for a few hundred ms while the raylet tears the process group down."""
    t0 = time.monotonic()
    report = ReapReport(shard=handle.index if handle.index is not None else handle.name)
    stop_actor(handle)
    if not _on_this_host(handle.info):
        report.checked = False
        log.warning("shard %s ran on node %s: its processes cannot be checked from here", report.shard,
                    handle.info.get("node_ip"))
        return report
    actor = processes([handle.actor_pid] if handle.actor_pid else [])
    engine = processes(handle.engine_pids)
    if cleanup_disabled():
        # Honour the operator: wait for the actor only, then report what it left behind.
        wait_exit(actor, timeout_s)
        time.sleep(0.5)  # what Ray's cleanup would have needed: the orphans are really orphans
        for proc in engine:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    report.orphans.append({"pid": proc.pid, "rss_bytes": proc.memory_info().rss, "name": proc.name()})
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
    report.seconds = time.monotonic() - t0
    return report


def restart_shard(fleet: "GenerationFleet", index: int) -> dict[str, Any]:
    """One recovery attempt for shard ``index``: reap, replace, catch up, re-admit.

    Returns what was done (``action``: "none" | "promoted-spare" | "restarted"). Raises
    ``ShardRetired`` when the attempts are spent, ``EngineStartError``/``ShardDiedError``
    (infra: worth another attempt) when the replacement fails, ``PlacementError`` (data)
    when the cluster cannot hold it."""
    health = fleet.health
    state = health.state_of(index)
    if state in SERVING_STATES:
        return {"shard": index, "action": "none", "state": state.value}
    if state is ShardState.STALE:  # up, but behind: a refit from what is staged is enough
        handle = fleet.handle(index)
        try:
            caught_up = handle is not None and catch_up(fleet, index, handle)
        except StaleShard:
            caught_up = False
        return {"shard": index, "action": "caught-up" if caught_up else "none", "state": health.state_of(index).value}
    if state is ShardState.RETIRED:
        raise ShardRetired(f"shard {index} is retired: {_last_error(fleet, index)}")
    with fleet.slot_lock(index):
        health.mark_restarting(index)
        if health.state_of(index) is ShardState.RETIRED:
            raise ShardRetired(
                f"shard {index} retired after {health.policy.max_restart_attempts_per_shard} restart "
                f"attempt(s) (health.max_restart_attempts_per_shard): {_last_error(fleet, index)}"
            )
        t0 = time.monotonic()
        old = fleet.handle(index)
        reaped = reap_shard(old, fleet.settings.health.reap_timeout_s) if old is not None else None
        if reaped is not None and reaped.orphans:
            fleet.orphans.extend({"shard": index, **o} for o in reaped.orphans)
        # A spare is promoted under the refit lock: a refit in progress finishes first (the
        # spare takes it too), so the slot never gets weights behind the fleet's.
        with fleet.refit_lock:
            spare = fleet.take_spare()
            if spare is not None:
                ray.get(spare.actor.assign.remote(index, _attempts(fleet, index)), timeout=30)
                fleet.install(index, spare)
                health.mark_loaded(index)
                if fleet.weight_version is not None:  # else: train mode before its first refit
                    health.report_refit(index, fleet.weight_version)
                action = "promoted-spare"
        if spare is not None:
            fleet.replenish_spares()
        else:
            attempt = _attempts(fleet, index)
            spec = dataclasses.replace(
                fleet.resolved.shards[index], name=f"{fleet.settings.fleet.name}-shard-{index}-r{attempt}"
            )
            handle = launch_shard(spec)
            ray.get(handle.actor.assign.remote(index, attempt), timeout=30)
            fleet.install(index, handle)
            health.mark_loaded(index)
            try:
                catch_up(fleet, index, handle)
                action = "restarted"
            except StaleShard:
                action = "restarted-stale"
    return {
        "shard": index,
        "action": action,
        "state": health.state_of(index).value,
        "weight_version": fleet.weight_version,
        "seconds": time.monotonic() - t0,
        "reaped": reaped.to_json() if reaped else None,
    }


def catch_up(fleet: "GenerationFleet", key: Any, handle: ShardHandle) -> bool:
    """Bring a fresh engine to the fleet's weight version. ``key``: the slot (the ledger is
    updated) or ("spare", name). Returns False when there is no version to catch up to yet
    (a train-mode fleet before its first refit: the shard stays STALE)."""
    version = fleet.weight_version
    if version is None:
        return False
    is_slot = not isinstance(key, tuple)
    with fleet.refit_lock:
        version = fleet.weight_version
        if handle.info.get("weight_version") == version and fleet.staged_refit is None:
            pass  # it loaded the checkpoint at start, and no refit has happened since (eval, v0)
        else:
            staged = fleet.staged_refit
            if staged is None or staged.version != version:
                if not fleet.weight_source:
                    raise _stale(fleet, key, version)
                # Another process did the last refit (its staging is gone): stage it again.
                staged = stage(fleet, fleet.weight_source, version)
                fleet.staged_refit = staged
            ok, _, error = apply_staged(fleet.settings.refit.timeout_s, staged, {key: handle})[key]
            if not ok:
                if is_slot:
                    fleet.health.mark_dead(key, error)
                raise ShardDiedError(key if is_slot else -1, error)
        handle.info["weight_version"] = version
        if is_slot:
            fleet.health.report_refit(key, version)
    return True


def recover(fleet: "GenerationFleet", index: int, rng: random.Random | None = None) -> dict[str, Any] | None:
    """The library's retry policy around ``restart_shard`` (what the Prefect task does with
    ``retries``): backoff with jitter between attempts, infra failures retried, data failures
    and ``ShardRetired`` not. Returns the last attempt's result, or None if it gave up."""
    h = fleet.settings.health
    policy = backoff_policy(fleet.settings)
    rng = rng or random.Random()
    attempt = 0
    while not fleet.closed:
        attempt += 1
        try:
            return restart_shard(fleet, index)
        except ShardRetired as exc:
            log.error("%s", exc)
            return None
        except Exception as exc:
            if fleet.closed:
                return None
            fleet.health.mark_dead(index, describe(exc).splitlines()[0])
            if not is_retriable(exc):
                log.error("shard %d: not restarting after a data failure: %s", index, describe(exc))
                fleet.health.retire(index, f"restart failed: {describe(exc).splitlines()[0]}")
                return None
            if attempt >= h.max_restart_attempts_per_shard + 1:
                continue  # the next restart_shard call retires it through the ledger
            delay = policy.delay(attempt, rng)
            log.warning("shard %d: restart attempt %d failed (%s); next in %.1fs", index, attempt, exc, delay)
            fleet.wait_closed(delay)
    return None


def backoff_policy(settings) -> BackoffPolicy:
    """The restart schedule from ``health.restart_*`` settings (shared by Prefect and the library)."""
    h = settings.health
    return BackoffPolicy(
        base_s=h.restart_backoff_s,
        max_s=max(h.restart_backoff_max_s, h.restart_backoff_s),
        jitter=min(h.restart_jitter, 1.0),
        max_attempts=max(1, h.max_restart_attempts_per_shard),
    )


def _stale(fleet: "GenerationFleet", key: Any, version: int) -> NemoGenError:
    reason = (
        f"no source for weight version {version} in this process (it came from live tensors "
        "pushed by another process): stays STALE until the next refit"
    )
    if not isinstance(key, tuple):
        fleet.health.mark_loaded(key)  # STALE, with the reason on record
    log.warning("shard %s: %s", key, reason)
    return StaleShard(reason)


def _attempts(fleet: "GenerationFleet", index: int) -> int:
    return next(s.restart_attempts for s in fleet.health.snapshot() if s.dp_shard_idx == index)


def _last_error(fleet: "GenerationFleet", index: int) -> str:
    return next((s.last_error for s in fleet.health.snapshot() if s.dp_shard_idx == index), "") or "no error recorded"


def _on_this_host(info: dict[str, Any]) -> bool:
    ip = info.get("node_ip")
    return ip is None or ip == get_node_ip_address()
