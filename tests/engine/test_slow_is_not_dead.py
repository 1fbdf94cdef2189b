"""Slow, busy and cancelled requests on real vLLM CPU engines: only dead condemns a shard.

Two fleets: a 2-shard fleet on vLLM's AsyncLLM (many requests per engine at once, as an RL loop
or the HTTP server drives it), with vLLM's own admission bound (``max_num_queued_reqs``), and a
1-shard fleet on the sync engine (the default; batches). Requests here are long on purpose:
``ignore_eos`` and thousands of tokens, so a deadline or a cancel lands mid-generation. What
the engine holds is read from vLLM itself (its output processor's request states, which an
abort removes; ``ShardActor.unfinished``), not from nemo_gen's own bookkeeping.

Before: a request past ``fleet.request_timeout_s`` condemned its shard and was re-routed with
no limit; vLLM's QueueOverflowError condemned its shard; cancelling ``generate_async`` or
disconnecting an HTTP client left the engine generating to the end; a stream its client left kept
its server slots (``server.max_in_flight``) for good."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from nemo_gen import GenerationFleet
from nemo_gen.errors import FleetBusy, RequestTimeout
from tests.helpers import shutdown_all, wait_until

pytestmark = pytest.mark.engine

LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 1.0}
QUEUE = 10  # vLLM's max_num_queued_reqs per async engine: unfinished (waiting + running) requests


@pytest.fixture(scope="module")
def fleets(ray_cluster, make_settings, tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    # The tiny model with room for long generations (the session's has 512 positions).
    model = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-4k", max_position_embeddings=4096)
    common = dict(model__path=str(model), generation__vllm_cfg__max_model_len=4096, health__probe_interval_s=1.0,
                  health__max_restart_attempts_per_shard=1)
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(GenerationFleet.launch, make_settings(
            fleet__name="slow-async", fleet__num_shards=2, generation__vllm_cfg__async_engine=True,
            generation__vllm_kwargs={"max_num_queued_reqs": QUEUE}, **common))
        s = pool.submit(GenerationFleet.launch, make_settings(fleet__name="slow-sync", fleet__num_shards=1, **common))
        out = {"async": a.result(), "sync": s.result()}
    yield out
    shutdown_all(out.values())


def held(fleet) -> dict[int, dict[str, int]]:
    """Per slot, what its engine holds now: engine request id -> tokens made (vLLM's own account,
    ``Unfinished`` on the wire)."""
    return {slot: ray.get(fleet.handle(slot).actor.call.remote("unfinished"), timeout=10).tokens()
            for slot in range(fleet.settings.fleet.num_shards)}


def untouched(fleet) -> bool:
    snap = fleet.health.snapshot()
    return all(s.state.value == "healthy" and s.restart_attempts == 0 for s in snap)


def settled(fleet, timeout_s: float = 30.0) -> None:
    wait_until(lambda: not any(held(fleet).values()), timeout_s, "the engines to hold no request")


def test_a_request_past_its_deadline_fails_alone_and_its_shard_serves_on(fleets):
    """A request whose deadline is a third of its generation time fails with RequestTimeout at
    its deadline; the engine stops generating it; the shard's other requests finish; the shard
    stays HEALTHY with 0 restarts."""
    fleet = fleets["async"]
    t0 = time.monotonic()
    whole = asyncio.run(fleet.generate_async("Once upon a time", **LONG))
    took = time.monotonic() - t0
    assert whole.ok and len(whole.token_ids) == 3000

    async def run():
        others = [asyncio.ensure_future(fleet.generate_async(p, max_new_tokens=64, ignore_eos=True))
                  for p in ("The quick brown fox", "Hello, my name is")]
        t = time.monotonic()
        with pytest.raises(RequestTimeout) as caught:
            await fleet.generate_async("A fleet of engines", timeout_s=took / 3, **LONG)
        failed_in = time.monotonic() - t
        mine = caught.value.shard
        # Aborted on its engine: no request of more than 64 tokens is left there well before it
        # could have finished. At its deadline it had made at most a third of its tokens, so
        # generating on it would hold it ~2/3 of `took` longer; gone within a third of `took`, it
        # was stopped. (A bound with its reason, not a latency target: every poll here is a Ray
        # call, which a loaded machine can hold for over a second; the 1 s of cancellation is
        # the next test's.)
        t = time.monotonic()
        await asyncio.to_thread(wait_until, lambda: not any(n > 64 for n in held(fleet)[mine].values()),
                                took / 3, "the long request aborted")
        return failed_in, mine, time.monotonic() - t, await asyncio.gather(*others)

    failed_in, shard, aborted_in, others = asyncio.run(run())
    assert took / 3 <= failed_in < took / 3 + 2.0, (failed_in, took)
    assert aborted_in < took / 3, (aborted_in, took)
    assert all(r.ok and len(r.token_ids) == 64 for r in others)
    assert untouched(fleet) and fleet.handle(shard) is not None
    settled(fleet)


def test_cancelled_requests_stop_on_their_engine_within_a_second(fleets):
    """16 long requests, 8 of them cancelled (task.cancel(), as an RL loop drops stragglers): the
    engines hold 8 within a second, the cancelled ones' token counts stop; n samples go together."""
    fleet = fleets["async"]

    async def run():
        tasks = [asyncio.ensure_future(fleet.generate_async(f"prompt {i}", **LONG)) for i in range(16)]
        await asyncio.to_thread(wait_until, lambda: sum(map(len, held(fleet).values())) == 16, 60, "16 requests held")
        before = {rid for h in held(fleet).values() for rid in h}
        for task in tasks[:8]:
            task.cancel()
        t0 = time.monotonic()
        await asyncio.to_thread(wait_until, lambda: sum(map(len, held(fleet).values())) == 8, 5, "8 requests held")
        dropped_in = time.monotonic() - t0
        after = {rid: n for h in held(fleet).values() for rid, n in h.items()}
        await asyncio.sleep(0.5)
        later = {rid: n for h in held(fleet).values() for rid, n in h.items()}
        for task in tasks[8:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return before, after, later, dropped_in

    before, after, later, dropped_in = asyncio.run(run())
    assert dropped_in < 1.0, dropped_in
    assert set(after) == set(later) and set(after) < before  # the 8 gone stay gone
    assert all(later[r] > after[r] for r in after)  # the other 8 kept generating meanwhile
    settled(fleet, 5)

    async def n_samples():  # one request of 4 samples: vLLM runs them as 4 child requests
        task = asyncio.ensure_future(fleet.generate_async("Four of them", n=4, **LONG))
        await asyncio.to_thread(wait_until, lambda: sum(map(len, held(fleet).values())) == 4, 60, "4 samples held")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: not any(held(fleet).values()), 1.0, "all 4 samples gone")

    asyncio.run(n_samples())
    assert untouched(fleet)


