"""The fleet ledger: which generation shards may serve, and why (NeMo-RL's ``fleet_health``).

A pure state machine, a drop-in for ``nemo_rl.models.generation.fleet_health`` with the same
public names and transitions. Probing, restarting, refitting and pushing membership are I/O
and belong to callers; they report what they saw here, and every router reads one answer to
"who is eligible".

The transition that matters most is the one that does not exist: probes never move a shard
from DEAD back to HEALTHY. A restarted engine answers probes while holding whatever weights
it loaded at start, so re-admitting it on probes would serve stale samples silently.
Recovery goes DEAD -> RESTARTING -> STALE -> (refit) -> HEALTHY.

Beyond the reference: a bounded transition history (``history()``), ``add_shard()`` for
warm spares (they start STALE), ``absent_shards()`` for the refit path, copies from
``snapshot()``, IndexError on unknown shards, and a lock so a probe pump thread and
request handlers can report concurrently.

Built for fleets of 10,000 shards (``bench/control_plane.py``): every report costs O(1) (the
state of each shard is kept in per-state index sets, the serving set is maintained as shards
enter and leave it, and the membership epoch is bumped from that, not by rebuilding the set),
and ``serving_changes_since()`` lets a router follow the serving set by its changes instead of
re-reading it whole.

One shard's states, record and thresholds are declared in ``nemo_gen.core.shard_health`` and
re-exported here.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from nemo_gen.core.retry import describe

# Re-exported: NeMo-RL's fleet_health module exposes the selector beside the ledger.
from nemo_gen.core.selector import HealthyShardSelector, NoHealthyShards
from nemo_gen.core.shard_health import (
    ABSENT_STATES,
    SERVING_LOG_LIMIT,
    SERVING_STATES,
    FleetHealthPolicy,
    ShardHealth,
    ShardState,
    Transition,
    copy_of,
)
from nemo_gen.errors import FleetExhausted

__all__ = [
    "ABSENT_STATES",
    "SERVING_STATES",
    "FleetHealthPolicy",
    "GenerationFleetExhausted",
    "GenerationFleetHealth",
    "HealthyShardSelector",
    "NoHealthyShards",
    "ShardHealth",
    "ShardState",
    "Transition",
]

logger = logging.getLogger("nemo_gen.fleet_health")

# Identity checks on the hot paths: Enum.__hash__ is Python code, so `in SERVING_STATES`
# costs a function call per probe.
_HEALTHY = ShardState.HEALTHY
_SUSPECT = ShardState.SUSPECT

# NeMo-RL's name for the same condition; one class object, so either name catches it.
GenerationFleetExhausted = FleetExhausted


class GenerationFleetHealth:
    """Per-shard health and the serving set derived from it.

    Args:
        shard_count: Number of shards at start (indices ``0..shard_count-1``), all HEALTHY.
        policy: Thresholds; the defaults when None.
        base_urls: Per-shard base URLs, when shards have them (None entries allowed).
        clock: Monotonic time source (None: time.monotonic); injectable so tests need not sleep.
        weight_version: The weight version every starting shard holds.
        history_limit: How many transitions ``history()`` keeps (oldest dropped first).
    """

    def __init__(
        self,
        shard_count: int,
        policy: FleetHealthPolicy | None = None,
        base_urls: Sequence[str | None] | None = None,
        clock: Callable[[], float] | None = time.monotonic,
        *,
        weight_version: int = 0,
        history_limit: int = 1000,
    ) -> None:
        if shard_count < 1:
            raise ValueError(f"shard_count must be >= 1, got {shard_count}")
        if base_urls is not None and len(base_urls) != shard_count:
            raise ValueError(f"base_urls has {len(base_urls)} entries for {shard_count} shards")
        if history_limit < 1:
            raise ValueError(f"history_limit must be >= 1, got {history_limit}")
        # None accepted too: NeMo-RL's signature defaults clock to None.
        self._clock = clock if clock is not None else time.monotonic
        self._policy = policy if policy is not None else FleetHealthPolicy()
        self._lock = threading.RLock()
        now = self._clock()
        self._shards: list[ShardHealth] = [
            ShardHealth(
                dp_shard_idx=idx,
                base_url=base_urls[idx] if base_urls is not None else None,
                weight_version=weight_version,
                last_ok_at=now,
            )
            for idx in range(shard_count)
        ]
        self._history: deque[Transition] = deque(maxlen=history_limit)
        # Indices per state, kept as shards move, so counts and state sets cost O(1).
        self._by_state: dict[ShardState, set[int]] = {state: set() for state in ShardState}
        self._by_state[ShardState.HEALTHY].update(range(shard_count))
        # The serving indices, kept sorted as shards enter and leave (bisect: O(log n) search,
        # a memmove of at most n ints), so reading the set never sorts it.
        self._serving: list[int] = list(range(shard_count))
        # Their base URLs, position for position (None where a shard has none).
        self._serving_urls: list[str | None] = [shard.base_url for shard in self._shards]
        # Bumped only when the serving set changes, so readers compare one integer. Entry k of
        # the log (from the right) is the change that made the epoch what it was k-1 bumps ago:
        # (shard, serving after the change).
        self._membership_epoch = 0
        self._serving_log: deque[tuple[int, bool]] = deque(maxlen=SERVING_LOG_LIMIT)
        self._by_url: dict[str, set[int]] = {}
        for shard in self._shards:
            self._index_url(shard.dp_shard_idx, shard.base_url)

    # -- read side ----------------------------------------------------------------------

    @property
    def policy(self) -> FleetHealthPolicy:
        return self._policy

    @property
    def membership_epoch(self) -> int:
        return self._membership_epoch

    @property
    def shard_count(self) -> int:
        return len(self._shards)

    def snapshot(self) -> list[ShardHealth]:
        """Copies of every shard's health, by index (mutating them changes nothing here)."""
        with self._lock:
            return [copy_of(shard) for shard in self._shards]

    def serving_shards(self) -> list[int]:
        """Indices eligible for traffic (HEALTHY or SUSPECT), sorted."""
        with self._lock:
            return list(self._serving)

    def serving_changes_since(self, epoch: int | None) -> tuple[int, list[tuple[int, bool]] | None]:
        """How the serving set changed after membership epoch ``epoch``.

        Returns ``(current epoch, changes)``: ``changes`` lists ``(shard, serving now)`` in the
        order they happened, one per epoch bump (empty when nothing changed). ``changes`` is
        None when ``epoch`` is None, not an epoch this ledger had, or older than the last
        ``SERVING_LOG_LIMIT`` changes: the caller re-reads ``serving_shards()`` whole.
        Replaying changes is idempotent, so a full read newer than the epoch is safe too.
        """
        with self._lock:
            current = self._membership_epoch
            if epoch is None or not 0 <= current - epoch <= len(self._serving_log):
                return current, None
            log = self._serving_log
            return current, [log[-k] for k in range(current - epoch, 0, -1)]

    def absent_shards(self) -> list[int]:
        """Indices whose process cannot join a refit (DEAD, RESTARTING, RETIRED), sorted."""
        with self._lock:
            by_state = self._by_state
            return sorted(idx for state in ABSENT_STATES for idx in by_state[state])

    def state_of(self, shard_idx: int) -> ShardState:
        return self._get(shard_idx).state

    def counts_by_state(self) -> dict[ShardState, int]:
        """Shards per state, every state present (zeros included)."""
        with self._lock:
            return {state: len(members) for state, members in self._by_state.items()}

    def serving_base_urls(self) -> list[str]:
        """Base URLs of the serving shards, skipping shards without one."""
        with self._lock:
            return list(filter(None, self._serving_urls))

    def shard_for_base_url(self, url: str) -> int | None:
        """Shard index for a base URL (routers report failures by URL), or None."""
        with self._lock:
            if not isinstance(url, str):  # None, or something unhashable: the plain scan
                return next((s.dp_shard_idx for s in self._shards if s.base_url == url), None)
            owners = self._by_url.get(url)
            return min(owners) if owners else None

    def as_metrics(self) -> dict[str, float]:
        """Flat metric dict, keys as NeMo-RL publishes them."""
        with self._lock:
            metrics = {
                f"gen_fleet/shards/{state.value}": float(count)
                for state, count in self.counts_by_state().items()
            }
            metrics["gen_fleet/membership_epoch"] = float(self._membership_epoch)
            metrics["gen_fleet/serving_shards"] = float(len(self._serving))
            for shard in self._shards:
                idx = shard.dp_shard_idx
                metrics[f"gen_fleet/restart_attempts/{idx}"] = float(shard.restart_attempts)
                # Outside a rolling refit a serving shard whose version trails the fleet's is a
                # correctness bug; during one (refit.rollout waves) two versions serve, per shard here.
                metrics[f"gen_fleet/shard_weight_version/{idx}"] = float(shard.weight_version)
            return metrics

    def history(self, shard: int | None = None) -> list[dict[str, Any]]:
        """Recorded transitions, oldest first, as dicts (time, shard, old, new, reason)."""
        with self._lock:
            return [t.as_dict() for t in self._history if shard is None or t.shard == shard]

    def state_summary(self) -> dict[str, int]:
        """Non-zero counts keyed by state value, as error messages quote the fleet."""
        return {state.value: n for state, n in self.counts_by_state().items() if n}

    def raise_if_exhausted(self) -> None:
        """Raise GenerationFleetExhausted when fewer than min_healthy_shards are serving."""
        with self._lock:
            serving = len(self._serving)
            minimum = self._policy.min_healthy_shards
            if serving < minimum:
                raise GenerationFleetExhausted(
                    f"only {serving} generation shard(s) serving, below "
                    f"min_healthy_shards={minimum}; fleet state is {self.state_summary()}"
                )

    # -- write side ---------------------------------------------------------------------

    def record_probe(self, shard_idx: int, ok: bool, error: str | None = None) -> None:
        """Fold one liveness probe into a shard's state; ignored unless the shard serves.

        A non-serving shard ignores probes because an answer says nothing about whether its
        weights are current: only report_refit brings a shard back.
        """
        with self._lock:
            shard = self._get(shard_idx)
            state = shard.state
            if state is not _HEALTHY and state is not _SUSPECT:
                return
            if ok:
                shard.consecutive_probe_failures = 0
                shard.consecutive_probe_successes += 1
                shard.last_ok_at = self._clock()
                streak = shard.consecutive_probe_successes
                if state is _SUSPECT and streak >= self._policy.healthy_threshold:
                    self._transition(shard, ShardState.HEALTHY, f"{streak} probe(s) ok in a row")
                return
            shard.consecutive_probe_successes = 0
            shard.consecutive_probe_failures += 1
            shard.last_error = error or "probe failed"
            self._escalate(shard, shard.consecutive_probe_failures)

    def report_failure(self, shard_idx: int, exc: BaseException) -> None:
        """A real request failed on this shard (its own streak). Ignored unless serving."""
        with self._lock:
            shard = self._get(shard_idx)
            if shard.state is not _HEALTHY and shard.state is not _SUSPECT:
                return
            shard.consecutive_reported_failures += 1
            shard.last_error = describe(exc)
            self._escalate(shard, shard.consecutive_reported_failures)

    def mark_dead(self, shard_idx: int, reason: str) -> None:
        """The shard's actor or engine is known to be gone (not a streak): -> DEAD at once.
        Only a serving or STALE shard can die; other states are left as they are."""
        with self._lock:
            shard = self._get(shard_idx)
            if shard.state not in (*SERVING_STATES, ShardState.STALE):
                return
            shard.last_error = reason
            self._transition(shard, ShardState.DEAD, reason)

    def report_success(self, shard_idx: int) -> None:
        """A real request completed; clears only the reported-failure streak."""
        with self._lock:
            self._get(shard_idx).consecutive_reported_failures = 0

    def mark_restarting(self, shard_idx: int) -> None:
        """A replacement is being started; retires the shard once attempts exceed the max."""
        with self._lock:
            shard = self._get(shard_idx)
            if shard.state is ShardState.RETIRED:
                return
            shard.restart_attempts += 1
            limit = self._policy.max_restart_attempts_per_shard
            if shard.restart_attempts > limit:
                self.retire(shard_idx, "restart attempts exhausted")
                return
            self._transition(
                shard, ShardState.RESTARTING, f"restart attempt {shard.restart_attempts}/{limit}"
            )

    def restore_restart_attempts(self, shard_idx: int, attempts: int) -> None:
        """Carry a restart count kept elsewhere (the shard's actor) into this ledger, so the
        budget spans every process that attaches to a long-lived fleet. Never lowers it."""
        if attempts < 0:
            raise ValueError(f"restart attempts must be >= 0, got {attempts}")
        with self._lock:
            shard = self._get(shard_idx)
            shard.restart_attempts = max(shard.restart_attempts, attempts)

    def mark_loaded(self, shard_idx: int, base_url: str | None = None) -> None:
        """The replacement engine is up; it holds stale weights until refit (-> STALE).

        ``base_url`` replaces the shard's URL: a restarted engine may bind a new port.
        """
        with self._lock:
            shard = self._get(shard_idx)
            if shard.state is ShardState.RETIRED:
                return
            if base_url is not None and base_url != shard.base_url:
                self._unindex_url(shard_idx, shard.base_url)
                shard.base_url = base_url
                self._index_url(shard_idx, base_url)
                # (A serving shard's stale entry in _serving_urls goes with it: it leaves below.)
            self._transition(shard, ShardState.STALE, "engine loaded; stale until refit")

    def report_refit(self, shard_idx: int, weight_version: int) -> None:
        """A refit completed: the only way back into service after DEAD (-> HEALTHY).

        Stricter than NeMo-RL on purpose (DESIGN invariant 1): a DEAD or RESTARTING shard has
        no loaded engine to hold the new weights, so the report is ignored; recovery must pass
        through ``mark_loaded`` (STALE) first.
        """
        with self._lock:
            shard = self._get(shard_idx)
            state = shard.state
            if state is not _HEALTHY and state is not _SUSPECT and state is not ShardState.STALE:
                if state is not ShardState.RETIRED:
                    logger.warning(
                        "gen_fleet: ignoring refit report for shard %d in state %s "
                        "(re-admission goes through STALE)", shard_idx, shard.state.value
                    )
                return
            shard.weight_version = weight_version
            shard.consecutive_probe_failures = 0
            shard.consecutive_probe_successes = 0
            shard.consecutive_reported_failures = 0
            shard.last_ok_at = self._clock()
            if state is not _HEALTHY:  # (the reason string is only built for a real transition)
                self._transition(shard, _HEALTHY, f"refit to weight version {weight_version}")

    def retire(self, shard_idx: int, reason: str) -> None:
        """Remove a shard for good (terminal)."""
        with self._lock:
            shard = self._get(shard_idx)
            shard.last_error = reason
            self._transition(shard, ShardState.RETIRED, reason)

    def add_shard(self, base_url: str | None = None, weight_version: int = 0) -> int:
        """Add a shard (a warm spare) and return its index. It starts STALE: refit it first."""
        with self._lock:
            shard = ShardHealth(
                dp_shard_idx=len(self._shards),
                base_url=base_url,
                state=ShardState.STALE,
                weight_version=weight_version,
                last_ok_at=self._clock(),
            )
            self._shards.append(shard)
            self._by_state[ShardState.STALE].add(shard.dp_shard_idx)
            self._index_url(shard.dp_shard_idx, base_url)
            self._record(shard.dp_shard_idx, None, ShardState.STALE, "added; stale until refit")
            return shard.dp_shard_idx

    # -- internals ----------------------------------------------------------------------

    def _get(self, shard_idx: int) -> ShardHealth:
        # No negative indexing: shard -1 is a caller bug, not the last shard.
        if not 0 <= shard_idx < len(self._shards):
            raise IndexError(
                f"shard {shard_idx} out of range: the fleet has {len(self._shards)} shard(s)"
            )
        return self._shards[shard_idx]

    def _index_url(self, idx: int, url: str | None) -> None:
        if isinstance(url, str):
            self._by_url.setdefault(url, set()).add(idx)

    def _unindex_url(self, idx: int, url: str | None) -> None:
        if not isinstance(url, str):
            return
        owners = self._by_url.get(url)
        if owners is not None:
            owners.discard(idx)
            if not owners:
                del self._by_url[url]

    def _escalate(self, shard: ShardHealth, streak: int) -> None:
        """A failure streak of ``streak``: DEAD at the threshold, else HEALTHY -> SUSPECT."""
        if streak >= self._policy.unhealthy_threshold:
            self._transition(shard, ShardState.DEAD, shard.last_error)
        elif shard.state is ShardState.HEALTHY:
            self._transition(shard, ShardState.SUSPECT, shard.last_error)

    def _transition(self, shard: ShardHealth, new: ShardState, reason: str) -> None:
        old = shard.state
        if old is new:
            return
        idx = shard.dp_shard_idx
        shard.state = new
        self._by_state[old].discard(idx)
        self._by_state[new].add(idx)
        # One shard moved, so the serving set changed iff it crossed the serving boundary.
        now_serving = new is _HEALTHY or new is _SUSPECT
        if (old is _HEALTHY or old is _SUSPECT) != now_serving:
            at = bisect.bisect_left(self._serving, idx)
            if now_serving:
                self._serving.insert(at, idx)
                self._serving_urls.insert(at, shard.base_url)
            else:
                del self._serving[at]
                del self._serving_urls[at]
            self._membership_epoch += 1
            self._serving_log.append((idx, now_serving))
        # Last, so a log handler that reads the ledger sees the transition complete.
        self._record(idx, old, new, reason)

    def _record(self, idx: int, old: ShardState | None, new: ShardState, reason: str) -> None:
        self._history.append(Transition(self._clock(), idx, old, new, reason))
        level = logging.WARNING if new in ABSENT_STATES else logging.INFO
        before = old.value if old is not None else "new"
        logger.log(
            level,
            "gen_fleet: shard %d %s -> %s%s",
            idx,
            before,
            new.value,
            f" ({reason})" if reason else "",
        )
