"""A direct line from the driver to a shard actor on its own host, for the calls of a refit.

A Ray actor call costs a task submission and a reply each way, which at refit sizes where the
copy itself takes a few milliseconds is most of the refit (bench/results/2026-12-03/h200.md).
Here the shard actor serves its ``weight_sync`` on a Unix socket (``ChannelServer``), and the
driver connects to it once (``Channel``). A call then costs a socket round trip.

The rules:
- same host only: the driver asks for the address over Ray, and uses it only when the actor
  runs on the driver's own node;
- authenticated: multiprocessing's HMAC handshake, with a key the actor hands out over Ray; the
  socket sits in a directory only its owner can enter;
- bounded: connecting and the handshake run under ``fleet.control_timeout_s`` on both sides,
  and each connection's handshake runs on its own, so a peer that connects and says nothing
  holds up no other; a call is read off the socket as its bytes come, never with a blocking
  read on the loop, and a peer that stops mid-call for ``fleet.control_timeout_s`` (a driver
  SIGSTOPped or paused mid-send: its socket stays open) is dropped, while the loop serves on;
- one method: the server runs ``weight_sync`` on the actor's event loop, as Ray would run it, and
  nothing else;
- every call is answered: a call that cannot be read is answered "unread" (it never ran; the
  driver sends it over Ray, whose pickling carries more than this line's), an answer that
  cannot be sent is answered as a data error (the call ran: it is not sent again);
- Ray stays the judge. A line that cannot be used is dropped, and the call goes over Ray, whose
  answer says what happened to the actor. A call that outlives its deadline drops the line too:
  its late answer must not be read as the next call's.

Owns: a shard actor's socket (server side) and one connection of the driver's (client side).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
# AuthenticationError is multiprocessing's own (typeshed lists it under multiprocessing only)
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from multiprocessing.reduction import ForkingPickler
from typing import Any, Awaitable, Callable

from nemo_gen.core.retry import failure
from nemo_gen.core.wire import Failure, FailureKind, exception_line

# The status of an answer to a call the server could not read (it never ran).
UNREAD = "unread"


class ChannelServer:
    """A shard actor's socket. A thread accepts, each connection's handshake runs in a thread of
    its own under ``timeout_s``, and the connection is then read on ``loop`` itself (the
    actor's): a call runs there as ``handler(*args)``, and its answer, ``(True, value)`` or
    ``(False, Failure)`` (the wire's, kind and all, as the Ray path reports it) — ``(UNREAD, why)`` for a call that could not be read — is
    written from there. So a call costs the socket and no hand-off between threads either way.

    One call at a time on a connection: it is not read again until its call has been answered,
    as the driver never sends a second call before the first one's answer. ``close`` stops new
    connections and closes the idle ones; a call in flight, or sent before it, is answered first.
    A call's frame (multiprocessing's: its length, then its bytes) is gathered on the loop from
    what each readable event brings, without blocking; a frame that makes no progress for
    ``timeout_s`` drops its line (``_Frame``)."""

    def __init__(self, handler: Callable[..., Awaitable[Any]], loop: asyncio.AbstractEventLoop, timeout_s: float):
        self._handler, self._loop = handler, loop
        self.timeout_s = timeout_s
        self.key = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="nemo-gen-channel-")  # mode 0700
        self.address = os.path.join(self._dir, "socket")
        self._listener = Listener(self.address, family="AF_UNIX")  # handshakes are ours: bounded, each its own
        self._closed = False
        self._lines: set[Connection] = set()  # the loop's: every open connection
        # the loop's: connections with a call in flight, and its task (asyncio keeps tasks only weakly)
        self._busy: dict[Connection, asyncio.Task[None]] = {}
        self._frames: dict[Connection, _Frame] = {}  # the loop's: calls partly read
        self.calls = 0  # calls served so far (the shard's info says how many came this way)
        threading.Thread(target=self._accept, name="nemo-gen-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return  # the listener was closed
            threading.Thread(target=self._handshake, args=(conn,), name="nemo-gen-channel-handshake",
                             daemon=True).start()

    def _handshake(self, conn: Connection) -> None:
        try:
            with _bounded(conn, self.timeout_s):
                deliver_challenge(conn, self.key)
                answer_challenge(conn, self.key)
        except (AuthenticationError, EOFError, OSError):  # no key, silent past the deadline, or gone
            conn.close()
            return
        try:
            self._loop.call_soon_threadsafe(self._attach, conn)
        except RuntimeError:  # the loop is closed: the actor is gone
            conn.close()

    # -- on the loop ------------------------------------------------------------------------------

    def _attach(self, conn: Connection) -> None:
        self._lines.add(conn)
        self._loop.add_reader(conn.fileno(), self._receive, conn)
        if self._closed:  # closed while this one was being accepted: served only if it has sent a call
            self._close_idle()

    def _receive(self, conn: Connection) -> None:
        """Bytes of a call arrived (or the driver closed its end): read what is there, without
        waiting for more; the call runs once its frame is whole."""
        partial = self._frames.setdefault(conn, _Frame(self._loop.time()))
        try:
            frame = partial.read(conn.fileno(), self._loop.time())
        except (EOFError, OSError):
            self._detach(conn)
            return
        if frame is None:
            if partial.timer is None:
                partial.timer = self._loop.call_later(self.timeout_s, self._stalled, conn, partial)
            return
        self._frames.pop(conn, None)
        if partial.timer is not None:
            partial.timer.cancel()
        self._loop.remove_reader(conn.fileno())  # one call at a time: read again once answered
        try:
            args = ForkingPickler.loads(frame)
        except Exception as exc:  # noqa: BLE001 — e.g. a class this process cannot import
            self._answer(conn, (UNREAD, exception_line(exc)))
            return
        self.calls += 1
        self._busy[conn] = self._loop.create_task(self._serve(conn, args))

    async def _serve(self, conn: Connection, args: tuple[Any, ...]) -> None:
        cancelled = None
        try:
            answer = (True, await self._handler(*args))
        except asyncio.CancelledError as exc:  # the loop is going down: the caller still hears of it
            answer, cancelled = (False, failure(exc)), exc
        except Exception as exc:  # noqa: BLE001 — every failure is the caller's to see
            answer = (False, failure(exc))
        self._busy.pop(conn, None)
        self._answer(conn, answer)
        if cancelled is not None:
            raise cancelled

    def _answer(self, conn: Connection, answer: tuple[bool | str, Any]) -> None:
        try:
            frame = ForkingPickler.dumps(answer)
        except Exception as exc:  # noqa: BLE001 — the call ran; its answer does not pickle
            frame = ForkingPickler.dumps((False, Failure(FailureKind.DATA, type(exc).__name__,
                                                          f"the answer could not be sent: {exc}")))
        try:
            conn.send_bytes(frame)
        except (OSError, ValueError):
            self._detach(conn)  # the driver gave up on this call and dropped the line
            return
        if self._closed:
            self._detach(conn)
        else:
            self._loop.add_reader(conn.fileno(), self._receive, conn)

    def _stalled(self, conn: Connection, partial: _Frame) -> None:
        """A call partly read: dropped when no byte of it came for ``timeout_s``."""
        if self._frames.get(conn) is not partial:
            return  # read whole, or its line dropped, since
        quiet = self._loop.time() - partial.progress
        if quiet < self.timeout_s:
            partial.timer = self._loop.call_later(self.timeout_s - quiet, self._stalled, conn, partial)
            return
        self._detach(conn)  # the driver hears of it as a broken line, and goes over Ray

    def _detach(self, conn: Connection) -> None:
        self._lines.discard(conn)
        partial = self._frames.pop(conn, None)
        if partial is not None and partial.timer is not None:
            partial.timer.cancel()
        if not conn.closed:
            self._loop.remove_reader(conn.fileno())
            conn.close()

    def _close_idle(self) -> None:
        """Close every line with no call in flight and none waiting to be read (a call sent
        before ``close`` is answered)."""
        for conn in [c for c in self._lines if c not in self._busy]:
            try:
                waiting = conn in self._frames or conn.poll(0)
            except (OSError, ValueError):
                waiting = False
            if not waiting:
                self._detach(conn)

    # ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """From any thread."""
        self._closed = True
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        try:
            self._loop.call_soon_threadsafe(self._close_idle)
        except RuntimeError:
            pass  # the loop is closed, and its connections with the process


class ChannelBroken(Exception):
    """The line failed mid-call: the actor is gone or going (its answer never came)."""


class FrameUnread(Exception):
    """The actor could not read the call (it never ran): send it another way."""


class Channel:
    """The driver's end of one shard actor's line. Not for two threads at once: ``lock`` is
    taken by whoever uses it (a refit holds the fleet's refit lock anyway). Connecting and the
    handshake give up after ``timeout_s`` (``OSError``, ``AuthenticationError``)."""

    def __init__(self, address: str, key: bytes, timeout_s: float):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect(address)
            sock.setblocking(True)
            conn = Connection(sock.detach())
        finally:
            sock.close()
        try:
            with _bounded(conn, timeout_s):
                answer_challenge(conn, key)
                deliver_challenge(conn, key)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        self.lock = threading.Lock()

    def send(self, args: tuple[Any, ...]) -> None:
        """Raises ``ChannelBroken`` when the line is down (nothing reached the actor)."""
        try:
            self._conn.send(args)
        except (OSError, ValueError) as exc:
            raise ChannelBroken(str(exc)) from exc

    def receive(self, timeout_s: float) -> tuple[bool, Any]:
        """The answer to the call sent last. ``TimeoutError`` after ``timeout_s``;
        ``ChannelBroken`` when the line closed first; ``FrameUnread`` when the actor could not
        read the call."""
        try:
            if self._conn.poll(max(0.0, timeout_s)):
                status, value = self._conn.recv()
                if status == UNREAD:
                    raise FrameUnread(value)
                return status, value
        except (EOFError, OSError) as exc:
            raise ChannelBroken(str(exc) or type(exc).__name__) from exc
        raise TimeoutError(f"no answer within {timeout_s:g}s")

    def close(self) -> None:
        self._conn.close()


class _Frame:
    """One call's frame as it arrives: multiprocessing's header (a 4-byte length; -1 and an
    8-byte length for a frame of 2 GiB or more), then its bytes. ``progress``: when a byte came last."""

    _CHUNK = 1 << 20
    _READS = 16  # chunks per readable event; the rest is read on the next one

    def __init__(self, now: float):
        self.header = b""
        self.size: int | None = None
        self.body = bytearray()
        self.progress = now
        self.timer: asyncio.TimerHandle | None = None

    def read(self, fd: int, now: float) -> bytes | None:
        """What the socket holds now, up to a few chunks so one event cannot hold the loop long
        (``EOFError`` when the peer closed it); the frame once whole, else None."""
        for _ in range(self._READS):
            if self.size is not None and len(self.body) == self.size:
                return bytes(self.body)
            want = (4 if len(self.header) < 4 else 12) - len(self.header) if self.size is None \
                else min(self.size - len(self.body), self._CHUNK)
            data = _recv_now(fd, want)
            if data is None:
                return None  # all there is for now
            if not data:
                raise EOFError("the driver closed its line")
            self.progress = now
            if self.size is not None:
                self.body += data
                continue
            self.header += data
            if len(self.header) == 4 and struct.unpack("!i", self.header)[0] != -1:
                self.size = struct.unpack("!i", self.header)[0]
            elif len(self.header) == 12:
                self.size = struct.unpack("!Q", self.header[4:])[0]
        return bytes(self.body) if self.size is not None and len(self.body) == self.size else None


def _recv_now(fd: int, size: int) -> bytes | None:
    """Up to ``size`` bytes the socket ``fd`` holds, without waiting (None: it holds none now)."""
    sock = socket.socket(fileno=fd)
    try:
        return sock.recv(size, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    finally:
        sock.detach()  # the fd stays the connection's


class _bounded:
    """Blocking reads and writes on ``conn`` give up after ``timeout_s`` (``OSError``) while the
    block runs — the socket's own timeouts, so the connection stays a plain blocking one."""

    def __init__(self, conn: Connection, timeout_s: float):
        self._fd, self._timeout_s = conn.fileno(), timeout_s

    def _set(self, seconds: float) -> None:
        sock = socket.socket(fileno=self._fd)
        try:
            whole = int(seconds)
            value = struct.pack("ll", whole, int((seconds - whole) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        finally:
            sock.detach()  # the fd stays the connection's

    def __enter__(self) -> None:
        self._set(max(self._timeout_s, 0.001))

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self._set(0.0)  # no timeout from here on
