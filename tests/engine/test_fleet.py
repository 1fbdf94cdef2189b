"""A real 2-shard fleet of vLLM CPU engines, shared by every test in this module: launch, greedy
determinism, ordering and provenance, prompt limits, sampling, the NeMo-RL interface; then RL
rollouts as people run them (a GRPO group of n samples per prompt: one engine request, one shard;
chat prompts rendered with the tokenizer's chat template; a multi-turn session that stays on its
shard and moves when that shard is killed). Each test gets the fleet checked on entry (both
slots HEALTHY at version 0: tests/helpers.py's ``SharedFleet``); the killed shard's test waits for
it to be back, and the shutdown test spends the fleet, so the tests pass in any order."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.results import Delta, GenerationResult
from nemo_gen.errors import RequestError
from tests.helpers import SharedFleet, alive, wait_gone, wait_until

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]


@pytest.fixture(scope="module")
def shared(ray_cluster, make_settings):
    def launch():
        events = []
        f = GenerationFleet.launch(
            # No probe lands among the routing tests' requests; the killed shard comes back quickly.
            make_settings(fleet__name="engine-tests", fleet__num_shards=2, health__probe_interval_s=60,
                          health__restart_backoff_s=0.2),
            progress=lambda i, ev, d: events.append((i, ev)),
        )
        f.launch_events = events
        return f

    shared = SharedFleet(launch, check=_whole_at_version_0)
    yield shared
    shared.close()


def _whole_at_version_0(fleet):
    assert fleet.health.serving_shards() == [0, 1], fleet.health.state_summary()
    assert fleet.weight_version == 0 and {s.weight_version for s in fleet.health.snapshot()} == {0}


@pytest.fixture
def fleet(shared):
    return shared.get()


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


def test_a_batchs_text_decoded_by_the_router_is_the_engines_own(fleet):
    # A batch's samples come back undecoded and the router decodes each once; a request with a
    # stop string (one that never matches) is decoded by vLLM's own incremental detokenizer.
    prompts = PROMPTS + ["Numbers: 1, 2, 3,", "\u00e9t\u00e9 \u00e0 Paris \u2014 caf\u00e9"]
    ours = fleet.generate(prompts, temperature=0, max_new_tokens=32, logprobs=2)
    engines = fleet.generate(prompts, temperature=0, max_new_tokens=32, logprobs=2, stop_strings=["\x00never\x00"])
    for a, b in zip(ours, engines):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs and a.top_logprobs == b.top_logprobs
        assert a.text == b.text and a.text
    for prompt, batch in zip(prompts[-2:], ours[-2:]):  # a stream's text is the engine's, as it comes
        pieces, final = asyncio.run(_streamed(fleet, prompt))
        assert "".join(pieces) == final.text == batch.text and final.token_ids == batch.token_ids


async def _streamed(fleet, prompt: str) -> tuple[list[str], GenerationResult]:
    items = [item async for item in fleet.generate_stream(prompt, temperature=0, max_new_tokens=32)]
    return [d.text for d in items if isinstance(d, Delta)], items[-1]


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


def test_shutdown_leaves_no_process_and_is_idempotent(shared, fleet):
    shared.spend()
    pids = [p for s in fleet.status() for p in [s.actor_pid, *s.engine_pids] if p]
    assert alive(pids)
    fleet.shutdown()
    assert wait_gone(pids, 30) == []
    fleet.shutdown()  # again: no error
    with pytest.raises(Exception, match="shut down"):
        fleet.generate(["x"])
