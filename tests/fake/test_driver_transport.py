"""The real ``ShardDriver`` over the in-process transport (``nemo_gen.fleet.transport_local``, no Ray):
its fan-out, its one deadline for every shard, its outcome mapping, the direct line's choice, and
a LoRA adapter refit, on real ``Shard``s over fake engines (tests/fakes.py). The Ray transport under
the same logic is tested on real engines in tests/engine/ (test_fleet, test_refit, test_lora)."""

from __future__ import annotations

import time

import pytest
import torch

from nemo_gen.core.adapters import AdapterError
from nemo_gen.core.wire import CheckRefit, FailureKind, SyncRequest, SyncUpdate
from nemo_gen.errors import ShardDiedError
from nemo_gen.fleet.driver import DriverTimeouts, ShardDriver
from nemo_gen.fleet.transport_local import InProcessTransport
from nemo_gen.shard.actor import ShardActor
from nemo_gen.shard.host import SHARD_CALLS, ShardHost
from nemo_gen.shard.rules import Shard
from tests.fakes import FakeDriver, fake_fleet

CHECK = CheckRefit("/dev/shm/none", 0, (), 5.0)


@pytest.fixture
def three(fake_fleet_settings):
    """Three shards on a fake driver whose refit deadline is 1 s."""
    driver = FakeDriver(timeouts=DriverTimeouts(control_s=1.0, stop_s=0.5, engine_grace_s=0.1, refit_s=1.0))
    fleet = fake_fleet(fake_fleet_settings(fleet__num_shards=3), driver, watch=False)
    yield driver, fleet
    fleet.shutdown()
    driver.close()


def test_the_fake_is_the_real_driver_over_the_in_process_transport():
    """FakeDriver restated 20 of the driver's 22 methods; now it restates none."""
    assert issubclass(FakeDriver, ShardDriver)
    restated = sorted(n for n, v in vars(FakeDriver).items()
                      if callable(v) and not n.startswith("_") and n in vars(ShardDriver))
    assert restated == []
    assert isinstance(FakeDriver().transport, InProcessTransport)


def test_fan_out_maps_each_outcome_and_waits_its_deadline_once_for_all(three):
    driver, fleet = three
    ok, refusing = fleet.handle(0), fleet.handle(1)
    driver.shard(refusing).refuse_refit = "tensor w has the wrong shape"
    t0 = time.monotonic()
    out = driver.fan_out({0: ok, 1: refusing}, CHECK, margin_s=0.0)
    assert out[0].ok and out[0].value == 1
    assert out[1].failure.kind is FailureKind.DATA and not out[1].infra
    assert out[1].error == "ValueError: tensor w has the wrong shape"
    assert time.monotonic() - t0 < 30  # a bound, not a latency target

    # Frozen shards cost the deadline once, together: three of them one after another take 3 s.
    driver.shard(refusing).refuse_refit = None
    for handle in fleet.shards:
        driver.set_hung(handle.name)
    t0 = time.monotonic()
    out = driver.fan_out({h.index: h for h in fleet.shards}, CHECK, margin_s=0.0)
    waited = time.monotonic() - t0
    assert all(o.failure.kind is FailureKind.DEAD and o.failure.type_name == "GetTimeoutError" for o in out.values())
    assert 0.9 <= waited < 2.5, waited
    for handle in fleet.shards:
        driver.set_hung(handle.name, False)

    driver.set_dead(fleet.handle(2).name)
    out = driver.fan_out({2: fleet.handle(2)}, CHECK, margin_s=0.0)
    assert out[2].failure.kind is FailureKind.DEAD and out[2].infra


def test_infos_wait_one_control_deadline_for_every_shard(three):
    driver, fleet = three
    for handle in fleet.shards[1:]:
        driver.set_hung(handle.name)
    t0 = time.monotonic()
    out = driver.infos({h.index: h for h in fleet.shards})
    waited = time.monotonic() - t0
    assert out[0].slot == 0
    assert all(isinstance(out[i], ShardDiedError) and "did not answer within 1s" in out[i].detail for i in (1, 2))
    assert 0.9 <= waited < 1.9, waited  # once for both, not 2 s one after the other
    for handle in fleet.shards[1:]:
        driver.set_hung(handle.name, False)


