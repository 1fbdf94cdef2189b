"""The fleet's eyes: a death watch on every shard and spare, and real-generation probes.

Crash: each shard actor runs a ``watch`` call that returns when one of its engine processes
exits, and fails at once when the actor itself dies — the monitor holds those calls in one
wait, so a SIGKILL is seen within ``health.watch_interval_s`` (no probe streak needed: a dead
process is certain). Hang: every ``health.probe_interval_s`` each serving shard gets a probe
(one real token, or proof of a recent engine step while it runs a batch); no answer within
``health.probe_timeout_s`` is a failure, and ``health.unhealthy_threshold`` of them in a row
condemn the shard (NeMo-RL's streak rules, in the ledger). A SIGSTOPped engine answers
nothing and is condemned this way. A sleeping fleet (``nemo_gen.fleet.sleep``) is not probed and
late answers count for nothing (its schedulers are paused); its death watch runs on.

``DeathWatch`` owns the watch calls: whoever installs a member (the spare pool, recovery) hands it
to the death watch, which starts its call once a monitor runs; the monitor waits on them and
settles them. ``Prober`` owns what a probe answer means (shared by the monitor's thread and the heal flow's
blocking ``probe_round``); a lost shard is condemned in the slot table, whose ``ShardLost``
recovery drains.

Stats: when the engines keep vLLM's stats, each probe round also fetches every serving shard's
(``VllmStats``, off the monitor's thread); ``/metrics`` reads that snapshot and its age, so a scrape
makes no call to a shard however often it comes.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.retry import describe
from nemo_gen.core.slots import SlotTable
from nemo_gen.core.wire import ProbeReply, ProbeStatus, Sampling
from nemo_gen.errors import ShardDiedError
from nemo_gen.fleet.driver import Call, ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.handles import ShardHandle

log = logging.getLogger(__name__)


class Prober:
    """Sends probes and records their answers (through the slot table, into the ledger)."""

    def __init__(self, *, driver: ShardDriver, slots: SlotTable, members: Membership,
                 sampling: Mapping[str, Any] | Sampling, tokens: list[int], timeout_s: float, warmup_s: float):
        self.driver = driver
        self.slots = slots
        self.health = slots.ledger  # read only: every write is a table transaction
        self.members = members
        # the probe's one greedy token: a resolved sampling dict (``resolve_sampling``) as the wire's
        self.sampling = sampling if isinstance(sampling, Sampling) else Sampling.of(sampling)
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.warmup_s = warmup_s
        self.detections: list[dict[str, Any]] = []  # (for benchmarks and status) what was seen when

    def send(self, handle: ShardHandle) -> Call:
        return self.driver.start_probe(handle, self.sampling, self.tokens, self.timeout_s, self.warmup_s)

    def answer_of(self, call: Call) -> ProbeReply:
        """The probe's answer; a dead actor or engine is ``DEAD`` (condemned at once), any other
        failure is one step of a streak."""
        try:
            return self.driver.result(call)
        except ShardDiedError as exc:
            return ProbeReply(ProbeStatus.DEAD, f"probe failed: {exc.detail}")
        except Exception as exc:
            return ProbeReply(ProbeStatus.FAILED, f"probe failed: {describe(exc).splitlines()[0]}")

    def timed_out(self) -> ProbeReply:
        return ProbeReply(ProbeStatus.UNANSWERED, f"probe not answered within {self.timeout_s:g}s")

    def record(self, member: Member, answer: ProbeReply) -> None:
        """One probe answer about ``member``: a streak step in the ledger; a dead actor or engine,
        or a streak at the threshold, condemns the shard. A skipped probe counts for nothing."""
        if not self.members.is_current(member) or answer.status is ProbeStatus.SKIPPED:
            return
        slot = member.slot
        if answer.status is ProbeStatus.DEAD:
            self.detected(member, "probe", answer.detail or "probe found the shard dead")
            return
        if not self.slots.sleep_state().awake:  # sent before a sleep paused its scheduler: no news
            return
        alive = answer.status.alive
        state = self.slots.record_probe_answer(slot, alive, None if alive else answer.detail)
        if not alive:
            log.warning("shard %d probe failed: %s", slot, answer.detail)
        if state is ShardState.DEAD:
            self.detected(member, "probe", (None if alive else answer.detail) or "probe failures")

    def detected(self, member: Member, by: str, reason: str) -> None:
        key = member.name if member.is_spare else member.slot
        self.detections.append({"key": key, "name": member.name, "at": time.monotonic(), "by": by, "reason": reason})
        self.members.condemn(member, reason)

    def probe_round(self, unhealthy_threshold: int) -> list[dict[str, Any]]:
        """One blocking round over the serving shards (the heal flow's, where no monitor runs):
        a failing shard is probed up to ``unhealthy_threshold`` times in a row; a dead actor or
        engine is condemned at once."""
        out = []
        if not self.slots.sleep_state().awake:  # asleep is a state, not a fault: nothing to probe
            return out
        for slot in self.health.serving_shards():
            handle = self.members.handle(slot)
            member = Member(handle.name, slot)
            answer = ProbeReply(ProbeStatus.UNANSWERED, "not probed")
            for _ in range(unhealthy_threshold):
                call = self.send(handle)
                if self.driver.wait([call], self.timeout_s):
                    answer = self.answer_of(call)
                else:
                    self.driver.cancel(call)
                    answer = self.timed_out()
                self.record(member, answer)
                if answer.ok or self.health.state_of(slot) is ShardState.DEAD:
                    break
            out.append({"shard": slot, "ok": answer.ok, "error": None if answer.ok else answer.detail,
                        "state": self.health.state_of(slot).value})
        return out


class VllmStats:
    """Each serving shard's vLLM stats (``driver.vllm_metrics``) as last fetched, with when. A fetch
    runs in this object's threads, so a silent shard holds up neither the monitor nor the other
    shards' fetches (at most one in flight per shard); one that fails leaves the last snapshot,
    which ages."""

    def __init__(self, driver: ShardDriver, name: str, workers: int = 4):
        self.driver = driver
        self._lock = threading.Lock()
        self._last: dict[int, tuple[str, list[dict[str, Any]], float]] = {}  # slot -> (actor, rows, at)
        self._fetching: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"nemo-gen-stats-{name}")

    def refresh(self, handles: Mapping[int, ShardHandle]) -> None:
        """Fetch the stats of each slot's shard, unless its last fetch is still running."""
        for slot, handle in handles.items():
            with self._lock:
                if handle.name in self._fetching:
                    continue
                self._fetching.add(handle.name)
            try:
                self._pool.submit(self._fetch, slot, handle)
            except RuntimeError:  # closed: the fleet is going down
                return

    def _fetch(self, slot: int, handle: ShardHandle) -> None:
        try:
            rows = self.driver.vllm_metrics(handle)
        except Exception as exc:  # its probes and watch judge the shard; the stats only age
            log.debug("shard %d: vLLM stats not fetched: %s", slot, describe(exc).splitlines()[0])
            rows = None
        with self._lock:
            self._fetching.discard(handle.name)
            if rows is not None:
                self._last[slot] = (handle.name, rows, time.monotonic())

    def snapshot(self, serving: Mapping[int, str]) -> dict[int, tuple[list[dict[str, Any]], float]]:
        """slot -> (rows, age in seconds), for each slot of ``serving`` (slot -> the actor serving it
        now) whose last stats came from that actor: a replaced shard's are not its successor's."""
        now = time.monotonic()
        with self._lock:
            return {slot: (rows, now - at) for slot, (name, rows, at) in self._last.items()
                    if serving.get(slot) == name}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class DeathWatch:
    """One pending ``watch`` call per member (``ShardActor.watch``: it returns when an engine
    process exits and fails when the actor dies). The one owner of which members are watched:
    the spare pool and recovery hand it each member they install (``watch``); nothing is watched
    until a monitor runs (``start``, with the members there are then), and the monitor waits on
    the calls and takes each one that answered (``take``)."""

    def __init__(self, *, driver: ShardDriver, interval_s: float):
        self.driver = driver
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._calls: dict[Call, Member] = {}
        self.active = False  # a monitor runs

    def start(self, members: Mapping[Member, ShardHandle]) -> None:
        self.active = True
        for member, handle in members.items():
            self.watch(member, handle)

    def watch(self, member: Member, handle: ShardHandle) -> None:
        """Watch ``handle`` in its role ``member`` (a no-op while no monitor runs)."""
        if not self.active:
            return
        call = self.driver.start_watch(handle, self.interval_s)
        with self._lock:
            self._calls[call] = member

    def calls(self) -> list[Call]:
        with self._lock:
            return list(self._calls)

    def take(self, call: Call) -> Member | None:
        """The member ``call`` watched, if it was a watch call (it is no longer pending)."""
        with self._lock:
            return self._calls.pop(call, None)


class FleetMonitor:
    def __init__(self, *, prober: Prober, watches: DeathWatch, probe_interval_s: float, name: str,
                 stats: bool = False):
        self.prober = prober
        self.driver = prober.driver
        self.watches = watches
        # stats: the engines keep vLLM's stats (without, they answer nothing: none are fetched)
        self.stats = VllmStats(self.driver, name) if stats else None
        self._watch_interval = watches.interval_s
        self._probe_interval = probe_interval_s
        self._lock = threading.Lock()
        self._probes: dict[Call, tuple[Member, float]] = {}  # call -> (member, deadline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nemo-gen-monitor-{name}", daemon=True)

    @property
    def detections(self) -> list[dict[str, Any]]:
        return self.prober.detections

    def start(self) -> "FleetMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        if self.stats is not None:
            self.stats.close()

    def vllm_stats(self) -> dict[int, tuple[list[dict[str, Any]], float]]:
        """Per serving slot, vLLM's own stats of its engine and their age in seconds, as fetched on
        the last probe round that reached it: no call to a shard. Empty while the engines keep no
        stats (``generation.vllm_cfg.enable_vllm_metrics_logger``)."""
        if self.stats is None:
            return {}
        return self.stats.snapshot({slot: h.name for slot, h in self._serving().items()})

    def _serving(self) -> dict[int, ShardHandle]:
        """Each serving slot's shard now (slots between two shards left out)."""
        members = self.prober.members
        return {slot: h for slot in self.prober.health.serving_shards() if (h := members.handle(slot)) is not None}

    def _run(self) -> None:
        next_probe = time.monotonic() + self._probe_interval
        if self.stats is not None:  # a scrape soon after launch finds them: the first round is later
            self.stats.refresh(self._serving())
        while not self._stop.is_set():
            with self._lock:
                calls = self.watches.calls() + list(self._probes)
            if not calls:
                self._stop.wait(self._watch_interval)
            else:
                try:
                    ready = self.driver.wait(calls, self._watch_interval)
                except Exception as exc:  # Ray going down under us (shutdown): stop quietly
                    if self._stop.is_set():
                        return
                    log.warning("monitor: wait failed: %s", exc)
                    self._stop.wait(self._watch_interval)
                    continue
                for call in ready:
                    self._settle(call)
            if self._stop.is_set():
                return
            self._expire_probes()
            now = time.monotonic()
            if now >= next_probe:
                self._send_probes()
                next_probe = now + self._probe_interval

    def _settle(self, call: Call) -> None:
        watched = self.watches.take(call)
        with self._lock:
            probe = self._probes.pop(call, None)
        if watched is not None:
            try:
                reason = self.driver.result(call)
            except Exception as exc:  # the actor itself died (or its watch broke): it is lost either way
                reason = f"actor died: {exc.detail if isinstance(exc, ShardDiedError) else describe(exc)}"
            self.prober.detected(watched, "watch", reason)
        elif probe is not None:
            self.prober.record(probe[0], self.prober.answer_of(call))

    def _expire_probes(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(call, p) for call, p in self._probes.items() if p[1] <= now]
            for call, _ in expired:
                del self._probes[call]
        for call, (member, _) in expired:
            self.driver.cancel(call)
            self.prober.record(member, self.prober.timed_out())

    def _send_probes(self) -> None:
        prober = self.prober
        with self._lock:
            probing = {p[0].slot for p in self._probes.values()}
        if not prober.slots.sleep_state().awake:  # a sleeping engine's scheduler is paused: the death
            return                                  # watch still sees it killed
        deadline = time.monotonic() + prober.timeout_s
        serving = self._serving()
        for slot, handle in serving.items():
            if slot in probing:
                continue
            call = prober.send(handle)
            with self._lock:
                self._probes[call] = (Member(handle.name, slot), deadline)
        if self.stats is not None:
            self.stats.refresh(serving)
