"""Token streaming's routing rules on a fake driver (tests/fakes.py: FakeStream): what the router's
``generate_stream`` hands out, re-routing of a shard lost before the first token, the error naming
the shard lost after it, the shard's load while a stream is read, cancellation, sessions, and the
per-token weight-version spans of a refit landing mid-stream. The engine paths (vLLM's deltas
through a Ray streaming generator) are tested in tests/e2e/test_serve.py; the pure pieces that cut
deltas out of a request's track (nemo_gen.shard.streaming) at the end of this file."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.results import Delta, GenerationRequest, GenerationResult
from nemo_gen.core.wire import SampleDelta
from nemo_gen.errors import RequestError, ShardDiedError
from nemo_gen.shard.batch import Track, sampled_by
from nemo_gen.shard.streaming import Cursor, merge, span_slice
from tests import helpers
from tests.fakes import fake_fleet


@pytest.fixture
def settings(make_settings):
    def make(**overrides):
        base = dict(fleet__name="fake-stream", fleet__num_shards=2, health__probe_interval_s=60,
                    health__auto_recover=False, health__reap_timeout_s=0.1)
        base.update(overrides)
        return make_settings(**base)
    return make


def expected_ids(prompt, n, k=0):
    return [(sum(prompt) + k + i) % 97 for i in range(n)]


async def collect(stream):
    return [event async for event in stream]


def streaming_slot(fleet, timeout_s=10.0) -> int:
    """The slot a stream just started on (the only one holding a request)."""
    helpers.wait_until(lambda: any(fleet.router.selector.inflight(s) for s in (0, 1)), timeout_s, "a stream placed",
                       poll_s=0.005)
    return next(s for s in (0, 1) if fleet.router.selector.inflight(s))


def test_a_stream_is_deltas_then_the_same_result_as_generate_async(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        events = asyncio.run(collect(fleet.generate_stream([1, 2, 3], max_new_tokens=5, n=2)))
        whole = asyncio.run(fleet.generate_async([1, 2, 3], max_new_tokens=5, n=2))
    *deltas, result = events
    assert all(isinstance(d, Delta) for d in deltas) and isinstance(result, GenerationResult)
    for k in (0, 1):
        mine = [d for d in deltas if d.sample == k]
        assert [t for d in mine for t in d.token_ids] == expected_ids([1, 2, 3], 5, k) == whole.samples[k].token_ids
        assert [d.finish_reason for d in mine] == [None] * 4 + ["length"]
        assert {d.shard for d in mine} == {result.shard}
    assert [s.token_ids for s in result.samples] == [s.token_ids for s in whole.samples]
    assert result.weight_versions == whole.weight_versions == [(0, 5)]


def test_a_shard_lost_before_the_first_token_is_re_routed_unseen(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        for handle in fleet.shards:
            driver.set_slow(handle.name, 30)  # no first token from either until the test says so

        async def main():
            task = asyncio.ensure_future(collect(fleet.generate_stream([4, 5], max_new_tokens=6)))
            victim = await asyncio.to_thread(streaming_slot, fleet)
            driver.set_slow(fleet.handle(1 - victim).name, 0)
            driver.set_dead(fleet.handle(victim).name)  # its watch fires: the ledger condemns it
            return victim, await asyncio.wait_for(task, 10)

        victim, events = asyncio.run(main())
        *deltas, result = events
        assert [t for d in deltas for t in d.token_ids] == expected_ids([4, 5], 6) == result.token_ids
        assert {d.shard for d in deltas} == {result.shard} == {1 - victim}
        assert fleet.router.rerouted == 1 and fleet.health.state_of(victim) is ShardState.DEAD
        assert driver.shard(fleet.handle(victim)).streams[0].cancelled  # the lost call is ended there


@pytest.mark.parametrize("how", ["its stream fails", "it is condemned"])
def test_without_migration_a_shard_lost_mid_stream_ends_the_stream_with_an_error_naming_it(settings, driver, how):
    """fleet.migration off (with it on, the stream goes on: tests/unit/test_migration_fleet.py)."""
    with fake_fleet(settings(fleet__migration__mode="off"), driver) as fleet:
        for handle in fleet.shards:
            driver.set_token_s(handle.name, 0.02)

        async def main():
            got = []
            with pytest.raises(ShardDiedError) as info:
                async for event in fleet.generate_stream([7], max_new_tokens=200):
                    got.append(event)
                    if len(got) == 3:
                        victim = got[0].shard
                        name = fleet.handle(victim).name
                        if how == "its stream fails":  # the engine died: the call itself fails
                            driver.set_dead(name, actor=False)
                        else:  # a probe streak condemned it while the stream hangs
                            driver.set_hung(name)
                            fleet.recovery.shard_lost(Member(name, victim), "probe streak")
            return got, info.value

        got, error = asyncio.run(main())
        victim = got[0].shard
        assert error.shard == victim and f"shard {victim}" in str(error) and "mid-stream after" in str(error)
        assert 3 <= len(got) < 200 and all(isinstance(d, Delta) and d.shard == victim for d in got)
        assert fleet.health.state_of(victim) is ShardState.DEAD
        assert fleet.router.rerouted == 0 and fleet.router.selector.inflight(victim) == 0
        assert driver.shard(fleet.handle(1 - victim)).streams == []  # nothing was sent again


def test_a_stream_holds_its_shard_until_it_ends_and_closing_it_cancels_the_call(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        for handle in fleet.shards:
            driver.set_token_s(handle.name, 0.01)

        async def main():
            stream = fleet.generate_stream([9, 9], max_new_tokens=500)
            first = await stream.__anext__()
            held = fleet.router.selector.inflight(first.shard)
            await stream.aclose()
            return first, held

        first, held = asyncio.run(main())
        assert held == 1 and fleet.router.selector.inflight(first.shard) == 0
        (call,) = driver.shard(fleet.handle(first.shard)).streams
        assert call.cancelled and call.sent < 500


def test_bad_requests_fail_before_anything_streams(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        with pytest.raises(RequestError):
            fleet.generate_stream("x", no_such_keyword=1)
        (only,) = asyncio.run(collect(fleet.generate_stream(list(range(1, 600)))))  # past max_model_len
        assert isinstance(only, GenerationResult) and "max_model_len" in only.error
        assert all(driver.shard(h).streams == [] for h in fleet.shards)


def test_a_streamed_session_stays_on_its_shard(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        first = asyncio.run(collect(fleet.generate_stream([1], session_id="chat-1", max_new_tokens=2)))[-1]
        for turn in range(3):
            asyncio.run(fleet.generate_async([2 + turn]))  # other traffic in between
            again = asyncio.run(collect(fleet.generate_stream([1, turn], session_id="chat-1", max_new_tokens=2)))[-1]
            assert again.shard == first.shard
        assert fleet.router.session_shard("chat-1") == first.shard


def test_a_refit_landing_mid_stream_shows_in_the_deltas_and_the_result(settings, driver, tmp_path):
    """Under ``keep`` (the shard's rule: a drain would wait for the stream to end)."""
    import torch

    with fake_fleet(settings(refit__staging_dir=str(tmp_path), refit__in_flight="keep"), driver) as fleet:
        for handle in fleet.shards:
            driver.set_token_s(handle.name, 0.02)

        async def main():
            got = []
            async for event in fleet.generate_stream([3, 1], max_new_tokens=30):
                got.append(event)
                if len(got) == 5:
                    await asyncio.to_thread(fleet.refit, {"w": torch.ones(4, 4), "b": torch.ones(4)})
            return got

        *deltas, result = asyncio.run(main())
    spans = [s for d in deltas for s in d.weight_versions]
    assert spans[0] == (0, 1) and spans[-1] == (1, 1)
    assert sum(n for _, n in spans) == 30
    assert result.weight_versions[0][0] == 0 and result.weight_versions[-1][0] == 1
    assert sum(n for _, n in result.weight_versions) == 30 and result.weight_version == 1


# -- the pure pieces ----------------------------------------------------------------------------

def _comp(index, tokens, text="", finish=None):
    return SimpleNamespace(index=index, token_ids=tokens, logprobs=None, text=text, finish_reason=finish)


def test_a_cursor_cuts_what_came_since_its_last_call_with_the_versions_that_made_it():
    req = GenerationRequest(index=0, prompt_token_ids=[1, 2])
    track = Track.start(req, SimpleNamespace(n=2, max_tokens=4), "r", "i")
    cursor = Cursor(track)
    track.observe("r", SimpleNamespace(outputs=[_comp(0, [5, 6], "ab")], finished=False), sampled_by(0))
    assert cursor.deltas() == [SampleDelta(0, [5, 6], "ab", [], ((0, 2),), None)]
    assert cursor.deltas() == []  # nothing new
    track.observe("r", SimpleNamespace(outputs=[_comp(0, [7], "c"), _comp(1, [8], "d")], finished=False),
                  sampled_by(1))
    assert [(d.sample, d.token_ids, d.weight_versions) for d in cursor.deltas()] == [
        (0, [7], ((1, 1),)), (1, [8], ((1, 1),))]
    track.observe("r", SimpleNamespace(outputs=[_comp(0, [9], "e", "length"), _comp(1, [], "", "stop")],
                                       finished=True), sampled_by(1))
    assert [(d.sample, d.token_ids, d.finish_reason) for d in cursor.deltas()] == [
        (0, [9], "length"), (1, [], "stop")]
    assert cursor.deltas() == []


def test_a_final_only_track_cut_without_resume_closes_from_what_the_engine_holds():
    """An unstreamed batch's request reports only its final output: a cut that does not resume
    reads what each sample had made (``Piece``s, as vLLM's request state holds them) and closes
    the partial result, the unfinished samples ending with "abort"."""
    from nemo_gen.shard.batch import Piece

    req = GenerationRequest(index=3, prompt_token_ids=[1, 2])
    track = Track.start(req, SimpleNamespace(n=2, max_tokens=5), "r", "i", final_only=True)
    pieces = {0: Piece([5, 6, 7], None, "abc", [(0, 2), (1, 1)], None),
              1: Piece([8, 9, 4, 4, 4], None, "dexxx", [(0, 5)], "length")}  # sample 1 finished
    assert track.stale_tokens(1) == 0  # nothing absorbed yet: the track alone knows of no token
    assert track.stale_tokens(1, pieces) == 5
    track.absorb(pieces)
    result = track.abandon()
    assert result.index == 3 and track.result is result
    first, second = result.samples
    assert first.token_ids == [5, 6, 7] and first.text == "abc" and first.finish_reason == "abort"
    assert first.weight_versions == ((0, 2), (1, 1))
    assert second.token_ids == [8, 9, 4, 4, 4] and second.finish_reason == "length"


def test_spans_between_cuts_a_samples_labels_to_a_delta():
    from nemo_gen.shard.batch import spans_between

    starts = [("a", 0), ("b", 5)]  # label a from token 0, b from token 5
    assert spans_between(starts, 0, 3) == [("a", 3)]
    assert spans_between(starts, 3, 8) == [("a", 2), ("b", 3)]
    assert spans_between(starts, 6, 9) == [("b", 3)]
    assert spans_between([], 0, 4) == [(None, 4)]  # no label reported: the caller's default
    assert spans_between([("b", 2)], 0, 4) == [(None, 2), ("b", 2)]
    assert spans_between(starts, 4, 4) == []


def test_merging_deltas_joins_each_samples_tokens_and_spans_in_order():
    d = lambda k, ids, v, fin=None: SampleDelta(k, ids, "x" * len(ids), [0.0] * len(ids), ((v, len(ids)),), fin)  # noqa: E731
    merged = merge([d(0, [1], 0), d(1, [2], 0), d(0, [3, 4], 0), d(0, [5], 1, "length")])
    assert [m.sample for m in merged] == [0, 1]
    assert merged[0].token_ids == [1, 3, 4, 5] and merged[0].text == "xxxx"
    assert merged[0].weight_versions == ((0, 3), (1, 1)) and merged[0].finish_reason == "length"
    assert merged[1].token_ids == [2] and merged[1].finish_reason is None
    assert span_slice([[0, 3], [1, 4]], 2, 5) == ((0, 1), (1, 2)) and span_slice([[0, 3]], 3, 3) == ()
