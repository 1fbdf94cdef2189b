"""``nemo_gen.shard.control_channel`` with real sockets: a server running its handler on an event
loop (as a shard actor's runs ``weight_sync`` on Ray's), and a driver's line to it. The line
inside a fleet, with real engines, is tested in tests/engine/test_refit.py."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
import threading
import time
import types
from multiprocessing.connection import AuthenticationError

import pytest

from nemo_gen.core.wire import Failure, FailureKind, SyncRequest, SyncUpdate
from nemo_gen.errors import ShardBusy
from nemo_gen.shard.control_channel import Channel, ChannelBroken, ChannelServer

# fleet.control_timeout_s of these lines: connecting and each handshake give up after it.
TIMEOUT_S = 5.0


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _sync(step: str, payload=None) -> SyncRequest:
    """A weight-sync call as the driver sends it, telling ``_handler`` what to do."""
    return SyncRequest(SyncUpdate({"do": step, "arg": payload}), 5.0)


async def _handler(step, payload=None, timeout_s=1.0):
    if isinstance(step, SyncRequest):  # the driver's call (a shard actor's weight_sync takes it)
        step, payload = step.payload.update_info["do"], step.payload.update_info["arg"]
    if step == "fail":
        raise RuntimeError(f"refit refused:\nthe chunk {payload} has the wrong shape")
    if step == "busy":  # the engine refused admission for now: an infra failure, not the input's
        raise ShardBusy(0, "QueueOverflowError: vLLM's queue is full")
    if step == "slow":
        await asyncio.sleep(payload)
    return {"step": step, "payload": payload, "thread": threading.current_thread().name}


@pytest.fixture
def server(loop):
    server = ChannelServer(_handler, loop, TIMEOUT_S)
    yield server
    server.close()


def test_a_call_runs_on_the_loop_and_answers(server, loop):
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line.send(("apply", {"layout": 3}, 10.0))
        ok, value = line.receive(10)
        assert ok and value["step"] == "apply" and value["payload"] == {"layout": 3}
        assert value["thread"] != "nemo-gen-channel-conn"  # the handler ran on the loop's thread
        line.send(("fail", "w"))
        # the wire's Failure, kind and all (not "Type: message" text the driver had to parse)
        assert line.receive(10) == (False, Failure(FailureKind.DATA, "RuntimeError", "the chunk w has the wrong shape"))
        assert server.calls == 2
    finally:
        line.close()


def test_the_socket_is_its_owners_and_a_wrong_key_is_refused(server):
    mode = os.stat(os.path.dirname(server.address)).st_mode
    assert stat.S_IMODE(mode) == 0o700
    with pytest.raises(AuthenticationError):
        Channel(server.address, b"not the key" * 3, TIMEOUT_S)
    line = Channel(server.address, server.key, TIMEOUT_S)  # the server still serves after a refused client
    try:
        line.send(("apply",))
        assert line.receive(10)[0]
    finally:
        line.close()


def test_a_late_answer_is_a_timeout(server):
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line.send(("slow", 0.5))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            line.receive(0.05)
        assert time.monotonic() - t0 < 0.5
    finally:
        line.close()


def test_a_line_whose_server_is_gone_is_broken(loop):
    server = ChannelServer(_handler, loop, TIMEOUT_S)
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line.send(("slow", 0.2))
        server.close()  # the actor stops: its connection threads end after the call in flight
        assert line.receive(10)[0]
        line.close()
        with pytest.raises(ChannelBroken):
            line.send(("apply",))
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            Channel(server.address, server.key, TIMEOUT_S)
    finally:
        line.close()


def test_a_line_is_read_again_only_once_its_call_is_answered(loop):
    """The driver sends one call at a time; should a second one come early, it waits for the
    first one's answer instead of running beside it."""
    events = []

    async def handler(step, payload=None, timeout_s=1.0):
        events.append(("start", step))
        await asyncio.sleep(payload or 0)
        events.append(("end", step))
        return step

    server = ChannelServer(handler, loop, TIMEOUT_S)
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line.send(("first", 0.3))
        line.send(("second", 0))
        assert line.receive(10) == (True, "first") and line.receive(10) == (True, "second")
        assert events == [("start", "first"), ("end", "first"), ("start", "second"), ("end", "second")]
        assert server.calls == 2
    finally:
        line.close()
        server.close()


