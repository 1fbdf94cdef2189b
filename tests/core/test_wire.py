"""The shard's wire (``nemo_gen.core.wire``): frozen messages, one payload type per weight-sync step,
failures by kind, and every message survives the pickling Ray and a shard's direct line apply."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from nemo_gen.core import wire
from nemo_gen.core.wire import (
    ApplyTimings, ChannelAddress, CheckRefit, Failure, FailureKind, GenerateReply, InFlight, LoadRefit, LoadStats, ProbeReply,
    ProbeStatus, RequestResult, SampleDelta, SampleResult, Sampling, ShardInfo, StepGaps, Structured, Unfinished,
    StreamDeltas, StreamEnd, SyncAbort, SyncApply, SyncFinish, SyncInit, SyncReply, SyncRequest, SyncShutdown,
    SyncStart, SyncStartDraft, SyncStep, SyncUpdate,
)

IN_FLIGHT = InFlight("drain", resume_aborted=False)
SAMPLE = SampleResult([1], [-0.5], "a", "length", ((2, 1),), (((1, -0.5), (7, -2.0)),))
MESSAGES = [
    ShardInfo(slot=1, weight_version=3, engine_pids=(7, 8), dtype="bfloat16"),
    Sampling(max_new_tokens=4, temperature=0.7, stop_strings=("x",), n=2,
             structured_outputs=Structured(json='{"type": "object"}'), adapter=("a#1", 1)),
    GenerateReply(shard=0, weight_version=2, results=(RequestResult(0, (SAMPLE,), None, (None, ((3, -1.0),))),),
                  seconds=0.1),
    StreamDeltas((SampleDelta(0, [4], "b", [0.0], ((2, 1),), None),)),
    StreamEnd(RequestResult.failed(0, "RequestError: no"), shard=1, weight_version=None, seconds=0.2),
    StepGaps(0.5, ((1.0, 1.5),)),
    Unfinished((("nemo-gen-3", 7),)),
    LoadStats(path="direct", seconds=0.2, plan="recorded"),
    ProbeReply(ProbeStatus.BUSY, step_age_s=0.5),
    CheckRefit("/dev/shm/x", 80, (("w", [4, 4], "float32", 0),), 30.0),
    LoadRefit("/dev/shm/x", 80, (("policy", []),), 4, 30.0, "/ckpt", IN_FLIGHT),
    SyncRequest(SyncApply(IN_FLIGHT, {"layout": 1, "layout_only": True}, "policy", 5), 10.0),
    SyncReply(timings=ApplyTimings(0.1, 0.05, 0.01, 1.0, 1.1)),
    Failure(FailureKind.BUSY, "QueueOverflowError", "queue full"),
    ChannelAddress("/tmp/x.sock", b"k" * 32, "10.0.0.1"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_is_frozen_and_crosses_a_pickle_unchanged(message):
    assert pickle.loads(pickle.dumps(message)) == message
    field = dataclasses.fields(message)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(message, field, None)


def test_each_weight_sync_step_has_exactly_one_payload_type():
    assert set(wire.PAYLOADS) == set(SyncStep)
    assert {payload.step for payload in wire.PAYLOADS.values()} == set(SyncStep)
    assert wire.PAYLOADS[SyncStep.ABORT] is SyncAbort and wire.PAYLOADS[SyncStep.START_DRAFT] is SyncStartDraft


def test_a_request_names_its_step_by_its_payload_and_refuses_anything_else():
    update = {"names": ["w"], "layout": 2}
    assert SyncRequest(SyncUpdate(update), 1.0).step is SyncStep.UPDATE
    assert SyncRequest(SyncUpdate(update), 1.0).chunk() is update
    assert SyncRequest(SyncApply(IN_FLIGHT, update, "draft", 3), 1.0).chunk() is update
    for payload in (SyncInit({"x": 1}), SyncStart(IN_FLIGHT), SyncFinish(3), SyncAbort(True), SyncShutdown()):
        assert SyncRequest(payload, 1.0).chunk() is None  # no step but update and apply carries weights
    with pytest.raises(TypeError, match="not a weight-sync payload"):
        SyncRequest({"step": "finish"}, 1.0)  # type: ignore[arg-type] — the old dict form
    with pytest.raises(TypeError, match="not a weight-sync payload"):
        SyncRequest(CheckRefit("/x", 0, (), 1.0), 1.0)  # type: ignore[arg-type]


def test_a_failure_carries_its_kind_and_only_data_is_not_infra():
    assert {k: Failure(k, "E", "x").infra for k in FailureKind} == {
        FailureKind.DEAD: True, FailureKind.BUSY: True, FailureKind.SLOW: True, FailureKind.DATA: False}
    assert str(Failure(FailureKind.DATA, "ValueError", "bad manifest")) == "ValueError: bad manifest"
    assert [k.value for k in FailureKind] == ["dead", "busy", "slow", "data"]  # the fault model's names


def test_a_new_version_is_a_new_info_and_the_old_one_is_unchanged():
    old = ShardInfo(slot=0, weight_version=1, engine_pids=(5,))
    new = old.with_version(2)
    assert (old.weight_version, new.weight_version) == (1, 2) and new.engine_pids == (5,)
    assert new.as_dict()["engine_pids"] == [5] and new.as_dict()["weight_version"] == 2


def test_only_alive_probes_count_as_alive_and_a_skipped_one_is_not_a_failure():
    assert {s for s in ProbeStatus if s.alive} == {ProbeStatus.OK, ProbeStatus.BUSY}
    assert {s for s in ProbeStatus if ProbeReply(s).ok} == {ProbeStatus.OK, ProbeStatus.BUSY, ProbeStatus.SKIPPED}


def test_sampling_from_a_resolved_dict_keeps_every_keyword_and_carries_no_dict():
    from nemo_gen.core.sampling import SAMPLING_KEYS, resolve_sampling

    defaults = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "stop_token_ids": [2]}
    resolved = resolve_sampling(defaults, {"n": 3, "structured_outputs": {"json": {"type": "object"}},
                                           "stop_strings": ["\\n"], "logprobs": 2})
    s = Sampling.of(resolved, ["a#4", 4])
    assert {f.name for f in dataclasses.fields(Sampling)} == set(SAMPLING_KEYS) | {"adapter"}
    assert (s.n, s.logprobs, s.stop_token_ids, s.stop_strings, s.adapter) == (3, 2, (2,), ("\\n",), ("a#4", 4))
    assert s.structured_outputs == Structured(json='{"type": "object"}')
    assert s.structured_outputs.as_kwargs()["json"] == '{"type": "object"}'
    plain = Sampling.of(resolve_sampling(defaults, {}))
    assert (plain.n, plain.logprobs, plain.ignore_eos, plain.adapter, plain.structured_outputs) == (1, 0, False, None, None)


def test_a_manifest_crosses_as_entries_and_reads_back_by_name():
    m = wire.EngineManifest.of({"tensors": {"w": ([4, 4], "float32")}, "optional": ["w"]})
    assert m.entries == (("w", (4, 4), "float32"),) and m.tensors == {"w": ((4, 4), "float32")}
    assert pickle.loads(pickle.dumps(m)) == m and m.optional == ("w",)
