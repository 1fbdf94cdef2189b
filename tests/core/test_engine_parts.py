"""The engine's collaborators without an engine: the admission gate (``gate.Gate``), the
step clock (``step_clock.StepClock``), the weights' version labels and poison
(``engine_base.Weights``) and the batch a swap's cut shares with the step thread
(``batch.Running``). The engines that use them run in tests/engine/."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import StepGaps
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard import step_clock
from nemo_gen.shard.batch import Running, Track
from nemo_gen.shard.engine_base import Weights
from nemo_gen.shard.gate import Gate
from nemo_gen.shard.step_clock import StepClock


async def _settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_hold_waits_for_the_requests_in_flight_and_holds_new_ones_until_release():
    async def main():
        gate, order = Gate(), []
        release_first = asyncio.Event()

        async def request(name, until=None):
            async with gate.serving():
                order.append(f"{name} in")
                if until is not None:
                    await until.wait()
            order.append(f"{name} out")

        _first = asyncio.create_task(request("first", release_first))  # held: a task nobody refers to may be collected
        await _settle()
        hold = asyncio.create_task(gate.hold())
        await _settle()
        assert not hold.done() and gate.held  # closed, but the request in flight runs on
        second = asyncio.create_task(request("second"))
        await _settle()
        assert "second in" not in order
        release_first.set()
        await hold
        assert order == ["first in", "first out"]
        await gate.release()
        await second
        assert order == ["first in", "first out", "second in", "second out"] and not gate.held

    asyncio.run(main())


def test_claim_closes_the_gate_without_waiting_and_a_second_refit_waits_for_the_first():
    async def main():
        gate, running = Gate(), asyncio.Event()

        async def request():
            async with gate.serving():
                await running.wait()

        req = asyncio.create_task(request())
        await _settle()
        await asyncio.wait_for(gate.claim(), 1)  # the swap freezes what runs: it does not wait for it
        second = asyncio.create_task(gate.hold())
        await _settle()
        assert not second.done()
        await gate.release()
        await _settle()
        assert not second.done()  # held by the second refit now, which waits for the request
        running.set()
        await asyncio.wait_for(second, 1)
        await req
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(gate.claim(), 0.1)  # still held: a claim waits

    asyncio.run(main())


def test_the_step_clock_keeps_gaps_over_its_bound_until_a_reset(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(step_clock.time, "monotonic", lambda: now[0])
    clock = StepClock()
    clock.begin()
    for dt in (0.001, 0.001, 0.5, 0.001):
        now[0] += dt
        clock.stepped()
    out = clock.gaps(reset=True)
    assert clock.steps == 4 and out.max_step_gap_s == pytest.approx(0.5)
    assert out.gaps == ((pytest.approx(100.002), pytest.approx(100.502)),)
    assert clock.gaps(reset=False) == StepGaps(0.0, ())
    now[0] += 3.0  # the first step after a reset starts a new window: no gap from before it
    clock.stepped()
    assert clock.gaps(reset=False).max_step_gap_s == 0.0


def test_the_step_clock_judges_a_busy_engine_by_its_progress(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(step_clock.time, "monotonic", lambda: now[0])
    clock = StepClock()
    with clock.running():
        now[0] = 20.0  # no output yet: the warm-up bound applies
        assert clock.evidence(stall_s=10, warmup_s=30)["ok"]
        clock.output()
        now[0] = 31.0  # an output came, then nothing for longer than the stall bound
        answer = clock.evidence(stall_s=10, warmup_s=30)
        assert not answer["ok"] and "11.0s" in answer["error"]
        assert clock.active == 1
    assert clock.active == 0 and clock.gaps(reset=False).gaps == ()  # outputs keep no gaps
    with clock.running():  # busy again: the count starts over
        assert clock.steps == 0 and clock.last_step_at == 31.0


def test_weights_read_labels_back_and_a_poisoned_engine_refuses_requests():
    w = Weights(3)
    assert w.version_of("default") == 3 and w.salt == "nemo-gen-w3"
    label = w.label(4)
    w.version = 4
    assert w.version_of(label) == 4 and w.version_of(None) == 4 and w.version_of("default") == 3
    w.check()
    w.poisoned = "refit to version 5 failed"
    with pytest.raises(ShardDiedError, match="half-loaded: refit to version 5 failed"):
        w.check()


def test_a_cut_drops_every_engine_request_of_a_track_and_tells_the_stream():
    params = SimpleNamespace(n=2, max_tokens=4)
    a = Track.start(GenerationRequest(index=0, prompt_token_ids=[1]), params, "r0", "i0")
    b = Track.start(GenerationRequest(index=1, prompt_token_ids=[1]), params, "r1", "i1")
    a.parts["r0-s1"] = ("i0-s1", 1)  # a request that is two engine requests
    batch, told = Running(), []
    batch.tracks = {"r0": a, "r0-s1": a, "r1": b}
    assert batch.tracks_now() == [a, b]
    batch.stepped()  # no stream: nothing to tell
    batch.on_step = lambda: told.append(len(batch.tracks))
    batch.drop(a)
    batch.stepped()
    assert batch.tracks == {"r1": b} and told == [1]
    batch.clear()
    assert batch.tracks == {} and batch.on_step is None
