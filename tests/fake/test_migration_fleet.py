"""Migration on the fake driver (tests/fakes.py): a shard dies mid-request and each of its
requests goes on on the other shard from the tokens it had made (``fleet.migration``). The fake
engine makes one token per ``token_s`` and checkpoints what it made; its continuation makes the
tokens the uninterrupted request would have (a greedy engine's rule), so a moved result equals an
unmoved one token for token. The same on real vLLM engines: tests/engine/test_migration.py."""

from __future__ import annotations

import asyncio
import threading

import pytest

from nemo_gen.core.members import Member
from tests import helpers
from tests.fakes import fake_fleet

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]] * 2
TOKENS = 60


def wait_until(predicate, timeout_s: float = 30.0, what: str = "the condition"):
    return helpers.wait_until(predicate, timeout_s, what, poll_s=0.005)


@pytest.fixture
def settings(fake_fleet_settings):
    def make(**overrides):
        if overrides.get("fleet__migration__mode") != "off":
            overrides.setdefault("fleet__migration__checkpoint_s", 0.01)
        return fake_fleet_settings(health__auto_recover=False, **overrides)
    return make


def expected(prompt, n=TOKENS, k=0):
    return [(sum(prompt) + k + i) % 97 for i in range(n)]


def kill_when(driver, fleet, slot, tokens, how="its call fails"):
    """Lose ``slot``'s shard once a request there has made ``tokens`` tokens and its checkpoint is
    in: it dies (its call fails), or a probe streak condemns it while it hangs."""
    engine = driver.shard(fleet.handle(slot))
    wait_until(lambda: max(engine.tokens_made.values(), default=0) >= tokens, what=f"{tokens} tokens on {slot}")
    cp = fleet.router.checkpointer
    wait_until(lambda: any(len(s) >= tokens // 2 for k in cp.kept_now().values() for s in k), what="a checkpoint")
    if how == "its call fails":
        driver.set_dead(engine.name)
    else:
        driver.set_hung(engine.name)
        fleet.recovery.shard_lost(Member(engine.name, slot), "probe streak")
    return engine


def batch_with_a_kill(fleet, driver, prompts=PROMPTS, how="its call fails", **params):
    """``prompts`` generated while shard 1 is lost 20 tokens in (after a checkpoint): the results."""
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.01)
    out: list = []
    running = threading.Thread(target=lambda: out.extend(fleet.generate(prompts, max_new_tokens=TOKENS, **params)))
    running.start()
    kill_when(driver, fleet, 1, 20, how)
    running.join(30)
    assert not running.is_alive()
    return out


@pytest.mark.parametrize("how", ["its call fails", "it is condemned"])
def test_a_batch_on_a_lost_shard_goes_on_from_its_tokens(settings, driver, how):
    with fake_fleet(settings(), driver) as fleet:
        out = batch_with_a_kill(fleet, driver, how=how)
        assert all(r.ok for r in out), [r.error for r in out]
        # exactly the tokens of an uninterrupted run, every token under a version
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS]
        assert all(sum(n for _, n in r.weight_versions) == TOKENS for r in out)
        moved = [r for r in out if r.migrations]
        assert moved, "no request moved"
        for r in moved:
            (m,) = r.migrations
            assert m.from_shard == 1 and 0 < m.at_token < TOKENS and m.sample == 0
            assert r.shard == 0
        assert fleet.router.checkpointer.migrated == len(moved)
        assert fleet.router.rerouted == 0  # what kept tokens did not count as a re-route
        assert all(r.to_json()["migrations"] for r in moved)
        assert "migrations" not in next(r for r in out if not r.migrations).to_json()


def test_moves_that_keep_tokens_do_not_count_against_max_reroutes(settings, driver):
    """fleet.max_reroutes=0: a re-route would fail the request; a move that kept tokens does not."""
    with fake_fleet(settings(fleet__max_reroutes=0), driver) as fleet:
        out = batch_with_a_kill(fleet, driver)
        assert all(r.ok for r in out), [r.error for r in out]
        assert any(r.migrations for r in out)


def test_with_migration_off_a_dying_shards_requests_start_again(settings, driver):
    with fake_fleet(settings(fleet__migration__mode="off"), driver) as fleet:
        assert fleet.router.checkpointer is None
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        out: list = []
        running = threading.Thread(target=lambda: out.extend(fleet.generate(PROMPTS, max_new_tokens=TOKENS)))
        running.start()
        engine = driver.shard(fleet.handle(1))
        wait_until(lambda: max(engine.tokens_made.values(), default=0) >= 20, what="20 tokens on shard 1")
        driver.set_dead(engine.name)
        running.join(30)
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS]
        assert not any(r.migrations for r in out)
        assert fleet.router.rerouted > 0


