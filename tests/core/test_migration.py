"""Migration's rules (``nemo_gen.core.migration``), pure: checkpoints kept and merged, a lost
request's continuations (prompt + kept tokens, fewer tokens to make, one per unfinished sample),
answers joined to what was kept with every token's logprob and version span, the moves recorded,
and which losses count as re-routes (those that kept no token)."""

from __future__ import annotations

from nemo_gen.core.migration import Checkpoints, Kept, MigrationMode, Migrations, span_prefix
from nemo_gen.core.results import GenerationRequest, GenerationResult, Moved
from nemo_gen.core.wire import RequestProgress, RequestResult, SampleProgress, SampleResult, Sampling

SAMPLING = Sampling(max_new_tokens=10, temperature=0.0)


def progress(key, start, ids, version=1, sample=0, finish=None):
    return RequestProgress(key, (SampleProgress(sample, start, list(ids), [-0.5] * len(ids), ((version, len(ids)),),
                                                finish),))


def test_the_mode_is_an_enum_of_off_and_on_and_a_cadence_with_it_off_is_refused():
    import pytest
    from pydantic import ValidationError

    from nemo_gen.settings import NemoGenSettings

    assert [m.value for m in MigrationMode] == ["off", "on"]
    s = NemoGenSettings(fleet={"migration": {"mode": "off"}})
    assert s.fleet.migration.mode is MigrationMode.OFF
    assert NemoGenSettings().fleet.migration.mode is MigrationMode.ON  # the default
    with pytest.raises(ValidationError, match="checkpoint_s is set but fleet.migration.mode is off"):
        NemoGenSettings(fleet={"migration": {"mode": "off", "checkpoint_s": 0.5}})
    with pytest.raises(ValidationError):
        NemoGenSettings(fleet={"migration": {"mode": "sometimes"}})


def test_checkpoints_merge_from_what_is_known_and_ask_from_the_least_advanced_sample():
    cp = Checkpoints()
    assert cp.known(["a"]) == (("a", 0),)
    cp.apply([progress("a", 0, [1, 2, 3])])
    cp.apply([progress("a", 3, [4, 5], version=2)])
    assert cp.known(["a"]) == (("a", 5),)
    cp.apply([progress("a", 2, [9, 9, 9, 9], version=2)])  # a repeat from an earlier point replaces what follows
    (k,) = cp.take("a")
    assert k.token_ids == [1, 2, 9, 9, 9, 9] and k.spans == [[1, 2], [2, 4]] and len(k.logprobs) == 6
    assert cp.take("a") == []  # taken: forgotten


def test_a_checkpoint_past_a_gap_is_skipped_and_a_torn_one_keeps_the_shorter_of_ids_and_logprobs():
    k = Kept()
    k.apply(SampleProgress(0, 5, [1, 2], [0.0, 0.0], ((1, 2),)))
    assert k.token_ids == []
    k.apply(SampleProgress(0, 0, [1, 2, 3], [0.0, 0.0], ((1, 3),), "stop"))  # read while the engine stepped
    assert k.token_ids == [1, 2] and k.spans == [[1, 2]] and k.finish_reason is None


def test_span_prefix():
    assert span_prefix([[1, 3], [2, 4]], 5) == [[1, 3], [2, 2]]
    assert span_prefix([[1, 3]], 0) == []


def test_a_lost_request_with_kept_tokens_goes_on_from_them_and_its_answer_is_joined():
    m = Migrations(SAMPLING)
    req = Migrations.keyed([GenerationRequest(0, [7, 8])], "c0")[0]
    assert req.key == "c0:0"
    kept = Kept([1, 2, 3], [-0.1, -0.2, -0.3], [[4, 3]])
    (cont,) = m.lost(req, 1, [kept])
    assert cont.prompt_token_ids == [7, 8, 1, 2, 3] and cont.continues == 3 and cont.index == 0
    assert m.request(cont) is req
    raw = RequestResult(0, (SampleResult([4, 5, 6, 7, 8, 9, 10], [-1.0] * 7, None, "length", ((5, 7),)),))
    whole = m.answered(cont, raw)
    (s,) = whole.samples
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert s.logprobs == [-0.1, -0.2, -0.3] + [-1.0] * 7
    assert s.weight_versions == ((4, 3), (5, 7)) and s.finish_reason == "length"
    assert m.moves(0) == [Moved(from_shard=1, at_token=3, sample=0)]


