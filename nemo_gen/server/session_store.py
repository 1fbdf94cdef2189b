"""The gateway's sessions on disk (``server.sessions_dir``): one append-only file per session,
each record fsync'd before the turn's response is sent, so a restarted server serves them again.

Layout: ``<sessions_dir>/`` is a directory of ours at mode 0700, opened with ``O_NOFOLLOW`` (a
symlink there, another user's directory or a file is refused, naming ``server.sessions_dir``);
every file in it is opened relative to that directory's fd, ``O_NOFOLLOW`` too. ``LOCK`` is
held (``flock``) by the one server that writes the directory: a second server on it is refused
at start; a SIGKILLed one's lock goes with its process. ``<session id>.jsonl`` holds the session:
its opening record, then one record per turn, each a line ``<crc32 hex> <json>\\n``.

Why files and not SQLite: a session's records are only ever appended and read back whole, and
deleted whole (``DELETE``, TTL expiry): an ``unlink`` gives the space back at once, where SQLite
would keep it until a ``VACUUM``; a record is a line that ``jq`` reads; and a torn write can only
be the last line of one file (one writer, each append fsync'd before the next), which ``load``
drops — by its CRC or its missing newline — truncating the file back to its last whole record.
No earlier record is rewritten, ever.

The store knows records, not trajectories: what a record holds and how a session is rebuilt
from it is ``nemo_gen.server.gateway``'s and ``nemo_gen.core.trajectory``'s.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import stat
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nemo_gen.errors import ConfigError

log = logging.getLogger(__name__)

FIELD = "server.sessions_dir"
_SUFFIX = ".jsonl"
_NAME = re.compile(r"^(sess-[A-Za-z0-9_-]{1,96})\.jsonl$")


def encode(record: dict[str, Any]) -> bytes:
    """One record as its line: the CRC-32 of its JSON, a space, the JSON, a newline."""
    body = json.dumps(record, separators=(",", ":"), default=str).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode(line: bytes) -> dict[str, Any] | None:
    """The record of a whole line (its newline stripped), or None when it is torn or corrupt."""
    crc, _, body = line.partition(b" ")
    try:
        if len(crc) != 8 or int(crc, 16) != zlib.crc32(body):
            return None
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class Stored:
    """One session as read back: its id, its records in order, and what ``load`` dropped from its tail."""

    id: str
    records: list[dict[str, Any]] = field(default_factory=list)
    dropped_bytes: int = 0


def _refused(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{FIELD} {path} {why}; remove it, or set {FIELD} elsewhere", field=FIELD)


def open_private_dir(path: Path) -> int:
    """An fd of ``path``, a directory of ours at mode 0700 (made if missing; a wider mode of ours
    narrowed), never reached through a symlink at its last component."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise _refused(path, f"cannot be made: {exc.strerror or exc}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(path, "is a symlink" if path.is_symlink() else "is not a directory") from None
        raise _refused(path, f"cannot be opened: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise _refused(path, f"belongs to uid {st.st_uid}, not to this process (uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) != 0o700:
        log.warning("%s %s had mode %o; narrowed to 0700", FIELD, path, stat.S_IMODE(st.st_mode))
        os.fchmod(fd, 0o700)
    return fd


class SessionStore:
    """The records of one server's sessions under ``path``. ``open`` takes the directory (and its
    lock); ``create`` / ``append`` / ``remove`` each return once the change is on disk
    (file and directory fsync'd); ``load`` reads every session back; ``close`` lets go."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._dir: int | None = None
        self._lock_fd: int | None = None
        self._lock = threading.Lock()  # one append at a time per store (turns of different sessions may race)

    def open(self) -> "SessionStore":
        fd = open_private_dir(self.path)
        try:
            lock = os.open("LOCK", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise _refused(self.path, f"has a LOCK this process cannot open ({exc.strerror or exc})") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock)
            os.close(fd)
            raise ConfigError(f"{FIELD} {self.path} is in use by another server (its LOCK is held): one "
                              f"server writes a sessions directory; stop that one or set {FIELD} elsewhere",
                              field=FIELD) from None
        self._dir, self._lock_fd = fd, lock
        return self

    def close(self) -> None:
        with self._lock:
            for fd in (self._lock_fd, self._dir):
                if fd is not None:
                    os.close(fd)  # the flock goes with its last fd
            self._dir = self._lock_fd = None

    @property
    def dir_fd(self) -> int:
        if self._dir is None:
            raise RuntimeError(f"the session store at {self.path} is closed")
        return self._dir

    # -- writes -----------------------------------------------------------------------------------

    def create(self, sid: str, record: dict[str, Any]) -> None:
        """A new session's file holding its opening ``record`` (``FileExistsError`` if one is there)."""
        name = self._name(sid)
        with self._lock:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.dir_fd)
            try:
                os.write(fd, encode(record))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.fsync(self.dir_fd)  # the new name survives a crash too

    def append(self, sid: str, record: dict[str, Any]) -> int:
        """Append ``record`` to the session's file and fsync it; returns the bytes written."""
        line = encode(record)
        with self._lock:
            fd = os.open(self._name(sid), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
            try:
                view = memoryview(line)
                while view:  # a short write (a full disk) raises on the next call
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
        return len(line)

    def remove(self, sid: str) -> None:
        """The session's records gone from disk (nothing there: nothing to do)."""
        with self._lock:
            try:
                os.unlink(self._name(sid), dir_fd=self.dir_fd)
            except FileNotFoundError:
                return
            os.fsync(self.dir_fd)

    # -- reads ------------------------------------------------------------------------------------

    def ids(self) -> list[str]:
        return sorted(m.group(1) for name in os.listdir(self.dir_fd) if (m := _NAME.match(name)))

    def load(self) -> list[Stored]:
        """Every session's records. A torn or corrupt tail (a write the process did not finish) is
        dropped and the file truncated back to its last whole record, so the next append follows it."""
        return [self._read(sid) for sid in self.ids()]

    def size(self, sid: str) -> int:
        return os.stat(self._name(sid), dir_fd=self.dir_fd, follow_symlinks=False).st_size

    def _read(self, sid: str) -> Stored:
        name = self._name(sid)
        with self._lock:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
            try:
                with os.fdopen(os.dup(fd), "rb") as f:
                    data = f.read()
                out, good = Stored(sid), 0
                while good < len(data):
                    end = data.find(b"\n", good)
                    record = decode(data[good:end]) if end >= 0 else None
                    if record is None:
                        break
                    out.records.append(record)
                    good = end + 1
                if good < len(data):
                    out.dropped_bytes = len(data) - good
                    log.warning("%s: dropped %d bytes after record %d of session %s (a torn or corrupt write); "
                                "the %d records before it are kept", self.path / name, out.dropped_bytes,
                                len(out.records), sid, len(out.records))
                    os.ftruncate(fd, good)
                    os.fsync(fd)
                return out
            finally:
                os.close(fd)

    @staticmethod
    def _name(sid: str) -> str:
        name = sid + _SUFFIX
        if not _NAME.match(name):  # ids are ours (``sess-`` + hex); anything else never names a file
            raise ValueError(f"not a session id: {sid!r}")
        return name
