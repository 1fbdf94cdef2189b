"""Refit while requests run, on real vLLM CPU engines (refit.in_flight): long generations with a
refit landing mid-way in each mode. Every prompt gets exactly one result with no error, and its
weight_versions spans sum to its token count; in keep and abort the refit returns before the
generation ends and some results span two versions, in drain none does; with
resume_aborted false the partial results come back with finish_reason "abort"; after a version
change a repeated prompt is not answered from the old version's prefix cache (its tokens equal a
fresh engine's on the new weights).

The same on the async engine (vLLM's AsyncLLM, ``generation.vllm_cfg.async_engine``), where keep
freezes the requests with vLLM's pause, and a cut that resumes — abort, keep past max_staleness,
refit.recompute_kv — is vLLM's preemption: each request goes on from its tokens with its KV
recomputed on the new weights, so its tokens after the cut are a fresh engine's continuation.

Three fleets for the module, started together: the two under test (one shard each, sync and
async, refit back and forth between the tiny model and model B) and a fresh engine on model B,
the reference."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.tiny_model import make_tiny_model
from tests.helpers import wait_until

pytestmark = pytest.mark.engine

# Prompts longer than a KV block (16 tokens), so their prefix is cached and could be reused.
PROMPTS = [f"{w} the quick brown fox jumps over the lazy dog while a fleet of engines keeps serving"
           for w in ("One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight")]
# As long as the tiny model's 512 positions allow, so that a refit lands well inside the batch.
TOKENS = 400


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("inflight-models") / "tiny-b", seed=1)


@pytest.fixture(scope="module")
def fleets(ray_cluster, make_settings, model_b):
    common = dict(fleet__num_shards=1, health__probe_interval_s=60, generation__vllm_cfg__max_model_len=512)
    with ThreadPoolExecutor(3) as pool:
        main = pool.submit(GenerationFleet.launch, make_settings(fleet__name="inflight", **common))
        on_async = pool.submit(GenerationFleet.launch, make_settings(
            fleet__name="inflight-async", generation__vllm_cfg__async_engine=True, **common))
        fresh = pool.submit(GenerationFleet.launch, make_settings(fleet__name="inflight-b", model__path=str(model_b),
                                                                  **common))
        fleets = {"main": main.result(), "async": on_async.result(), "fresh_b": fresh.result()}
    yield fleets
    for f in fleets.values():
        f.shutdown()


@pytest.fixture
def fleet(fleets, tiny_model_dir):
    """The fleet under test, back on the tiny model after each test whatever the test did (a
    test that failed half-way must not hand the next one model B's weights as its "before"), and
    on its refit settings."""
    yield from restored_after(fleets["main"], tiny_model_dir)


@pytest.fixture
def async_fleet(fleets, tiny_model_dir):
    """The async engine's fleet, back on the tiny model and its settings after each test."""
    yield from restored_after(fleets["async"], tiny_model_dir)


def restored_after(fleet, tiny_model_dir):
    """Yield ``fleet``; then put back its refit settings and the tiny model's weights."""
    refit = fleet.settings.refit.model_copy()
    yield fleet
    fleet.settings.refit = refit
    fleet.refit(str(tiny_model_dir))


LAST: dict = {}  # generate_then_refit's last observation of the shard


def generate_then_refit(fleet, source, mode, **sampling):
    """Start a long batch, refit once it is well under way; (results, refit report, when the
    refit returned, when the batch's results were back here). ``LAST["generating"]``: whether
    the shard still ran the batch when the refit returned, asked of the shard itself."""
    done: dict = {}
    sampling = {"temperature": 0, **sampling}

    def run():
        done["results"] = fleet.generate(PROMPTS, max_new_tokens=TOKENS, ignore_eos=True, **sampling)
        done["at"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    # Synchronised on the engine's own progress: the batch is running and past its first steps.
    wait_until(lambda: (info := fleet.driver.info(fleet.handle(0))).generating and info.batch_steps >= 5,
               120, "the batch to be under way")
    t0 = time.monotonic()
    report = fleet.refit(source, in_flight=mode)
    refit_at = time.monotonic()
    LAST["generating"] = fleet.driver.info(fleet.handle(0)).generating
    print(f"{mode}: refit {refit_at - t0:.3f}s", end=" ")
    thread.join(300)
    assert not thread.is_alive()
    print(f"batch ended {done['at'] - refit_at:+.3f}s after the refit returned")
    return done["results"], report, refit_at, done["at"]


def check_whole(results, report):
    assert [r.index for r in results] == list(range(len(PROMPTS)))
    assert all(r.ok for r in results), [r.error for r in results]
    for r in results:
        assert sum(n for _, n in r.weight_versions) == len(r.token_ids)
        assert r.weight_version == r.weight_versions[-1][0]
    assert [s.ok for s in report.shards] == [True]


def resumed_on_fresh_kv(fleet, fresh, source, mode):
    """A refit in ``mode`` lands on a long batch whose requests it resumes with recomputed KV: it
    returns first, every result is whole, its tokens span the old version then the new one, and
    after the cut they go on as a fresh engine on the new weights would (``continues_as_fresh``)."""
    before = fleet.weight_version
    results, report, refit_at, batch_at = generate_then_refit(fleet, source, mode)
    check_whole(results, report)
    assert refit_at < batch_at
    assert all(len(r.token_ids) == TOKENS and r.finish_reason == "length" for r in results)
    assert all([v for v, _ in r.weight_versions] == [before, report.version] for r in results), \
        [r.weight_versions for r in results]
    continues_as_fresh(results, fresh)


def continues_as_fresh(results, fresh, check=16):
    """Each of the first two results' tokens after its cut are what a fresh engine on the new
    weights makes from its prompt and the tokens it had: its KV was recomputed, not kept."""
    cut = [r.weight_versions[0][1] for r in results[:2]]
    prefixes = [list(r.prompt_token_ids) + r.token_ids[:k] for r, k in zip(results, cut)]
    reference = fresh.generate(prefixes, temperature=0, max_new_tokens=check, ignore_eos=True)
    assert [r.token_ids[k:k + check] for r, k in zip(results, cut)] == [ref.token_ids for ref in reference]


def test_drain_waits_for_the_batch_and_nothing_spans_two_versions(fleet, model_b):
    before = fleet.weight_version
    results, report, refit_at, batch_at = generate_then_refit(fleet, str(model_b), "drain")
    check_whole(results, report)
    # The load waited for the batch to finish: when the refit returned, the shard ran no batch.
    # (Not "before generate returned here": the results' trip back and their decoding in this
    # process may end after the refit's load.)
    assert LAST["generating"] is False
    assert {tuple(r.weight_versions) for r in results} == {((before, TOKENS),)}


@pytest.mark.parametrize("engine", ["fleet", "async_fleet"])
def test_keep_swaps_under_the_running_requests_and_results_span_both_versions(engine, request, model_b):
    fleet = request.getfixturevalue(engine)  # the sync engine's fleet, then the async one's
    before = fleet.weight_version
    results, report, refit_at, batch_at = generate_then_refit(fleet, str(model_b), "keep")
    check_whole(results, report)
    assert refit_at < batch_at  # the refit did not wait for the requests
    assert all(len(r.token_ids) == TOKENS and r.finish_reason == "length" for r in results)
    two = [r.weight_versions for r in results if len(r.weight_versions) == 2]
    assert two, [r.weight_versions for r in results]
    assert all(spans[0][0] == before and spans[1][0] == report.version for spans in two)


def test_abort_resumes_each_request_on_the_new_weights(fleet, model_b):
    before = fleet.weight_version
    results, report, refit_at, batch_at = generate_then_refit(fleet, str(model_b), "abort")
    check_whole(results, report)
    assert refit_at < batch_at
    assert all(len(r.token_ids) == TOKENS and r.finish_reason == "length" for r in results)
    assert all(r.weight_versions[-1][0] == report.version for r in results)
    assert any(r.weight_versions[0][0] == before for r in results)  # some tokens came from before the cut


def test_abort_resumes_every_sample_of_a_group(fleet, model_b):
    """A GRPO group (n samples of one prompt, vLLM's child requests) cut mid-batch: each sample
    goes on from its own tokens and ends complete, its spans covering every token."""
    before = fleet.weight_version
    results, report, refit_at, batch_at = generate_then_refit(fleet, str(model_b), "abort", n=2, temperature=1.0,
                                                              seed=7)
    check_whole(results, report)
    assert refit_at < batch_at
    samples = [s for r in results for s in r.samples]
    assert len(samples) == 2 * len(PROMPTS)
    assert all(len(s.token_ids) == TOKENS and s.finish_reason == "length" for s in samples)
    assert all(sum(n for _, n in s.weight_versions) == TOKENS and s.weight_versions[-1][0] == report.version
               for s in samples), [s.weight_versions for s in samples]
    assert any(s.weight_versions[0][0] == before for s in samples)


@pytest.mark.parametrize("engine", ["fleet", "async_fleet"])
def test_abort_without_resume_returns_the_partial_results(engine, request, model_b):
    fleet = request.getfixturevalue(engine)
    fleet.settings.refit.resume_aborted = False
    results, report, _, _ = generate_then_refit(fleet, str(model_b), "abort")
    check_whole(results, report)
    cut = [r for r in results if r.finish_reason == "abort"]
    assert cut and all(0 < len(r.token_ids) < TOKENS for r in cut)
    assert all(r.weight_versions[-1][0] != report.version for r in cut)  # no token from the new weights


def test_keep_past_max_staleness_resumes_each_request_on_fresh_kv(fleet, fleets, model_b):
    """refit.max_staleness 0: every running request has tokens from the old weights, so each is
    cut and resumed: its tokens after the cut are what a fresh engine on the new weights makes
    from its prompt and the tokens it had (its prefix re-computed, not kept as in plain keep)."""
    fleet.settings.refit.max_staleness = 0
    resumed_on_fresh_kv(fleet, fleets["fresh_b"], str(model_b), "keep")


@pytest.mark.parametrize("engine", ["fleet", "async_fleet"])
def test_keep_with_recompute_kv_goes_on_as_a_fresh_engine_would(engine, request, fleets, model_b):
    """refit.recompute_kv: the running requests are kept, and vLLM preempts them so their KV is
    recomputed on the new weights as they resume."""
    fleet = request.getfixturevalue(engine)
    fleet.settings.refit.recompute_kv = True
    resumed_on_fresh_kv(fleet, fleets["fresh_b"], str(model_b), "keep")


def test_after_a_version_change_no_prompt_is_answered_from_the_old_cache(fleet, fleets, model_b):
    fresh = fleets["fresh_b"]
    # Prompts of several KV blocks (the CPU backend's blocks are 128 tokens): their prefix is cached.
    long = [" ".join([p] * 8) for p in PROMPTS[:2]]
    probe = fleet.generate(long, max_new_tokens=1)
    assert all(r.ok for r in probe) and 256 < min(len(r.prompt_token_ids) for r in probe) < 480, \
        [len(r.prompt_token_ids) for r in probe]
    fleet.generate(long, temperature=0, max_new_tokens=8)  # the old weights' KV, cached
    results, report, _, _ = generate_then_refit(fleet, str(model_b), "keep")
    again = fleet.generate(long, temperature=0, max_new_tokens=16)
    reference = fresh.generate(long, temperature=0, max_new_tokens=16)
    assert {r.weight_version for r in again} == {report.version}
    assert [r.token_ids for r in again] == [r.token_ids for r in reference]


def test_async_abort_resumes_each_request_on_the_new_weights(async_fleet, fleets, model_b):
    resumed_on_fresh_kv(async_fleet, fleets["fresh_b"], str(model_b), "abort")


def test_async_stream_across_a_keep_refit_tells_each_token_its_version(async_fleet, model_b):
    """A streamed request on the async engine with a refit landing mid-stream: its deltas' spans,
    laid end to end, are the result's, and they change version once."""
    from nemo_gen.core.results import Delta

    before, items = async_fleet.weight_version, []

    async def read():
        async for item in async_fleet.generate_stream(PROMPTS[0], max_new_tokens=TOKENS, ignore_eos=True,
                                                      temperature=0):
            items.append(item)

    thread = threading.Thread(target=asyncio.run, args=(read(),))
    thread.start()
    wait_until(lambda: sum(len(i.token_ids) for i in items if isinstance(i, Delta)) >= 20, 120,
               "the stream to be under way")
    report = async_fleet.refit(str(model_b), in_flight="keep")
    thread.join(300)
    assert not thread.is_alive()
    deltas, result = [i for i in items if isinstance(i, Delta)], items[-1]
    assert result.ok and len(result.token_ids) == TOKENS
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    spans: list[list] = []
    for d in deltas:
        for version, count in d.weight_versions:
            if spans and spans[-1][0] == version:
                spans[-1][1] += count
            else:
                spans.append([version, count])
    assert [tuple(s) for s in spans] == [tuple(s) for s in result.weight_versions]
    assert [v for v, _ in result.weight_versions] == [before, report.version], result.weight_versions


def test_the_async_engine_returns_what_the_sync_engine_does_and_counts_steps(fleets):
    """The async engine's batches ask vLLM for each request's final output only: the same
    seeded batch (n samples, the sampled tokens' logprobs, the prompts' logprobs) on the sync and
    the async engine gives the same token ids, logprobs, finish reasons and version spans; and the
    async engine's progress (a probe's evidence) counts engine steps, not one per request per step."""
    sync, on_async = fleets["main"], fleets["async"]
    tokens, kw = 24, dict(temperature=1.0, n=2, seed=7, logprobs=0, prompt_logprobs=1)
    want = sync.generate(PROMPTS, max_new_tokens=tokens, **kw)
    got = on_async.generate(PROMPTS, max_new_tokens=tokens, **kw)
    assert all(r.ok for r in want + got), [r.error for r in want + got]
    for a, b in zip(want, got):
        assert len(a.samples) == len(b.samples) == 2
        for x, y in zip(a.samples, b.samples):
            assert x.token_ids == y.token_ids and len(x.token_ids) > 0
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4) and len(y.logprobs) == len(y.token_ids)
            assert x.finish_reason == y.finish_reason
            assert [n for _, n in x.weight_versions] == [n for _, n in y.weight_versions] == [len(y.token_ids)]
        assert b.weight_versions == [(on_async.weight_version, len(b.token_ids))]
        assert b.prompt_logprobs is not None and len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert [e is None for e in a.prompt_logprobs] == [e is None for e in b.prompt_logprobs]
    # One step clock tick per engine step (about one a token), not one per request output a step.
    steps = on_async.driver.info(on_async.handle(0)).batch_steps
    assert 0 < steps <= tokens + 4, steps


def test_in_flight_settings_on_both_engines(make_settings):
    from nemo_gen.errors import ConfigError

    for engine in (False, True):
        settings = make_settings(refit__in_flight="keep", refit__recompute_kv=True,
                                 generation__vllm_cfg__async_engine=engine)
        assert settings.refit.in_flight == "keep" and settings.refit.recompute_kv
    with pytest.raises(ConfigError, match="refit.recompute_kv"):  # nothing to recompute: it could not act
        make_settings(refit__in_flight="drain", refit__recompute_kv=True)
