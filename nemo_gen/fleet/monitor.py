"""The fleet's eyes: a death watch on every shard and spare, and real-generation probes.

Crash: each shard actor runs a ``watch`` call that returns when one of its engine processes
exits, and fails at once when the actor itself dies — the monitor holds those calls in one
``ray.wait``, so a SIGKILL is seen within ``health.watch_interval_s`` (no probe streak needed:
a dead process is certain). Hang: every ``health.probe_interval_s`` each serving shard gets a
probe (one real token, or proof of a recent engine step while it runs a batch); no answer
within ``health.probe_timeout_s`` is a failure, and ``health.unhealthy_threshold`` of them in
a row condemn the shard (NeMo-RL's streak rules, in the ledger). A SIGSTOPped engine answers
nothing and is condemned this way.

What happens to a lost shard is the fleet's business (``GenerationFleet.shard_lost``).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import ray

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.fleet.shard import ShardHandle, root_cause

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.fleet.fleet import GenerationFleet

log = logging.getLogger(__name__)


class FleetMonitor:
    def __init__(self, fleet: "GenerationFleet", probe_sampling: dict[str, Any], probe_tokens: list[int]):
        self._fleet = fleet
        h = fleet.settings.health
        self._watch_interval = h.watch_interval_s
        self._probe_interval = h.probe_interval_s
        self._probe_timeout = h.probe_timeout_s
        self._sampling = probe_sampling
        self._tokens = probe_tokens
        self._lock = threading.Lock()
        self._watches: dict[Any, tuple[Any, str]] = {}  # ref -> (key, actor name)
        self._probes: dict[Any, tuple[int, str, float]] = {}  # ref -> (slot, actor name, deadline)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"nemo-gen-monitor-{fleet.settings.fleet.name}", daemon=True)
        self.detections: list[dict[str, Any]] = []  # (for benchmarks and status) what was seen when

    def start(self) -> "FleetMonitor":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def watch(self, key: Any, handle: ShardHandle) -> None:
        """Start watching ``handle`` (key: its slot, or ("spare", name))."""
        ref = handle.actor.watch.remote(self._watch_interval)
        with self._lock:
            self._watches[ref] = (key, handle.name)

    def _run(self) -> None:
        next_probe = time.monotonic() + self._probe_interval
        while not self._stop.is_set():
            with self._lock:
                refs = list(self._watches) + list(self._probes)
            if not refs:
                self._stop.wait(self._watch_interval)
            else:
                try:
                    ready, _ = ray.wait(refs, num_returns=1, timeout=self._watch_interval)
                    if ready:  # collect everything else that is done too
                        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
                except Exception as exc:  # Ray going down under us (shutdown): stop quietly
                    if self._stop.is_set() or not ray.is_initialized():
                        return
                    log.warning("monitor: ray.wait failed: %s", exc)
                    self._stop.wait(self._watch_interval)
                    continue
                for ref in ready:
                    self._settle(ref)
            if self._stop.is_set():
                return
            self._expire_probes()
            now = time.monotonic()
            if now >= next_probe:
                self._send_probes()
                next_probe = now + self._probe_interval

    def _settle(self, ref: Any) -> None:
        with self._lock:
            watch = self._watches.pop(ref, None)
            probe = self._probes.pop(ref, None)
        if watch is not None:
            key, name = watch
            try:
                reason = ray.get(ref)
            except Exception as exc:
                reason = f"actor died: {root_cause(exc)}"
            self.detections.append({"key": key, "name": name, "at": time.monotonic(), "by": "watch", "reason": reason})
            self._fleet.shard_lost(key, name, reason)
        elif probe is not None:
            slot, name, _ = probe
            try:
                answer = ray.get(ref)
            except Exception as exc:
                answer = {"ok": False, "error": f"probe failed: {root_cause(exc)}"}
            self._record(slot, name, answer)

    def _expire_probes(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [(ref, p) for ref, p in self._probes.items() if p[2] <= now]
            for ref, _ in expired:
                del self._probes[ref]
        for ref, (slot, name, _) in expired:
            ray.cancel(ref)
            self._record(slot, name, {"ok": False, "error": f"probe not answered within {self._probe_timeout:g}s"})

    def _record(self, slot: int, name: str, answer: dict[str, Any]) -> None:
        fleet = self._fleet
        if not fleet.is_current(slot, name) or answer.get("skipped"):
            return
        health = fleet.health
        health.record_probe(slot, bool(answer.get("ok")), answer.get("error"))
        if not answer.get("ok"):
            log.warning("shard %d probe failed: %s", slot, answer.get("error"))
        if health.state_of(slot) is ShardState.DEAD:
            self.detections.append({"key": slot, "name": name, "at": time.monotonic(), "by": "probe",
                                    "reason": answer.get("error")})
            fleet.shard_lost(slot, name, answer.get("error") or "probe failures")

    def _send_probes(self) -> None:
        fleet = self._fleet
        with self._lock:
            probing = {p[0] for p in self._probes.values()}
        deadline = time.monotonic() + self._probe_timeout
        for slot in fleet.health.serving_shards():
            handle = fleet.handle(slot)
            if slot in probing or handle is None:
                continue
            ref = handle.actor.probe.remote(self._sampling, self._tokens, self._probe_timeout)
            with self._lock:
                self._probes[ref] = (slot, handle.name, deadline)
