"""Streams of ``n`` samples across a SIGKILL on real vLLM CPU engines
(``nemo_gen.fleet.stream_moves``): each unfinished sample goes on on the other shard from the
tokens its reader has, so every sample reads as one run, no token missing or twice. The samples
are drawn with ``top_k=1`` (vLLM refuses n > 1 under temperature 0; top-1 picks the greedy
token), so each equals the greedy uninterrupted run's tokens. The library stream, and the HTTP
server read by the official ``openai`` client. The fake-driver tier: tests/fake/test_stream_moves.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.results import Delta
from tests.engine.test_migration import TOKENS, full_strength, long_model  # noqa: F401  (a fixture)

pytestmark = pytest.mark.engine

PROMPT = [1, 5, 9, 13, 17]
TOP1 = dict(temperature=1.0, top_k=1, seed=7, max_new_tokens=TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings, long_model):  # noqa: F811
    f = GenerationFleet.launch(make_settings(
        model__path=str(long_model), fleet__name="stream-moves", fleet__num_shards=2,
        generation__vllm_cfg__max_model_len=1024, health__probe_interval_s=0.5, health__probe_timeout_s=20,
        health__unhealthy_threshold=2, health__restart_backoff_s=0.2, health__reap_timeout_s=5))
    yield f
    f.shutdown()


@pytest.fixture(scope="module")
def reference(fleet):
    (ref,) = fleet.generate([PROMPT], temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    return ref.token_ids


def test_an_n4_stream_whose_shard_is_killed_reads_each_sample_as_one_run(fleet, reference):
    async def run():
        items, killed = [], None
        async for item in fleet.generate_stream(PROMPT, n=4, **TOP1):
            items.append(item)
            if killed is None and isinstance(item, Delta) and sum(len(d.token_ids) for d in items[:-1]
                                                                  if d.sample == 0) >= 40:
                killed = next(s for s in fleet.status() if s.index == item.shard)
                os.kill(killed.actor_pid, signal.SIGKILL)
        return items, killed

    items, killed = asyncio.run(run())
    deltas, result = items[:-1], items[-1]
    assert killed is not None and result.ok, result.error
    for k in range(4):
        ids = [t for d in deltas if d.sample == k for t in d.token_ids]
        assert ids == reference, f"sample {k}: {len(ids)} tokens"
        assert result.samples[k].token_ids == ids and len(result.samples[k].logprobs) == TOKENS
        assert sum(n for _, n in result.samples[k].weight_versions) == TOKENS
    assert result.migrations and all(m.from_shard == killed.index and m.at_token >= 1 for m in result.migrations)
    assert {m.sample for m in result.migrations} <= {0, 1, 2, 3}
    assert {d.shard for d in deltas} == {0, 1}
    full_strength(fleet)


def test_an_openai_client_reads_an_n2_stream_as_one_run_per_choice_across_a_kill(fleet, reference):
    import openai

    from nemo_gen.server import start_server

    full_strength(fleet)
    with start_server(fleet) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=fleet.settings.model_name(), prompt=PROMPT, max_tokens=TOKENS,
                                           n=2, temperature=1.0, seed=7, stream=True,
                                           extra_body={"top_k": 1, "ignore_eos": True, "return_token_ids": True})
        ids: dict[int, list[int]] = {0: [], 1: []}
        chunks, killed = [], None
        for chunk in stream:
            chunks.append(chunk)
            for choice in chunk.choices:
                ids[choice.index] += choice.token_ids or []
            if killed is None and len(ids[0]) >= 40:
                killed = next(s for s in fleet.status() if fleet.router.selector.inflight(s.index))
                os.kill(killed.actor_pid, signal.SIGKILL)
    assert killed is not None
    assert ids[0] == reference and ids[1] == reference
    final = next(c for c in reversed(chunks) if getattr(c, "nemo_gen", None))
    assert final.nemo_gen["migrations"] and all(m["from_shard"] == killed.index for m in final.nemo_gen["migrations"])
    full_strength(fleet)
