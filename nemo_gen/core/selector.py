"""Least-outstanding shard selection over the ledger's serving set.

Kept apart from the ledger (``fleet_health``, which re-exports it under NeMo-RL's names):
the ledger says who *may* serve, the selector picks who *does*, from in-flight counts that
only the request path knows.
"""

from __future__ import annotations

import threading
from typing import Protocol

from nemo_gen.errors import ShardUnavailableError


class NoHealthyShards(ShardUnavailableError):
    """No generation shard is eligible to serve right now (infra: retry after backoff)."""


class ServingSet(Protocol):
    """What the selector reads from the ledger (GenerationFleetHealth satisfies it)."""

    def serving_shards(self) -> list[int]: ...

    def state_summary(self) -> dict[str, int]: ...

    def state_of(self, shard_idx: int) -> object: ...


class HealthyShardSelector:
    """Least-outstanding choice among serving shards.

    Better than round-robin for LLM serving: it steers away from a slow or wedged shard
    before anything has diagnosed it.
    """

    def __init__(self, monitor: ServingSet) -> None:
        self.monitor = monitor
        self._inflight: dict[int, int] = {}
        self._lock = threading.Lock()

    def next_shard(self) -> int:
        """The serving shard with the smallest (in-flight, index); NoHealthyShards if none."""
        serving = self.monitor.serving_shards()
        if not serving:
            raise NoHealthyShards(
                "no generation shard is eligible to serve; fleet state is "
                f"{self.monitor.state_summary()}"
            )
        with self._lock:
            return min(serving, key=lambda idx: (self._inflight.get(idx, 0), idx))

    def acquire(self, shard_idx: int) -> None:
        self.monitor.state_of(shard_idx)  # IndexError for an unknown shard
        with self._lock:
            self._inflight[shard_idx] = self._inflight.get(shard_idx, 0) + 1

    def release(self, shard_idx: int) -> None:
        with self._lock:
            self._inflight[shard_idx] = max(0, self._inflight.get(shard_idx, 0) - 1)

    def inflight(self, shard_idx: int) -> int:
        with self._lock:
            return self._inflight.get(shard_idx, 0)
