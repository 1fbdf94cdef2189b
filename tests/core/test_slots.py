"""The slot table (``nemo_gen.core.slots``): transactions are all-or-nothing, losses are queued
events, reads never write. Pure: strings stand in for actor handles; milliseconds.

Checked by mutation (each line below removed from the table, the named test fails):
``_require_restarting`` in ``promote`` (test_a_promotion_into_a_slot_not_being_restarted_changes_nothing);
the spare put back in ``promote``'s ``except``, and ``mark_dead`` in ``_swap``'s rollback
(test_a_promotion_whose_ledger_step_fails_puts_both_back); the old handle put back in ``_swap``
(that test and test_a_replacement_whose_ledger_step_fails_leaves_the_old_actor); ``is_current``
in ``condemn`` (test_old_news_condemns_nothing); ``_closed`` in ``condemn``
(test_a_queued_loss_wakes_a_waiter_and_closing_wakes_it_empty_handed); ``quarantine`` marking
DEAD without queuing the loss (test_a_quarantined_slot_leaves_service_and_queues_a_loss; in the
fleet's fast tier both ..._healed tests of tests/fake/test_fleet_logic.py); the version check in
``promote`` (test_a_spare_behind_the_version_is_not_promoted); ``condemn`` queuing the loss
without marking DEAD (test_condemning_takes_the_slot_out_at_once_and_queues_the_loss, and
test_the_heal_path_probes_plans_and_restarts_without_a_monitor).
"""

from __future__ import annotations

import threading

import pytest

from nemo_gen.core.fleet_health import GenerationFleetHealth, ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.slots import ShardLost, SlotConflict, SlotTable


def _table(spares=("spare-0",), spare_version: int | None = 3) -> tuple[SlotTable[str], GenerationFleetHealth]:
    health = GenerationFleetHealth(shard_count=2)
    for i in range(2):
        health.mark_loaded(i)
        health.report_refit(i, 3)
    table = SlotTable(health=health, slots=[(0, "a", "handle-a", 3), (1, "b", "handle-b", 3)],
                      spares=[(n, f"handle-{n}", spare_version) for n in spares])
    return table, health


def _restarting(table: SlotTable[str], health: GenerationFleetHealth, slot: int, name: str) -> None:
    assert table.condemn(Member(name, slot), "gone")
    health.mark_restarting(slot)


def _state(table: SlotTable[str], health: GenerationFleetHealth):
    return table.slots(), table.spares(), [(s.state, s.weight_version) for s in health.snapshot()]


def test_a_promotion_moves_the_spare_into_the_slot_healthy_at_the_version():
    table, health = _table()
    _restarting(table, health, 1, "b")
    member = table.promote(1, "spare-0", 3)
    assert member == Member("spare-0", 1)
    assert table.handle(1) == "handle-spare-0" and table.spares() == {}
    assert health.state_of(1) is ShardState.HEALTHY and table.version_of(member) == 3
    assert not table.is_current(Member("b", 1)) and table.is_current(member)


def test_a_promotion_before_the_first_refit_leaves_the_slot_stale():
    table, health = _table(spare_version=None)
    _restarting(table, health, 1, "b")
    table.promote(1, "spare-0", None)
    assert health.state_of(1) is ShardState.STALE


def test_a_promotion_into_a_slot_not_being_restarted_changes_nothing():
    table, health = _table()
    health.retire(1, "spent")
    before = _state(table, health)
    with pytest.raises(SlotConflict, match="retired, not restarting"):
        table.promote(1, "spare-0", 3)
    assert _state(table, health) == before


def test_a_spare_behind_the_version_is_not_promoted():
    table, health = _table(spare_version=2)
    _restarting(table, health, 1, "b")
    before = _state(table, health)
    with pytest.raises(SlotConflict, match="holds version 2, the slot needs 3"):
        table.promote(1, "spare-0", 3)
    assert _state(table, health) == before and health.state_of(1) is ShardState.RESTARTING


