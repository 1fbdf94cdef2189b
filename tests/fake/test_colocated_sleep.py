"""The colocated layout's sleep/wake state machine on the fake driver (tests/fakes.py): refusals,
routing, probes, recovery of a sleeping shard, refit while asleep, sleep with requests in flight,
HTTP. Each test fails without its rule. The GPU side (memory freed, greedy tokens after
wake+refit+wake, NeMo-RL's IPC sender) is tests/gpu/test_colocated_gpu.py."""

from __future__ import annotations

import threading

import pytest

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.sleep import SleepLevel, SleepPhase, WakeTag
from nemo_gen.errors import ConfigError, FleetAsleep
from tests import helpers
from tests.fakes import fake_fleet

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]


def wait_until(predicate, timeout_s: float = 30.0, what: str = "the condition"):
    return helpers.wait_until(predicate, timeout_s, what, poll_s=0.005)


def tensors(value: float = 1.0):
    import torch

    return {"w": torch.full((4, 4), value), "b": torch.zeros(4)}


@pytest.fixture
def colocated(fake_fleet_settings, tmp_path):
    """Settings of a colocated 2-shard GPU fleet on the fake driver."""
    def make(**overrides):
        return fake_fleet_settings(fleet__device="gpu", generation__colocated__enabled=True,
                                   refit__staging_dir=str(tmp_path), **overrides)
    return make


# -- settings: accepted on GPU, refused on CPU ---------------------------------------------------

def test_colocated_starts_gpu_engines_with_sleep_mode_and_is_refused_on_cpu(fake_fleet_settings):
    from nemo_gen.fleet.resolve import resolve_generation

    gpu = resolve_generation(fake_fleet_settings(fleet__device="gpu", generation__colocated__enabled=True), None)
    assert gpu.shards[0].engine_kwargs["enable_sleep_mode"] is True
    plain = resolve_generation(fake_fleet_settings(fleet__device="gpu"), None)
    assert "enable_sleep_mode" not in plain.shards[0].engine_kwargs
    with pytest.raises(ConfigError, match="generation.colocated.enabled") as err:
        resolve_generation(fake_fleet_settings(fleet__device="cpu", generation__colocated__enabled=True), None)
    assert err.value.field == "generation.colocated.enabled" and "CPU" in str(err.value)


def test_colocated_refuses_warm_spares(fake_fleet_settings):
    from nemo_gen.fleet.resolve import resolve_generation

    with pytest.raises(ConfigError, match="fleet.spares must be 0") as err:
        resolve_generation(fake_fleet_settings(fleet__device="gpu", generation__colocated__enabled=True,
                                               fleet__spares=1), None)
    assert err.value.field == "fleet.spares"


def test_a_fleet_without_sleep_mode_refuses_to_sleep_and_names_the_setting(fake_fleet_settings, driver):
    with fake_fleet(fake_fleet_settings(), driver) as fleet:
        with pytest.raises(ConfigError, match="generation.colocated.enabled=true"):
            fleet.sleep()
        assert all(not driver.shard(h).sleeps for h in fleet.shards)
        assert fleet.wake().state.awake  # awake already: a no-op, as NeMo-RL's prepare asks
        with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
            fleet.sleep(3)
        with pytest.raises(ValueError, match="unknown wake tag 'kv'"):
            fleet.wake(["kv"])


# -- refusals and routing -------------------------------------------------------------------------

