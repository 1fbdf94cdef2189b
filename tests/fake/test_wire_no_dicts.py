"""No dict crosses the shard's actor boundary in the fleet's own protocol (``nemo_gen.core.wire``):
the fake tier (``tests/fakes.py``) checks every argument and answer of every call it carries to a
real ``Shard`` — generate, streams, probes, info, refit and weight-sync messages — and fails the
call (and, at ``close``, the test) on a dict anywhere in it. Only vLLM's own payloads are left
alone: the fields ``wire.VLLM_OWNED`` names, and ``vllm_metrics``' stats rows."""

from __future__ import annotations

import asyncio

import pytest

from nemo_gen.core import wire
from nemo_gen.core.wire import GenerateReply, InFlight, LoadRefit, RequestResult, SampleResult, SyncApply, SyncRequest
from tests.fakes import FakeEngine, dicts_in, fake_fleet

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
CHUNK = {"path": "/nonexistent", "total": 80, "entries": [["w", [4, 4], "float32", 0], ["b", [4], "float32", 64]]}


def checkpoint_tensors():
    import torch

    return {"w": torch.zeros(4, 4), "b": torch.zeros(4)}


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def test_a_dict_is_found_anywhere_in_a_message_but_in_vllms_own_payloads():
    sample = SampleResult([1], [0.0], "", "length")
    assert dicts_in(GenerateReply(0, 1, (RequestResult(0, (sample,)),), 0.1)) == []
    assert dicts_in(GenerateReply(0, 1, ({"index": 0},), 0.1)) == [".GenerateReply.results[0]"]
    assert dicts_in((1, [sample, {"a": 1}])) == ["[1][1]"]
    assert dicts_in(LoadRefit("/x", 1, (), 1, 1.0, None, {"mode": "drain"})) == [".LoadRefit.in_flight"]
    # vLLM's update_info is vLLM's: a mapping there is its own business
    assert dicts_in(SyncRequest(SyncApply(InFlight("keep"), CHUNK, "policy", 2), 1.0)) == []
    assert (SyncApply, "update_info") in wire.VLLM_OWNED


def test_generate_streams_probes_and_refits_cross_with_no_dict(settings, driver):
    with fake_fleet(settings(fleet__spares=1), driver) as fleet:
        assert all(r.ok for r in fleet.generate(PROMPTS, n=2, temperature=1.0))
        assert asyncio.run(fleet.generate_async([1, 2], max_new_tokens=3)).ok

        async def stream():
            return [item async for item in fleet.generate_stream([1, 2], max_new_tokens=3)]

        assert asyncio.run(stream())[-1].ok
        assert fleet.weight_sync_client().apply_weight_update(CHUNK).ok
        assert fleet.refit(checkpoint_tensors(), version=7).ok  # check_refit, then load_refit
        fleet.status()
        assert fleet.prober.answer_of(fleet.prober.send(fleet.handle(0))).ok
        assert {method for _, method, _ in driver.remote_calls} == {"weight_sync", "check_refit", "load_refit"}
    assert driver.wire_violations == []


def test_a_dict_put_back_into_a_result_fails_the_call_and_the_test(settings, driver, monkeypatch):
    """The check is no formality: an engine whose result carries a dict again is caught at the
    boundary, the call fails, and the driver's ``close`` fails the test."""
    generate = FakeEngine.generate

    async def with_a_dict(self, requests, sampling):
        return [{"index": r.index, **vars(r)} for r in await generate(self, requests, sampling)]

    monkeypatch.setattr(FakeEngine, "generate", with_a_dict)
    with fake_fleet(settings(health__enabled=False), driver) as fleet:
        with pytest.raises(AssertionError, match=r"a dict crossed the actor boundary in generate's answer"):
            fleet.generate(PROMPTS)
    assert driver.wire_violations
    with pytest.raises(AssertionError, match="generate's answer"):
        driver.close()
    driver.wire_violations.clear()  # for the fixture's own close