def test_a_promotion_of_a_spare_taken_meanwhile_changes_nothing():
    table, health = _table()
    _restarting(table, health, 1, "b")
    assert table.pop_spare("spare-0") == "handle-spare-0"
    before = _state(table, health)
    with pytest.raises(SlotConflict, match="no longer in the pool"):
        table.promote(1, "spare-0", 3)
    assert _state(table, health) == before


class _Boom(Exception):
    pass


def test_a_promotion_whose_ledger_step_fails_puts_both_back(monkeypatch):
    table, health = _table()
    _restarting(table, health, 1, "b")

    def fail(slot, version):
        raise _Boom("ledger")

    monkeypatch.setattr(health, "report_refit", fail)
    with pytest.raises(_Boom):
        table.promote(1, "spare-0", 3)
    assert table.handle(1) == "handle-b" and table.spares() == {"spare-0": "handle-spare-0"}
    assert health.state_of(1) is ShardState.DEAD  # out of service, for recovery to try again
    assert health.serving_shards() == [0]


def test_a_replacement_is_installed_stale_without_a_version():
    table, health = _table()
    _restarting(table, health, 0, "a")
    member = table.install_replacement(0, "a-r1", "handle-a-r1")
    assert table.handle(0) == "handle-a-r1" and health.state_of(0) is ShardState.STALE
    assert table.version_of(member) is None and table.spares() == {"spare-0": "handle-spare-0"}


def test_a_replacement_whose_ledger_step_fails_leaves_the_old_actor(monkeypatch):
    table, health = _table()
    _restarting(table, health, 0, "a")

    def fail(slot, base_url=None):
        raise _Boom("ledger")

    monkeypatch.setattr(health, "mark_loaded", fail)
    with pytest.raises(_Boom):
        table.install_replacement(0, "a-r1", "handle-a-r1")
    assert table.handle(0) == "handle-a" and table.is_current(Member("a", 0))


def test_a_replacement_for_a_serving_slot_is_refused():
    table, health = _table()
    before = _state(table, health)
    with pytest.raises(SlotConflict, match="healthy, not restarting"):
        table.install_replacement(0, "a-r1", "handle-a-r1")
    assert _state(table, health) == before


def test_condemning_takes_the_slot_out_at_once_and_queues_the_loss():
    table, health = _table()
    assert table.condemn(Member("b", 1), "engine exited")
    assert health.serving_shards() == [0]
    assert table.drain_losses() == [ShardLost(Member("b", 1), "engine exited")]
    assert table.drain_losses() == []


def test_old_news_condemns_nothing():
    table, health = _table()
    _restarting(table, health, 1, "b")
    table.install_replacement(1, "b-r1", "handle-b-r1")
    table.drain_losses()
    assert not table.condemn(Member("b", 1), "the old actor's death, seen late")
    assert health.state_of(1) is ShardState.STALE and table.drain_losses() == []


def test_a_spare_condemned_stays_in_the_pool_until_recovery_drops_it():
    table, health = _table()
    assert table.condemn(Member("spare-0", None), "refit failed")
    assert table.spares() == {"spare-0": "handle-spare-0"}
    assert table.drain_losses() == [ShardLost(Member("spare-0", None), "refit failed")]


def test_a_reported_loss_is_only_queued():
    table, health = _table()
    before = _state(table, health)
    table.report_loss(Member("a", 0), "info: actor died")
    assert _state(table, health) == before
    assert table.drain_losses() == [ShardLost(Member("a", 0), "info: actor died")]


def test_a_queued_loss_wakes_a_waiter_and_closing_wakes_it_empty_handed():
    table, _ = _table()
    seen: list[bool] = []
    waiter = threading.Thread(target=lambda: seen.append(table.wait_losses(5.0)))
    waiter.start()
    table.report_loss(Member("a", 0), "x")
    waiter.join(5.0)
    assert seen == [True]
    table.drain_losses()
    table.close()
    assert table.wait_losses(5.0) is False
    assert not table.condemn(Member("a", 0), "shutting down")  # a closing fleet condemns nothing


