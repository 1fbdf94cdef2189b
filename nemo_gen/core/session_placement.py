"""Where a session lives: the shard each open session is pinned to, and the count per shard.

A session opened through the trajectory gateway (``nemo_gen.server.gateway``) or ``fleet.session()``
has a lifetime (opened, closed or expired), so the fleet knows how many sessions each shard
holds. Pure stickiness — a new session to whichever shard served the last one, or to the
least-busy one at this instant — piles long conversations onto one engine while others idle
(prime-rl #3255/#3563: prefix hit rate 98 % -> 5 %). So a new session goes to the serving shard
with the fewest open sessions, ties broken by the fewest requests in flight, then the lowest
index; it stays there (its prompt's KV is cached there) until it ends; when its shard stops
serving (dead, restarting), its next turn re-places it the same way and the pin moves.

Thread-safe (one lock); no Ray, no clock: the caller supplies the serving set and the in-flight
count of a shard.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterable


class SessionPlacement:
    """session id -> pinned shard, and open sessions per shard."""

    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self._count: Counter[int] = Counter()
        self._lock = threading.Lock()

    def place(self, session: str, serving: Iterable[int], load: Callable[[int], int] = lambda _: 0) -> int:
        """Pin ``session`` (new, or moving off a shard that stopped serving) to the serving shard
        with the fewest open sessions, then the least ``load`` (requests in flight), then the
        lowest index. ``ValueError`` when nothing serves."""
        candidates = sorted(set(serving))
        if not candidates:
            raise ValueError("no shard serves: a session cannot be placed")
        with self._lock:
            old = self._slot_of.get(session)
            if old is not None:
                self._count[old] -= 1
            best = min(candidates, key=lambda s: (self._count[s], load(s), s))
            self._slot_of[session] = best
            self._count[best] += 1
            return best

    def slot_of(self, session: str) -> int | None:
        with self._lock:
            return self._slot_of.get(session)

    def release(self, session: str) -> int | None:
        """The session ended (closed or expired): its shard holds one session less. Idempotent."""
        with self._lock:
            slot = self._slot_of.pop(session, None)
            if slot is not None:
                self._count[slot] -= 1
                if self._count[slot] <= 0:
                    del self._count[slot]
            return slot

    def active(self, slot: int) -> int:
        """Open sessions pinned to ``slot``."""
        with self._lock:
            return self._count.get(slot, 0)

    def counts(self) -> dict[int, int]:
        with self._lock:
            return {s: n for s, n in self._count.items() if n}

    def __len__(self) -> int:
        with self._lock:
            return len(self._slot_of)
