"""The shard's rules (``nemo_gen.shard.rules.Shard``) over a fake engine, with no Ray and no
fleet: results stamped with the version read at the start, busy refusals, and the refit rules —
half-loaded weights never carry a version, a weight-sync session ends at its new version or back at
the old one only when nothing was loaded, a layout's short form only for the layout the workers hold."""

from __future__ import annotations

import asyncio
import time

import pytest

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import (
    InFlight, LoadRefit, ProbeStatus, Sampling, ShardInfo, SyncAbort, SyncApply, SyncFinish, SyncInit, SyncReply, SyncRequest, SyncStart,
    SyncUpdate,
)
from nemo_gen.errors import ShardBusy
from nemo_gen.shard.rules import Host, Shard, probe_reply
from tests.fakes import FakeEngine

DRAIN = InFlight("drain", resume_aborted=False)
KEEP = InFlight("keep", resume_aborted=False)
SHORT = {"layout": "a", "layout_only": True}


class Engine(FakeEngine):
    """A fake engine that notes the version its shard claimed while each RPC ran."""

    def __init__(self, shard_claims: list):
        super().__init__("e", 0, {"w": ((4, 4), "float32")}, time.monotonic)
        self.claims = shard_claims
        self.fail: dict[str, str] = {}  # rpc method -> the error it raises

    async def rpc(self, method, *args, timeout=None):
        self.claims.append((method, self.rules.weight_version))
        if method in self.fail:
            raise RuntimeError(self.fail[method])
        return await super().rpc(method, *args, timeout=timeout)


def make(version: int | None = 0, slot: int | None = 1) -> tuple[Shard, Engine]:
    engine = Engine([])
    shard = Shard(index=1, weight_version=version, slot=slot, fleet="f", host=Host(actor_pid=11, node_id="n"))
    engine.rules = shard
    shard.attach(engine, "spawn")
    return shard, engine


def sync(shard: Shard, payload) -> SyncReply:
    return asyncio.run(shard.weight_sync(SyncRequest(payload, 5.0)))


def test_info_is_the_shards_own_account():
    shard, engine = make(version=3)
    engine.pids = [21, 22]
    info = shard.assign(slot=4, restarts=2)
    assert isinstance(info, ShardInfo) and (info.slot, info.weight_version, info.restarts) == (4, 3, 2)
    assert (info.actor_pid, info.engine_pids, info.node_id, info.engine_core_start) == (11, (21, 22), "n", "spawn")
    assert shard.info(direct_calls=5).direct_calls == 5


def test_a_result_carries_the_version_read_when_the_work_started():
    shard, engine = make(version=2)
    engine.token_s = 0.01

    async def main():
        call = asyncio.ensure_future(shard.generate([GenerationRequest(index=0, prompt_token_ids=[1])],
                                                    Sampling(max_new_tokens=20, temperature=0.0)))
        await asyncio.sleep(0.05)
        await shard.load_refit(LoadRefit("/x", 80, (("policy", []),), 3, 5.0, None, KEEP))  # lands mid-batch
        return await call

    reply = asyncio.run(main())
    assert (reply.shard, reply.weight_version, len(reply.results)) == (1, 2, 1) and shard.weight_version == 3


def test_a_full_queue_leaves_the_shard_as_busy_naming_its_slot():
    shard, engine = make(slot=3)
    engine.busy = 1
    with pytest.raises(ShardBusy) as caught:
        asyncio.run(shard.generate([GenerationRequest(index=0, prompt_token_ids=[1])], Sampling(4, 0.0)))
    assert caught.value.shard == 3 and engine.refused == 1


@pytest.mark.parametrize("in_flight", [DRAIN, KEEP], ids=["drain", "keep"])
def test_a_load_claims_no_version_while_it_runs_and_none_when_it_fails(in_flight):
    shard, engine = make(version=0)
    msg = LoadRefit("/x", 80, (("policy", []), ("draft", [])), 1, 5.0, "/ckpt/1", in_flight)
    asyncio.run(shard.load_refit(msg))
    assert engine.claims == [("nemo_gen_load_staged", None)] * 2  # half-loaded weights carry no version
    assert (shard.weight_version, shard.claim.source, engine.version) == (1, "/ckpt/1", 1)
    engine.fail["nemo_gen_load_staged"] = "out of memory"
    with pytest.raises(RuntimeError, match="out of memory"):
        asyncio.run(shard.load_refit(LoadRefit("/x", 80, (("policy", []),), 2, 5.0, None, in_flight)))
    assert shard.weight_version is None and not engine.gate.held  # requests flow again, to a shard claiming nothing
    assert (engine.poisoned is not None) == (in_flight.mode == "keep")  # a swap's batch is cut, not resumed