def test_close_answers_what_was_sent_and_closes_the_idle_lines(loop):
    server = ChannelServer(_handler, loop, TIMEOUT_S)
    idle, busy = Channel(server.address, server.key, TIMEOUT_S), Channel(server.address, server.key, TIMEOUT_S)
    try:
        busy.send(("slow", 0.3))
        time.sleep(0.05)  # both lines are the loop's by now
        server.close()
        assert busy.receive(10)[0]  # the call in flight is answered
        with pytest.raises(ChannelBroken):  # then its line is closed, like the idle one
            busy.send(("apply",))
            busy.receive(5)
        with pytest.raises(ChannelBroken):
            idle.send(("apply",))
            idle.receive(5)
    finally:
        idle.close()
        busy.close()


def _serve_in_a_process(queue) -> None:
    """A stand-in shard actor: its line served from its own process, until it is killed."""
    loop = asyncio.new_event_loop()
    server = ChannelServer(_handler, loop, TIMEOUT_S)
    queue.put((server.address, server.key))
    loop.run_forever()


@pytest.fixture
def remote():
    """A server in a process of its own, as a shard actor's is: (process, address, key)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve_in_a_process, args=(queue,), daemon=True)
    proc.start()
    try:
        address, key = queue.get(timeout=60)
        yield proc, address, key
    finally:
        proc.kill()  # started here: stopped here, by its PID
        proc.join(10)


def test_a_server_killed_mid_call_breaks_the_line(remote):
    """The actor dies with a call in flight: the driver sees the line close, not a hang."""
    proc, address, key = remote
    line = Channel(address, key, TIMEOUT_S)
    line.send(("slow", 30.0))
    os.kill(proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(ChannelBroken):
        line.receive(20)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ChannelBroken):
        line.send(("apply",))
    line.close()


# -- the driver's use of a line (ShardDriver.fan_out), on real sockets -------------------------


class _LocalDriver:
    """A ShardDriver whose lines go to a server in this process (no Ray: every call below is
    carried by a line, so no actor is ever called)."""

    @staticmethod
    def make(server, refit_s: float):  # server: anything with the line's address and key
        from nemo_gen.fleet.driver import DriverTimeouts, ShardDriver

        class Driver(ShardDriver):
            def open_channel(self, handle):
                return Channel(server.address, server.key, TIMEOUT_S)

        return Driver(DriverTimeouts(control_s=5, stop_s=5, engine_grace_s=1, refit_s=refit_s))


def _handle():
    from nemo_gen.fleet.handles import ShardHandle

    return ShardHandle(index=0, name="fleet-shard-0", actor=None, placement_group=None)


def test_the_driver_answers_from_the_line_as_from_ray(server):
    driver, handle = _LocalDriver.make(server, refit_s=5), _handle()
    (ok,) = driver.fan_out({0: handle}, _sync("apply", {"layout": 1}), margin_s=0).values()
    assert ok.ok and ok.value["payload"] == {"layout": 1}
    (refused,) = driver.fan_out({0: handle}, _sync("fail", "w"), margin_s=0).values()
    # what the Ray path gives for an exception the actor raised: root_cause's form, not infra
    assert refused.error == "RuntimeError: the chunk w has the wrong shape" and not refused.infra
    assert driver.lines() == {handle.name} and server.calls == 2


def test_a_failure_over_the_line_keeps_its_kind(server):
    """The line carried an exception as text, which the driver labelled DATA whatever it was: a
    shard refusing for now read as a verdict on the weights. It carries the wire's Failure."""
    driver, handle = _LocalDriver.make(server, refit_s=5), _handle()
    (busy,) = driver.fan_out({0: handle}, _sync("busy"), margin_s=0).values()
    assert busy.failure.kind is FailureKind.BUSY and busy.infra
    assert busy.error.startswith("ShardBusy: ") and driver.lines() == {handle.name}


