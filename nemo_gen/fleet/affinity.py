"""Which shard a session's request goes to: the router's session rules, in one place.

Two kinds of session:

- an **open session** (``fleet.session()``, the HTTP gateway's ``/nemo_gen/sessions``): placed when
  it opens on the serving shard with the fewest open sessions, ties by fewest requests in flight
  (``nemo_gen.core.session_placement``), and pinned there while it lives — its turns go there
  however many requests it holds, because its prompt's KV is cached there (a turn that shard
  refuses, busy, goes elsewhere by the fault model, and the pin follows it). When that shard stops serving
  (dead, restarting), the session's next try is placed again the same way and the pin moves;
  ``close`` releases it;
- a bare ``session_id`` (no lifetime known): its turn goes to the shard that served its last one
  while that shard serves and carries at most ``fleet.session_affinity_slack`` more requests in
  flight than the least-loaded one; otherwise the least-loaded shard, and the session moves.
  The last ``_SESSIONS`` are remembered.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from nemo_gen.core.fleet_health import SERVING_STATES, HealthyShardSelector
from nemo_gen.core.ledger_view import LedgerView
from nemo_gen.fleet.members import Membership
from nemo_gen.core.session_placement import SessionPlacement
from nemo_gen.errors import ShardUnavailableError
from nemo_gen.fleet.rolling import open_to_sessions, placeable

# Sessions remembered (least recently used forgotten first): enough for every live agent.
_SESSIONS = 100_000


class SessionAffinity:
    def __init__(self, health: LedgerView, members: Membership, selector: HealthyShardSelector, slack: int):
        self.health, self.members, self.selector, self.slack = health, members, selector, slack
        self.placement = SessionPlacement()
        self._last: OrderedDict[str, int] = OrderedDict()  # session id -> the slot of its last turn
        self._lock = threading.Lock()

    def _serves(self, slot: int) -> bool:
        return self.health.state_of(slot) in SERVING_STATES and self.members.has_slot(slot)

    # -- open sessions -----------------------------------------------------------------------------

    def open(self, session: str) -> int:
        """Place a new session; its slot (``ShardUnavailableError`` when none serves)."""
        return self._place(session)

    def _place(self, session: str) -> int:
        serving = placeable(self.members.table, [s for s in self.health.serving_shards() if self.members.has_slot(s)])
        if not serving:
            raise ShardUnavailableError(f"no shard serves: session {session!r} cannot be placed")
        return self.placement.place(session, serving, self.selector.inflight)

    def close(self, session: str) -> int | None:
        with self._lock:
            self._last.pop(session, None)
        return self.placement.release(session)

    # -- a request's pick ---------------------------------------------------------------------------

    def pick(self, session: str | None) -> int | None:
        """The slot ``session``'s request goes to, acquired; None: least-loaded routing decides."""
        if session is None:
            return None
        pinned = self.placement.slot_of(session)
        if pinned is not None:
            if not self._serves(pinned):
                try:
                    pinned = self._place(session)  # its shard stopped serving: the session moves
                except ShardUnavailableError:
                    return None  # nothing serves now: the router waits for a recovery, or fails
            self.selector.acquire(pinned)
            return pinned
        with self._lock:
            slot = self._last.get(session)
        if slot is None or not self._serves(slot) or not open_to_sessions(self.members.table, slot):
            return None
        try:
            least = self.selector.next_shard()
        except ShardUnavailableError:
            return None
        if self.selector.inflight(slot) > self.selector.inflight(least) + self.slack:
            return None  # too busy: the session moves
        self.selector.acquire(slot)
        return slot

    def remember(self, session: str | None, slot: int) -> None:
        """The slot ``session``'s request went to (an open session re-placed by a retry moves its pin)."""
        if session is None:
            return
        pinned = self.placement.slot_of(session)
        if pinned is not None and pinned != slot:
            self.placement.place(session, [slot])
        with self._lock:
            self._last[session] = slot
            self._last.move_to_end(session)
            while len(self._last) > _SESSIONS:
                self._last.popitem(last=False)

    def last_shard(self, session: str) -> int | None:
        """The slot that served ``session``'s last turn (None: new or forgotten)."""
        with self._lock:
            return self._last.get(session)
