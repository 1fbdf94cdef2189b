"""A direct line from the driver to a shard actor on its own host, for the calls of a refit.

A Ray actor call costs ~1.2-1.5 ms each way on the H200 host. A colocated ``nemo_gen_ipc`` refit
of a 4.46 GB model took 8.0 ms on 2026-12-03: the copy was 2.1 ms, the call reaching the actor 1.53 ms
and its answer back 1.20 ms. That fixed cost, not the copy, keeps a refit of a mid-sized
model far from copy speed. Here the shard actor serves its ``weight_sync`` on a Unix socket
(``ChannelServer``), and the driver connects to it once (``Channel``). A call then costs a socket
round trip, not Ray's task submission and reply.

The rules:
- same host only: the driver asks for the address over Ray, and uses it only when the actor
  runs on the driver's own node;
- authenticated: multiprocessing's HMAC handshake, with a key the actor hands out over Ray; the
  socket sits in a directory only its owner can enter;
- one method: the server runs ``weight_sync`` on the actor's event loop, as Ray would run it, and
  nothing else;
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
import tempfile
import threading
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from typing import Any, Awaitable, Callable


def describe(exc: BaseException) -> str:
    """``Type: last line`` of an exception the actor raised: how the line answers a failed call,
    and how the Ray path reports one (``driver.root_cause`` describes the task error's cause)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"


class ChannelServer:
    """A shard actor's socket. A thread accepts (the handshake blocks), and each connection is then
    read on ``loop`` itself (the actor's): a call runs there as ``handler(*args)``, and its answer,
    ``(True, value)`` or ``(False, "Type: message")``, is written from there. So a call costs the
    socket and no hand-off between threads either way. (Served by a thread per connection, the
    call waited for the loop to wake it and the answer for that thread to wake: on the H200 the
    two legs took 0.21 and 0.49 ms.)

    One call at a time on a connection: it is not read again until its call has been answered,
    as the driver never sends a second call before the first one's answer. ``close`` stops new
    connections and closes the idle ones; a call in flight, or sent before it, is answered first.
    A call is read whole on the loop: its sender is the authenticated driver, and a driver that
    dies mid-message closes the socket, which ends the read."""

    def __init__(self, handler: Callable[..., Awaitable[Any]], loop: asyncio.AbstractEventLoop):
        self._handler, self._loop = handler, loop
        self.key = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="nemo-gen-channel-")  # mode 0700
        self.address = os.path.join(self._dir, "socket")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        self._closed = False
        self._lines: set[Connection] = set()  # the loop's: every open connection
        # the loop's: connections with a call in flight, and its task (asyncio keeps tasks only weakly)
        self._busy: dict[Connection, asyncio.Task] = {}
        self.calls = 0  # calls served so far (the shard's info says how many came this way)
        threading.Thread(target=self._accept, name="nemo-gen-channel", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (AuthenticationError, EOFError, ConnectionError):
                continue  # a client without the key, or one that left during the handshake
            except OSError:
                return  # the listener was closed
            try:
                self._loop.call_soon_threadsafe(self._attach, conn)
            except RuntimeError:  # the loop is closed: the actor is gone
                conn.close()
                return

    # -- on the loop ------------------------------------------------------------------------------

    def _attach(self, conn: Connection) -> None:
        self._lines.add(conn)
        self._loop.add_reader(conn.fileno(), self._receive, conn)
        if self._closed:  # closed while this one was being accepted: served only if it has sent a call
            self._close_idle()

    def _receive(self, conn: Connection) -> None:
        """A call arrived (or the driver closed its end)."""
        self._loop.remove_reader(conn.fileno())  # one call at a time: read again once answered
        try:
            args = conn.recv()
        except (EOFError, OSError):
            self._detach(conn)
            return
        self.calls += 1
        self._busy[conn] = self._loop.create_task(self._serve(conn, args))

    async def _serve(self, conn: Connection, args: tuple) -> None:
        cancelled = None
        try:
            answer = (True, await self._handler(*args))
        except asyncio.CancelledError as exc:  # the loop is going down: the caller still hears of it
            answer, cancelled = (False, describe(exc)), exc
        except Exception as exc:  # noqa: BLE001 — every failure is the caller's to see
            answer = (False, describe(exc))
        self._busy.pop(conn, None)
        try:
            conn.send(answer)
        except (OSError, ValueError):
            self._detach(conn)  # the driver gave up on this call and dropped the line
        else:
            if self._closed:
                self._detach(conn)
            else:
                self._loop.add_reader(conn.fileno(), self._receive, conn)
        if cancelled is not None:
            raise cancelled

    def _detach(self, conn: Connection) -> None:
        self._lines.discard(conn)
        if not conn.closed:
            self._loop.remove_reader(conn.fileno())
            conn.close()

    def _close_idle(self) -> None:
        """Close every line with no call in flight and none waiting to be read (a call sent
        before ``close`` is answered)."""
        for conn in [c for c in self._lines if c not in self._busy]:
            try:
                waiting = conn.poll(0)
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


class Channel:
    """The driver's end of one shard actor's line. Not for two threads at once: ``lock`` is
    taken by whoever uses it (a refit holds the fleet's refit lock anyway)."""

    def __init__(self, address: str, key: bytes):
        self._conn = Client(address, family="AF_UNIX", authkey=key)
        self.lock = threading.Lock()

    def send(self, args: tuple) -> None:
        """Raises ``ChannelBroken`` when the line is down (nothing reached the actor)."""
        try:
            self._conn.send(args)
        except (OSError, ValueError) as exc:
            raise ChannelBroken(str(exc)) from exc

    def receive(self, timeout_s: float) -> tuple[bool, Any]:
        """The answer to the call sent last. ``TimeoutError`` after ``timeout_s``;
        ``ChannelBroken`` when the line closed first."""
        try:
            if self._conn.poll(max(0.0, timeout_s)):
                return self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ChannelBroken(str(exc) or type(exc).__name__) from exc
        raise TimeoutError(f"no answer within {timeout_s:g}s")

    def close(self) -> None:
        self._conn.close()