def test_versions_follow_their_member_only():
    table, _ = _table()
    assert table.note_version(Member("spare-0", None), 4)
    assert not table.note_version(Member("gone", None), 5)
    assert not table.note_version(Member("x", 0), 5)  # slot 0 is "a"'s
    assert table.ready_spares(4) == ["spare-0"] and table.ready_spares(3) == []
    assert table.version_of(Member("a", 0)) == 3


def test_a_quarantined_slot_leaves_service_and_queues_a_loss():
    table, health = _table()
    assert table.quarantine(Member("b", 1), "refit to version 4 failed: load_refit did not answer")
    assert health.state_of(1) is ShardState.DEAD and health.serving_shards() == [0]
    assert table.drain_losses() == [ShardLost(Member("b", 1), "refit to version 4 failed: load_refit did not answer")]
    assert not table.quarantine(Member("old", 1), "old news")  # not the slot's actor: nothing done
    assert table.drain_losses() == []


def test_a_refit_result_moves_the_version_and_the_state_together():
    table, health = _table()
    health.mark_dead(1, "x")
    health.mark_restarting(1)
    member = table.install_replacement(1, "b-r1", "handle-b-r1")
    assert table.record_refit(member, 4)
    assert health.state_of(1) is ShardState.HEALTHY and table.version_of(member) == 4
    assert health.snapshot()[1].weight_version == 4
    assert not table.record_refit(Member("b", 1), 5)  # the replaced actor's late news
    assert table.version_of(member) == 4 and health.snapshot()[1].weight_version == 4
    table.keep_stale(1)
    assert health.state_of(1) is ShardState.STALE


def test_a_drained_loss_takes_its_slot_out_once_and_old_news_not_at_all():
    table, health = _table()
    table.report_loss(Member("a", 0), "info: actor died")
    table.report_loss(Member("old", 1), "an earlier actor's death")
    first, second = table.drain_losses()
    assert table.confirm_loss(first) and health.state_of(0) is ShardState.DEAD
    assert not table.confirm_loss(second) and health.state_of(1) is ShardState.HEALTHY


def test_probes_requests_and_restarts_go_through_the_table():
    table, health = _table()
    threshold = health.policy.unhealthy_threshold
    states = [table.record_probe_answer(1, False, "probe failed") for _ in range(threshold)]
    assert states[-1] is ShardState.DEAD
    assert table.begin_restart(1) is ShardState.RESTARTING
    table.restart_failed(1, "EngineStartError: not ready", retire=False)
    assert health.state_of(1) is ShardState.RESTARTING  # no engine to kill: it stays as it was
    table.restart_failed(0, "PlacementError: no node", retire=True)
    assert health.state_of(0) is ShardState.RETIRED
    assert "PlacementError" in health.snapshot()[0].last_error
    table.record_success(1)  # (not serving: ignored, nothing raised)


def test_seeding_enters_each_slot_as_its_seed_says():
    from nemo_gen.core.planner import Seed

    health = GenerationFleetHealth(shard_count=4)
    table = SlotTable(health=health)
    table.seed([Seed(0, ShardState.HEALTHY, "", 1), Seed(1, ShardState.STALE, "", 0),
                Seed(2, ShardState.DEAD, "not found", 2), Seed(3, ShardState.RETIRED, "spent", 5)], version=6)
    assert [(s.state, s.restart_attempts) for s in health.snapshot()] == [
        (ShardState.HEALTHY, 1), (ShardState.STALE, 0), (ShardState.DEAD, 2), (ShardState.RETIRED, 5)]
    assert health.snapshot()[0].weight_version == 6


def test_the_ledger_view_reads_and_cannot_write():
    table, health = _table()
    view = table.ledger
    assert view.serving_shards() == health.serving_shards() and view.state_of(1) is ShardState.HEALTHY
    assert view.membership_epoch == health.membership_epoch and view.policy is health.policy
    with pytest.raises(AttributeError):
        view.mark_dead(1, "x")  # type: ignore[attr-defined]
