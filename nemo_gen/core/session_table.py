"""The gateway's open sessions: ids, expiry and bounds — bookkeeping only, over any value.

- A session expires ``ttl_s`` after its last use (opening it, or a turn ending); a turn in
  flight keeps it alive. ``expire()`` takes the expired ones out (the caller releases their
  shards). Every ``open`` and lookup expires first, and the table's owner also calls it every
  ``sweep_interval(ttl_s)`` while any session is open, so an idle server does not keep an
  expired session (its bytes, its shard) for longer than that past its TTL.
- At most ``max_sessions`` are open at once: one more is refused (``SessionError`` 429 naming
  ``server.max_sessions``) — never an older session dropped to make room.
- Each session's record is at most ``max_bytes`` (``charge``): a turn that would take it past
  is refused (413 naming ``server.max_session_bytes``) and not recorded; the session stays
  usable (its trajectory so far is intact) and can be read and deleted.
- One turn at a time per session (``begin`` / ``end``): a second while one runs is a 409 — the
  next turn's prompt is built on the previous turn's tokens, so turns are ordered.
- A restarted server puts back the sessions it had (``restore``: their bytes, how long they
  were idle); they count against ``max_sessions`` like any (none is dropped if there are more
  than it allows: new ones are refused until enough end).

No clock of its own (``clock`` is given), no Ray, no HTTP: errors carry the status the server answers with.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

# An expired session outlives its TTL by at most a quarter of it, and never by more than this.
SWEEP_MOST_S = 30.0


def sweep_interval(ttl_s: float) -> float:
    """How often the table's owner sweeps out expired sessions: ``min(ttl_s / 4, 30 s)``."""
    return max(min(ttl_s / 4.0, SWEEP_MOST_S), 0.0)


class SessionError(Exception):
    """A session request refused: ``status`` (404, 409, 413, 429) and the setting or field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class SessionLimits:
    ttl_s: float
    max_sessions: int
    max_bytes: int


@dataclass
class _Entry(Generic[T]):
    value: T
    last_used: float
    bytes: int = 0
    busy: bool = False


class SessionTable(Generic[T]):
    def __init__(self, limits: SessionLimits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self._entries: dict[str, _Entry[T]] = {}  # in order of last use (``_touch``)
        self._lock = threading.Lock()

    def open(self, value: T, session_id: str | None = None) -> tuple[str, list[tuple[str, T]]]:
        """A new session holding ``value``: (its id, the sessions that expired meanwhile)."""
        expired = self.expire()
        with self._lock:
            if len(self._entries) >= self.limits.max_sessions:
                raise SessionError(429, f"server.max_sessions={self.limits.max_sessions} sessions are open; "
                                   "end one (DELETE /nemo_gen/sessions/{id}) or wait for one to expire "
                                   f"(server.session_ttl_s={self.limits.ttl_s:g})", "server.max_sessions")
            sid = session_id or f"sess-{secrets.token_hex(12)}"
            if sid in self._entries:
                raise SessionError(409, f"session {sid!r} exists", "id")
            self._entries[sid] = _Entry(value, self.clock())
        return sid, expired

    def get(self, sid: str) -> T:
        with self._lock:
            entry = self._live(sid)
            return entry.value

    def begin(self, sid: str) -> T:
        """A turn starts: the session is held (409 if a turn already runs) and kept alive."""
        with self._lock:
            entry = self._live(sid)
            if entry.busy:
                raise SessionError(409, f"session {sid!r} has a turn in flight; send its turns one at a time", "id")
            entry.busy = True
            self._touch(sid, entry)
            return entry.value

    def end(self, sid: str) -> None:
        with self._lock:
            entry = self._entries.get(sid)
            if entry is not None:
                entry.busy = False
                self._touch(sid, entry)

    def charge(self, sid: str, nbytes: int) -> None:
        """Count ``nbytes`` more of the session's record, or refuse them (413) if that passes the bound."""
        with self._lock:
            entry = self._live(sid)
            if entry.bytes + nbytes > self.limits.max_bytes:
                raise SessionError(413, f"session {sid!r} has recorded {entry.bytes} bytes; this turn's "
                                   f"{nbytes} more would pass server.max_session_bytes={self.limits.max_bytes}: "
                                   "read its trajectory and start a new session", "server.max_session_bytes")
            entry.bytes += nbytes

    def refund(self, sid: str, nbytes: int) -> None:
        """Give back ``nbytes`` charged for a turn that was not recorded after all."""
        with self._lock:
            entry = self._entries.get(sid)
            if entry is not None:
                entry.bytes = max(entry.bytes - nbytes, 0)

    def restore(self, sid: str, value: T, nbytes: int, idle_s: float) -> None:
        """Put back a session a restarted server read from disk: ``nbytes`` recorded, last used
        ``idle_s`` ago. Not bounded by ``max_sessions`` (it was admitted once); it counts against it."""
        with self._lock:
            if sid in self._entries:
                raise SessionError(409, f"session {sid!r} exists", "id")
            self._entries[sid] = _Entry(value, self.clock() - max(idle_s, 0.0), nbytes)
            # back in order of last use, which ``expire`` relies on
            self._entries = dict(sorted(self._entries.items(), key=lambda kv: kv[1].last_used))

    def bytes_of(self, sid: str) -> int:
        with self._lock:
            return self._live(sid).bytes

    def close(self, sid: str) -> T:
        with self._lock:
            entry = self._live(sid)
            del self._entries[sid]
            return entry.value

    def expire(self) -> list[tuple[str, T]]:
        """Take out the sessions idle past ``ttl_s`` (none with a turn in flight)."""
        now = self.clock()
        with self._lock:
            gone = []
            for sid, e in self._entries.items():  # in order of last use: the expired ones first
                if now - e.last_used <= self.limits.ttl_s:
                    break  # every later one was used later
                if not e.busy:
                    gone.append(sid)
            return [(sid, self._entries.pop(sid).value) for sid in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _touch(self, sid: str, entry: _Entry[T]) -> None:
        """``entry`` used now (the lock held): it moves to the end, so the entries stay in order of
        last use and ``expire`` — run on every lookup — reads only the expired ones and those with
        a turn in flight, not every open session."""
        entry.last_used = self.clock()
        self._entries[sid] = self._entries.pop(sid)

    def _live(self, sid: str) -> _Entry[T]:
        entry = self._entries.get(sid)
        if entry is None:
            raise SessionError(404, f"no session {sid!r}: it was never opened, was deleted, or expired "
                               f"(server.session_ttl_s={self.limits.ttl_s:g} after its last turn)", "id")
        if not entry.busy and self.clock() - entry.last_used > self.limits.ttl_s:
            # left for expire(), whose caller releases the session's shard
            raise SessionError(404, f"session {sid!r} expired (server.session_ttl_s={self.limits.ttl_s:g} after "
                               "its last turn)", "id")
        return entry
