"""The incremental structures behind a 10,000-shard control plane, checked against brute force.

The ledger keeps per-state index sets, a sorted serving list (and its URLs), a URL index and a
log of serving-set changes; the selector keeps a mirror of the serving set and a min-tree of
(in-flight, index). Each is driven here with random event sequences and compared, after every
step, with the answer recomputed from scratch from ``snapshot()``.
"""

from __future__ import annotations

import random
import threading

import pytest

from nemo_gen.core import fleet_health as fh
from nemo_gen.core.fleet_health import (
    ABSENT_STATES,
    FleetHealthPolicy,
    GenerationFleetHealth,
    HealthyShardSelector,
    NoHealthyShards,
    ShardState,
)

SEEDS = range(12)


def random_event(fleet: GenerationFleetHealth, rng: random.Random) -> None:
    """One ledger event of any kind, on a random shard (most of them legal, some ignored)."""
    idx = rng.randrange(fleet.shard_count)
    kind = rng.random()
    if kind < 0.35:
        fleet.record_probe(idx, ok=rng.random() < 0.6, error="TimeoutError: probe")
    elif kind < 0.45:
        fleet.report_failure(idx, RuntimeError("request failed"))
    elif kind < 0.50:
        fleet.report_success(idx)
    elif kind < 0.58:
        fleet.mark_dead(idx, "ActorDiedError")
    elif kind < 0.68:
        fleet.mark_restarting(idx)
    elif kind < 0.78:
        fleet.mark_loaded(idx, base_url=rng.choice([None, f"http://h{idx}:{rng.randrange(3)}/v1", "http://shared/v1"]))
    elif kind < 0.95:
        fleet.report_refit(idx, weight_version=rng.randrange(10))
    elif kind < 0.98:
        fleet.add_shard(rng.choice([None, f"http://spare{fleet.shard_count}/v1"]))
    else:
        fleet.retire(idx, "gone")


def make_fleet(rng: random.Random, shards: int) -> GenerationFleetHealth:
    urls = [rng.choice([None, f"http://h{i}:0/v1", "http://shared/v1"]) for i in range(shards)]
    policy = FleetHealthPolicy(unhealthy_threshold=2, healthy_threshold=2, max_restart_attempts_per_shard=50)
    return GenerationFleetHealth(shards, policy, base_urls=urls)


def brute_serving(fleet: GenerationFleetHealth) -> list[int]:
    return [s.dp_shard_idx for s in fleet.snapshot() if s.state in fh.SERVING_STATES]


def brute_pick(fleet: GenerationFleetHealth, selector: HealthyShardSelector) -> int | None:
    serving = brute_serving(fleet)
    if not serving:
        return None
    return min(serving, key=lambda i: (selector.inflight(i), i))


# -- the ledger's indices ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_ledger_reads_match_a_full_scan_after_every_event(seed: int) -> None:
    rng = random.Random(seed)
    fleet = make_fleet(rng, rng.randrange(1, 12))
    for _ in range(400):
        random_event(fleet, rng)
        snap = fleet.snapshot()
        assert fleet.serving_shards() == brute_serving(fleet)
        assert fleet.absent_shards() == [s.dp_shard_idx for s in snap if s.state in ABSENT_STATES]
        counts = {state: sum(s.state is state for s in snap) for state in ShardState}
        assert fleet.counts_by_state() == counts
        assert list(fleet.counts_by_state()) == list(ShardState)  # order kept (state_summary)
        assert fleet.serving_base_urls() == [s.base_url for s in snap if s.is_serving and s.base_url]
        for url in {s.base_url for s in snap} | {"http://nowhere/v1"}:
            expected = next((s.dp_shard_idx for s in snap if s.base_url == url), None)
            assert fleet.shard_for_base_url(url) == expected
        assert fleet.as_metrics()["gen_fleet/serving_shards"] == len(brute_serving(fleet))


