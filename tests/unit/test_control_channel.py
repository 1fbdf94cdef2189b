"""``nemo_gen.fleet.control_channel`` with real sockets: a server running its handler on an event
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

from nemo_gen.fleet.control_channel import Channel, ChannelBroken, ChannelServer


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _handler(step, payload=None, timeout_s=1.0):
    if step == "fail":
        raise RuntimeError(f"refit refused:\nthe chunk {payload} has the wrong shape")
    if step == "slow":
        await asyncio.sleep(payload)
    return {"step": step, "payload": payload, "thread": threading.current_thread().name}


@pytest.fixture
def server(loop):
    server = ChannelServer(_handler, loop)
    yield server
    server.close()


def test_a_call_runs_on_the_loop_and_answers(server, loop):
    line = Channel(server.address, server.key)
    try:
        line.send(("apply", {"layout": 3}, 10.0))
        ok, value = line.receive(10)
        assert ok and value["step"] == "apply" and value["payload"] == {"layout": 3}
        assert value["thread"] != "nemo-gen-channel-conn"  # the handler ran on the loop's thread
        line.send(("fail", "w"))
        assert line.receive(10) == (False, "RuntimeError: the chunk w has the wrong shape")
        assert server.calls == 2
    finally:
        line.close()


def test_the_socket_is_its_owners_and_a_wrong_key_is_refused(server):
    mode = os.stat(os.path.dirname(server.address)).st_mode
    assert stat.S_IMODE(mode) == 0o700
    with pytest.raises(AuthenticationError):
        Channel(server.address, b"not the key" * 3)
    line = Channel(server.address, server.key)  # the server still serves after a refused client
    try:
        line.send(("apply",))
        assert line.receive(10)[0]
    finally:
        line.close()


def test_a_late_answer_is_a_timeout(server):
    line = Channel(server.address, server.key)
    try:
        line.send(("slow", 0.5))
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            line.receive(0.05)
        assert time.monotonic() - t0 < 0.5
    finally:
        line.close()


def test_a_line_whose_server_is_gone_is_broken(loop):
    server = ChannelServer(_handler, loop)
    line = Channel(server.address, server.key)
    try:
        line.send(("slow", 0.2))
        server.close()  # the actor stops: its connection threads end after the call in flight
        assert line.receive(10)[0]
        line.close()
        with pytest.raises(ChannelBroken):
            line.send(("apply",))
        with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
            Channel(server.address, server.key)
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

    server = ChannelServer(handler, loop)
    line = Channel(server.address, server.key)
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
    server = ChannelServer(_handler, loop)
    idle, busy = Channel(server.address, server.key), Channel(server.address, server.key)
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
    server = ChannelServer(_handler, loop)
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
    line = Channel(address, key)
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
                return Channel(server.address, server.key)

        return Driver(DriverTimeouts(control_s=5, stop_s=5, engine_grace_s=1, refit_s=refit_s))


def _handle():
    from nemo_gen.fleet.shard import ShardHandle

    return ShardHandle(index=0, name="fleet-shard-0", actor=None, placement_group=None)


def test_the_driver_answers_from_the_line_as_from_ray(server):
    driver, handle = _LocalDriver.make(server, refit_s=5), _handle()
    (ok,) = driver.fan_out({0: handle}, "weight_sync", ("apply", {"layout": 1}, 5.0), margin_s=0).values()
    assert ok.ok and ok.value["payload"] == {"layout": 1}
    (refused,) = driver.fan_out({0: handle}, "weight_sync", ("fail", "w", 5.0), margin_s=0).values()
    # what the Ray path gives for an exception the actor raised: root_cause's form, not infra
    assert refused.error == "RuntimeError: the chunk w has the wrong shape" and not refused.infra
    assert driver.lines() == {handle.name} and server.calls == 2


def test_a_call_past_its_deadline_drops_the_line(server):
    driver, handle = _LocalDriver.make(server, refit_s=0.1), _handle()
    (late,) = driver.fan_out({0: handle}, "weight_sync", ("slow", 1.0, 5.0), margin_s=0).values()
    assert late.error.startswith("GetTimeoutError") and late.infra
    assert driver.lines() == set()  # its late answer must not be read as the next call's


def test_a_line_that_breaks_mid_call_is_the_actors_loss(remote):
    proc, address, key = remote
    where = types.SimpleNamespace(address=address, key=key)
    driver, handle = _LocalDriver.make(where, refit_s=20), _handle()
    threading.Timer(0.3, os.kill, (proc.pid, signal.SIGKILL)).start()
    (lost,) = driver.fan_out({0: handle}, "weight_sync", ("slow", 30.0, 5.0), margin_s=0).values()
    assert lost.error.startswith("ActorDiedError") and lost.infra
    assert driver.lines() == set()
