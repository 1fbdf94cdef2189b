"""The fleet ledger, driven step by step with a fake clock: every transition of the table."""

from __future__ import annotations

import logging

import pytest

from nemo_gen.core.fleet_health import (
    SERVING_STATES,
    FleetHealthPolicy,
    GenerationFleetExhausted,
    GenerationFleetHealth,
    HealthyShardSelector,
    NoHealthyShards,
    ShardState,
)
from nemo_gen.errors import FleetExhausted, InfraError, ShardUnavailableError


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def make(clock: FakeClock, shards: int = 3, **policy: int) -> GenerationFleetHealth:
    return GenerationFleetHealth(
        shards,
        FleetHealthPolicy(**policy),
        base_urls=[f"http://h{i}:8000/v1" for i in range(shards)],
        clock=clock,
    )


def kill(fleet: GenerationFleetHealth, idx: int) -> None:
    for _ in range(fleet.policy.unhealthy_threshold):
        fleet.record_probe(idx, ok=False, error="TimeoutError: probe")
    assert fleet.state_of(idx) is ShardState.DEAD


# -- construction and policy ---------------------------------------------------------------


def test_shard_state_values_and_serving_set() -> None:
    assert [s.value for s in ShardState] == [
        "healthy", "suspect", "dead", "restarting", "stale", "retired"
    ]
    assert ShardState("healthy") is ShardState.HEALTHY and ShardState.DEAD == "dead"
    assert SERVING_STATES == {ShardState.HEALTHY, ShardState.SUSPECT}


def test_policy_defaults_and_validation() -> None:
    p = FleetHealthPolicy()
    assert (p.unhealthy_threshold, p.healthy_threshold) == (3, 2)
    assert (p.max_restart_attempts_per_shard, p.min_healthy_shards) == (5, 1)
    for bad in ({"unhealthy_threshold": 0}, {"healthy_threshold": 0}, {"min_healthy_shards": 0}):
        with pytest.raises(ValueError):
            FleetHealthPolicy(**bad)


def test_constructor_validation_and_initial_state(clock: FakeClock) -> None:
    with pytest.raises(ValueError, match="shard_count"):
        GenerationFleetHealth(0)
    with pytest.raises(ValueError, match="2 entries for 3 shards"):
        GenerationFleetHealth(3, base_urls=["a", "b"])
    assert GenerationFleetHealth(shard_count=1, policy=None, clock=None).shard_count == 1
    fleet = GenerationFleetHealth(2, clock=clock, weight_version=7)
    assert fleet.policy == FleetHealthPolicy()
    assert fleet.serving_shards() == [0, 1]
    assert fleet.membership_epoch == 0
    snap = fleet.snapshot()
    assert [(s.dp_shard_idx, s.state, s.weight_version, s.last_ok_at) for s in snap] == [
        (0, ShardState.HEALTHY, 7, 100.0),
        (1, ShardState.HEALTHY, 7, 100.0),
    ]


