"""A planned drain on real vLLM CPU engines: a healthy shard is restarted on purpose
(``fleet.restart_shard``: drained, then replaced) while a greedy batch runs on it. Each of its
requests goes on on the other shard from the tokens it had made: the batch returns exactly the
tokens of an uninterrupted run, every move names the drain (``cause=drained``) and none counts
as a re-route; no new request goes to the drained shard, and its replacement serves after.

The rules: tests/core/test_drain.py; the fleet's logic on the fake driver: tests/fake/test_drain_fleet.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.results import MoveCause
from nemo_gen.tiny_model import make_tiny_model
from tests.engine.test_migration import PROMPTS, TOKENS, every_request_checkpointed, moved_whole
from tests.helpers import alive

pytestmark = pytest.mark.engine



@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings, tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("drain-long") / "tiny", max_position_embeddings=2048)
    f = GenerationFleet.launch(
        make_settings(
            model__path=str(model),
            fleet__name="drain",
            fleet__num_shards=2,
            fleet__max_reroutes=0,  # a counted re-route would fail its request: a drain counts none
            health__probe_interval_s=0.5,
            health__probe_timeout_s=20,  # only the drain may take a shard out here (a loaded machine)
            health__unhealthy_threshold=2,
            health__reap_timeout_s=5,
            generation__vllm_cfg__max_model_len=1024,
        )
    )
    yield f
    f.shutdown()


def test_a_greedy_batch_on_a_shard_restarted_on_purpose_returns_the_uninterrupted_tokens(fleet):
    params = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    reference = fleet.generate(PROMPTS, **params)
    rerouted = fleet.router.rerouted
    old = next(s for s in fleet.status() if s.index == 1)
    pool = ThreadPoolExecutor(1)
    future = pool.submit(lambda: fleet.generate(PROMPTS, **params))
    pool.shutdown(wait=False)
    every_request_checkpointed(fleet, len(PROMPTS))  # (so each move keeps tokens: at_token > 0)
    assert not future.done(), "the batch finished before the drain could land"
    report = fleet.restart_shard(1)
    assert report["action"] == "drained" and report["moved"], report
    assert report["restart"]["action"] in ("restarted", "promoted-spare"), report
    results = future.result(timeout=300)
    for r in moved_whole(results, reference):
        assert r.migrations[0].cause is MoveCause.DRAINED
    assert fleet.router.rerouted == rerouted
    # the drained actor is gone, its replacement serves at the fleet's version
    deadline = time.monotonic() + 30
    while alive([old.actor_pid]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive([old.actor_pid])
    new = next(s for s in fleet.status() if s.index == 1)
    assert new.state == "healthy" and new.actor_pid != old.actor_pid and new.weight_version == fleet.weight_version
    again = fleet.generate(PROMPTS, temperature=0, max_new_tokens=8)
    assert {r.shard for r in again} == {0, 1}
    assert [r.token_ids for r in again] == [r.token_ids[:8] for r in reference]