@pytest.mark.parametrize("seed", SEEDS)
def test_membership_epoch_bumps_exactly_when_the_serving_set_changes(seed: int) -> None:
    rng = random.Random(seed)
    fleet = make_fleet(rng, rng.randrange(1, 10))
    for _ in range(400):
        before, epoch = brute_serving(fleet), fleet.membership_epoch
        random_event(fleet, rng)
        after = brute_serving(fleet)
        assert fleet.membership_epoch == epoch + (1 if after != before else 0)


@pytest.mark.parametrize("seed", SEEDS)
def test_serving_changes_since_replays_to_the_current_set(seed: int) -> None:
    rng = random.Random(seed)
    fleet = make_fleet(rng, 8)
    seen: dict[int, list[int]] = {0: fleet.serving_shards()}
    for _ in range(300):
        random_event(fleet, rng)
        seen[fleet.membership_epoch] = fleet.serving_shards()
    current = fleet.membership_epoch
    for epoch, serving in seen.items():
        got_epoch, changes = fleet.serving_changes_since(epoch)
        assert got_epoch == current and changes is not None
        assert len(changes) == current - epoch  # one change per bump
        replayed = set(serving)
        for idx, now_serving in changes:
            assert (idx in replayed) != now_serving  # each entry is a real change
            (replayed.add if now_serving else replayed.discard)(idx)
        assert sorted(replayed) == fleet.serving_shards()
    assert fleet.serving_changes_since(None) == (current, None)
    assert fleet.serving_changes_since(current + 1) == (current, None)  # not an epoch it had
    assert fleet.serving_changes_since(-1) == (current, None)


def test_serving_changes_since_is_bounded_and_says_when_too_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fh, "SERVING_LOG_LIMIT", 4)
    fleet = GenerationFleetHealth(2)
    for v in range(5):  # 10 changes: shard 0 leaves and rejoins five times
        fleet.mark_dead(0, "x")
        fleet.mark_restarting(0)
        fleet.mark_loaded(0)
        fleet.report_refit(0, v)
    assert fleet.membership_epoch == 10
    assert fleet.serving_changes_since(6) == (10, [(0, False), (0, True), (0, False), (0, True)])
    assert fleet.serving_changes_since(5) == (10, None)  # beyond the kept log: re-read whole


# -- the selector's min-tree ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_routing_matches_brute_force_least_loaded_on_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    fleet = make_fleet(rng, rng.randrange(1, 20))
    selector = HealthyShardSelector(fleet)
    held: list[int] = []
    for _ in range(1500):
        r = rng.random()
        if r < 0.2:
            random_event(fleet, rng)
        elif r < 0.3 and held:
            selector.release(held.pop(rng.randrange(len(held))))
        elif r < 0.33:
            selector.release(rng.randrange(fleet.shard_count))  # a stray release: clamps at 0
        elif r < 0.36:
            idx = rng.randrange(fleet.shard_count)  # a shard picked before it left serving
            selector.acquire(idx)
            held.append(idx)
        else:
            expected = brute_pick(fleet, selector)
            if expected is None:
                with pytest.raises(NoHealthyShards):
                    selector.next_shard()
                continue
            assert selector.next_shard() == expected
            if rng.random() < 0.7:
                selector.acquire(expected)
                held.append(expected)


def test_selector_does_not_reread_the_serving_set_per_pick() -> None:
    fleet = GenerationFleetHealth(1000)
    calls = {"serving_shards": 0}
    real = fleet.serving_shards

    def counting() -> list[int]:
        calls["serving_shards"] += 1
        return real()

    fleet.serving_shards = counting  # type: ignore[method-assign]
    selector = HealthyShardSelector(fleet)
    for _ in range(3000):
        selector.acquire(selector.next_shard())
    fleet.mark_dead(5, "gone")
    fleet.report_failure(7, RuntimeError("x"))
    for _ in range(100):
        assert selector.next_shard() != 5
    assert calls["serving_shards"] == 1  # the first sync only; then changes are replayed
    assert [selector.inflight(i) for i in (0, 999)] == [3, 3]