def test_a_call_the_shard_does_not_have_is_refused_by_name(driver, fake_fleet_settings):
    with fake_fleet(fake_fleet_settings(fleet__num_shards=1), driver, watch=False) as fleet:
        handle = fleet.handle(0)
        with pytest.raises(AttributeError, match="no call 'reboot'.*SHARD_CALLS"):
            driver._call(handle, "reboot", timeout_s=5)


def test_every_shard_call_is_one_the_shell_or_its_rules_define_and_the_actor_forwards_none():
    assert all(callable(getattr(ShardHost, name, None)) or callable(getattr(Shard, name, None))
               for name in SHARD_CALLS), sorted(n for n in SHARD_CALLS
                                                if not hasattr(ShardHost, n) and not hasattr(Shard, n))
    actor = ShardActor.__ray_metadata__.modified_class.__ray_actor_class__
    own = {n for n, v in vars(actor).items() if callable(v) and not n.startswith("__")}
    assert own == {"start", "watch", "shutdown"}  # what needs the actor's process; nothing forwarded


def test_a_weight_sync_goes_over_the_direct_line_and_its_failure_keeps_its_kind(driver, fake_fleet_settings):
    """The direct line's choice (a shard on this node) in the fast tier: a real line to the shell's
    real server, in process. A failure comes back as the wire's Failure."""
    driver.channels = True
    with fake_fleet(fake_fleet_settings(fleet__num_shards=2), driver, watch=False) as fleet:
        handles = {h.index: h for h in fleet.shards}
        step = SyncRequest(SyncUpdate({"names": ["w"]}), 5.0)
        out = driver.fan_out(handles, step, margin_s=1.0)
        assert driver.lines() == {h.name for h in fleet.shards}
        assert driver.remote_calls == []  # nothing went over the transport
        assert all(o.ok for o in out.values()), out
        driver.shard(fleet.handle(1)).fail_load = "the chunk w has the wrong shape"
        out = driver.fan_out(handles, step, margin_s=1.0)
        assert out[0].ok and out[1].failure.kind is FailureKind.DATA
        assert out[1].error == "RuntimeError: the chunk w has the wrong shape"
        assert all(driver.rules(h).info().direct_calls == 0 for h in fleet.shards)  # rules count no line calls
        assert all(driver.info(h).direct_calls == 2 for h in fleet.shards)


def _adapter(rank: int = 4) -> dict:
    config = {"r": rank, "lora_alpha": 8, "peft_type": "LORA", "target_modules": ["q_proj"]}
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return {"config": config, "tensors": {f"{prefix}.lora_A.weight": torch.zeros(rank, 4),
                                          f"{prefix}.lora_B.weight": torch.zeros(8, rank)}}


@pytest.fixture
def lora_driver():
    manifest = {"model.layers.0.self_attn.q_proj.weight": ((8, 4), "float32"), "w": ((4, 4), "float32")}
    driver = FakeDriver(manifest=manifest)
    yield driver
    driver.close()


def test_an_adapter_refit_runs_in_the_fast_tier(lora_driver, fake_fleet_settings):
    """The adapter calls had no route in the old fake driver, so a LoRA refit never ran without
    real engines. Over the in-process transport it runs the real fan-out on every shard."""
    driver = lora_driver
    settings = fake_fleet_settings(**{"generation.vllm_cfg.lora.enabled": True, "generation.vllm_cfg.lora.max_rank": 8})
    with fake_fleet(settings, driver, watch=False) as fleet:
        report = fleet.refit_adapter("a", _adapter())
        assert report.version == 1 and len(report.shards) == 2
        assert [driver.shard(h).adapters for h in fleet.shards] == [{report.engine_id}] * 2
        assert {m for _, m, _ in driver.remote_calls} == {"adapter_call"}

        # One shard refuses the next version: the fleet drops it everywhere, the old one serves on.
        driver.shard(fleet.handle(1)).refuse_adapter = "no free adapter slot"
        with pytest.raises(AdapterError, match="refused, the previous version serves on.*no free adapter slot"):
            fleet.refit_adapter("a", _adapter())
        assert [driver.shard(h).adapters for h in fleet.shards] == [{report.engine_id}] * 2
        assert fleet.adapter_versions() == {"a": 1}