def test_vllms_full_queue_is_busy_never_dead(fleets):
    """Each async engine admits QUEUE unfinished requests (vLLM's max_num_queued_reqs); with
    both full, one more is refused by each (QueueOverflowError, 503) and fails with FleetBusy;
    no shard is condemned, and once the queues drain the fleet serves again."""
    fleet = fleets["async"]

    async def run():
        fill = [asyncio.ensure_future(fleet.generate_async(f"fill {i}", **LONG)) for i in range(2 * QUEUE)]
        await asyncio.to_thread(wait_until, lambda: sum(map(len, held(fleet).values())) == 2 * QUEUE, 60,
                                "both queues full")
        t0 = time.monotonic()
        with pytest.raises(FleetBusy, match="busy shards"):
            await fleet.generate_async("one too many", max_new_tokens=8)
        refused_in = time.monotonic() - t0
        for task in fill:
            task.cancel()
        await asyncio.gather(*fill, return_exceptions=True)
        return refused_in

    refused_in = asyncio.run(run())
    assert refused_in < 10  # a few backoffs (fleet.busy_backoff_s doubling), never a deadline
    assert fleet.router.refused >= 2 and untouched(fleet)
    settled(fleet)
    assert asyncio.run(fleet.generate_async("served again", max_new_tokens=8)).ok


def test_the_sync_engine_aborts_a_batch_past_its_deadline_and_serves_on(fleets):
    fleet = fleets["sync"]
    t0 = time.monotonic()
    results = fleet.generate(["Once upon a time", "The quick brown fox"], timeout_s=1.0, **LONG)
    took = time.monotonic() - t0
    assert all(not r.ok and r.error.startswith("RequestTimeout") for r in results), [r.error for r in results]
    assert took < 5
    wait_until(lambda: not held(fleet)[0], 1.0, "the batch aborted on the engine")
    assert untouched(fleet)

    async def cancel_one():  # a cancelled awaitable on the sync engine stops its batch too
        task = asyncio.ensure_future(fleet.generate_async("Hello, my name is", **LONG))
        await asyncio.to_thread(wait_until, lambda: held(fleet)[0], 30, "the request on the engine")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(wait_until, lambda: not held(fleet)[0], 1.0, "the request aborted")

    asyncio.run(cancel_one())
    ok = fleet.generate(["A fleet of engines"], max_new_tokens=8)
    assert ok[0].ok and untouched(fleet)