def test_selector_resyncs_after_the_change_log_overflows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fh, "SERVING_LOG_LIMIT", 8)
    fleet = GenerationFleetHealth(50)
    selector = HealthyShardSelector(fleet)
    assert selector.next_shard() == 0
    for idx in range(0, 40, 2):  # 20 changes between two picks: more than the log keeps
        fleet.mark_dead(idx, "gone")
    selector.acquire(1)
    assert selector.next_shard() == 3
    assert selector.next_shard() == brute_pick(fleet, selector)


def test_selector_grows_for_added_shards_and_follows_a_replaced_monitor() -> None:
    fleet = GenerationFleetHealth(2)
    selector = HealthyShardSelector(fleet)
    for _ in range(2):
        for idx in (0, 1):
            selector.acquire(idx)
    assert selector.next_shard() == 0
    spares = [fleet.add_shard(f"http://spare{i}/v1") for i in range(5)]
    assert selector.next_shard() == 0  # spares are STALE: not serving yet
    fleet.report_refit(spares[-1], weight_version=1)  # index 6: beyond the first tree
    assert selector.next_shard() == 6
    other = GenerationFleetHealth(3)
    other.mark_dead(0, "gone")
    selector.monitor = other
    assert selector.next_shard() == 2  # 1 and 2 serve there; shard 1 has 2 in flight here


def test_train_mode_fleet_joins_shard_by_shard() -> None:
    # All STALE at first (the fleet does this in train mode); refits bring shards in one by one.
    fleet = GenerationFleetHealth(64)
    for idx in range(64):
        fleet.mark_loaded(idx)
    selector = HealthyShardSelector(fleet)
    with pytest.raises(NoHealthyShards):
        selector.next_shard()
    for idx in reversed(range(64)):
        fleet.report_refit(idx, weight_version=1)
        assert selector.next_shard() == idx
        selector.acquire(idx)


def test_generic_monitor_without_change_log_is_scanned_per_pick() -> None:
    class Minimal:
        def __init__(self) -> None:
            self.serving = [0, 1, 2]

        def serving_shards(self) -> list[int]:
            return list(self.serving)

        def state_summary(self) -> dict[str, int]:
            return {"healthy": len(self.serving)}

        def state_of(self, shard_idx: int) -> object:
            if not 0 <= shard_idx < 3:
                raise IndexError(shard_idx)
            return "healthy"

    monitor = Minimal()
    selector = HealthyShardSelector(monitor)
    selector.acquire(0)
    assert selector.next_shard() == 1
    monitor.serving = [0]
    assert selector.next_shard() == 0
    monitor.serving = []
    with pytest.raises(NoHealthyShards, match="fleet state is {'healthy': 0}"):
        selector.next_shard()


def test_concurrent_routing_and_reports_stay_consistent() -> None:
    fleet = GenerationFleetHealth(64, FleetHealthPolicy(max_restart_attempts_per_shard=10_000))
    selector = HealthyShardSelector(fleet)
    errors: list[BaseException] = []
    stop = threading.Event()

    def route() -> None:
        try:
            while not stop.is_set():
                try:
                    idx = selector.next_shard()
                except NoHealthyShards:
                    continue
                selector.acquire(idx)
                selector.release(idx)
        except Exception as exc:  # noqa: BLE001  (any failure in a router thread fails the test)
            errors.append(exc)

    threads = [threading.Thread(target=route) for _ in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(0)
    for i in range(3000):
        idx = rng.randrange(64)
        fleet.mark_dead(idx, "x")
        fleet.mark_restarting(idx)
        fleet.mark_loaded(idx)
        fleet.report_refit(idx, i)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert all(selector.inflight(i) == 0 for i in range(64))
    assert selector.next_shard() == brute_pick(fleet, selector) == 0
