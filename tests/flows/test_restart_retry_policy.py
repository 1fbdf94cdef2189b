"""The ``restart-shard`` retry policy under a real Prefect API: ``retry_options`` (from the
``health.*`` settings) and its ``retry_condition_fn`` on the infra/data taxonomy, applied by
Prefect's own retry machinery. The attempt is a stand-in that fails the way a restart does
(the exceptions nemo_gen raises), so each outcome is certain; the heal flow's test runs the
same policy over real engines."""

from __future__ import annotations

import asyncio

import pytest
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from nemo_gen.errors import EngineStartError, PlacementError, RequestError, ShardDiedError, ShardRetired
from nemo_gen.settings import NemoGenSettings
from tasks.recovery import restart_shard, retry_on_infra, retry_options

pytestmark = pytest.mark.flows

CALLS: list[str] = []


@task(name="restart-attempt", cache_policy=NO_CACHE)
def attempt(failure: str) -> str:
    CALLS.append(failure)
    raise {
        "engine-start": EngineStartError(1, "killed while loading"),
        "died": ShardDiedError(1, "actor gone"),
        "placement": PlacementError("fleet needs 9 CPU but the Ray cluster has 8 CPU"),
        "request": RequestError("prompt longer than max_model_len"),
        "retired": ShardRetired("shard 1 retired after 2 restart attempt(s)"),
    }[failure]


async def _states(task_run_id, timeout_s: float = 60) -> list[str]:
    """The task run's state history as the API recorded it. Task-run states reach the API
    asynchronously (Prefect 3 sends them as events): wait for the terminal one to land."""
    from prefect.client.orchestration import get_client

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with get_client() as client:
        while True:
            names = [s.name for s in await client.read_task_run_states(task_run_id)]
            if (names and names[-1] == "Failed") or loop.time() > deadline:
                return names
            await asyncio.sleep(0.2)


@pytest.mark.parametrize(
    "failure, runs",
    [("engine-start", 3), ("died", 3), ("placement", 1), ("request", 1), ("retired", 1)],
)
def test_infra_failures_are_retried_and_data_failures_are_not(prefect_harness, failure, runs):
    settings = NemoGenSettings.load(overrides={
        "health.max_restart_attempts_per_shard": 2, "health.restart_backoff_s": 0, "health.restart_jitter": 0,
    })
    options = retry_options(settings)
    assert options["retries"] == 2 and options["retry_condition_fn"] is retry_on_infra

    seen = {}

    @flow(name="restart-policy")
    def heal_like():  # as heal does: the task's final state is read, the flow goes on
        seen["state"] = attempt.with_options(**options)(failure, return_state=True)

    CALLS.clear()
    heal_like()
    state = seen["state"]
    assert state.is_failed()
    assert CALLS == [failure] * runs  # 1 + retries for infra, once for a data failure
    # What the UI shows: a retry state for an infra failure, none for a data failure. (The
    # API's history can merge repeated retry states, so attempts are counted above, not here.)
    names = asyncio.run(_states(state.state_details.task_run_id))
    assert names[-1] == "Failed" and ("AwaitingRetry" in names) == (runs > 1), names


def test_the_heal_flow_uses_this_policy_on_the_real_task():
    settings = NemoGenSettings.load(overrides={"health.max_restart_attempts_per_shard": 3,
                                               "health.restart_backoff_s": 2, "health.restart_jitter": 0.5})
    configured = restart_shard.with_options(**retry_options(settings))
    assert configured.retries == 3 and configured.retry_condition_fn is retry_on_infra
    assert configured.retry_delay_seconds == [2.0, 4.0, 8.0] and configured.retry_jitter_factor == 0.5