def test_a_sleeping_fleet_refuses_requests_with_its_state_and_sends_none(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        report = fleet.sleep(1)
        assert report.state.phase is SleepPhase.ASLEEP and sorted(report.seconds) == [0, 1]
        assert [driver.shard(h).sleeps for h in fleet.shards] == [[(1, 0)], [(1, 0)]]
        assert all("reset_prefix_cache" in driver.shard(h).rpcs for h in fleet.shards)
        generated = [driver.shard(h).generated for h in fleet.shards]
        with pytest.raises(FleetAsleep, match=r"is asleep \(level 1\).*fleet.wake"):
            fleet.generate(PROMPTS)
        import asyncio
        with pytest.raises(FleetAsleep, match="asleep"):
            asyncio.run(fleet.generate_async([1, 2]))
        assert [driver.shard(h).generated for h in fleet.shards] == generated  # nothing was sent
        # a state, not a fault: every slot keeps its place and its version
        assert fleet.health.serving_shards() == [0, 1]
        assert {s.sleep for s in fleet.status()} == {"asleep (level 1)"}
        fleet.wake(["weights"])  # half awake: still refused, and the message says what is missing
        with pytest.raises(FleetAsleep, match=r"kv_cache memory is released.*tags=\['kv_cache'\]"):
            fleet.generate(PROMPTS)
        assert {s.sleep for s in fleet.status()} == {"asleep (level 1; weights resident)"}
        fleet.wake(["kv_cache"])
        assert [driver.shard(h).wakes for h in fleet.shards] == [[["weights"], ["kv_cache"]]] * 2
        assert all(r.ok for r in fleet.generate(PROMPTS))
        assert {s.sleep for s in fleet.status()} == {"awake"}
        fleet.wake()  # awake: nothing is sent
        assert [len(driver.shard(h).wakes) for h in fleet.shards] == [2, 2]


def test_a_request_that_reaches_a_sleeping_shard_is_refused_there_not_hung(colocated, driver):
    import asyncio

    from nemo_gen.core.sleep import SleepOrder
    from nemo_gen.core.wire import Sampling
    from nemo_gen.errors import ShardBusy

    with fake_fleet(colocated(), driver) as fleet:
        shard = driver.rules(fleet.handle(0))
        asyncio.run_coroutine_threadsafe(shard.sleep(SleepOrder(SleepLevel.OFFLOAD)), driver.loop).result(5)
        req = fleet.router.requests([[1, 2]])[0][0]
        with pytest.raises(ShardBusy, match="asleep"):
            asyncio.run_coroutine_threadsafe(shard.generate([req], Sampling.of({"max_new_tokens": 2, "temperature": 0.0})),
                                             driver.loop).result(5)


def test_http_answers_503_with_retry_after_naming_the_state(colocated, driver):
    import httpx

    from nemo_gen.server import start_server

    settings = colocated(server__port=0, server__retry_after_s=7, generation__vllm_cfg__skip_tokenizer_init=True)
    with fake_fleet(settings, driver) as fleet:
        handle = start_server(fleet)
        try:
            fleet.sleep()
            r = httpx.post(f"{handle.url}/v1/completions", json={"model": settings.model_name(), "prompt": [1, 2],
                                                                 "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"] == "7"
            assert "FleetAsleep" in r.json()["error"]["message"] and "asleep" in r.json()["error"]["message"]
            fleet.wake()
            r = httpx.post(f"{handle.url}/v1/completions", json={"model": settings.model_name(), "prompt": [1, 2],
                                                                 "max_tokens": 2})
            assert r.status_code == 200
        finally:
            handle.stop()


# -- probes -----------------------------------------------------------------------------------------

def test_a_sleeping_shard_is_not_probed_as_dead(colocated, driver):
    # A sleeping engine's scheduler is paused: a real probe would get no token (a hung shard here).
    with fake_fleet(colocated(health__probe_timeout_s=0.05, health__unhealthy_threshold=2), driver,
                    watch=False) as fleet:
        fleet.sleep()
        for h in fleet.shards:
            driver.set_hung(h.name)
        assert fleet.probe_once() == []
        assert [fleet.health.state_of(s) for s in (0, 1)] == [ShardState.HEALTHY] * 2
        # a probe sent before the sleep, answered (or expired) after it, counts for nothing either
        from nemo_gen.core.members import Member
        from nemo_gen.core.wire import ProbeReply, ProbeStatus

        for _ in range(3):
            fleet.prober.record(Member(fleet.handle(0).name, 0), ProbeReply(ProbeStatus.UNANSWERED, "late"))
        assert fleet.health.state_of(0) is ShardState.HEALTHY
        for h in fleet.shards:
            driver.set_hung(h.name, False)
        fleet.wake()
        assert [p["ok"] for p in fleet.probe_once()] == [True, True]


def test_a_shard_killed_while_asleep_is_detected_and_comes_back_asleep_at_the_fleets_version(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        fleet.refit(tensors(), version=3)
        fleet.sleep(1)
        victim = fleet.handle(0).name
        driver.set_dead(victim)  # the death watch runs on while asleep
        wait_until(lambda: fleet.handle(0).name != victim and fleet.health.state_of(0) is ShardState.HEALTHY,
                   what="slot 0 replaced")
        newcomer = driver.shard(fleet.handle(0))
        assert newcomer.weight_version == 3  # caught up first (awake), then put to sleep
        assert newcomer.sleeps == [(1, 0)] and driver.rules(fleet.handle(0)).sleep_state.phase is SleepPhase.ASLEEP
        assert fleet.sleep_state.phase is SleepPhase.ASLEEP
        with pytest.raises(FleetAsleep):
            fleet.generate(PROMPTS)
        fleet.wake()
        assert {(r.ok, r.weight_version) for r in fleet.generate(PROMPTS)} == {(True, 3)}


def test_a_newcomer_takes_the_half_awake_state_too(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        fleet.sleep(1)
        fleet.wake(["weights"])
        driver.set_dead(fleet.handle(1).name)
        wait_until(lambda: fleet.handle(1).name.endswith("-r1") and fleet.health.state_of(1) is ShardState.HEALTHY,
                   what="slot 1 replaced")
        newcomer = driver.shard(fleet.handle(1))
        assert newcomer.sleeps == [(1, 0)] and newcomer.wakes == [["weights"]]


def test_a_shard_that_cannot_sleep_is_quarantined_and_replaced_asleep(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        victim = fleet.handle(1).name
        driver.shard(fleet.handle(1)).fail_sleep = "CUDA error: out of memory while offloading"
        report = fleet.sleep()
        assert list(report.failed) == [1] and "out of memory while offloading" in report.failed[1]
        wait_until(lambda: fleet.handle(1).name != victim and fleet.health.state_of(1) is ShardState.HEALTHY,
                   what="slot 1 replaced")
        assert driver.shard(fleet.handle(1)).sleeps == [(1, 0)]


# -- refit while asleep ---------------------------------------------------------------------------

def test_a_refit_while_asleep_wakes_the_weights_first_in_nemo_rls_order(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        fleet.sleep(1)
        report = fleet.refit(tensors(2.0))
        assert all(s.ok for s in report.shards) and fleet.weight_version == 1
        for h in fleet.shards:
            engine = driver.shard(h)
            assert engine.wakes == [["weights"]] and engine.weight_version == 1
            # the weights were woken before any byte was loaded
            assert engine.rpcs.index("nemo_gen_check_staged") > engine.rpcs.index("reset_prefix_cache")
        state = fleet.sleep_state
        assert state.phase is SleepPhase.ASLEEP and state.resident == {WakeTag.WEIGHTS}
        with pytest.raises(FleetAsleep, match="kv_cache"):  # wake(kv_cache) is the caller's step
            fleet.generate(PROMPTS)
        fleet.wake(["kv_cache"])
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


def test_a_shard_refuses_a_refit_while_its_weights_sleep(colocated, driver):
    import asyncio

    from nemo_gen.core.sleep import SleepOrder
    from nemo_gen.core.wire import CheckRefit

    with fake_fleet(colocated(), driver) as fleet:
        shard = driver.rules(fleet.handle(0))
        asyncio.run_coroutine_threadsafe(shard.sleep(SleepOrder(SleepLevel.OFFLOAD)), driver.loop).result(5)
        with pytest.raises(RuntimeError, match=r"weights must be woken"):
            asyncio.run_coroutine_threadsafe(shard.check_refit(CheckRefit("/x", 0, (), 1.0)), driver.loop).result(5)


def test_level_2_discards_the_weights_so_the_fleet_serves_again_only_after_a_refit(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        fleet.sleep(SleepLevel.DISCARD)
        assert [driver.shard(h).sleeps for h in fleet.shards] == [[(2, 0)]] * 2
        fleet.wake()
        with pytest.raises(FleetAsleep, match="discarded weight version 0: refit it"):
            fleet.generate(PROMPTS)
        fleet.refit(tensors())
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


# -- sleep with requests in flight ------------------------------------------------------------------

def test_a_sleep_drains_running_requests_first_and_refuses_new_ones_meanwhile(colocated, driver):
    with fake_fleet(colocated(), driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)  # 16 tokens each: the batch runs for a while
        results: list = []
        running = threading.Thread(target=lambda: results.extend(fleet.generate(PROMPTS)))
        running.start()
        wait_until(lambda: any(driver.shard(h).running for h in fleet.shards), what="requests running")
        sleeping = threading.Thread(target=fleet.sleep)
        sleeping.start()
        wait_until(lambda: fleet.sleep_state.phase is not SleepPhase.AWAKE, what="the sleep begun")
        with pytest.raises(FleetAsleep, match="going to sleep"):
            fleet.generate([[1]])
        running.join(30)
        sleeping.join(30)
        assert not running.is_alive() and not sleeping.is_alive()
        assert len(results) == len(PROMPTS) and all(r.ok and len(r.token_ids) == 16 for r in results)
        # every engine fell asleep with nothing running: the batch finished first
        assert [driver.shard(h).sleeps for h in fleet.shards] == [[(1, 0)]] * 2
        assert fleet.sleep_state.phase is SleepPhase.ASLEEP


# -- the seed API's hooks (NeMo-RL's semantics) ------------------------------------------------------

def test_vllm_generation_finish_sleeps_and_prepare_wakes_when_colocated(colocated, driver):
    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(colocated(), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        assert gen.colocated and gen.blocks_training()
        assert gen.finish_generation(release_gpu=True) is True
        assert [driver.shard(h).sleeps for h in fleet.shards] == [[(1, 0)]] * 2
        with pytest.raises(FleetAsleep):
            fleet.generate(PROMPTS)
        assert gen.prepare_for_generation(tags=["weights"]) and fleet.sleep_state.resident == {WakeTag.WEIGHTS}
        assert gen.prepare_for_generation(tags=["kv_cache"]) and fleet.sleep_state.awake
        assert gen.prepare_for_generation()  # awake: cheap, nothing sent
        assert [driver.shard(h).wakes for h in fleet.shards] == [[["weights"], ["kv_cache"]]] * 2
        assert gen.prepare_for_generation(tags=["bogus"]) is False  # NeMo-RL: logged, False


def test_vllm_generation_not_colocated_finish_resets_the_prefix_cache_and_prepare_does_nothing(
        fake_fleet_settings, driver):
    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(fake_fleet_settings(), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        assert not gen.colocated and not gen.blocks_training()
        assert gen.finish_generation() is True
        assert all(driver.shard(h).rpcs == ["reset_prefix_cache"] for h in fleet.shards)
        assert all(not driver.shard(h).sleeps for h in fleet.shards)
        assert gen.prepare_for_generation(tags=["kv_cache"]) is True
        assert all(not driver.shard(h).wakes for h in fleet.shards)
        assert gen.invalidate_kv_cache() is True
        assert all(driver.shard(h).rpcs.count("reset_prefix_cache") == 2 for h in fleet.shards)
        assert all(r.ok for r in fleet.generate(PROMPTS))


# -- NeMo-RL's refit calls on VllmGeneration ----------------------------------------------------------

def state_dict_info(driver):
    import torch

    return {name: (torch.Size(shape), getattr(torch, dtype)) for name, (shape, dtype) in driver.manifest.items()}


def test_prepare_refit_info_is_checked_against_the_engines(colocated, driver):
    import torch

    from nemo_gen.core.manifest import RefitError
    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(colocated(), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        with pytest.raises(RefitError, match="prepare_refit_info"):
            gen.update_weights_via_ipc_zmq()
        with pytest.raises(RefitError, match="w"):
            gen.prepare_refit_info({"w": (torch.Size([3, 4]), torch.float32), "b": (torch.Size([4]), torch.float32)})
        gen.prepare_refit_info(state_dict_info(driver))  # bf16 from the trainer is fine for a float engine
        gen.prepare_refit_info({**state_dict_info(driver), "w": (torch.Size([4, 4]), torch.bfloat16)})


def settled(answers: list) -> list:
    """What NeMo-RL's caller reads of a list the seed API returns (``ray.get``): Ray refs where Ray
    runs in this process (a test before this one in the worker may have started it), else values."""
    import ray

    return ray.get(answers) if ray.is_initialized() else answers


def test_ipc_zmq_refit_in_nemo_rls_order_on_a_sleeping_fleet(colocated, driver):
    from nemo_gen.core.ipc_zmq import IpcZmqRefit
    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(colocated(), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        gen.prepare_refit_info(state_dict_info(driver))
        assert gen.finish_generation()  # NeMo-RL: asleep after construction / each rollout
        assert gen.prepare_for_generation(tags=["weights"])
        assert settled(gen.update_weights_via_ipc_zmq()) == [True, True]
        assert gen.prepare_for_generation(tags=["kv_cache"])
        sent = [m for _, method, m in driver.remote_calls if isinstance(m, IpcZmqRefit)]
        assert len(sent) == 2 and {m.version for m in sent} == {1}
        assert sent[0].entries == (("w", (4, 4), "float32"), ("b", (4,), "float32"))
        for h in fleet.shards:
            engine = driver.shard(h)
            assert engine.weight_version == 1 and "nemo_gen_update_weights_via_ipc_zmq" in engine.rpcs
            assert engine.wakes == [["weights"], ["kv_cache"]]  # weights woken before the stream
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}
        # the fleet's own rule: asleep at the next refit, the weights are woken by the refit itself
        gen.finish_generation()
        assert settled(gen.update_weights_via_ipc_zmq()) == [True, True] and fleet.weight_version == 2
        assert all(driver.shard(h).wakes[-1] == ["weights"] for h in fleet.shards)


def test_a_shard_failing_the_ipc_stream_is_quarantined_and_reported_false(colocated, driver):
    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(colocated(health__auto_recover=False), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        gen.prepare_refit_info(state_dict_info(driver))
        driver.shard(fleet.handle(1)).fail_load = "IpcManifestError: missing keys (1): ['b']"
        assert settled(gen.update_weights_via_ipc_zmq()) == [True, False]  # NeMo-RL's caller raises on a False
        assert fleet.health.state_of(1) is ShardState.DEAD and fleet.weight_version == 1
        assert {r.shard for r in fleet.generate(PROMPTS)} == {0}


def test_init_collective_maps_nemo_rls_ranks_onto_vllms_nccl_transfer(fake_fleet_settings, driver):
    from nemo_gen.core.nemo_rl_collective import collective_init_info, collective_update_info
    from nemo_gen.core.wire import SyncInit, SyncRequest
    from nemo_gen.generation.vllm import VllmGeneration

    info = collective_init_info("10.0.0.1", 29500, world_size=6, train_world_size=4, engine_ranks=2)
    assert info["rank_offset"] == 4 and info["world_size"] == 6 and info["packed"] is True
    with pytest.raises(ValueError, match="train_world_size=4 trainer rank\\(s\\) \\+ 2 engine worker"):
        collective_init_info("10.0.0.1", 29500, world_size=5, train_world_size=4, engine_ranks=2)
    assert collective_update_info((("w", (4, 4), "bfloat16"),)) == {
        "names": ["w"], "dtype_names": ["bfloat16"], "shapes": [[4, 4]]}

    with fake_fleet(fake_fleet_settings(), driver) as fleet:  # refit.backend is not nccl: refused
        with pytest.raises(ConfigError, match="refit.backend=nccl") as err:
            VllmGeneration(fleet=fleet).init_collective("10.0.0.1", 29500, 6, train_world_size=4)
        assert err.value.field == "refit.backend"
    with fake_fleet(fake_fleet_settings(refit__backend="nccl"), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        gen.prepare_refit_info(state_dict_info(driver))
        with pytest.raises(Exception, match="world_size=5"):
            gen.init_collective("10.0.0.1", 29500, 5, train_world_size=4)
        assert settled(gen.init_collective("10.0.0.1", 29500, 6, train_world_size=4)) == [True]
        inits = {name: m.payload.init_info for name, _, m in driver.remote_calls
                 if isinstance(m, SyncRequest) and isinstance(m.payload, SyncInit)}
        # NeMo-RL's layout: trainer ranks 0..3, then each shard's worker
        assert sorted(i["rank_offset"] for i in inits.values()) == [4, 5]
        assert {i["world_size"] for i in inits.values()} == {6}
        assert settled(gen.update_weights_from_collective()) == [True, True] and fleet.weight_version == 1
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


def test_attaching_to_a_sleeping_fleet_adopts_its_state(colocated, driver):
    from nemo_gen.fleet.fleet import GenerationFleet

    with fake_fleet(colocated(), driver) as fleet:
        fleet.sleep(1)
        fleet.wake(["weights"])
        infos = [driver.info(h) for h in fleet.shards]
        assert {(i.sleep_level, i.sleep_resident) for i in infos} == {(1, ("weights",))}
        other = GenerationFleet(fleet.resolved, fleet.shards, driver=driver, attached=True, watch=False)
        try:
            assert other.sleep_state == fleet.sleep_state
            with pytest.raises(FleetAsleep, match="kv_cache"):
                other.generate(PROMPTS)
            assert {s.sleep for s in other.status()} == {"asleep (level 1; weights resident)"}
        finally:
            other._close_background(detached=True)


def test_a_newcomer_a_sleep_reached_before_its_catch_up_still_catches_up_and_sleeps(colocated, driver):
    # Recovery installs a replacement, a sleep reaches it (it holds a slot), then its catch-up runs:
    # its weights are woken for the load and it ends asleep like the others.
    from nemo_gen.core.members import Member

    with fake_fleet(colocated(), driver) as fleet:
        fleet.refit(tensors(), version=4)
        fleet.sleep(1)
        handle = fleet.handle(0)
        shard = driver.rules(handle)
        shard.claim = type(shard.claim)(None)  # as a fresh replacement: no version yet
        assert fleet.refitter.catch_up(Member(handle.name, 0), handle)
        engine = driver.shard(handle)
        assert engine.weight_version == 4 and engine.wakes[-1] == ["weights"]
        assert shard.sleep_state.phase is SleepPhase.ASLEEP and not shard.sleep_state.resident
        assert [lvl for lvl, _ in engine.sleeps] == [1, 1]  # asleep again after the load


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_a_refit_of_a_sleeping_fleet_swaps_nothing_under_a_paused_scheduler(colocated, driver, mode):
    # keep / abort pause the scheduler under a running batch; a sleeping engine runs none and its
    # scheduler is paused already: the load goes in as a drain would.
    with fake_fleet(colocated(), driver) as fleet:
        fleet.sleep(1)
        assert all(s.ok for s in fleet.refit(tensors(), in_flight=mode).shards)
        assert [driver.shard(h).swaps for h in fleet.shards] == [0, 0]
        fleet.wake()
        fleet.refit(tensors(), in_flight=mode)  # awake: the mode acts as it says
        assert [driver.shard(h).swaps for h in fleet.shards] == [1, 1]
