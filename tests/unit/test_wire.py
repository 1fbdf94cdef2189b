"""The shard's wire (``nemo_gen.core.wire``): frozen messages, one payload type per weight-sync step,
failures by kind, and every message survives the pickling Ray and a shard's direct line apply."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from nemo_gen.core import wire
from nemo_gen.core.wire import (
    ApplyTimings, ChannelAddress, CheckRefit, Failure, FailureKind, GenerateReply, LoadRefit, ProbeReply, ProbeStatus, ShardInfo,
    StreamDeltas, StreamEnd, SyncAbort, SyncApply, SyncFinish, SyncInit, SyncReply, SyncRequest, SyncShutdown,
    SyncStart, SyncStartDraft, SyncStep, SyncUpdate,
)

IN_FLIGHT = {"mode": "drain", "resume_aborted": False, "max_staleness": None, "recompute_kv": False}
MESSAGES = [
    ShardInfo(slot=1, weight_version=3, engine_pids=(7, 8), dtype="bfloat16"),
    GenerateReply(shard=0, weight_version=2, results=({"index": 0, "token_ids": [1]},), seconds=0.1),
    StreamDeltas(({"sample": 0, "token_ids": [4]},)),
    StreamEnd({"index": 0}, shard=1, weight_version=None, seconds=0.2),
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