def test_a_call_past_its_deadline_drops_the_line(server):
    driver, handle = _LocalDriver.make(server, refit_s=0.1), _handle()
    (late,) = driver.fan_out({0: handle}, _sync("slow", 1.0), margin_s=0).values()
    assert late.error.startswith("GetTimeoutError") and late.infra
    assert driver.lines() == set()  # its late answer must not be read as the next call's


def test_a_line_that_breaks_mid_call_is_the_actors_loss(remote):
    proc, address, key = remote
    where = types.SimpleNamespace(address=address, key=key)
    driver, handle = _LocalDriver.make(where, refit_s=20), _handle()
    threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
    (lost,) = driver.fan_out({0: handle}, _sync("slow", 30.0), margin_s=0).values()
    assert lost.error.startswith("ActorDiedError") and lost.infra
    assert driver.lines() == set()


# -- every call answered, every wait bounded ----------------------------------------------------


def test_a_frame_that_does_not_unpickle_is_answered_and_the_line_goes_on(server):
    """An authenticated frame the actor cannot read (bytes that are no pickle, a class the actor
    cannot import) was left unanswered: the refit waited out its deadline and quarantined a
    healthy shard. It is answered "unread" at once, and the next call is served."""
    from nemo_gen.shard.control_channel import FrameUnread

    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line._conn.send_bytes(b"\x80\x05bad")  # what a peer with the key could send
        t0 = time.monotonic()
        with pytest.raises(FrameUnread, match="UnpicklingError"):
            line.receive(10)
        assert time.monotonic() - t0 < 2
        line.send(("apply", 1))
        ok, value = line.receive(10)
        assert ok and value["payload"] == 1
        assert server.calls == 1  # the unread frame never reached the handler
    finally:
        line.close()


def test_an_answer_that_does_not_pickle_is_answered_as_a_data_error(loop):
    async def handler(step, payload=None, timeout_s=1.0):
        return (lambda: None) if step == "lambda" else step  # a lambda does not pickle

    server = ChannelServer(handler, loop, TIMEOUT_S)
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line.send(("lambda",))
        ok, value = line.receive(10)
        assert not ok and value.kind is FailureKind.DATA and "the answer could not be sent" in value.detail
        line.send(("next",))
        assert line.receive(10) == (True, "next")
    finally:
        line.close()
        server.close()


def test_a_silent_peer_blocks_no_other_connect_and_is_dropped_at_the_deadline(loop):
    """A peer that connects and never does the handshake held the single accept thread, so
    every later driver's connect hung for good."""
    import socket

    server = ChannelServer(_handler, loop, 0.5)
    silent = socket.socket(socket.AF_UNIX)
    silent.connect(server.address)
    try:
        t0 = time.monotonic()
        line = Channel(server.address, server.key, TIMEOUT_S)
        assert time.monotonic() - t0 < 1.0  # not behind the silent peer's handshake
        line.send(("apply",))
        assert line.receive(10)[0]
        line.close()
        silent.settimeout(5)  # the server gives up on it after its handshake deadline: EOF
        t0 = time.monotonic()
        while silent.recv(4096):  # the challenge it was sent, then the close
            pass
        assert time.monotonic() - t0 < 3
    finally:
        silent.close()
        server.close()


def _loop_answers(loop, timeout_s: float = 10.0) -> bool:
    """Whether a no-op callback on ``loop`` runs within ``timeout_s`` (the shard actor's loop serves
    generation and probes beside the line: it must never wait on a peer)."""
    try:
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=timeout_s)
        return True
    except TimeoutError:
        return False


