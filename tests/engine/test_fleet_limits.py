"""The fleet's limits on real vLLM CPU engines: an engine that does not come up in time (the
launch is all-or-none: nothing of it is left), a shard whose engine stops making progress
(condemned by its probes — no request deadline is needed — its requests re-routed), and a shard
past ``health.max_restart_attempts_per_shard`` (RETIRED, never back).

One fleet of 2 shards is shared by the last two tests (tests/helpers.py's ``SharedFleet``),
checked on entry: both slots HEALTHY. The wedged-engine test spends slot 1's one restart; the
retiring test spends the fleet, and uses up that restart itself when it gets a fresh fleet."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest
import ray
from ray.util.placement_group import placement_group_table

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.errors import EngineStartError
from tests.helpers import SharedFleet, alive, wait_gone, wait_until

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"] * 4
FLEET = "limits"


def _ours() -> dict[int, str]:
    """This session's shard processes (actors, EngineCores, workers): descendants of the test
    process, which started the session's Ray cluster."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
        except psutil.Error:
            continue
        if name.startswith(("ray::ShardActor", "VLLM::")):
            found[proc.pid] = name
    return found


def _engine_core(row) -> int:
    return next(p for p in row.engine_pids if "EngineCore" in psutil.Process(p).name())


def test_an_engine_that_does_not_start_in_time_leaves_nothing_behind(ray_cluster, make_settings):
    """engine_start_timeout_s=5 while an engine takes ~40 s to load here: both shards miss it
    mid-load. Every actor, placement group and process the launch made is gone afterwards."""
    before = set(_ours())
    seen: dict[int, str] = {}
    stop = threading.Event()

    def watch():  # every process the launch starts, while it runs
        while not stop.is_set():
            seen.update({p: n for p, n in _ours().items() if p not in before})
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    settings = make_settings(fleet__name="slow-start", fleet__num_shards=2, fleet__engine_start_timeout_s=5)
    try:
        with pytest.raises(EngineStartError, match=r"not ready within fleet.engine_start_timeout_s=5s"):
            GenerationFleet.launch(settings)
    finally:
        stop.set()
        watcher.join(5)
    assert any(n.startswith("ray::ShardActor") for n in seen.values()), seen  # the launch did start them
    assert wait_gone(list(seen), 60) == [], {p: seen[p] for p in alive(seen)}
    for i in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"slow-start-shard-{i}", namespace=settings.ray.namespace)
    groups = {g["name"]: g["state"] for g in placement_group_table().values() if g["name"].startswith("slow-start-")}
    assert groups and set(groups.values()) == {"REMOVED"}, groups


@pytest.fixture(scope="module")
def shared(ray_cluster, make_settings):
    shared = SharedFleet(lambda: GenerationFleet.launch(make_settings(
        fleet__name=FLEET,
        fleet__num_shards=2,
        # What condemns a wedged shard: its probes (a busy engine that made no step for
        # probe_timeout_s fails one; two in a row condemn it). No request deadline is set.
        health__probe_interval_s=1,
        health__probe_timeout_s=5,
        health__warmup_grace_s=10,  # the batch's first step never ends: this bound applies
        health__unhealthy_threshold=2,
        health__max_restart_attempts_per_shard=1,
        health__restart_backoff_s=0.2,
        health__restart_jitter=0,
        health__reap_timeout_s=5,
        generation__max_new_tokens=8,
    )), check=_serving_both)
    yield shared
    shared.close()


def _serving_both(fleet):
    assert fleet.health.serving_shards() == [0, 1], fleet.health.state_summary()


@pytest.fixture
def fleet(shared):
    return shared.get()


def _since(fleet, slot, t):
    return [h for h in fleet.health.history(slot) if h["time"] >= t]


def test_a_shard_whose_engine_stops_is_condemned_by_its_probes_and_its_requests_rerouted(fleet):
    assert fleet.settings.fleet.request_timeout_s is None
    assert fleet.health.snapshot()[1].restart_attempts == 0  # its one restart is this test's
    victim = fleet.status()[1]
    core = _engine_core(victim)
    since = time.monotonic()
    os.kill(core, signal.SIGSTOP)  # the engine hangs: alive (no watch fires), makes no step
    try:
        results = fleet.generate(PROMPTS, temperature=0)
    finally:
        if alive([core]):
            os.kill(core, signal.SIGKILL)
    assert [r.index for r in results] == list(range(len(PROMPTS)))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert {r.shard for r in results} == {0} and {r.weight_version for r in results} == {fleet.weight_version}
    dead = next(h for h in _since(fleet, 1, since) if h["new"] == "dead")
    assert "no generation step" in dead["reason"] or "probe not answered" in dead["reason"], dead
    # Recovered: restart attempt 1 of 1. A bound for an engine start on a loaded machine.
    wait_until(lambda: fleet.health.state_of(1) is ShardState.HEALTHY, 300, "slot 1 restarted")
    assert [h["new"] for h in _since(fleet, 1, since)][-4:] == ["dead", "restarting", "stale", "healthy"]
    assert wait_gone([victim.actor_pid, *victim.engine_pids], 30) == []
    again = fleet.generate(PROMPTS, temperature=0)
    assert {r.shard for r in again} == {0, 1} and all(r.ok for r in again)


def test_a_shard_past_its_restart_budget_is_retired_and_the_fleet_serves_on(shared, fleet):
    shared.spend()  # slot 1 ends RETIRED
    if fleet.health.snapshot()[1].restart_attempts == 0:  # a fresh fleet: use up the one restart
        first = fleet.status()[1]
        os.kill(first.actor_pid, signal.SIGKILL)
        # A bound for an engine start on a loaded machine.
        wait_until(lambda: fleet.health.snapshot()[1].restart_attempts == 1
                   and fleet.health.state_of(1) is ShardState.HEALTHY, 300, "slot 1 restarted once")
    snap = {s.dp_shard_idx: s for s in fleet.health.snapshot()}
    assert snap[1].restart_attempts == 1 and snap[1].state is ShardState.HEALTHY
    victim = fleet.status()[1]
    since = time.monotonic()
    os.kill(victim.actor_pid, signal.SIGKILL)
    wait_until(lambda: fleet.health.state_of(1) is ShardState.RETIRED, 60, "slot 1 retired")
    path = [h["new"] for h in _since(fleet, 1, since)]
    assert path == ["dead", "retired"], path  # no second restart was attempted
    retired = fleet.health.snapshot()[1]
    assert retired.restart_attempts == 1  # the budget, spent; no attempt beyond it
    assert retired.last_error.startswith("retired after 1 restart attempt(s) (health.max_restart_attempts_per_shard)")
    assert wait_gone([victim.actor_pid, *victim.engine_pids], 30) == []
    assert {s.index: s.state for s in fleet.status()} == {0: "healthy", 1: "retired"}
    results = fleet.generate(PROMPTS, temperature=0)
    assert all(r.ok for r in results) and {r.shard for r in results} == {0}
    assert fleet.health.serving_shards() == [0]
