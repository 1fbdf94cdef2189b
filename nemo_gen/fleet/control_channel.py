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
    """A shard actor's socket: one thread accepts, one thread per connection serves it. Each
    call is ``handler(*args)`` run on ``loop`` (the actor's); the answer is ``(True, value)`` or
    ``(False, "Type: message")``."""

    def __init__(self, handler: Callable[..., Awaitable[Any]], loop: asyncio.AbstractEventLoop):
        self._handler, self._loop = handler, loop
        self.key = secrets.token_bytes(32)
        self._dir = tempfile.mkdtemp(prefix="nemo-gen-channel-")  # mode 0700
        self.address = os.path.join(self._dir, "socket")
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.key)
        self._closed = False
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
            threading.Thread(target=self._serve, args=(conn,), name="nemo-gen-channel-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while True:
                try:
                    args = conn.recv()
                except (EOFError, OSError):
                    return  # the driver closed its end
                self.calls += 1
                future = asyncio.run_coroutine_threadsafe(self._handler(*args), self._loop)
                try:
                    answer = (True, future.result())
                except BaseException as exc:  # noqa: BLE001 — every failure is the caller's to see
                    answer = (False, describe(exc))
                try:
                    conn.send(answer)
                except (OSError, ValueError):
                    return  # the driver gave up on this call and dropped the line

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


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
