"""A stream of ``n`` samples whose shard is lost mid-stream (``nemo_gen.fleet.stream_moves``):
every unfinished sample goes on on another shard from exactly the tokens its reader has, with
no break and no repeat, each under its own sample index; the result joins every sample's
tokens. On the fake driver (tests/fakes.py: sample k's tokens differ from sample 0's by k, and a
continuation makes the tokens its sample would have). Real engines: tests/engine/test_migration_async.py."""

from __future__ import annotations

import asyncio

import pytest

from nemo_gen.core.results import MoveCause
from nemo_gen.errors import ShardDiedError
from tests.fake.test_migration_fleet import PROMPTS, TOKENS, expected, settings  # noqa: F401  (a fixture)
from tests.fakes import fake_fleet


def stream_with_a_loss(fleet, driver, lose, after: int = 15, **params):
    """``generate_stream(PROMPTS[0])``'s items, the shard it runs on lost (``lose(fleet, driver,
    shard)``) once ``after`` items are read."""
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.01)

    async def run():
        items = []
        async for item in fleet.generate_stream(PROMPTS[0], max_new_tokens=TOKENS, **params):
            items.append(item)
            if len(items) == after:
                await asyncio.to_thread(lose, fleet, driver, item.shard)
        return items

    return asyncio.run(run())


def kill(fleet, driver, shard):
    driver.set_dead(fleet.handle(shard).name, actor=False)


def drain(fleet, driver, shard):
    fleet.drain(shard)


@pytest.mark.parametrize("lose, cause", [(kill, MoveCause.LOST), (drain, MoveCause.DRAINED)])
def test_an_n4_stream_goes_on_per_sample_with_no_break_and_no_repeat(settings, driver, lose, cause):  # noqa: F811
    with fake_fleet(settings(), driver) as fleet:
        items = stream_with_a_loss(fleet, driver, lose, n=4, temperature=1.0)
        deltas, result = items[:-1], items[-1]
        assert result.ok, result.error
        for k in range(4):
            ids = [t for d in deltas if d.sample == k for t in d.token_ids]
            assert ids == expected(PROMPTS[0], TOKENS, k), f"sample {k}"
            assert result.samples[k].token_ids == ids and len(result.samples[k].logprobs) == TOKENS
            assert sum(n for _, n in result.samples[k].weight_versions) == TOKENS
        assert sorted(m.sample for m in result.migrations) == [0, 1, 2, 3]
        assert all(m.cause is cause and 0 < m.at_token < TOKENS for m in result.migrations)
        assert len({d.shard for d in deltas}) == 2 and fleet.router.rerouted == 0
        assert sum(1 for d in deltas if d.finish_reason is not None) == 4  # each sample ends once


def test_a_stream_asking_for_alternatives_still_ends_when_lost_mid_stream(settings, driver):  # noqa: F811
    """What a delta does not carry (each token's alternatives) cannot be kept: such a stream ends
    with ShardDiedError naming the shard, never a silently short answer."""
    with fake_fleet(settings(), driver) as fleet:
        with pytest.raises(ShardDiedError, match="lost mid-stream"):
            stream_with_a_loss(fleet, driver, kill, logprobs=2)