def test_a_session_claims_no_version_until_finish_serves_the_new_one():
    shard, engine = make(version=4)
    sync(shard, SyncStart(DRAIN))
    assert shard.weight_version is None and engine.gate.held and shard.sync.open
    sync(shard, SyncUpdate({"names": ["w"]}))
    sync(shard, SyncFinish(5))
    assert (shard.weight_version, engine.version, engine.gate.held, shard.sync.open) == (5, 5, False, False)


@pytest.mark.parametrize("nothing_loaded, version", [(True, 4), (False, None)])
def test_an_abort_restores_the_old_version_only_when_nothing_was_loaded(nothing_loaded, version):
    shard, engine = make(version=4)
    sync(shard, SyncStart(KEEP))
    sync(shard, SyncAbort(nothing_loaded=nothing_loaded))
    assert shard.weight_version == version and not engine.gate.held
    assert (engine.poisoned is None) == nothing_loaded


def test_an_abort_whose_workers_fail_to_end_claims_nothing():
    shard, engine = make(version=4)
    sync(shard, SyncStart(DRAIN))
    engine.fail["finish_weight_update"] = "worker gone"
    sync(shard, SyncAbort(nothing_loaded=True))
    assert shard.weight_version is None and not engine.gate.held


def test_a_start_that_fails_keeps_the_old_version_and_lets_requests_flow():
    shard, engine = make(version=4)
    engine.fail["start_weight_update"] = "no transfer engine"
    with pytest.raises(RuntimeError, match="no transfer engine"):
        sync(shard, SyncStart(DRAIN))
    assert shard.weight_version == 4 and not engine.gate.held and not shard.sync.open


def test_a_layouts_short_form_goes_only_to_a_shard_holding_that_layout():
    shard, engine = make()
    assert sync(shard, SyncUpdate(SHORT)) == SyncReply(layout_unknown=True) and engine.claims == []
    sync(shard, SyncUpdate({"names": ["w"], "layout": "a"}))
    assert shard.sync.layout == "a" and sync(shard, SyncUpdate(SHORT)) == SyncReply()
    assert sync(shard, SyncUpdate({**SHORT, "layout": "b"})).layout_unknown
    sync(shard, SyncInit({"backend": "shm"}))  # a new transfer engine holds no layout
    assert shard.sync.layout is None and sync(shard, SyncUpdate(SHORT)).layout_unknown


def test_apply_is_start_chunk_and_finish_in_one_call():
    shard, engine = make(version=0)
    reply = sync(shard, SyncApply(KEEP, {"names": ["w"], "layout": "a"}, "policy", 7))
    assert reply.timings is not None and reply.timings.left_at >= reply.timings.entered_at
    assert (shard.weight_version, engine.version, shard.sync.layout) == (7, 7, "a")
    assert engine.claims == [("nemo_gen_weight_update", None)]
    engine.fail["nemo_gen_weight_update"] = "bad bytes"
    with pytest.raises(RuntimeError, match="bad bytes"):
        sync(shard, SyncApply(KEEP, SHORT, "policy", 8))
    assert shard.weight_version is None and shard.sync.layout is None and engine.poisoned is not None


def test_the_engines_probe_answers_become_statuses():
    assert probe_reply({"ok": True, "skipped": "refit"}).status is ProbeStatus.SKIPPED
    assert probe_reply({"ok": False, "error": "no step for 9s"}).detail == "no step for 9s"
    assert probe_reply({"ok": True, "busy": True, "step_age_s": 0.2}).step_age_s == 0.2
    assert probe_reply({"ok": True, "busy": True, "refused": "queue full"}).status is ProbeStatus.BUSY
    assert probe_reply({"ok": True, "seconds": 0.1}).status is ProbeStatus.OK
    shard, engine = make()
    shard.detach()
    assert asyncio.run(shard.probe({}, [1], 1.0, 1.0)).status is ProbeStatus.FAILED
