"""RL rollouts as people run them, on real vLLM CPU engines: a GRPO group of n samples per prompt
(one engine request, one shard), chat prompts rendered with the tokenizer's chat template, and a
multi-turn session that stays on its shard and moves when that shard is killed.

One fleet of 2 shards for the module; the kill runs last."""

from __future__ import annotations

import os
import signal

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.errors import RequestError
from tests.helpers import wait_gone, wait_until

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    f = GenerationFleet.launch(make_settings(fleet__name="rollouts", fleet__num_shards=2,
                                             health__probe_interval_s=60, health__restart_backoff_s=0.2))
    yield f
    f.shutdown()


def test_n_samples_are_one_request_on_one_shard(fleet):
    (group,) = fleet.generate(["Once upon a time"], n=4, temperature=1.0, seed=7, max_new_tokens=12)
    assert group.ok and len(group.samples) == 4
    assert group.token_ids == group.samples[0].token_ids and group.text == group.samples[0].text
    assert all(len(s.token_ids) > 0 and s.finish_reason in ("length", "stop") for s in group.samples)
    assert len({tuple(s.token_ids) for s in group.samples}) > 1  # sampled, not four copies
    assert all(sum(n for _, n in s.weight_versions) == len(s.token_ids) for s in group.samples)
    # Seeded: the group is reproducible.
    (again,) = fleet.generate(["Once upon a time"], n=4, temperature=1.0, seed=7, max_new_tokens=12)
    assert [s.token_ids for s in again.samples] == [s.token_ids for s in group.samples]
    with pytest.raises(RequestError, match="need temperature > 0"):
        fleet.generate(["Once upon a time"], n=3, temperature=0)


def test_chat_prompts_render_with_the_chat_template(fleet):
    chat = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Say hello."}]
    (r,) = fleet.generate([chat], temperature=0, max_new_tokens=8)
    assert r.ok and r.prompt.endswith("<s>assistant\n") and r.token_ids
    # The same conversation as token ids gives the same greedy answer.
    (ids,) = fleet.generate([r.prompt_token_ids], temperature=0, max_new_tokens=8)
    assert ids.token_ids == r.token_ids


def test_a_four_turn_session_stays_on_its_shard(fleet):
    messages = [{"role": "user", "content": "Tell me a story."}]
    shards = []
    for turn in range(4):
        (r,) = fleet.generate([messages], session_id="story", temperature=0, max_new_tokens=8)
        assert r.ok
        shards.append(r.shard)
        messages = messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"And then {turn}?"}]
    assert len(set(shards)) == 1 and fleet.router.session_shard("story") == shards[0]


def test_a_session_moves_when_its_shard_is_killed(fleet):
    (r,) = fleet.generate(["Hello, my name is"], session_id="agent", temperature=0, max_new_tokens=4)
    home = r.shard
    victim = next(s for s in fleet.status() if s.index == home)
    os.kill(victim.actor_pid, signal.SIGKILL)
    wait_until(lambda: fleet.health.state_of(home) is not ShardState.HEALTHY, 30, "the death watch")
    (moved,) = fleet.generate(["Hello, my name is and"], session_id="agent", temperature=0, max_new_tokens=4)
    assert moved.ok and moved.shard == 1 - home and fleet.router.session_shard("agent") == 1 - home
    wait_until(lambda: fleet.health.state_of(home) is ShardState.HEALTHY, 240, "the killed shard back")
    assert wait_gone([victim.actor_pid, *victim.engine_pids], 30) == []
