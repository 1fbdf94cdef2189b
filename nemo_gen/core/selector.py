"""Least-outstanding shard selection over the ledger's serving set.

Kept apart from the ledger (``fleet_health``, which re-exports it under NeMo-RL's names):
the ledger says who *may* serve, the selector picks who *does*, from in-flight counts that
only the request path knows.

Routing is O(log n) worst case and O(1) for the pick itself, at any fleet size: the selector
keeps a min-tree over shard indices whose leaves hold ``(in-flight, index)`` packed into one
int (``in-flight << 32 | index``; a shard out of service holds a key above every real one),
so the root is the answer and ``acquire``/``release`` update one leaf and walk up, stopping
as soon as an ancestor is unchanged. It follows the ledger's serving set by its changes
(``membership_epoch`` compared on every pick, ``serving_changes_since`` replayed when it
moved) instead of re-reading the set per request. A monitor without those two members (any
other ``ServingSet``) gets the original scan of ``serving_shards()``, with the same answers.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

from nemo_gen.errors import ShardUnavailableError

_SHIFT = 32
_INDEX_MASK = (1 << _SHIFT) - 1
_ABSENT = 1 << 62  # above every (in-flight << 32 | index) a real fleet can reach


class NoHealthyShards(ShardUnavailableError):
    """No generation shard is eligible to serve right now (infra: retry after backoff)."""


class ServingSet(Protocol):
    """What the selector reads from the ledger (GenerationFleetHealth satisfies it).

    Monitors that also have ``membership_epoch`` and ``serving_changes_since(epoch)`` (as
    GenerationFleetHealth does) are followed incrementally; others are scanned per pick.
    """

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
        # The mirror of the monitor's serving set, and the min-tree over it.
        self._synced: Any = None  # the monitor the mirror follows (None: not built yet)
        self._incremental = False  # whether that monitor can be followed by its changes
        self._epoch: int | None = None
        self._serving: set[int] = set()
        self._size = 0  # leaves; tree[size + idx] is shard idx's leaf, tree[1] the root
        self._tree: list[int] = [_ABSENT, _ABSENT]

    def next_shard(self, avoid: int | None = None) -> int:
        """The serving shard with the smallest (in-flight, index); NoHealthyShards if none.
        ``avoid``: a shard that just refused a request (busy) — another one when there is one."""
        monitor = self.monitor
        with self._lock:
            if monitor is not self._synced:
                self._attach(monitor)
            if self._incremental:
                if monitor.membership_epoch != self._epoch:  # type: ignore[attr-defined]
                    self._follow(monitor)
                key = self._tree[1]
                if key < _ABSENT:
                    best = key & _INDEX_MASK
                    if best != avoid or len(self._serving) < 2:
                        return best
                    return min((i for i in self._serving if i != avoid),
                               key=lambda idx: (self._inflight.get(idx, 0), idx))
                serving: list[int] = []
        if not self._incremental:
            serving = monitor.serving_shards()
        if not serving:
            raise NoHealthyShards(
                "no generation shard is eligible to serve; fleet state is "
                f"{monitor.state_summary()}"
            )
        others = [i for i in serving if i != avoid] or serving
        with self._lock:
            return min(others, key=lambda idx: (self._inflight.get(idx, 0), idx))

    def acquire(self, shard_idx: int) -> None:
        self.monitor.state_of(shard_idx)  # IndexError for an unknown shard
        with self._lock:
            count = self._inflight.get(shard_idx, 0) + 1
            self._inflight[shard_idx] = count
            if shard_idx in self._serving:
                self._update(shard_idx, count << _SHIFT | shard_idx)

    def release(self, shard_idx: int) -> None:
        with self._lock:
            count = max(0, self._inflight.get(shard_idx, 0) - 1)
            self._inflight[shard_idx] = count
            if shard_idx in self._serving:
                self._update(shard_idx, count << _SHIFT | shard_idx)

    def inflight(self, shard_idx: int) -> int:
        with self._lock:
            return self._inflight.get(shard_idx, 0)

    # -- the mirror (all under self._lock) -------------------------------------------------------

    def _attach(self, monitor: Any) -> None:
        """Start following a (new) monitor: incrementally when it offers the change log."""
        self._synced = monitor
        self._incremental = callable(getattr(monitor, "serving_changes_since", None)) and isinstance(
            getattr(monitor, "membership_epoch", None), int
        )
        self._epoch = None
        self._rebuild(())
        if self._incremental:
            self._follow(monitor)

    def _follow(self, monitor: Any) -> None:
        """Bring the mirror up to the monitor's current epoch."""
        epoch, changes = monitor.serving_changes_since(self._epoch)
        if changes is None:
            # Too far behind (or first sync): the whole set. It may be newer than ``epoch``;
            # replaying those changes again later is harmless (each sets a final state).
            self._rebuild(monitor.serving_shards())
        else:
            for idx, serving in changes:
                if serving:
                    self._serving.add(idx)
                    self._update(idx, self._inflight.get(idx, 0) << _SHIFT | idx)
                elif idx in self._serving:
                    self._serving.discard(idx)
                    self._update(idx, _ABSENT)
        self._epoch = epoch

    def _rebuild(self, serving: Iterable[int]) -> None:
        self._serving = set(serving)
        need = max(self._serving, default=0) + 1
        size = 1
        while size < need:
            size <<= 1
        tree = [_ABSENT] * (2 * size)
        inflight = self._inflight
        for idx in self._serving:
            tree[size + idx] = inflight.get(idx, 0) << _SHIFT | idx
        for i in range(size - 1, 0, -1):
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left < right else right  # noqa: FURB136 (min() is a call: slower)
        self._size, self._tree = size, tree

    def _update(self, idx: int, key: int) -> None:
        """Set shard ``idx``'s leaf and fix its ancestors, stopping at the first one unchanged."""
        if idx >= self._size:  # beyond the tree: grow it (doubling: amortized O(1)) to join
            if key < _ABSENT:
                self._rebuild(self._serving)  # the caller has already added idx to it
            return
        tree = self._tree
        i = self._size + idx
        tree[i] = key
        while i > 1:
            sibling = tree[i ^ 1]
            if sibling < key:  # noqa: PLR1730 (min() is a call: slower on the hot path)
                key = sibling
            i >>= 1
            if tree[i] == key:
                return
            tree[i] = key
