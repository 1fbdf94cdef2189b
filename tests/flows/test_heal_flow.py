"""The ``heal`` flow under a real Prefect API on real engines: a shard is killed, and its
first replacement is killed too while heal runs — the ``restart-shard`` task's retry shows up
in the API (AwaitingRetry, run_count 2), and the shard is back at the fleet's weight version.
Lost once more with its restart budget spent, heal retires it (not retried) and fails the run."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import ray

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from tests.helpers import alive, wait_gone

pytestmark = pytest.mark.flows

FLEET = "heal-test"


def _overrides(tiny_model_dir, home, address):
    values = {
        "home": str(home),
        "model.path": str(tiny_model_dir),
        "fleet.device": "cpu",
        "fleet.name": FLEET,
        "fleet.num_shards": 2,
        "ray.namespace": "nemo_gen_tests",
        "ray.address": address,
        "generation.max_new_tokens": 8,
        "generation.vllm_cfg.max_model_len": 256,
        # The fleet the test launches must not heal itself: that is the flow's job here.
        "health.auto_recover": "false",
        "health.restart_backoff_s": 0.5,
        "health.restart_jitter": 0.1,
    }
    return [f"{k}={v}" for k, v in values.items()]


async def _restart_task_runs(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    async with get_client() as client:
        runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [flow_run_id]}))
        out = []
        for run in runs:
            if run.name.startswith("restart-shard"):
                states = await client.read_task_run_states(run.id)
                out.append((run, [s.name for s in states]))
        return out


def _kill_first_replacement(stop: threading.Event, killed: list, known: frozenset = frozenset()):
    """Wait for heal's first new replacement actor of slot 1 (one not in ``known``) and SIGKILL
    it while it loads."""
    names = [f"{FLEET}-shard-1-r{n}" for n in range(1, 10)]
    while not stop.is_set():
        for name in names:
            if name in known:
                continue
            try:
                actor = ray.get_actor(name, namespace="nemo_gen_tests")
                info = ray.get(actor.info.remote(), timeout=5)
            except Exception:
                continue
            os.kill(info.actor_pid, signal.SIGKILL)
            killed.append(info.actor_pid)
            return
        time.sleep(0.1)


def test_heal_restarts_a_killed_shard_with_a_visible_retry(prefect_harness, ray_cluster, tiny_model_dir, tmp_path):
    from flows.heal import heal
    from nemo_gen.settings import NemoGenSettings

    address = ray.get_runtime_context().gcs_address
    overrides = _overrides(tiny_model_dir, tmp_path / "home", address)
    settings = NemoGenSettings.load(overrides=overrides)
    fleet = GenerationFleet.launch(settings)
    try:
        victim = fleet.status()[1]
        os.kill(victim.actor_pid, signal.SIGKILL)
        assert wait_gone([victim.actor_pid, *victim.engine_pids], 10) == []

        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_first_replacement, args=(stop, killed), daemon=True)
        killer.start()
        state = heal(overrides=overrides, return_state=True)
        stop.set()
        killer.join(5)
        assert state.is_completed(), state.message
        result = state.result()

        assert killed, "the first replacement was never seen"
        assert wait_gone(killed, 10) == []
        (restart,) = [r for r in result["restarts"] if r["shard"] == 1]
        assert restart["action"] == "restarted" and restart["state"] == "healthy"
        runs = asyncio.run(_restart_task_runs(state.state_details.flow_run_id))
        (run, history) = next((r, h) for r, h in runs if r.name == "restart-shard-1")
        assert run.run_count == 2, history
        assert "AwaitingRetry" in history and history[-1] == "Completed", history
        health = {row["shard"]: row for row in result["health"]}
        assert health[1]["state"] == "healthy" and health[1]["weight_version"] == 0
        assert health[1]["restarts"] == 2

        # The healed fleet serves from both slots, at the fleet's version.
        healed = GenerationFleet.attach(settings, watch=False)
        assert healed.health.state_of(1) is ShardState.HEALTHY
        # The restart budget outlives the heal run: the actor carries it to the next attach.
        assert healed.health.snapshot()[1].restart_attempts == 2
        results = healed.generate(["The quick brown fox"] * 6, temperature=0)
        assert all(r.ok for r in results) and {r.shard for r in results} == {0, 1}
        assert {r.weight_version for r in results} == {0}
        status = healed.status()
        pids = [p for s in status for p in [s.actor_pid, *s.engine_pids] if p]
        healed.detach()

        # Lost again, with a budget of 3 restarts over the slot's life (the budget spans heal
        # runs: the first heal spent two, and the fleet record keeps the count): its replacement is
        # killed while it loads (restart 3, infra: retried), restart 4 is past the budget, so heal
        # retires the slot (ShardRetired: not retried) and fails the run so a person sees it.
        again = next(s for s in status if s.index == 1)
        os.kill(again.actor_pid, signal.SIGKILL)
        assert wait_gone([again.actor_pid], 10) == []
        spent = overrides + ["health.max_restart_attempts_per_shard=3"]
        stop, killed = threading.Event(), []
        killer = threading.Thread(target=_kill_first_replacement, args=(stop, killed, {again.name}), daemon=True)
        killer.start()
        state = heal(overrides=spent, return_state=True)
        stop.set()
        killer.join(5)
        assert killed, "the replacement was never seen"
        assert state.is_failed() and "shard 1" in state.message and "retired" in state.message, state.message
        runs = asyncio.run(_restart_task_runs(state.state_details.flow_run_id))
        (run, history) = next((r, h) for r, h in runs if r.name == "restart-shard-1")
        assert run.run_count == 2 and "AwaitingRetry" in history and history[-1] == "Failed", history
        final = GenerationFleet.attach(NemoGenSettings.load(overrides=spent), watch=False)
        results = final.generate(["The quick brown fox"] * 4, temperature=0)
        assert all(r.ok for r in results) and {r.shard for r in results} == {0}
        # RETIRED is terminal, for the process that retired the slot and for every one that
        # attaches later (the next heal run): it must not come back with a fresh budget.
        assert final.health.state_of(1) is ShardState.RETIRED, (
            "the retirement did not outlive the heal run that decided it: " + str(final.health.history(1)))
        final.shutdown()
        assert wait_gone(pids, 30) == []
    finally:
        fleet.shutdown()
    assert not alive([victim.actor_pid])