def test_a_peer_stalled_mid_frame_never_blocks_the_loop_and_is_dropped(loop):
    """An authenticated driver that stops mid-send (SIGSTOPped, paused) keeps its socket open: a
    blocking read of the frame on the loop held the actor's loop until the rest came."""
    import struct

    server = ChannelServer(_handler, loop, 1.0)
    line = Channel(server.address, server.key, TIMEOUT_S)
    other = Channel(server.address, server.key, TIMEOUT_S)
    try:
        line._conn._send(struct.pack("!i", 1000) + b"\x80\x05" + b"x" * 10)  # 12 of a 1000-byte frame
        time.sleep(0.2)
        assert _loop_answers(loop), "the actor's loop is blocked by a peer stalled mid-frame"
        other.send(("apply", 1))  # another line is served meanwhile
        ok, value = other.receive(10)
        assert ok and value["payload"] == 1
        # no byte for the deadline (1 s): the line is dropped, and the driver hears of a broken line
        with pytest.raises(ChannelBroken):
            line.receive(10)
        assert _loop_answers(loop)
    finally:
        line.close()
        other.close()
        server.close()


def test_a_frame_sent_in_pieces_and_a_large_one_are_read_whole(loop):
    """Frames are gathered as their bytes come: one sent in slow pieces (each within the
    deadline) and one of several MiB (read over several events) both run their call."""
    from multiprocessing.reduction import ForkingPickler

    server = ChannelServer(_handler, loop, 1.0)
    line = Channel(server.address, server.key, TIMEOUT_S)
    try:
        frame = ForkingPickler.dumps(("apply", "slow pieces"))
        whole = struct_len(frame) + frame
        for i in range(0, len(whole), 7):
            line._conn._send(whole[i:i + 7])
            time.sleep(0.05)  # ~0.5 s in all: past no deadline, since every piece is progress
        ok, value = line.receive(10)
        assert ok and value["payload"] == "slow pieces"
        big = "b" * (6 * 2**20)
        line.send(("apply", big))
        ok, value = line.receive(30)
        assert ok and value["payload"] == big
        assert server.calls == 2
    finally:
        line.close()
        server.close()


def struct_len(frame: bytes) -> bytes:
    import struct

    return struct.pack("!i", len(frame))  # multiprocessing's frame header


def test_connecting_to_a_server_that_never_answers_gives_up_at_the_deadline(tmp_path):
    """The driver's connect and handshake are bounded: a listener that accepts and says nothing
    (a wedged actor) costs fleet.control_timeout_s, not forever."""
    import socket

    path = str(tmp_path / "socket")
    mute = socket.socket(socket.AF_UNIX)
    mute.bind(path)
    mute.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError):
            Channel(path, b"k" * 32, 0.3)
        assert time.monotonic() - t0 < 2
    finally:
        mute.close()


def test_a_call_the_line_cannot_read_goes_over_ray(server):
    """fan_out sends a call the actor answered "unread" over Ray at once (Ray's pickling carries
    a trainer's own classes by value): the shard is not lost, and the line is dropped."""
    from nemo_gen.fleet.driver import DriverTimeouts, ShardDriver
    from nemo_gen.fleet.handles import ShardHandle

    sent_over_ray = []

    class Ref:
        pass

    class Actor:  # what Ray would carry: a stand-in with the actor's one entry
        class call:  # noqa: N801 — the actor method's shape: .remote(method, *args)
            @staticmethod
            def remote(method, *args):
                sent_over_ray.append((method, *args))
                return Ref()

    class Driver(ShardDriver):
        def open_channel(self, handle):
            line = Channel(server.address, server.key, TIMEOUT_S)
            original = line.send
            line.send = lambda args: (line._conn.send_bytes(b"\x80\x05bad") if args[0].payload.update_info["do"] == "bad"
                                      else original(args))
            return line

    import ray as ray_module
    from unittest import mock

    driver = Driver(DriverTimeouts(control_s=5, stop_s=5, engine_grace_s=1, refit_s=5))
    handle = ShardHandle(index=0, name="fleet-shard-0", actor=Actor(), placement_group=None)
    with mock.patch.object(ray_module, "wait", lambda refs, **kw: (refs, [])), \
            mock.patch.object(ray_module, "get", lambda ref, timeout=None: {"over": "ray"}):
        (out,) = driver.fan_out({0: handle}, _sync("bad", 1), margin_s=0).values()
    assert out.ok and out.value == {"over": "ray"} and sent_over_ray == [("weight_sync", _sync("bad", 1))]
    assert driver.lines() == set()
