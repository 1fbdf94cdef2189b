"""The rolling refit's pure decisions (nemo_gen.core.waves) and its settings (refit.rollout,
refit.wave_size, refit.min_serving): which combinations act, wave order and size under the floor,
where new requests go while two versions serve, and the slot table's roll state."""

from __future__ import annotations

import os

import pytest

from nemo_gen.core.fleet_health import GenerationFleetHealth
from nemo_gen.core.slots import SlotConflict, SlotTable
from nemo_gen.core.waves import Roll, RollOutcome, Rollout, WavePlan, newest, rollout_problem
from nemo_gen.errors import ConfigError
from nemo_gen.settings import ENV_PREFIX, NemoGenSettings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in list(os.environ):
        if key.upper().startswith(ENV_PREFIX):
            monkeypatch.delenv(key)


def _refused(**overrides) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(overrides=overrides)
    return info.value


def test_the_default_is_all_at_once_and_waves_defaults_to_one_shard_at_a_time():
    s = NemoGenSettings.load()
    assert s.refit.rollout is Rollout.ALL and s.refit.wave_size is None and s.refit.min_serving is None
    s = NemoGenSettings.load(overrides={"fleet.num_shards": 4, "refit.rollout": "waves"})
    assert s.refit.rollout is Rollout.WAVES
    assert WavePlan.of(s.refit.wave_size, s.refit.min_serving, 4) == WavePlan(1, 3)
    assert WavePlan.of(2, None, 4) == WavePlan(2, 2) and WavePlan.of(1, 2, 4) == WavePlan(1, 2)


@pytest.mark.parametrize("overrides, field, words", [
    ({"refit.wave_size": 1}, "refit.wave_size", "only acts with refit.rollout=waves"),
    ({"refit.min_serving": 1}, "refit.min_serving", "only acts with refit.rollout=waves"),
    ({"refit.rollout": "waves", "fleet.num_shards": 2, "refit.wave_size": 2}, "refit.wave_size", "nothing serves"),
    ({"refit.rollout": "waves", "fleet.num_shards": 1}, "refit.wave_size", "nothing serves"),
    ({"refit.rollout": "waves", "fleet.num_shards": 4, "refit.wave_size": 2, "refit.min_serving": 3},
     "refit.min_serving", "fleet.num_shards - refit.wave_size = 2"),
    ({"refit.rollout": "waves", "refit.in_flight": "keep"}, "refit.in_flight", "lets its running requests finish"),
    ({"refit.rollout": "some"}, "refit.rollout", ""),
    ({"refit.rollout": "waves", "refit.wave_size": 0}, "refit.wave_size", ""),
])
def test_a_combination_that_cannot_act_is_refused_naming_the_key(overrides, field, words):
    err = _refused(**overrides)
    assert err.field == field and words in str(err)


def test_rollout_problem_is_none_where_waves_can_act():
    assert rollout_problem(Rollout.ALL, None, None, 1) is None
    assert rollout_problem(Rollout.WAVES, 1, 1, 2) is None
    assert rollout_problem(Rollout.WAVES, 2, 2, 4) is None
    assert rollout_problem(Rollout.WAVES, 3, 1, 4) is None


def test_waves_go_fewest_sessions_first_and_never_under_the_floor():
    plan = WavePlan(2, 2)
    order = plan.order([0, 1, 2, 3], {0: 3, 2: 1})
    assert order == [1, 3, 2, 0]  # shards with open sessions last, so those sessions can end first
    assert plan.next_wave(order, serving=4) == (1, 3)
    assert plan.next_wave(order, serving=3) == (1,)  # one shard is down: a smaller wave keeps the floor
    assert plan.next_wave(order, serving=2) == ()  # no wave can move
    assert WavePlan(1, 3).next_wave([2, 3], serving=4) == (2,)


def test_new_requests_go_to_the_newest_version_serving_and_not_to_a_moving_shard():
    versions = {0: 1, 1: 0, 2: 0, 3: 0}
    assert newest(versions, None) == [0, 1, 2, 3]  # no roll: every serving shard
    assert newest({0: 0, 1: 0, 2: 0, 3: 0}, Roll(0, 1, frozenset({0}))) == [1, 2, 3]  # wave 1 loading
    assert newest(versions, Roll(0, 1, frozenset({1}))) == [0]  # shard 0 moved: it takes the new ones
    assert newest({0: 1, 1: 0}, Roll(0, 1, frozenset({0, 1}))) == []
    assert newest({0: None, 1: 0}, Roll(None, 1)) == [1]  # a shard with no version is never the newest


def test_a_stopped_roll_names_each_shards_version():
    out = RollOutcome(3, 4, on_new=(0, 1), on_old=(2, 3), failed=(), error="shard 2 cannot read")
    text = out.describe()
    assert "shard 2 cannot read" in text and "shards [0, 1] serve version 4" in text and "shards [2, 3] version 3" in text


def test_the_slot_table_holds_the_roll_and_each_shards_version():
    table = SlotTable(health=GenerationFleetHealth(shard_count=2), slots=[(0, "a", "A", 3), (1, "b", "B", 3)])
    assert table.roll() is None and table.versions([0, 1, 5]) == {0: 3, 1: 3}
    with pytest.raises(SlotConflict):
        table.begin_wave([0])  # no roll under way
    table.begin_roll(3, 4)
    assert table.begin_wave([0]) == Roll(3, 4, frozenset({0}))
    assert table.roll().moving == {0}
    table.begin_wave([1])
    assert table.roll() == Roll(3, 4, frozenset({1}))
    table.end_roll()
    assert table.roll() is None
