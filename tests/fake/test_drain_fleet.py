"""A planned drain on the fake driver (tests/fakes.py): a healthy shard leaves service
mid-request (``fleet.drain``, ``fleet.restart_shard``), each of its requests goes on on the other
shard from the tokens it had made, named as a drain and counted against nothing, and no new
request goes to it. The fake engine's continuation makes the tokens the uninterrupted request
would have (a greedy engine's rule). The same on real vLLM engines: tests/engine/test_drain.py;
the rules: tests/core/test_drain.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nemo_gen.core.drain import DrainRefused
from nemo_gen.core.results import MoveCause
from tests.fake.test_migration_fleet import PROMPTS, TOKENS, expected, wait_until
from tests.fakes import fake_fleet


@pytest.fixture
def settings(fake_fleet_settings):
    def make(**overrides):
        if overrides.get("fleet__migration__mode") != "off":
            overrides.setdefault("fleet__migration__checkpoint_s", 0.01)
        # max_reroutes=0: any counted re-route fails its request, so a drain that counted one shows
        return fake_fleet_settings(health__auto_recover=False, fleet__max_reroutes=0, **overrides)
    return make


def slow(fleet, driver):
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.01)


def drain_when(driver, fleet, slot, tokens, restart=False):
    """Drain ``slot`` once a request there has made ``tokens`` and a checkpoint of half is in."""
    engine = driver.shard(fleet.handle(slot))
    wait_until(lambda: max(engine.tokens_made.values(), default=0) >= tokens, what=f"{tokens} tokens on {slot}")
    cp = fleet.router.checkpointer
    if cp is not None:
        wait_until(lambda: any(len(s) >= tokens // 2 for k in cp.kept_now().values() for s in k), what="a checkpoint")
    return fleet.restart_shard(slot) if restart else fleet.drain(slot, reason="scale-down")


def batch_with_a_drain(fleet, driver, restart=False, **params):
    slow(fleet, driver)
    out: list = []
    running = threading.Thread(target=lambda: out.extend(fleet.generate(PROMPTS, max_new_tokens=TOKENS, **params)))
    running.start()
    report = drain_when(driver, fleet, 1, 20, restart)
    running.join(30)
    assert not running.is_alive()
    return out, report


def test_a_batch_on_a_drained_shard_goes_on_from_its_tokens_named_and_uncounted(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        drained_actor = fleet.handle(1).name
        out, report = batch_with_a_drain(fleet, driver)
        assert report["action"] == "drained" and report["moved"] and report["actor"] == drained_actor
        assert all(r.ok for r in out), [r.error for r in out]
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS]
        moved = [r for r in out if r.migrations]
        assert moved, "no request moved"
        for r in moved:
            (m,) = r.migrations
            assert m.from_shard == 1 and m.cause is MoveCause.DRAINED and 0 < m.at_token < TOKENS
            assert r.shard == 0 and r.to_json()["migrations"][0]["cause"] == "drained"
        assert fleet.router.rerouted == 0
        (s1,) = [s for s in fleet.status() if s.index == 1]
        assert s1.state == "dead" and "drained: scale-down" in (s1.last_error or "")
        # new requests go to the serving shard only; the drained engine gets nothing more
        before = dict(driver.shard(fleet.handle(1)).tokens_made)
        again = fleet.generate(PROMPTS[:4], max_new_tokens=5)
        assert {r.shard for r in again} == {0} and driver.shard(fleet.handle(1)).tokens_made == before
        assert fleet.handle(1).name == drained_actor  # left out of service, not replaced


def test_a_drain_before_any_token_was_kept_sends_again_uncounted(settings, driver):
    """fleet.migration off: nothing is kept, every request of the drained shard is sent again from
    its prompt, and with fleet.max_reroutes=0 none fails (a drain counts no re-route)."""
    with fake_fleet(settings(fleet__migration__mode="off"), driver) as fleet:
        out, _ = batch_with_a_drain(fleet, driver)
        assert all(r.ok for r in out), [r.error for r in out]
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS]
        assert {r.shard for r in out} == {0} and not any(r.migrations for r in out)


def test_a_planned_restart_drains_then_replaces_the_shard(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        old = fleet.handle(1).name
        out, report = batch_with_a_drain(fleet, driver, restart=True)
        assert all(r.ok for r in out), [r.error for r in out]
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS]
        assert any(m.cause is MoveCause.DRAINED for r in out for m in r.migrations)
        assert report["restart"]["action"] in ("restarted", "promoted-spare"), report
        assert fleet.handle(1).name != old and fleet.health.state_of(1).value == "healthy"
        assert not fleet.members.table.has_losses()  # the old actor's reap was no news
        again = fleet.generate(PROMPTS, max_new_tokens=5)
        assert {r.shard for r in again} == {0, 1}


def test_generate_async_and_a_stream_go_on_across_a_drain(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        slow(fleet, driver)

        async def run():
            tasks = [asyncio.ensure_future(fleet.generate_async(p, max_new_tokens=TOKENS)) for p in PROMPTS[:3]]
            items = []
            async for item in fleet.generate_stream(PROMPTS[3], max_new_tokens=TOKENS):
                items.append(item)
                if len(items) == 15:
                    await asyncio.to_thread(fleet.drain, item.shard)
            return await asyncio.gather(*tasks), items

        results, items = asyncio.run(run())
        assert [r.token_ids for r in results] == [expected(p) for p in PROMPTS[:3]]
        deltas, final = items[:-1], items[-1]
        assert [t for d in deltas for t in d.token_ids] == expected(PROMPTS[3]) == final.token_ids
        (m,) = final.migrations
        assert m.cause is MoveCause.DRAINED and m.at_token >= 15 and len({d.shard for d in deltas}) == 2
        assert fleet.router.rerouted == 0


def test_a_drain_that_cannot_act_is_refused_naming_the_shard_and_changes_nothing(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        with pytest.raises(DrainRefused, match="shard 5: no such shard"):
            fleet.drain(5)
        with pytest.raises(DrainRefused, match="shard 5: no such shard"):
            fleet.restart_shard(5)
        assert fleet.drain(1)["action"] == "drained"
        with pytest.raises(DrainRefused, match="shard 1 is dead, not serving"):
            fleet.drain(1)
        with pytest.raises(DrainRefused, match="shard 0 is the last serving shard"):
            fleet.drain(0)
        with pytest.raises(DrainRefused, match="shard 0 is the last serving shard"):
            fleet.restart_shard(0)
        assert fleet.health.state_of(0).value == "healthy"
        assert fleet.generate(PROMPTS[:2], max_new_tokens=3)[0].ok
        # a shard that no longer serves is restarted without a drain
        assert fleet.restart_shard(1)["restart"]["action"] in ("restarted", "promoted-spare")
        assert fleet.health.state_of(1).value == "healthy"