def test_a_loss_that_kept_nothing_is_a_re_route_and_one_that_finished_needs_no_continuation():
    m = Migrations(SAMPLING)
    req = GenerationRequest(0, [7], key="c:0")
    assert m.lost(req, 0, []) is None and m.lost(req, 0, [Kept()]) is None
    done = Kept(list(range(10)), [0.0] * 10, [[1, 10]])  # every token made: nothing left to make
    assert m.lost(req, 0, [done]) == []
    assert m.whole(0).samples[0].finish_reason == "length" and m.whole(0).samples[0].token_ids == list(range(10))


def test_n_samples_each_go_on_from_their_own_tokens_and_the_result_waits_for_all():
    m = Migrations(Sampling(max_new_tokens=6, temperature=1.0, n=3))
    req = GenerationRequest(2, [5], key="c:2")
    kept = [Kept([1], [0.0], [[1, 1]]), Kept([2, 2, 2, 2, 2, 2], [0.0] * 6, [[1, 6]], "stop"), Kept()]
    conts = m.lost(req, 0, kept)
    assert [c.prompt_token_ids for c in conts] == [[5, 1], [5]]  # sample 1 had finished
    assert [c.continues for c in conts] == [1, 0] and [c.sample for c in conts] == [0, 2]
    assert [mv.sample for mv in m.moves(2)] == [0, 2]
    first = m.answered(conts[0], RequestResult(2, (SampleResult([3] * 5, [0.0] * 5, None, "length", ((2, 5),)),)))
    assert first is None  # sample 2 still runs
    whole = m.answered(conts[1], RequestResult(2, (SampleResult([4] * 6, [0.0] * 6, None, "length", ((2, 6),)),)))
    assert [s.token_ids for s in whole.samples] == [[1, 3, 3, 3, 3, 3], [2] * 6, [4] * 6]
    assert whole.samples[0].weight_versions == ((1, 1), (2, 5))


def test_a_continuation_lost_again_keeps_both_stretches_and_a_bare_repeat_counts():
    m = Migrations(SAMPLING)
    req = GenerationRequest(0, [7], key="c:0")
    (c1,) = m.lost(req, 0, [Kept([1, 2], [0.0, 0.0], [[1, 2]])])
    assert m.lost(c1, 1, [Kept()]) is None  # it made nothing there: sent again as it is (counts)
    (c2,) = m.lost(c1, 1, [Kept([3], [0.0], [[2, 1]])])
    assert c2.prompt_token_ids == [7, 1, 2, 3] and c2.continues == 3
    assert [(mv.from_shard, mv.at_token) for mv in m.moves(0)] == [(0, 2), (1, 3)]
    whole = m.answered(c2, RequestResult(0, (SampleResult([4] * 7, [0.0] * 7, None, "stop", ((3, 7),)),)))
    assert whole.samples[0].weight_versions == ((1, 2), (2, 1), (3, 7))


def test_an_answer_that_failed_fails_the_request():
    m = Migrations(SAMPLING)
    (c,) = m.lost(GenerationRequest(0, [7], key="c:0"), 0, [Kept([1], [0.0], [[1, 1]])])
    assert m.answered(c, RequestResult.failed(0, "RequestError: no")).error == "RequestError: no"


def test_an_unmoved_requests_answer_passes_and_its_json_has_no_migrations():
    m = Migrations(SAMPLING)
    raw = RequestResult(0, (SampleResult([1], [0.0], None, "stop"),))
    req = GenerationRequest(0, [7], key="c:0")
    assert m.answered(req, raw) is raw and m.request(req) is req
    result = GenerationResult(0, None, [7], "x", migrations=[])
    assert "migrations" not in result.to_json()
    result.migrations = [Moved(1, 3)]
    assert result.to_json()["migrations"] == [{"from_shard": 1, "at_token": 3, "sample": 0, "cause": "lost"}]
