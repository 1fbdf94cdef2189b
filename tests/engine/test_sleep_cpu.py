"""The sleep/wake plumbing on a real vLLM CPU engine: the shard's calls reach vLLM's
``LLM.sleep`` / ``wake_up`` / ``reset_prefix_cache`` with the arguments it takes. vLLM's CPU worker
frees no memory (it logs that sleep is not supported and keeps everything: why a CPU fleet refuses
``generation.colocated.enabled``), but its EngineCore pauses the scheduler on sleep and resumes it
on a full wake as on a GPU, so the fleet's state machine runs here for real: the fleet below is
told it may sleep (``sleeper.enabled``, which only a GPU fleet gets from its settings)."""

from __future__ import annotations

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.errors import FleetAsleep

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    f = GenerationFleet.launch(make_settings(fleet__name="sleep-cpu", fleet__num_shards=1))
    f.sleeper.enabled = True  # (see the module doc: the CPU engine pauses, frees nothing)
    yield f
    f.shutdown()


def test_a_real_engine_sleeps_refuses_wakes_in_nemo_rls_order_and_serves_the_same_tokens(fleet):
    (before,) = fleet.generate([PROMPT], temperature=0, max_new_tokens=8)
    assert before.ok
    report = fleet.sleep(1)
    assert not report.failed and fleet.status()[0].sleep == "asleep (level 1)"
    with pytest.raises(FleetAsleep, match="asleep"):
        fleet.generate([PROMPT], temperature=0, max_new_tokens=8)
    assert fleet.probe_once() == []  # not probed: its scheduler is paused
    assert not fleet.wake(["weights"]).failed
    report = fleet.refit(fleet.resolved.model_dir)  # the same weights, while the KV cache sleeps
    assert all(s.ok for s in report.shards)
    assert not fleet.wake(["kv_cache"]).failed
    (after,) = fleet.generate([PROMPT], temperature=0, max_new_tokens=8)
    assert after.ok and after.token_ids == before.token_ids and after.weight_version == report.version
    assert fleet.sleeper.reset_prefix_cache() is True  # vLLM's own reset, idle engine
