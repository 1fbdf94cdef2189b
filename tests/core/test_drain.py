"""Drain decisions (``nemo_gen.core.drain``) and the slot table's ``drain`` transaction
(``nemo_gen.core.slots``): what may be drained, that a drained slot leaves service at once
without queuing a loss, that its later death is no news, and that a drain's moves are named
and uncounted. Pure: milliseconds. The fleet: tests/fake/test_drain_fleet.py; real engines:
tests/engine/test_drain.py."""

from __future__ import annotations

import pytest

from nemo_gen.core.drain import move_cause, refusal
from nemo_gen.core.fleet_health import GenerationFleetHealth, ShardState
from nemo_gen.core.members import Member
from nemo_gen.core.migration import Kept, Migrations
from nemo_gen.core.results import GenerationRequest, GenerationResult, MoveCause, Moved
from nemo_gen.core.slots import SlotTable
from nemo_gen.core.wire import FailureKind, Sampling

H, D, S = ShardState.HEALTHY, ShardState.DEAD, ShardState.SUSPECT


def test_a_serving_shard_with_another_serving_may_be_drained():
    assert refusal({0: H, 1: H}, 1) is None
    assert refusal({0: S, 1: H, 2: D}, 0) is None  # a suspect shard serves, so it may go, and stay


@pytest.mark.parametrize("states, shard, words", [
    ({0: H, 1: H}, 7, ["shard 7", "no such shard", "0, 1"]),
    ({0: H, 1: H}, -1, ["shard -1", "no such shard"]),
    ({0: H, 1: D}, 1, ["shard 1 is dead", "not serving"]),
    ({0: H, 1: ShardState.RETIRED}, 1, ["shard 1 is retired"]),
    ({0: H, 1: D, 2: ShardState.STALE}, 0, ["shard 0", "last serving shard"]),
    ({0: H}, 0, ["shard 0", "last serving shard"]),
])
def test_what_cannot_act_is_refused_naming_the_shard(states, shard, words):
    why = refusal(states, shard)
    assert why is not None and all(w in why for w in words), why


def test_only_a_dead_loss_on_a_drained_shard_is_a_drain():
    assert move_cause(FailureKind.DEAD, drained=True) is MoveCause.DRAINED
    assert move_cause(FailureKind.DEAD, drained=False) is MoveCause.LOST
    assert move_cause(FailureKind.BUSY, drained=True) is MoveCause.LOST


def _table() -> tuple[SlotTable[str], GenerationFleetHealth]:
    health = GenerationFleetHealth(shard_count=2)
    for i in range(2):
        health.mark_loaded(i)
        health.report_refit(i, 3)
    return SlotTable(health=health, slots=[(0, "a", "handle-a", 3), (1, "b", "handle-b", 3)]), health


def test_a_drained_slot_leaves_service_at_once_and_queues_no_loss():
    table, health = _table()
    assert table.drain(Member("b", 1), "planned restart")
    assert health.state_of(1) is ShardState.DEAD and health.serving_shards() == [0]
    assert "drained: planned restart" in (health.snapshot()[1].last_error or "")
    assert not table.has_losses()  # the drainer acts, not recovery's loss queue
    assert table.was_drained(Member("b", 1)) and not table.was_drained(Member("a", 0))


def test_a_drained_members_death_is_no_news_and_a_fault_is_not_a_drain():
    table, health = _table()
    assert table.drain(Member("b", 1), "x")
    assert not table.condemn(Member("b", 1), "its actor died (the restart's reap)")
    assert not table.has_losses()
    assert table.condemn(Member("a", 0), "gone") and not table.was_drained(Member("a", 0))


def test_a_drain_of_what_is_not_current_or_not_serving_changes_nothing():
    table, health = _table()
    assert not table.drain(Member("old-b", 1), "x")  # replaced meanwhile
    assert not table.drain(Member("spare-0", None), "x")
    assert table.condemn(Member("a", 0), "gone")
    assert not table.drain(Member("a", 0), "x")  # dead already: not a drain
    assert not table.was_drained(Member("a", 0)) and health.state_of(1) is ShardState.HEALTHY


def test_a_replacement_in_a_drained_slot_is_not_drained():
    table, health = _table()
    assert table.drain(Member("b", 1), "planned restart")
    assert table.begin_restart(1) is ShardState.RESTARTING
    member = table.install_replacement(1, "b-r1", "handle-b-r1")
    assert not table.was_drained(member)
    assert table.condemn(member, "the new one died")  # its death is news again
    assert table.has_losses()


def test_a_drains_moves_name_the_drain_and_a_loss_names_a_loss():
    m = Migrations(Sampling(max_new_tokens=10, temperature=0.0))
    drained, lost = Migrations.keyed([GenerationRequest(0, [7]), GenerationRequest(1, [8])], "c0")
    m.lost(drained, 1, [Kept([1, 2], [-0.1, -0.2], [[0, 2]])], MoveCause.DRAINED)
    m.lost(lost, 1, [Kept([3], [-0.3], [[0, 1]])])
    assert m.moves(0) == [Moved(1, 2, 0, MoveCause.DRAINED)]
    assert m.moves(1) == [Moved(1, 1, 0, MoveCause.LOST)]
    result = GenerationResult(index=0, prompt=None, text="", prompt_token_ids=[7], token_ids=[1], logprobs=[0.0],
                              migrations=m.moves(0))
    assert result.to_json()["migrations"] == [{"from_shard": 1, "at_token": 2, "sample": 0, "cause": "drained"}]
