"""The fleet's own logic on a fake driver (tests/fakes.py): routing, re-routing, the death
watch, probes, spare promotion, restarts, retirement, refit settling and quarantine, the heal
path — with no Ray and no engine, so each test takes milliseconds. The engine paths of the same
behaviours are tested on real vLLM engines in tests/engine/."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.manifest import RefitError
from nemo_gen.core.wire import FleetRecordState, ShardInfo, SlotRecord
from nemo_gen.errors import EngineStartError, FleetExhausted, PlacementError, RequestError, ShardUnavailableError
from tests import helpers
from tests.fakes import fake_fleet

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]] * 4


def wait_until(predicate, timeout_s: float = 30.0, what: str = "the condition"):
    # Bounds, not latency targets: the fake answers in milliseconds, but a loaded 2-core machine
    # can hold a thread back for seconds.
    return helpers.wait_until(predicate, timeout_s, what, poll_s=0.005)


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def path_of(fleet, slot):
    return [h["new"] for h in fleet.health.history(slot)]


def expected_ids(prompt, n=16):
    return [(sum(prompt) + i) % 97 for i in range(n)]


def test_a_batch_spreads_over_the_shards_and_comes_back_in_order(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        results = fleet.generate(PROMPTS)
        assert [r.index for r in results] == list(range(len(PROMPTS)))
        assert [r.token_ids for r in results] == [expected_ids(p) for p in PROMPTS]
        assert {r.shard for r in results} == {0, 1}  # least-loaded routing uses both
        assert {r.weight_version for r in results} == {0}
        assert [driver.shard(h).generated for h in fleet.shards] == [8, 8]


def test_a_shard_dying_mid_batch_loses_no_request_and_the_spare_takes_its_slot(settings, driver):
    with fake_fleet(settings(fleet__spares=1), driver) as fleet:
        victim, spare = fleet.handle(1).name, fleet.members.spares()[0].name
        driver.set_slow(victim, 10)  # the batch is certainly on it when it dies
        running = threading.Thread(target=lambda: results.extend(fleet.generate(PROMPTS)))
        results: list = []
        running.start()
        wait_until(lambda: fleet.router.selector.inflight(1) > 0, what="requests on shard 1")
        driver.set_dead(victim)
        running.join(5)
        assert not running.is_alive()
        assert [r.index for r in results] == list(range(len(PROMPTS)))
        assert all(r.ok for r in results)
        assert [r.token_ids for r in results] == [expected_ids(p) for p in PROMPTS]
        # the death watch notes it on its own thread, maybe after the router re-routed the batch
        detection = wait_until(lambda: next((d for d in fleet.monitor.detections if d["name"] == victim), None),
                               what="the death watch's detection")
        assert detection["by"] == "watch"
        wait_until(lambda: fleet.health.state_of(1) is ShardState.HEALTHY, what="slot 1 back")
        assert fleet.handle(1).name == spare  # promoted, no engine start
        assert path_of(fleet, 1)[-4:] == ["dead", "restarting", "stale", "healthy"]
        wait_until(lambda: len(fleet.members.spares()) == 1, what="a new spare")
        assert driver.launched[-1].spare and driver.launched[-1].actor_name == "fake-spare-1"


def test_without_a_spare_a_replacement_is_started_and_caught_up(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        driver.set_dead(fleet.handle(0).name, actor=False)  # the engine died under a live actor
        wait_until(lambda: fleet.health.state_of(0) is ShardState.HEALTHY and fleet.handle(0).name.endswith("-r1"),
                   what="slot 0 replaced")
        assert path_of(fleet, 0)[-4:] == ["dead", "restarting", "stale", "healthy"]
        assert driver.shards["fake-shard-0"].stopped  # the old actor was killed before its replacement
        assert {r.shard for r in fleet.generate(PROMPTS)} == {0, 1}


def test_a_hung_shard_is_condemned_by_a_probe_streak(settings, driver):
    s = settings(health__probe_interval_s=0.01, health__unhealthy_threshold=2, health__auto_recover=False)
    driver.timeouts = type(driver.timeouts)(control_s=0.5, stop_s=0.5, engine_grace_s=0.1, refit_s=1.0)
    with fake_fleet(s.model_copy(update={"health": s.health.model_copy(update={"probe_timeout_s": 1.0})}),
                    driver) as fleet:
        driver.set_hung(fleet.handle(0).name)
        # the ledger turns DEAD first and the monitor notes the detection right after (its own
        # thread): wait for both, or a loaded machine sees the one without the other
        detection = wait_until(lambda: fleet.health.state_of(0) is ShardState.DEAD and next(
            (d for d in fleet.monitor.detections if d["key"] == 0), None), what="the probes to condemn shard 0")
        assert path_of(fleet, 0)[-2:] == ["suspect", "dead"]  # a streak, not one miss
        assert detection["by"] == "probe" and "probe not answered" in detection["reason"]
        assert fleet.health.state_of(1) is ShardState.HEALTHY


def test_generate_async_reroutes_a_request_whose_shard_dies(settings, driver):
    with fake_fleet(settings(health__auto_recover=False), driver) as fleet:
        for h in fleet.shards:
            driver.set_slow(h.name, 0.3)

        async def run():
            tasks = [asyncio.ensure_future(fleet.generate_async(p)) for p in PROMPTS[:4]]
            await asyncio.sleep(0.05)
            driver.set_dead(fleet.handle(0).name)
            return await asyncio.gather(*tasks)

        results = asyncio.run(run())
        assert [r.token_ids for r in results] == [expected_ids(p) for p in PROMPTS[:4]]
        assert {r.shard for r in results} == {1}


def test_a_request_waits_for_a_spare_taking_the_only_slot(settings, driver):
    """One slot and a warm spare: while the spare is promoted no shard serves, and a request
    waits for it (within its deadline, if it has one) instead of failing with FleetExhausted."""
    with fake_fleet(settings(fleet__num_shards=1, fleet__spares=1), driver) as fleet:
        spare = fleet.members.spares()[0].name
        driver.set_slow(spare, 0.3)  # promotion asks the spare twice: ~0.6 s without a serving shard
        driver.set_dead(fleet.handle(0).name)
        wait_until(lambda: fleet.health.serving_shards() == [], what="slot 0 condemned")
        results = fleet.generate(PROMPTS[:2])
        assert all(r.ok for r in results) and fleet.handle(0).name == spare


def test_a_request_on_the_only_shard_when_it_dies_waits_for_the_spare(settings, driver):
    """The re-route comes right after the death, before recovery has taken the loss off its
    queue (its thread is held back here, as a loaded host holds it): the request must see a
    recovery about to begin and wait for the spare, not fail with FleetExhausted."""
    with fake_fleet(settings(fleet__num_shards=1, fleet__spares=1), driver) as fleet:
        victim, spare = fleet.handle(0).name, fleet.members.spares()[0].name
        drain, held_back = fleet.recovery.drain, threading.Event()

        def slow_to_drain():
            if fleet.members.table.has_losses():
                held_back.set()
                time.sleep(0.5)
            drain()

        fleet.recovery.drain = slow_to_drain
        driver.set_slow(victim, 10)  # the batch is certainly on it when it dies
        results: list = []
        running = threading.Thread(target=lambda: results.extend(fleet.generate(PROMPTS[:4])))
        running.start()
        wait_until(lambda: fleet.router.selector.inflight(0) > 0, what="requests on shard 0")
        driver.set_dead(victim)
        running.join(10)
        assert held_back.is_set() and not running.is_alive()
        assert [r.index for r in results] == [0, 1, 2, 3] and all(r.ok for r in results), results
        assert {r.shard for r in results} == {0} and fleet.handle(0).name == spare


def test_losing_every_shard_raises_fleet_exhausted(settings, driver):
    with fake_fleet(settings(health__auto_recover=False), driver) as fleet:
        for h in fleet.shards:
            driver.set_dead(h.name)
        wait_until(lambda: fleet.health.serving_shards() == [], what="both condemned")
        with pytest.raises(FleetExhausted, match=r"only 0 generation shard\(s\) serving"):
            fleet.generate(PROMPTS)


def test_restarts_that_keep_failing_retire_the_slot(settings, driver):
    with fake_fleet(settings(health__max_restart_attempts_per_shard=2), driver) as fleet:
        driver.launch_failures = [EngineStartError(1, "CUDA error"), EngineStartError(1, "CUDA error")]
        driver.set_dead(fleet.handle(1).name)
        wait_until(lambda: fleet.health.state_of(1) is ShardState.RETIRED, what="slot 1 retired")
        # A failed attempt leaves the slot RESTARTING (the ledger's rule); each one counts.
        assert path_of(fleet, 1) == ["dead", "restarting", "retired"]
        assert "retired after 2 restart attempt(s)" in fleet.health.snapshot()[1].last_error
        assert len(driver.launched) == 2 + 2  # the fleet, then one launch per attempt
        assert {r.shard for r in fleet.generate(PROMPTS)} == {0}


def test_a_data_failure_on_restart_retires_at_once(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        driver.launch_failures = [PlacementError("the cluster cannot hold it")]
        driver.set_dead(fleet.handle(1).name)
        wait_until(lambda: fleet.health.state_of(1) is ShardState.RETIRED, what="slot 1 retired")
        assert "restart failed: PlacementError" in fleet.health.snapshot()[1].last_error
        assert len(driver.launched) == 2 + 1  # no second attempt


def _tensors():
    import torch

    return {"w": torch.ones(4, 4), "b": torch.zeros(4)}


def test_a_refit_moves_every_shard_and_spare_and_stamps_results(settings, driver, tmp_path):
    with fake_fleet(settings(fleet__spares=1, refit__staging_dir=str(tmp_path)), driver) as fleet:
        report = fleet.refit(_tensors(), version=7)
        assert report.version == 7 and fleet.weight_version == 7
        assert sorted(s.shard for s in report.shards if s.ok) == [0, 1]
        assert {driver.shard(h).weight_version for h in fleet.shards + fleet.members.spares()} == {7}
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {7}
        with pytest.raises(RefitError, match="not newer"):
            fleet.refit(_tensors(), version=7)


def test_a_bad_manifest_changes_nothing(settings, driver, tmp_path):
    import torch

    with fake_fleet(settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        with pytest.raises(RefitError, match="w"):
            fleet.refit({"w": torch.ones(3, 4), "b": torch.zeros(4)})
        assert fleet.weight_version == 0
        assert {driver.shard(h).weight_version for h in fleet.shards} == {0}
        assert fleet.health.serving_shards() == [0, 1]


def test_a_shard_that_fails_while_loading_is_quarantined_the_rest_move_on(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path), health__auto_recover=False), driver) as fleet:
        driver.shard(fleet.handle(1)).fail_load = "out of memory while loading"
        report = fleet.refit(_tensors())
        assert [(s.shard, s.ok) for s in sorted(report.shards, key=lambda s: s.shard)] == [(0, True), (1, False)]
        assert "out of memory while loading" in next(s.error for s in report.shards if not s.ok)
        assert fleet.weight_version == 1 and fleet.health.state_of(1) is ShardState.DEAD
        assert {(r.shard, r.weight_version) for r in fleet.generate(PROMPTS)} == {(0, 1)}


def test_a_shard_that_fails_while_loading_is_healed_by_the_self_healing_fleet(settings, driver, tmp_path):
    # The quarantine queues a loss: recovery replaces the live but untrusted shard, and the
    # replacement catches up to the version the others loaded (it used to stay DEAD for good).
    with fake_fleet(settings(refit__staging_dir=str(tmp_path), health__auto_recover=True), driver) as fleet:
        victim = fleet.handle(1).name
        driver.shard(fleet.handle(1)).fail_load = "out of memory while loading"
        report = fleet.refit(_tensors())
        assert [s.shard for s in report.shards if not s.ok] == [1] and fleet.weight_version == 1
        wait_until(lambda: fleet.health.state_of(1) is ShardState.HEALTHY, what="slot 1 healthy again")
        assert fleet.handle(1).name != victim and driver.shard(fleet.handle(1)).weight_version == 1
        assert path_of(fleet, 1)[-4:] == ["dead", "restarting", "stale", "healthy"]
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


def test_a_shard_frozen_while_loading_is_given_up_on_at_the_refit_deadline_and_healed(settings, driver, tmp_path):
    from nemo_gen.core.wire import LoadRefit

    with fake_fleet(settings(refit__staging_dir=str(tmp_path), health__auto_recover=True), driver) as fleet:
        victim = fleet.handle(1).name
        send = driver.fan_out

        def freezing_on_load(handles, message, margin_s):  # it passed the check; it freezes now
            if isinstance(message, LoadRefit):
                driver.set_hung(victim)
            return send(handles, message, margin_s)

        driver.fan_out = freezing_on_load
        t0 = time.monotonic()
        report = fleet.refit(_tensors())
        elapsed = time.monotonic() - t0
        driver.fan_out = send
        driver.set_hung(victim, False)  # it thaws: alive, and still not to be trusted
        (lost,) = report.failed
        assert lost.shard == 1 and "did not answer" in lost.error
        # The deadline is driver.timeouts.refit_s (1 s); a bound with room for a loaded machine,
        # below the old deadline (refit_s + 60 s).
        assert elapsed < driver.timeouts.refit_s + 30
        wait_until(lambda: fleet.health.state_of(1) is ShardState.HEALTHY, what="slot 1 healthy again")
        assert fleet.handle(1).name != victim and driver.shard(fleet.handle(1)).weight_version == 1


def test_a_shard_refusing_the_staged_weights_refuses_the_refit_everywhere(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        driver.shard(fleet.handle(1)).refuse_refit = "cannot map the staging file"
        with pytest.raises(RefitError, match="no weight was changed: shard 1 cannot read"):
            fleet.refit(_tensors())
        assert fleet.weight_version == 0 and fleet.health.serving_shards() == [0, 1]


def test_a_replacement_catches_up_to_the_last_refit(settings, driver, tmp_path):
    with fake_fleet(settings(refit__staging_dir=str(tmp_path)), driver) as fleet:
        fleet.refit(_tensors(), version=3)
        driver.set_dead(fleet.handle(0).name)
        wait_until(lambda: fleet.health.state_of(0) is ShardState.HEALTHY and fleet.handle(0).name.endswith("-r1"),
                   what="slot 0 replaced")
        assert driver.shard(fleet.handle(0)).weight_version == 3  # loaded from the staged refit
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {3}


def test_train_mode_serves_nothing_before_the_first_refit(settings, driver, tmp_path):
    with fake_fleet(settings(fleet__mode="train", refit__staging_dir=str(tmp_path)), driver) as fleet:
        assert fleet.health.serving_shards() == []
        with pytest.raises(ShardUnavailableError, match="has not been refit yet"):
            fleet.generate(PROMPTS)
        fleet.refit(_tensors())
        assert fleet.health.serving_shards() == [0, 1] and fleet.weight_version == 0


def test_the_heal_path_probes_plans_and_restarts_without_a_monitor(settings, driver):
    from nemo_gen.core.planner import Restart
    from nemo_gen.fleet.recovery import restart_shard

    with fake_fleet(settings(), driver, watch=False) as fleet:
        driver.set_dead(fleet.handle(1).name)
        probes = fleet.probe_once()
        assert [p["ok"] for p in probes] == [True, False]
        assert fleet.health.state_of(1) is ShardState.DEAD  # condemned at once: a dead actor is certain
        assert fleet.recovery.plan() == [Restart(1, 1)]
        out = restart_shard(fleet, 1)
        assert out["action"] == "restarted" and fleet.health.state_of(1) is ShardState.HEALTHY
        assert fleet.recovery.plan() == []


def test_status_lists_slots_then_spares(settings, driver):
    with fake_fleet(settings(fleet__spares=1), driver) as fleet:
        rows = fleet.status()
        assert [(r.index, r.state, r.name) for r in rows] == [
            (0, "healthy", "fake-shard-0"), (1, "healthy", "fake-shard-1"), (2, "spare", "fake-spare-0")]
        driver.set_hung(fleet.handle(1).name)
        fleet.settings.health.auto_recover = False
        rows = fleet.status()  # a shard that does not answer info shows dead; recovery is told
        assert rows[1].state == "dead"
        wait_until(lambda: fleet.health.state_of(1) is ShardState.DEAD, what="the loss drained")


def test_status_only_reads_a_loss_it_sees_is_queued_for_recovery(settings, driver):
    from nemo_gen.core.planner import Restart

    with fake_fleet(settings(), driver, watch=False) as fleet:
        driver.set_dead(fleet.handle(1).name)
        before = fleet.health.snapshot()
        assert [r.state for r in fleet.status()] == ["healthy", "dead"]
        assert fleet.health.snapshot() == before  # the ledger is untouched: a read never writes
        assert fleet.recovery.plan() == [Restart(1, 1)]  # the queued loss, drained by the planner
        assert fleet.health.state_of(1) is ShardState.DEAD


def test_n_samples_come_back_as_one_result_from_one_shard(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        results = fleet.generate(PROMPTS[:4], n=3)
        for r, p in zip(results, PROMPTS):
            assert len(r.samples) == 3 and r.token_ids == r.samples[0].token_ids == expected_ids(p)
            assert len({tuple(s.token_ids) for s in r.samples}) == 3
        assert sum(driver.shard(h).generated for h in fleet.shards) == 4  # one request per prompt, not 12
        assert "samples" in results[0].to_json() and "samples" not in fleet.generate(PROMPTS[:1])[0].to_json()
        with pytest.raises(RequestError, match="n must be a positive integer"):
            fleet.generate(PROMPTS[:1], n=0)
        with pytest.raises(RequestError, match="need temperature > 0"):
            fleet.generate(PROMPTS[:1], n=2, temperature=0)


def test_chat_prompts_are_rendered_with_the_chat_template(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        chat = [{"role": "user", "content": "Hello there"}]
        (r,) = fleet.generate([chat])
        assert r.ok and r.prompt == "<s>user\nHello there</s>\n<s>assistant\n"
        assert r.prompt_token_ids == fleet.router.tokenizer(r.prompt, add_special_tokens=False)["input_ids"]
        with pytest.raises(RequestError, match="string 'role' and 'content'"):
            fleet.generate([[{"role": "user"}]])
        fleet.router.tokenizer.chat_template = None
        (bad, ok) = fleet.generate([chat, "plain"])
        assert not bad.ok and "no chat template" in bad.error and ok.ok


def test_a_session_stays_on_its_shard_and_moves_when_it_is_busy_or_gone(settings, driver):
    with fake_fleet(settings(fleet__session_affinity_slack=1, health__auto_recover=False), driver) as fleet:
        first = fleet.generate(["turn one"], session_id="s")[0].shard
        for turn in range(3):  # unloaded fleet: every turn on the same shard
            assert fleet.generate([f"turn {turn}"], session_id="s")[0].shard == first
        other = 1 - first
        # Its shard busier than the least-loaded one by more than the slack: the session moves.
        for _ in range(2):
            fleet.router.selector.acquire(first)
        assert fleet.generate(["busy"], session_id="s")[0].shard == other
        for _ in range(2):
            fleet.router.selector.release(first)
        assert fleet.generate(["follows"], session_id="s")[0].shard == other  # it stays where it moved
        driver.set_dead(fleet.handle(other).name)
        wait_until(lambda: fleet.health.state_of(other) is ShardState.DEAD, what="its shard condemned")
        assert fleet.generate(["after the loss"], session_id="s")[0].shard == first
        # One id per prompt in a batch.
        rs = fleet.generate(["a", "b"], session_id=["s", None])
        assert rs[0].shard == first
        with pytest.raises(RequestError, match="session_id has 1 entries for 2 prompts"):
            fleet.generate(["a", "b"], session_id=["s"])


def test_a_launch_is_all_or_none(settings, driver):
    """One engine failing to start stops the others it started and raises that failure."""
    # The first launch succeeds (None), the second fails.
    driver.launch_failures = [None, EngineStartError(1, "not ready within fleet.engine_start_timeout_s=600s")]
    with pytest.raises(EngineStartError, match="engine_start_timeout_s"):
        fake_fleet(settings(), driver)
    (started,) = driver.shards.values()
    assert started.stopped  # the one that came up was stopped again


def test_attaching_seeds_the_ledger_from_what_the_actors_and_the_record_say():
    from nemo_gen.core.fleet_health import GenerationFleetHealth
    from nemo_gen.core.planner import attach_seeds
    from nemo_gen.core.slots import SlotTable

    infos = {0: ShardInfo(slot=0, weight_version=4, weight_source="/ckpt/4", restarts=2),
             1: ShardInfo(slot=1, weight_version=3),
             3: ShardInfo(slot=3, weight_version=4, unresponsive="GetTimeoutError: info")}
    version, source, seeds = attach_seeds(4, infos, recorded=None)
    assert (version, source) == (4, "/ckpt/4")  # the newest version any shard holds, and its source
    health = GenerationFleetHealth(4)
    SlotTable(health=health).seed(seeds, version)
    assert [health.state_of(i).value for i in range(4)] == ["healthy", "stale", "dead", "dead"]
    assert health.snapshot()[0].restart_attempts == 2 and "not found" in health.snapshot()[2].last_error
    # The record outlives every shard: its version wins, and version 4's checkpoint is not version 5's.
    assert attach_seeds(4, infos, recorded=FleetRecordState("f", weight_version=5))[:2] == (5, None)
    assert attach_seeds(4, infos, recorded=FleetRecordState("f", weight_version=4))[:2] == (4, "/ckpt/4")


def test_spares_follow_fleet_spares_changed_on_a_live_fleet(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        assert fleet.members.spares() == []
        fleet.settings.fleet.spares = 1
        fleet.replenish_spares()
        wait_until(lambda: len(fleet.members.spares()) == 1, what="the new spare")
        assert driver.launched[-1].spare


def test_retirement_and_the_restart_budget_outlive_the_process_that_decided_them():
    from nemo_gen.core.fleet_health import GenerationFleetHealth
    from nemo_gen.core.planner import attach_seeds
    from nemo_gen.core.slots import SlotTable

    recorded = FleetRecordState("f", weight_version=2, slots=(
        SlotRecord(1, restarts=3, retired="restart attempts exhausted"), SlotRecord(0, restarts=2)))
    infos = {0: ShardInfo(slot=0, weight_version=2, restarts=1)}
    _, _, seeds = attach_seeds(2, infos, recorded)
    health = GenerationFleetHealth(2)
    SlotTable(health=health).seed(seeds, 2)
    assert health.state_of(1) is ShardState.RETIRED and health.snapshot()[1].restart_attempts == 3
    assert health.state_of(0) is ShardState.HEALTHY and health.snapshot()[0].restart_attempts == 2


def test_recovery_writes_restarts_and_retirement_to_the_fleet_record(settings, driver):
    written = []
    with fake_fleet(settings(health__max_restart_attempts_per_shard=1), driver) as fleet:
        fleet.weights.record.write_slot = lambda slot, restarts, retired: written.append(  # the record's stand-in
            {"slot": slot, "restarts": restarts, "retired": retired})
        driver.launch_failures = [EngineStartError(1, "CUDA error")]
        driver.set_dead(fleet.handle(1).name)
        wait_until(lambda: fleet.health.state_of(1) is ShardState.RETIRED, what="slot 1 retired")
    slot1 = [w for w in written if w.get("slot") == 1]
    assert slot1[0]["restarts"] == 1 and slot1[-1]["retired"]


def test_the_fleet_records_slot_entries_are_replaced_whole_and_kept_in_slot_order():
    state = FleetRecordState("f").with_slot(SlotRecord(2, restarts=1)).with_slot(SlotRecord(0, restarts=4))
    state = state.with_slot(SlotRecord(2, restarts=2, retired="restart attempts exhausted"))
    assert state.slots == (SlotRecord(0, restarts=4), SlotRecord(2, restarts=2, retired="restart attempts exhausted"))
    assert state.slot(2).retired and state.slot(1) is None
