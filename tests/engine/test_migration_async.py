"""Migration on the async engine (``vllm_cfg.async_engine``: vLLM's ``AsyncLLM``): its
checkpoints are read from vLLM's output-processor state. A greedy batch whose shard's actor is
SIGKILLed mid-generation returns exactly the uninterrupted run's tokens. The sync engine's cases:
tests/engine/test_migration.py."""

from __future__ import annotations

import pytest

from nemo_gen import GenerationFleet
from tests.engine.test_migration import PROMPTS, TOKENS, covers, kill_mid_generation, long_model  # noqa: F401

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings, long_model):  # noqa: F811
    f = GenerationFleet.launch(make_settings(
        model__path=str(long_model), fleet__name="migrate-async", fleet__num_shards=2,
        generation__vllm_cfg__async_engine=True, generation__vllm_cfg__max_model_len=1024,
        health__probe_interval_s=0.5, health__probe_timeout_s=20, health__auto_recover=False))
    yield f
    f.shutdown()


def test_a_greedy_batch_on_the_async_engine_goes_on_from_its_tokens(fleet):
    params = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    reference = fleet.generate(PROMPTS, **params)
    results, kept = kill_mid_generation(fleet, lambda: fleet.generate(PROMPTS, **params), len(PROMPTS))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    moved = [r for r in results if r.migrations]
    assert moved and all(r.migrations[0].at_token > 0 and covers(r.weight_versions, TOKENS) for r in moved)
    assert fleet.router.rerouted == 0