def test_n_samples_each_keep_their_tokens(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        out = batch_with_a_kill(fleet, driver, PROMPTS[:2], n=4, temperature=1.0)
        assert all(r.ok for r in out), [r.error for r in out]
        moved = next(r for r in out if r.migrations)
        assert len(moved.samples) == 4 and sorted(m.sample for m in moved.migrations) == [0, 1, 2, 3]
        prompt = PROMPTS[moved.index]
        for m in moved.migrations:
            s = moved.samples[m.sample]
            assert len(s.token_ids) == TOKENS and sum(n for _, n in s.weight_versions) == TOKENS
            # sample k's tokens are its own (the fake's sample k differs from the others by k), before
            # the move and after it (its continuation goes on as sample k: vLLM seeds it as sample k)
            assert s.token_ids == expected(prompt, TOKENS, m.sample)


def test_generate_async_goes_on_from_its_tokens(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)

        async def run():
            tasks = [asyncio.ensure_future(fleet.generate_async(p, max_new_tokens=TOKENS)) for p in PROMPTS[:4]]
            await asyncio.to_thread(kill_when, driver, fleet, 1, 20)
            return await asyncio.gather(*tasks)

        out = asyncio.run(run())
        assert [r.token_ids for r in out] == [expected(p) for p in PROMPTS[:4]]
        assert any(r.migrations and r.migrations[0].from_shard == 1 for r in out)
        assert fleet.router.rerouted == 0


@pytest.mark.parametrize("how", ["its stream fails", "it is condemned"])
def test_a_stream_goes_on_with_no_break_and_no_repeated_token(settings, driver, how):
    with fake_fleet(settings(), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)

        async def run():
            items = []
            async for item in fleet.generate_stream(PROMPTS[0], max_new_tokens=TOKENS):
                items.append(item)
                if len(items) == 15:
                    victim = item.shard
                    name = fleet.handle(victim).name
                    if how == "its stream fails":
                        driver.set_dead(name, actor=False)
                    else:  # a probe streak condemned it while its stream hangs
                        driver.set_hung(name)
                        fleet.recovery.shard_lost(Member(name, victim), "probe streak")
            return items

        items = asyncio.run(run())
        deltas, result = items[:-1], items[-1]
        assert [t for d in deltas for t in d.token_ids] == expected(PROMPTS[0])
        assert result.token_ids == expected(PROMPTS[0]) and result.ok
        (m,) = result.migrations
        assert m.at_token >= 15 and len({d.shard for d in deltas}) == 2


def test_an_openai_client_stream_reads_one_continuous_answer_across_a_kill(fake_fleet_settings, driver):
    """The HTTP server's streamed and unstreamed routes, the official openai client in front: the
    streamed answer's token ids are one run with no break or repeat, the same as an unstreamed
    answer's, and the final chunk's nemo_gen names the move."""
    import openai

    from nemo_gen.server import start_server

    fleet = fake_fleet(fake_fleet_settings(
        fleet__name="fake-migrate-http", fleet__migration__checkpoint_s=0.01,
        server__port=0, generation__vllm_cfg__skip_tokenizer_init=True, generation__vllm_cfg__max_model_len=4096),
        driver)
    handle = start_server(fleet)
    try:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="x", max_retries=0)
        model = fleet.settings.model_name()
        stream = client.completions.create(model=model, prompt=[1, 2], max_tokens=TOKENS, stream=True,
                                           extra_body={"return_token_ids": True})
        ids, chunks = [], []
        for chunk in stream:
            chunks.append(chunk)
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []
            if len(ids) >= 15 and len(chunks) == 15:
                victim = next(s for s in fleet.status() if s.state == "healthy" and fleet.router.selector.inflight(s.index))
                driver.set_dead(fleet.handle(victim.index).name)
        assert ids == expected([1, 2])
        final = next(c for c in reversed(chunks) if getattr(c, "nemo_gen", None))
        assert final.nemo_gen["migrations"][0]["at_token"] >= 15
        # unstreamed, across a second kill (the fleet restarted the first shard): the same answer
        wait_until(lambda: fleet.health.serving_shards() == [0, 1], what="the fleet back at full strength")
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        full: list = []
        worker = threading.Thread(target=lambda: full.append(client.completions.create(
            model=model, prompt=[1, 2], max_tokens=TOKENS, extra_body={"return_token_ids": True})))
        worker.start()
        (slot,) = wait_until(lambda: next(((i,) for i in (0, 1) if fleet.router.selector.inflight(i)), None),
                             what="the request placed")
        kill_when(driver, fleet, slot, 20)
        worker.join(30)
        assert full[0].choices[0].token_ids == expected([1, 2])
        assert full[0].nemo_gen["migrations"][0]["at_token"] >= 10
    finally:
        handle.stop()
        fleet.shutdown()
