"""A real 2-shard fleet of vLLM CPU engines, shared by every test in this module."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nemo_gen import GenerationFleet
from nemo_gen.errors import RequestError
from tests.helpers import alive, wait_gone

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    events = []
    f = GenerationFleet.launch(
        make_settings(fleet__name="engine-tests", fleet__num_shards=2),
        progress=lambda i, ev, d: events.append((i, ev)),
    )
    f.launch_events = events
    yield f
    f.shutdown()


def test_launch_reports_progress_and_every_shard_is_healthy(fleet):
    assert sorted(fleet.launch_events) == [(0, "loading"), (0, "ready"), (1, "loading"), (1, "ready")]
    status = fleet.status()
    assert [s.index for s in status] == [0, 1]
    for s in status:
        assert s.state == "healthy"
        assert s.weight_version == 0
        assert s.actor_pid and alive([s.actor_pid]) == [s.actor_pid]
        # EngineCore and its worker run as children of the actor.
        assert len(s.engine_pids) >= 2 and alive(s.engine_pids)
    assert status[0].actor_pid != status[1].actor_pid


def test_greedy_is_deterministic_and_identical_on_every_shard(fleet):
    # The same prompt 8 times: least-loaded routing sends copies to both shards.
    results = fleet.generate(["The quick brown fox"] * 8, temperature=0)
    assert {r.shard for r in results} == {0, 1}
    assert len({tuple(r.token_ids) for r in results}) == 1
    assert all(len(r.token_ids) == 16 for r in results)
    again = fleet.generate(["The quick brown fox"], temperature=0)[0]
    assert again.token_ids == results[0].token_ids
    assert again.text == results[0].text


def test_results_come_back_in_order_with_provenance(fleet):
    results = fleet.generate(PROMPTS, temperature=0, max_new_tokens=5)
    assert [r.index for r in results] == [0, 1, 2, 3]
    assert [r.prompt for r in results] == PROMPTS
    for r in results:
        assert r.ok and r.error is None
        assert r.shard in (0, 1) and r.weight_version == 0
        assert len(r.token_ids) == len(r.logprobs) == 5
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert r.finish_reason == "length"
        assert isinstance(r.text, str)
    # Requests spread: 4 prompts over 2 idle shards, least-loaded first.
    assert sorted(r.shard for r in results) == [0, 0, 1, 1]


def test_token_id_prompts_match_their_string_form(fleet):
    text = fleet.generate(["Once upon a time"], temperature=0)[0]
    ids = fleet.generate([text.prompt_token_ids], temperature=0)[0]
    assert ids.prompt is None
    assert ids.token_ids == text.token_ids


def test_too_long_prompt_fails_alone_and_the_batch_completes(fleet):
    long_ids = [5] * 300  # max_model_len is 256 in these tests
    results = fleet.generate(["Hello, my name is", long_ids, "Once upon a time"], temperature=0)
    assert results[0].ok and results[2].ok
    bad = results[1]
    assert not bad.ok and bad.text is None
    assert "300 tokens" in bad.error and "generation.vllm_cfg.max_model_len is 256" in bad.error
    # The shard is not blamed for a data error.
    assert {s.state for s in fleet.status()} == {"healthy"}


def test_prompt_exactly_max_model_len_is_rejected_by_the_same_rule(fleet):
    results = fleet.generate([[5] * 256, [5] * 255], max_new_tokens=1, temperature=0)
    assert not results[0].ok
    assert results[1].ok and len(results[1].token_ids) == 1


def test_bad_sampling_keyword_fails_before_dispatch(fleet):
    with pytest.raises(RequestError, match="temprature"):
        fleet.generate(PROMPTS, temprature=0.5)
    with pytest.raises(RequestError, match="top_p"):
        fleet.generate(PROMPTS, top_p=1.5)


def test_stop_strings_and_sampling_overrides(fleet):
    greedy = fleet.generate(["The quick brown fox"], temperature=0, max_new_tokens=16)[0]
    stop = greedy.text[4:8]
    assert len(stop) == 4
    cut = fleet.generate(["The quick brown fox"], temperature=0, max_new_tokens=16, stop_strings=[stop])[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and len(cut.token_ids) < 16


def test_generate_async_serves_concurrent_requests(fleet):
    async def main():
        return await asyncio.gather(*(fleet.generate_async(p, temperature=0) for p in PROMPTS))

    results = asyncio.run(main())
    batch = fleet.generate(PROMPTS, temperature=0)
    assert [r.token_ids for r in results] == [r.token_ids for r in batch]
    assert {r.shard for r in results} == {0, 1}


def test_nemo_rl_generation_interface_over_the_fleet(fleet):
    from nemo_gen.generation import resolve_generation_class

    cls = resolve_generation_class({"backend": "vllm"})
    gen = cls(fleet=fleet)
    pad = fleet.resolved.generation_config["_pad_token_id"]
    a = fleet.generate(["Once upon a time"], temperature=0)[0]
    b = fleet.generate(["Hello, my name is"], temperature=0)[0]
    width = max(len(a.prompt_token_ids), len(b.prompt_token_ids))
    input_ids = torch.full((2, width), pad, dtype=torch.long)
    for i, r in enumerate((a, b)):
        input_ids[i, : len(r.prompt_token_ids)] = torch.tensor(r.prompt_token_ids)
    lengths = torch.tensor([len(a.prompt_token_ids), len(b.prompt_token_ids)])
    out = gen.generate({"input_ids": input_ids, "input_lengths": lengths}, greedy=True)
    assert out["generation_lengths"].tolist() == [16, 16]
    for i, r in enumerate((a, b)):
        n = len(r.prompt_token_ids)
        assert out["output_ids"][i, :n].tolist() == r.prompt_token_ids
        assert out["output_ids"][i, n : n + 16].tolist() == r.token_ids
        assert out["logprobs"][i, :n].abs().sum() == 0
        assert out["unpadded_sequence_lengths"][i] == n + 16
    assert out["truncated"].tolist() == [True, True]
    assert gen.prepare_for_generation() and gen.finish_generation()
    gen.shutdown()  # does not own the fleet: it keeps serving
    assert fleet.generate(["Hello"], max_new_tokens=1)[0].ok


def test_shutdown_leaves_no_process_and_is_idempotent(fleet):
    pids = [p for s in fleet.status() for p in [s.actor_pid, *s.engine_pids] if p]
    assert alive(pids)
    fleet.shutdown()
    assert wait_gone(pids, 30) == []
    fleet.shutdown()  # again: no error
    with pytest.raises(Exception, match="shut down"):
        fleet.generate(["x"])