def test_a_disconnecting_http_client_cancels_its_request_on_the_engine(fleets):
    """The official openai client with a short timeout gives up on a long completion, streamed
    and not: the server cancels the request, and the engine holds nothing within a second."""
    import openai

    from nemo_gen.server import start_server

    fleet = fleets["async"]
    handle = start_server(fleet, fleet.settings.model_copy(
        update={"server": fleet.settings.server.model_copy(update={"port": 0})}))
    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", timeout=1.0, max_retries=0)
        model = fleet.settings.model_name()
        with pytest.raises(openai.APITimeoutError):  # not streamed: the client's timeout closes the connection
            client.completions.create(model=model, prompt="Once upon a time", max_tokens=3000,
                                      extra_body={"ignore_eos": True})
        t0 = time.monotonic()
        wait_until(lambda: not any(held(fleet).values()), 3.0, "the engine to drop the request")
        assert time.monotonic() - t0 < 1.0
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Go on"}],
                                                max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream)) for _ in range(3)]  # streaming for real, then the client goes away
        assert chunks and any(held(fleet).values())
        stream.close()
        t0 = time.monotonic()
        wait_until(lambda: not any(held(fleet).values()), 3.0, "the engine to drop the streamed request")
        assert time.monotonic() - t0 < 1.0
        assert untouched(fleet)
    finally:
        handle.stop()


def test_streams_abandoned_mid_way_give_back_their_slots_and_their_sessions_turn(fleets):
    """Streams left mid-way through the official openai client (``break``, then close), and a
    gateway session's streamed turn left alike: the server holds none of their
    ``server.max_in_flight`` slots, the engines hold none of their requests, and the session takes
    its next turn. Before: each stream's slots were held for good (here the whole bound, so every
    later request was a 503) and the session answered 409 to every later turn, never expiring.
    The fake tier's 50-stream and stalled-reader cases: tests/fake/test_server_streams.py."""
    import httpx
    import openai

    from nemo_gen.server import start_server

    fleet = fleets["async"]
    server = fleet.settings.server.model_copy(update={"port": 0, "max_in_flight": 8})
    handle = start_server(fleet, fleet.settings.model_copy(update={"server": server}))
    app = handle.server.config.app.app  # inside the Gate middleware
    api, gateway = app.state.gateway.api, app.state.gateway
    model = fleet.settings.model_name()

    def abandon(stream, chunks: int = 5) -> None:
        for k, _ in enumerate(stream):
            if k + 1 == chunks:
                break
        stream.close()

    try:
        client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0, timeout=60)
        for _ in range(4):  # 4 x n=2: the whole bound of 8
            abandon(client.completions.create(model=model, prompt="Once upon a time", max_tokens=3000, n=2,
                                              stream=True, extra_body={"ignore_eos": True}))
        wait_until(lambda: api.inflight.held == 0, 10, "the abandoned streams' slots given back")
        settled(fleet, 10)
        created = httpx.post(handle.url + "/nemo_gen/sessions").json()
        agent = openai.OpenAI(base_url=created["url"], api_key="none", max_retries=0, timeout=60)
        hi = [{"role": "user", "content": "Tell me a story"}]
        abandon(agent.chat.completions.create(model=model, messages=hi, max_tokens=3000, stream=True,
                                              extra_body={"ignore_eos": True}))
        wait_until(lambda: not gateway.table._entries[created["id"]].busy, 10, "the abandoned turn ended")
        answer = agent.chat.completions.create(model=model, messages=hi, max_tokens=4)  # not a 409
        assert answer.choices[0].finish_reason == "length" and api.inflight.held == 0
        out = client.completions.create(model=model, prompt="Hello", max_tokens=2, n=8)  # the whole bound: free
        assert len(out.choices) == 8
        settled(fleet, 10)
        assert untouched(fleet)
    finally:
        handle.stop()