def test_snapshot_is_a_copy(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.snapshot()[0].state = ShardState.DEAD
    assert fleet.state_of(0) is ShardState.HEALTHY


def test_unknown_index_raises_index_error_naming_index_and_count(clock: FakeClock) -> None:
    fleet = make(clock, shards=3)
    for call in (
        lambda: fleet.state_of(3),
        lambda: fleet.record_probe(-1, ok=True),
        lambda: fleet.report_failure(7, RuntimeError()),
        lambda: fleet.mark_restarting(3),
        lambda: fleet.report_refit(3, weight_version=1),
    ):
        with pytest.raises(IndexError, match=r"shard (3|-1|7) .*3 shard"):
            call()


# -- probes ----------------------------------------------------------------------------------


def test_probe_failures_go_suspect_then_dead_at_threshold(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False, error="TimeoutError: 1")
    assert fleet.state_of(0) is ShardState.SUSPECT
    assert fleet.serving_shards() == [0, 1, 2]  # SUSPECT still serves
    fleet.record_probe(0, ok=False, error="TimeoutError: 2")
    assert fleet.state_of(0) is ShardState.SUSPECT
    fleet.record_probe(0, ok=False, error="TimeoutError: 3")
    assert fleet.state_of(0) is ShardState.DEAD
    assert fleet.serving_shards() == [1, 2]
    shard = fleet.snapshot()[0]
    assert shard.consecutive_probe_failures == 3
    assert shard.last_error == "TimeoutError: 3"


def test_probe_failure_without_error_text_still_records_one(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(1, ok=False)
    assert fleet.snapshot()[1].last_error == "probe failed"


def test_suspect_recovers_after_healthy_threshold_ok_probes(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False)
    fleet.record_probe(0, ok=False)
    clock.advance(5)
    fleet.record_probe(0, ok=True)
    shard = fleet.snapshot()[0]
    assert shard.state is ShardState.SUSPECT  # one success is not enough
    assert (shard.consecutive_probe_failures, shard.consecutive_probe_successes) == (0, 1)
    assert shard.last_ok_at == 105.0
    fleet.record_probe(0, ok=True)
    assert fleet.state_of(0) is ShardState.HEALTHY


def test_failure_resets_success_streak(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False)
    fleet.record_probe(0, ok=True)
    fleet.record_probe(0, ok=False)
    fleet.record_probe(0, ok=True)
    assert fleet.state_of(0) is ShardState.SUSPECT
    assert fleet.snapshot()[0].consecutive_probe_successes == 1


def test_dead_never_returns_to_healthy_on_probes(clock: FakeClock) -> None:
    fleet = make(clock)
    kill(fleet, 0)
    for _ in range(20):
        fleet.record_probe(0, ok=True)
    assert fleet.state_of(0) is ShardState.DEAD
    assert fleet.snapshot()[0].consecutive_probe_successes == 0


@pytest.mark.parametrize("state", ["restarting", "stale", "retired"])
def test_probes_ignored_in_every_non_serving_state(clock: FakeClock, state: str) -> None:
    fleet = make(clock)
    kill(fleet, 0)
    fleet.mark_restarting(0)
    if state == "stale":
        fleet.mark_loaded(0)
    if state == "retired":
        fleet.retire(0, "node gone")
    before = fleet.snapshot()[0]
    for ok in (True, True, True, False, False, False):
        fleet.record_probe(0, ok=ok, error="x")
        fleet.report_failure(0, RuntimeError("y"))
    assert fleet.snapshot()[0] == before
    assert fleet.state_of(0) is ShardState(state)


# -- reported failures -----------------------------------------------------------------------


def test_reported_failures_are_a_separate_streak_probes_cannot_reset(clock: FakeClock) -> None:
    fleet = make(clock)
    # A wedged engine: answers probes, fails every real request.
    for _ in range(2):
        fleet.report_failure(1, ConnectionResetError("peer reset"))
        fleet.record_probe(1, ok=True)
        fleet.record_probe(1, ok=True)
    shard = fleet.snapshot()[1]
    assert shard.consecutive_reported_failures == 2
    assert shard.state is ShardState.HEALTHY  # two ok probes cleared SUSPECT, not the streak
    fleet.report_failure(1, ConnectionResetError("peer reset"))
    assert fleet.state_of(1) is ShardState.DEAD
    assert fleet.snapshot()[1].last_error == "ConnectionResetError: peer reset"


def test_report_failure_first_goes_suspect_and_keeps_probe_streak(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(2, ok=False)
    fleet.report_failure(2, ValueError("bad"))
    shard = fleet.snapshot()[2]
    assert shard.state is ShardState.SUSPECT
    assert (shard.consecutive_probe_failures, shard.consecutive_reported_failures) == (1, 1)
    # Two probe failures and two reported failures: neither streak is at 3.
    fleet.record_probe(2, ok=False)
    fleet.report_failure(2, ValueError("bad"))
    assert fleet.state_of(2) is ShardState.SUSPECT


def test_report_success_resets_only_the_reported_streak(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False)
    fleet.record_probe(0, ok=False)
    fleet.report_failure(0, RuntimeError("a"))
    fleet.report_failure(0, RuntimeError("b"))
    fleet.report_success(0)
    shard = fleet.snapshot()[0]
    assert shard.consecutive_reported_failures == 0
    assert shard.consecutive_probe_failures == 2
    assert shard.state is ShardState.SUSPECT  # report_success does not change state
    fleet.report_failure(0, RuntimeError("c"))
    fleet.report_failure(0, RuntimeError("d"))
    assert fleet.state_of(0) is ShardState.SUSPECT
    fleet.record_probe(0, ok=False)
    assert fleet.state_of(0) is ShardState.DEAD


# -- recovery path ---------------------------------------------------------------------------


def test_full_recovery_dead_restarting_stale_refit_healthy(clock: FakeClock) -> None:
    fleet = make(clock)
    kill(fleet, 0)
    fleet.report_failure(0, RuntimeError("ignored while dead"))
    fleet.mark_restarting(0)
    assert fleet.state_of(0) is ShardState.RESTARTING
    assert fleet.snapshot()[0].restart_attempts == 1
    fleet.mark_loaded(0, base_url="http://h0:8123/v1")
    assert fleet.state_of(0) is ShardState.STALE
    assert 0 not in fleet.serving_shards()
    assert fleet.shard_for_base_url("http://h0:8123/v1") == 0
    assert fleet.shard_for_base_url("http://h0:8000/v1") is None
    clock.advance(30)
    fleet.report_refit(0, weight_version=4)
    shard = fleet.snapshot()[0]
    assert shard.state is ShardState.HEALTHY
    assert shard.weight_version == 4
    assert shard.last_ok_at == 130.0
    assert (
        shard.consecutive_probe_failures,
        shard.consecutive_probe_successes,
        shard.consecutive_reported_failures,
    ) == (0, 0, 0)
    assert shard.restart_attempts == 1  # counted over the whole run
    assert fleet.serving_shards() == [0, 1, 2]


def test_report_refit_on_serving_shards_updates_version_and_clears_suspect(
    clock: FakeClock,
) -> None:
    fleet = make(clock)
    fleet.record_probe(1, ok=False)
    fleet.report_failure(1, RuntimeError("x"))
    for idx in range(3):
        fleet.report_refit(idx, weight_version=2)
    assert fleet.state_of(1) is ShardState.HEALTHY
    assert fleet.snapshot()[1].consecutive_reported_failures == 0
    assert fleet.as_metrics()["gen_fleet/shard_weight_version/1"] == 2.0


def test_retire_after_max_restart_attempts(clock: FakeClock) -> None:
    fleet = make(clock, max_restart_attempts_per_shard=2)
    kill(fleet, 0)
    fleet.mark_restarting(0)
    states = [fleet.state_of(0)]
    fleet.mark_restarting(0)  # second attempt: still within the budget
    states.append(fleet.state_of(0))
    assert states == [ShardState.RESTARTING, ShardState.RESTARTING]
    assert fleet.snapshot()[0].restart_attempts == 2
    fleet.mark_restarting(0)  # third exceeds 2
    shard = fleet.snapshot()[0]
    assert shard.state is ShardState.RETIRED
    assert shard.restart_attempts == 3
    assert shard.last_error == "restart attempts exhausted"


def test_retired_is_terminal(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.retire(2, "node gone")
    assert fleet.snapshot()[2].last_error == "node gone"
    fleet.mark_restarting(2)
    fleet.mark_loaded(2)
    fleet.report_refit(2, weight_version=9)
    fleet.record_probe(2, ok=True)
    shard = fleet.snapshot()[2]
    assert shard.state is ShardState.RETIRED
    assert shard.restart_attempts == 0 and shard.weight_version == 0


# -- membership epoch ------------------------------------------------------------------------


def test_membership_epoch_moves_only_when_serving_set_changes(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False)  # HEALTHY -> SUSPECT: still serving
    fleet.record_probe(0, ok=True)
    fleet.record_probe(0, ok=True)  # SUSPECT -> HEALTHY: still serving
    assert fleet.membership_epoch == 0
    kill(fleet, 0)
    assert fleet.membership_epoch == 1
    fleet.mark_restarting(0)
    fleet.mark_loaded(0)  # DEAD -> RESTARTING -> STALE: not serving throughout
    assert fleet.membership_epoch == 1
    fleet.report_refit(0, weight_version=1)
    assert fleet.membership_epoch == 2
    fleet.report_refit(0, weight_version=2)  # no state change
    assert fleet.membership_epoch == 2
    assert fleet.as_metrics()["gen_fleet/membership_epoch"] == 2.0


# -- read side -------------------------------------------------------------------------------


def test_counts_urls_and_metrics(clock: FakeClock) -> None:
    fleet = GenerationFleetHealth(3, base_urls=["http://a/v1", None, "http://c/v1"], clock=clock)
    kill(fleet, 2)
    fleet.mark_restarting(2)
    assert fleet.serving_base_urls() == ["http://a/v1"]  # None skipped, non-serving skipped
    counts = fleet.counts_by_state()
    assert set(counts) == set(ShardState)
    assert counts[ShardState.HEALTHY] == 2 and counts[ShardState.RESTARTING] == 1
    assert fleet.absent_shards() == [2]
    assert fleet.as_metrics() == {
        "gen_fleet/shards/healthy": 2.0,
        "gen_fleet/shards/suspect": 0.0,
        "gen_fleet/shards/dead": 0.0,
        "gen_fleet/shards/restarting": 1.0,
        "gen_fleet/shards/stale": 0.0,
        "gen_fleet/shards/retired": 0.0,
        "gen_fleet/membership_epoch": 1.0,
        "gen_fleet/serving_shards": 2.0,
        "gen_fleet/restart_attempts/0": 0.0,
        "gen_fleet/restart_attempts/1": 0.0,
        "gen_fleet/restart_attempts/2": 1.0,
        "gen_fleet/shard_weight_version/0": 0.0,
        "gen_fleet/shard_weight_version/1": 0.0,
        "gen_fleet/shard_weight_version/2": 0.0,
    }


def test_raise_if_exhausted_message_has_state_summary(clock: FakeClock) -> None:
    fleet = make(clock, shards=3, min_healthy_shards=2)
    fleet.raise_if_exhausted()
    kill(fleet, 0)
    fleet.raise_if_exhausted()  # 2 serving == minimum
    fleet.retire(1, "gone")
    with pytest.raises(GenerationFleetExhausted) as info:
        fleet.raise_if_exhausted()
    assert str(info.value) == (
        "only 1 generation shard(s) serving, below min_healthy_shards=2; "
        "fleet state is {'healthy': 1, 'dead': 1, 'retired': 1}"
    )
    assert GenerationFleetExhausted is FleetExhausted
    assert isinstance(info.value, InfraError)


# -- history and logging ---------------------------------------------------------------------


def test_history_records_every_transition_with_time_and_reason(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.record_probe(0, ok=False, error="TimeoutError: t1")
    clock.advance(5)
    fleet.record_probe(0, ok=False, error="TimeoutError: t2")  # no transition, no record
    fleet.record_probe(0, ok=False, error="TimeoutError: t3")
    clock.advance(1)
    fleet.mark_restarting(0)
    fleet.mark_loaded(0)
    clock.advance(2)
    fleet.report_refit(0, weight_version=3)
    fleet.record_probe(1, ok=False)
    assert fleet.history(shard=0) == [
        {"time": 100.0, "shard": 0, "old": "healthy", "new": "suspect",
         "reason": "TimeoutError: t1"},
        {"time": 105.0, "shard": 0, "old": "suspect", "new": "dead",
         "reason": "TimeoutError: t3"},
        {"time": 106.0, "shard": 0, "old": "dead", "new": "restarting",
         "reason": "restart attempt 1/5"},
        {"time": 106.0, "shard": 0, "old": "restarting", "new": "stale",
         "reason": "engine loaded; stale until refit"},
        {"time": 108.0, "shard": 0, "old": "stale", "new": "healthy",
         "reason": "refit to weight version 3"},
    ]
    assert [h["shard"] for h in fleet.history()] == [0, 0, 0, 0, 0, 1]


def test_history_is_bounded(clock: FakeClock) -> None:
    fleet = GenerationFleetHealth(1, clock=clock, history_limit=3)
    for _ in range(4):
        fleet.record_probe(0, ok=False)
        fleet.report_refit(0, weight_version=1)
    history = fleet.history()
    assert len(history) == 3
    assert history[-1]["new"] == "healthy"


def test_transitions_are_logged(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    fleet = make(clock)
    with caplog.at_level(logging.INFO, logger="nemo_gen.fleet_health"):
        kill(fleet, 1)
    messages = [r.getMessage() for r in caplog.records if r.name == "nemo_gen.fleet_health"]
    assert messages == [
        "gen_fleet: shard 1 healthy -> suspect (TimeoutError: probe)",
        "gen_fleet: shard 1 suspect -> dead (TimeoutError: probe)",
    ]
    assert caplog.records[-1].levelno == logging.WARNING


# -- add_shard -------------------------------------------------------------------------------


def test_add_shard_starts_stale_and_serves_only_after_refit(clock: FakeClock) -> None:
    fleet = make(clock, shards=2)
    idx = fleet.add_shard("http://spare/v1", weight_version=1)
    assert idx == 2 and fleet.shard_count == 3
    assert fleet.state_of(idx) is ShardState.STALE
    assert fleet.membership_epoch == 0  # the serving set did not change
    fleet.record_probe(idx, ok=True)
    fleet.record_probe(idx, ok=True)
    assert fleet.serving_shards() == [0, 1]
    assert fleet.history(shard=idx) == [
        {"time": 100.0, "shard": 2, "old": None, "new": "stale",
         "reason": "added; stale until refit"}
    ]
    fleet.report_refit(idx, weight_version=5)
    assert fleet.serving_shards() == [0, 1, 2]
    assert fleet.serving_base_urls()[-1] == "http://spare/v1"
    assert fleet.membership_epoch == 1
    assert fleet.add_shard() == 3


# -- selector --------------------------------------------------------------------------------


def test_selector_picks_least_loaded_then_lowest_index(clock: FakeClock) -> None:
    fleet = make(clock, shards=3)
    selector = HealthyShardSelector(fleet)
    picks = []
    for _ in range(6):
        shard = selector.next_shard()
        selector.acquire(shard)
        picks.append(shard)
    assert picks == [0, 1, 2, 0, 1, 2]
    selector.release(1)
    assert selector.next_shard() == 1
    selector.release(0)
    assert selector.next_shard() == 0  # tie at 1 in flight: lowest index


def test_selector_skips_non_serving_and_raises_no_healthy_shards(clock: FakeClock) -> None:
    fleet = make(clock, shards=2)
    selector = HealthyShardSelector(fleet)
    selector.acquire(1)
    selector.acquire(1)
    kill(fleet, 0)
    assert selector.next_shard() == 1  # the only serving shard, however loaded
    fleet.retire(1, "gone")
    with pytest.raises(NoHealthyShards) as info:
        selector.next_shard()
    assert str(info.value) == (
        "no generation shard is eligible to serve; fleet state is {'dead': 1, 'retired': 1}"
    )
    assert isinstance(info.value, ShardUnavailableError)


def test_selector_release_never_goes_below_zero(clock: FakeClock) -> None:
    fleet = make(clock, shards=2)
    selector = HealthyShardSelector(fleet)
    selector.release(0)
    selector.release(0)
    assert selector.inflight(0) == 0
    selector.acquire(0)
    assert selector.inflight(0) == 1
    with pytest.raises(IndexError):
        selector.acquire(5)


def test_refit_report_cannot_readmit_a_dead_or_restarting_shard(clock: FakeClock) -> None:
    # DESIGN invariant 1: DEAD -> RESTARTING -> STALE -> refit -> HEALTHY, nothing shorter.
    fleet = make(clock)
    kill(fleet, 0)
    fleet.report_refit(0, weight_version=7)
    assert fleet.state_of(0) is ShardState.DEAD
    fleet.mark_restarting(0)
    fleet.report_refit(0, weight_version=7)
    assert fleet.state_of(0) is ShardState.RESTARTING
    assert 0 not in fleet.serving_shards()
    fleet.mark_loaded(0)
    fleet.report_refit(0, weight_version=7)
    assert fleet.state_of(0) is ShardState.HEALTHY
    assert [h["new"] for h in fleet.history(0)][-4:] == ["dead", "restarting", "stale", "healthy"]


def test_mark_dead_is_immediate_and_only_for_live_shards(clock: FakeClock) -> None:
    fleet = make(clock)
    fleet.mark_dead(1, "ActorDiedError: actor gone")
    assert fleet.state_of(1) is ShardState.DEAD
    assert fleet.snapshot()[1].last_error == "ActorDiedError: actor gone"
    fleet.retire(2, "node gone")
    fleet.mark_dead(2, "late death notice")
    assert fleet.state_of(2) is ShardState.RETIRED


def test_restore_restart_attempts_carries_the_budget_and_never_lowers_it():
    health = GenerationFleetHealth(2, FleetHealthPolicy(max_restart_attempts_per_shard=2))
    health.restore_restart_attempts(0, 2)
    health.restore_restart_attempts(0, 1)  # an older count: ignored
    assert health.snapshot()[0].restart_attempts == 2
    health.mark_dead(0, "gone")
    health.mark_restarting(0)  # the third restart exceeds the budget carried in
    assert health.state_of(0) is ShardState.RETIRED
    with pytest.raises(ValueError):
        health.restore_restart_attempts(1, -1)
