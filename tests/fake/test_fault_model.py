"""The fault model on the fake driver (tests/fakes.py): dead, busy and slow each get their own
answer, and only dead condemns a shard. Shards here generate one token per ``token_s`` and
stop when their call is cancelled, as an engine does; the same paths on real vLLM engines are
in tests/engine/test_slow_is_not_dead.py.

Before this, a request past ``fleet.request_timeout_s`` condemned its shard and was re-routed
with no limit: one 300-token request on healthy 100 token/s shards retired a 2-shard fleet in
6 s; and vLLM's "queue full" condemned a shard as dead."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.errors import FleetBusy, RequestTimeout, ShardDiedError
from tests import helpers
from tests.fakes import fake_fleet


def wait_until(predicate, timeout_s: float = 30.0, what: str = "the condition"):
    return helpers.wait_until(predicate, timeout_s, what, poll_s=0.005)


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def healthy_untouched(fleet) -> bool:
    """Every slot HEALTHY, never restarted, never condemned."""
    snap = fleet.health.snapshot()
    return all(s.state is ShardState.HEALTHY and s.restart_attempts == 0 for s in snap) and not any(
        h["new"] == "dead" for s in snap for h in fleet.health.history(s.dp_shard_idx))


def tokens_settle(shard, index: int, quiet_s: float = 0.3) -> int:
    """The tokens a request had made once its count stopped moving for ``quiet_s``."""
    before = shard.tokens_made.get(index, 0)
    while True:
        time.sleep(quiet_s)
        now = shard.tokens_made.get(index, 0)
        if now == before:
            return now
        before = now


@contextlib.contextmanager
def fast_clock(fleet, driver):
    """The shards' and the router's clock, running 500 times faster than the real one (0.5 s a
    millisecond: 30 minutes in ~3.6 real seconds); yields it."""
    fake = {"now": 0.0}
    clock = lambda: fake["now"]  # noqa: E731
    driver.clock = fleet.router.clock = clock
    stop = threading.Event()

    def run():
        while not stop.is_set():
            fake["now"] += 0.5
            time.sleep(0.001)

    ticker = threading.Thread(target=run, daemon=True)
    ticker.start()
    try:
        yield clock
    finally:
        stop.set()
        ticker.join(5)


# -- slow: a deadline fails the request, never the shard -------------------------------------------


def test_a_request_past_its_deadline_fails_alone_and_its_shard_serves_on(settings, driver):
    """The reliability review's probe E: healthy shards at 100 tokens/s and
    fleet.request_timeout_s=1; a 300-token request (3 s anywhere) fails with RequestTimeout
    within its deadline, is aborted on its shard, and the fleet is untouched."""
    with fake_fleet(settings(fleet__request_timeout_s=1, health__max_restart_attempts_per_shard=2), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)

        async def run():
            short = asyncio.ensure_future(fleet.generate_async([1, 2], max_new_tokens=8))
            t0 = time.monotonic()
            with pytest.raises(RequestTimeout, match=r"within 1s .*aborted on shard \d, which serves on") as caught:
                await fleet.generate_async([5, 6], max_new_tokens=300)
            return time.monotonic() - t0, caught.value, await short

        took, error, short = asyncio.run(run())
        assert 0.9 < took < 2.5, took  # the deadline, with slack for a loaded 2-core machine
        assert short.ok
        victim = driver.shards[fleet.handle(error.shard).name]
        made = tokens_settle(victim, 0)
        assert 50 < made < 300  # it was generating, and stopped when the request was aborted
        assert healthy_untouched(fleet) and len(driver.launched) == 2
        assert all(r.ok for r in fleet.generate([[1], [2]], max_new_tokens=4))


def test_a_thirty_minute_generation_at_default_settings_condemns_nothing(settings, driver):
    """A long reasoning rollout on a healthy shard finishes at the default settings: no request
    deadline, and the probes judge a busy engine by its progress, not by its request's age. The
    shards' and the router's clock runs fast: 30 minutes of it pass in a few real seconds, one
    token a second, with probes every 10 ms of real time."""
    s = settings(health__probe_interval_s=0.01, health__unhealthy_threshold=2)
    assert s.fleet.request_timeout_s is None  # the default: no deadline
    with fake_fleet(s, driver) as fleet, fast_clock(fleet, driver) as clock:
        for h in fleet.shards:
            driver.set_token_s(h.name, 1.0)
        result = asyncio.run(fleet.generate_async([3, 4], max_new_tokens=1800))
        assert result.ok and len(result.token_ids) == 1800 and clock() >= 1800
        assert healthy_untouched(fleet) and len(driver.launched) == 2
        probes = [h for s_ in fleet.health.snapshot() for h in fleet.health.history(s_.dp_shard_idx)]
        assert all(h["new"] != "suspect" for h in probes), probes  # not even one failed probe


def test_the_same_generation_past_a_deadline_of_its_own_fails_at_that_deadline(settings, driver):
    with fake_fleet(settings(health__probe_interval_s=0.01), driver) as fleet, fast_clock(fleet, driver):
        for h in fleet.shards:
            driver.set_token_s(h.name, 1.0)
        with pytest.raises(RequestTimeout) as caught:
            asyncio.run(fleet.generate_async([3, 4], max_new_tokens=1800, timeout_s=600))
        shard = driver.shards[fleet.handle(caught.value.shard).name]
        # ~600 tokens at 1/s, then aborted: the router sees its deadline within a poll of real
        # time, which this fast clock turns into up to a few hundred of its seconds on a loaded machine
        assert 590 <= tokens_settle(shard, 0) < 1500
        assert healthy_untouched(fleet)


def test_a_batch_past_its_deadline_answers_the_rest_and_aborts_the_late(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        slow, fast = fleet.shards
        driver.set_token_s(slow.name, 0.05)  # 100 tokens: 5 s on shard 0
        results = fleet.generate([[1], [2], [3], [4]], max_new_tokens=100, timeout_s=1.0)
        late = [r for r in results if not r.ok]
        assert late and all(r.shard == 0 and r.error.startswith("RequestTimeout") for r in late)
        assert all(r.ok and r.shard == 1 for r in results if r.ok)
        assert [r.index for r in results] == [0, 1, 2, 3]
        assert tokens_settle(driver.shards[slow.name], late[0].index) < 100
        assert healthy_untouched(fleet)


def test_a_streams_deadline_runs_between_tokens(settings, driver):
    """A stream longer than its deadline finishes while tokens keep coming; one whose shard
    stops sending fails with RequestTimeout one deadline after its last token."""
    with fake_fleet(settings(health__probe_interval_s=3600), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.05)

        async def stream(hang_after: int | None = None):
            events = []
            async for e in fleet.generate_stream([7, 8], max_new_tokens=30, timeout_s=0.5):
                events.append(e)
                if len(events) == hang_after:
                    driver.set_hung(fleet.handle(events[0].shard).name)
            return events

        t0 = time.monotonic()
        events = asyncio.run(stream())
        assert time.monotonic() - t0 > 1.2  # 30 tokens at 50 ms: longer than the deadline
        assert events[-1].ok and len(events[-1].token_ids) == 30
        with pytest.raises(RequestTimeout, match="no token within 0.5s"):
            asyncio.run(stream(hang_after=5))
        assert fleet.health.snapshot()[0].restart_attempts == 0


# -- dead: condemned by evidence, re-routes capped -------------------------------------------------


def test_a_hung_shard_is_condemned_by_its_probes_and_its_requests_rerouted(settings, driver):
    """No request deadline is needed to get work off a wedged shard: its probes condemn it
    (no progress), and the router re-routes what it held."""
    s = settings(health__probe_interval_s=0.01, health__unhealthy_threshold=2, health__auto_recover=False)
    with fake_fleet(s.model_copy(update={"health": s.health.model_copy(update={"probe_timeout_s": 0.3})}),
                    driver) as fleet:
        driver.set_hung(fleet.handle(1).name)
        results = fleet.generate([[1], [2], [3], [4]])
        assert all(r.ok and r.shard == 0 for r in results)
        assert fleet.health.state_of(1) is ShardState.DEAD
        assert "probe not answered" in fleet.health.snapshot()[1].last_error


def test_re_routes_of_one_request_are_capped(settings, driver):
    """Each shard that takes the request dies under it: after fleet.max_reroutes=2 re-routes the
    request fails with ShardDiedError naming the cap, instead of going round forever."""
    with fake_fleet(settings(fleet__num_shards=4, health__auto_recover=False), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        killed = []

        def killer():
            while len(killed) < 4:
                for h in fleet.shards:
                    shard = driver.shards[h.name]
                    if shard.running and h.name not in killed and not shard.dead:
                        killed.append(h.name)
                        driver.set_dead(h.name)
                time.sleep(0.002)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        with pytest.raises(ShardDiedError, match=r"re-routed 2 time\(s\) already: fleet.max_reroutes=2"):
            asyncio.run(fleet.generate_async([1, 2], max_new_tokens=500))
        assert len(killed) == 3  # its first shard and two re-routes; the fourth never saw it
        assert fleet.router.rerouted == 2


# -- busy: retried elsewhere, never condemned --------------------------------------------------------


def test_a_busy_shard_is_not_condemned_and_its_requests_go_elsewhere(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        busy, free = fleet.shards
        driver.set_busy(busy.name)  # vLLM's QueueOverflowError on every call
        results = fleet.generate([[1], [2], [3], [4]])
        assert all(r.ok and r.shard == 1 for r in results)

        async def each():
            return await asyncio.gather(*(fleet.generate_async([i]) for i in range(4)))

        assert all(r.ok and r.shard == 1 for r in asyncio.run(each()))
        assert driver.shards[busy.name].refused >= 2
        assert healthy_untouched(fleet)
        assert fleet.router.refused >= 2


def test_every_shard_busy_is_fleet_busy_after_bounded_tries(settings, driver):
    with fake_fleet(settings(fleet__busy_retries=3, fleet__busy_backoff_s=0.01), driver) as fleet:
        for h in fleet.shards:
            driver.set_busy(h.name)
        with pytest.raises(FleetBusy, match=r"refused 4 time\(s\) by busy shards \(fleet.busy_retries=3"):
            asyncio.run(fleet.generate_async([1, 2]))
        assert sum(driver.shards[h.name].refused for h in fleet.shards) == 4  # the first try and 3 more
        results = fleet.generate([[1], [2]])
        assert all(not r.ok and r.error.startswith("FleetBusy") for r in results)
        assert healthy_untouched(fleet)
        for h in fleet.shards:  # the queues drain: the same fleet serves again
            driver.shards[h.name].busy = 0
        assert all(r.ok for r in fleet.generate([[1], [2]]))


def test_a_shard_busy_for_a_moment_serves_the_retry(settings, driver):
    with fake_fleet(settings(fleet__num_shards=1, fleet__busy_backoff_s=0.01), driver) as fleet:
        driver.set_busy(fleet.shards[0].name, calls=2)
        result = asyncio.run(fleet.generate_async([1, 2]))
        assert result.ok and driver.shards[fleet.shards[0].name].refused == 2
        assert healthy_untouched(fleet)


def test_a_stream_refused_by_a_busy_shard_goes_to_another(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        driver.set_busy(fleet.shards[0].name)

        async def stream():
            return [e async for e in fleet.generate_stream([1, 2], max_new_tokens=4)]

        events = asyncio.run(stream())
        assert events[-1].ok and events[-1].shard == 1
        assert healthy_untouched(fleet)


def test_the_pending_bound_refuses_at_once_and_sends_nothing(settings, driver):
    with fake_fleet(settings(fleet__max_pending_requests=2), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)

        async def run():
            held = [asyncio.ensure_future(fleet.generate_async([i], max_new_tokens=50)) for i in range(2)]
            await asyncio.sleep(0.1)
            calls = len(driver.remote_calls) + sum(s.generated + s.running for s in driver.shards.values())
            t0 = time.monotonic()
            with pytest.raises(FleetBusy, match=r"admits at most 2 \(fleet.max_pending_requests\)"):
                await fleet.generate_async([9])
            refused_in = time.monotonic() - t0
            after = len(driver.remote_calls) + sum(s.generated + s.running for s in driver.shards.values())
            done = await asyncio.gather(*held)
            return refused_in, calls, after, done

        refused_in, before, after, done = asyncio.run(run())
        assert refused_in < 0.5 and before == after  # at once (no wait, no backoff), and nothing of it was sent
        assert all(r.ok for r in done)
        with pytest.raises(FleetBusy):
            fleet.generate([[1], [2], [3]])  # a batch past the bound: refused whole, before anything
        assert all(r.ok for r in fleet.generate([[1], [2]]))  # the bound frees as requests finish


# -- cancellation reaches the engine -----------------------------------------------------------------


def test_cancelling_generate_async_stops_its_generation_on_the_shard(settings, driver):
    """How an RL loop drops a straggler: asyncio.wait_for / task.cancel(). The shard stops
    generating it (before: only the asyncio wrapper was cancelled; the engine went on)."""
    with fake_fleet(settings(), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)

        async def run():
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(fleet.generate_async([1, 2], max_new_tokens=500), 0.5)
            task = asyncio.ensure_future(fleet.generate_async([3, 4], max_new_tokens=500))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(run())
        wait_until(lambda: all(s.running == 0 for s in driver.shards.values()), 5, "the shards to stop generating")
        made = [tokens_settle(s, 0) for s in driver.shards.values() if 0 in s.tokens_made]
        assert made and all(m < 200 for m in made), made
        assert fleet.router.admission.held == 0 and healthy_untouched(fleet)
