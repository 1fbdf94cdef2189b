"""Migration on real vLLM CPU engines (``fleet.migration`` on, its default): a shard's actor is
SIGKILLed mid-generation and each of its requests goes on on the other shard from the tokens it
had made — the engine there prefills prompt + those tokens and goes on. Greedy: exactly the
tokens of an uninterrupted run; sampled (seeded, n=4): every sample keeps the tokens and
logprobs it had; across a refit between the kill and the resume, the spans carry both versions.

One fleet of 2 shards (no spare: the machine's memory is shared) for the module; each kill is
followed by the fleet's own restart of the shard, which the next test waits for."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nemo_gen import GenerationFleet
from nemo_gen.tiny_model import make_tiny_model
from tests.helpers import alive, wait_until

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"] * 2
TOKENS = 600  # long enough that a kill lands mid-generation on a fast CPU engine


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with room for long generations (the session's has 512 positions)."""
    return make_tiny_model(tmp_path_factory.mktemp("migrate-long") / "tiny", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings, long_model):
    f = GenerationFleet.launch(
        make_settings(
            model__path=str(long_model),
            fleet__name="migrate",
            fleet__num_shards=2,
            health__probe_interval_s=0.5,
            health__probe_timeout_s=20,  # only the kill may condemn a shard here (a loaded machine)
            health__unhealthy_threshold=2,
            health__restart_backoff_s=0.2,
            health__reap_timeout_s=5,
            generation__vllm_cfg__max_model_len=1024,
            server__port=0,
        )
    )
    yield f
    f.shutdown()


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("migrate-models") / "tiny-b", seed=1, max_position_embeddings=2048)


def full_strength(fleet, timeout_s: float = 240):
    wait_until(lambda: fleet.health.serving_shards() == [0, 1] and all(
        s.weight_version == fleet.weight_version for s in fleet.health.snapshot()), timeout_s,
        f"full strength; ledger {fleet.health.state_summary()}")


def kill_mid_generation(fleet, call, requests: int, slot: int = 1, tokens: int = 20):
    """Run ``call`` (``requests`` requests) in the background, SIGKILL ``slot``'s actor once every
    request has a checkpoint of ``tokens`` tokens in each sample (those on ``slot`` included: each
    shard answers the checkpointer on its own); (its results, the checkpoints read just before the kill)."""
    victim = next(s for s in fleet.status() if s.index == slot)
    pool = ThreadPoolExecutor(1)
    future = pool.submit(call)
    pool.shutdown(wait=False)
    kept = every_request_checkpointed(fleet, requests, tokens)
    assert not future.done(), "the call finished before the kill could land"
    os.kill(victim.actor_pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while alive([victim.actor_pid]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return future.result(timeout=300), kept


def every_request_checkpointed(fleet, requests: int, tokens: int = 20) -> dict[str, list[list[int]]]:
    """Wait until each of ``requests`` running requests has ``tokens`` checkpointed tokens in every
    sample (each shard answers the checkpointer on its own, so one shard's may lag); what is kept then."""
    cp = fleet.router.checkpointer
    # A bound, not a target: a loaded machine's engine makes 20 tokens within a minute.
    wait_until(lambda: len(now := cp.kept_now()) == requests and all(
        len(s) >= tokens for k in now.values() for s in k), 120, "a checkpoint of every request")
    return cp.kept_now()


def moved_whole(results, reference, from_shard: int = 1) -> list:
    """The checks every move of a greedy batch passes: each result whole and equal to the
    uninterrupted run's, some moved, each once from ``from_shard`` mid-way onto shard 0, with a
    version span and a logprob for every token; the moved results."""
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    moved = [r for r in results if r.migrations]
    assert moved, "no request moved"
    for r in moved:
        (m,) = r.migrations
        assert m.from_shard == from_shard and 0 < m.at_token < TOKENS and r.shard == 0
        assert covers(r.weight_versions, TOKENS) and len(r.logprobs) == TOKENS
    return moved


def kept_of(kept, index: int) -> list[list[int]]:
    return next(v for k, v in kept.items() if k.endswith(f":{index}"))


def covers(spans, n: int) -> bool:
    return sum(c for _, c in spans) == n


def test_a_greedy_batch_whose_shard_is_killed_returns_exactly_the_uninterrupted_tokens(fleet):
    params = dict(temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    reference = fleet.generate(PROMPTS, **params)
    rerouted = fleet.router.rerouted
    results, kept = kill_mid_generation(fleet, lambda: fleet.generate(PROMPTS, **params), len(PROMPTS))
    for r in moved_whole(results, reference):
        (m,) = r.migrations
        assert len(kept_of(kept, r.index)[0]) <= m.at_token  # at least what was checkpointed before the kill
        assert r.logprobs[:m.at_token] == pytest.approx(
            next(x for x in reference if x.index == r.index).logprobs[:m.at_token], abs=1e-3)
    assert fleet.router.rerouted == rerouted  # tokens were kept: no re-route counted
    full_strength(fleet)


def test_a_seeded_n4_request_keeps_every_samples_tokens_and_logprobs(fleet):
    full_strength(fleet)
    params = dict(temperature=1.0, seed=1234, n=4, max_new_tokens=TOKENS, ignore_eos=True)
    results, kept = kill_mid_generation(fleet, lambda: fleet.generate(PROMPTS[:4], **params), 4)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    moved = [r for r in results if r.migrations]
    assert moved, "no request moved"
    for r in moved:
        assert len(r.samples) == 4 and sorted(m.sample for m in r.migrations) == [0, 1, 2, 3]
        before = kept_of(kept, r.index)
        for m in r.migrations:
            s = r.samples[m.sample]
            shape = [(x.sample, x.at_token, len(before[x.sample]), len(r.samples[x.sample].token_ids)) for x in r.migrations]
            assert s.token_ids[:len(before[m.sample])] == before[m.sample], shape  # its first tokens, unchanged
            assert len(s.token_ids) == TOKENS == len(s.logprobs) and covers(s.weight_versions, TOKENS)
    full_strength(fleet)


def test_a_refit_between_the_kill_and_the_resume_shows_both_versions(fleet, model_b):
    """Shard 1 is killed while a drain refit holds shard 0 and waits for shard 1's requests: the
    requests go on on shard 0 once it has the new weights, their spans old then new."""
    full_strength(fleet)
    old = fleet.weight_version
    victim = next(s for s in fleet.status() if s.index == 1)
    pool = ThreadPoolExecutor(2)
    running = pool.submit(fleet.generate, PROMPTS, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    cp = fleet.router.checkpointer
    wait_until(lambda: any(len(s) >= 20 for k in cp.kept_now().values() for s in k), 120, "a checkpoint")
    refit = pool.submit(fleet.refit, str(model_b), None, "drain")
    time.sleep(1.0)  # the refit holds shard 0 (idle once its share is done) and drains shard 1
    threading.Thread(target=os.kill, args=(victim.actor_pid, signal.SIGKILL)).start()
    results = running.result(timeout=300)
    refit.result(timeout=300)
    pool.shutdown()
    new = fleet.weight_version
    assert new != old
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    moved = [r for r in results if r.migrations]
    assert moved, "no request moved"
    for r in moved:
        assert covers(r.weight_versions, TOKENS)
        assert r.weight_versions[0][0] == old and r.weight_versions[-1][0] == new
    full_strength(fleet)


def test_an_openai_client_stream_reads_one_continuous_answer_across_a_kill(fleet):
    """The HTTP server in front, the official openai client reading a greedy stream: its shard's
    actor is SIGKILLed mid-stream and the stream goes on from the tokens it had sent — the token
    ids read equal the uninterrupted answer's, none missing, none twice."""
    import openai

    from nemo_gen.server import start_server

    full_strength(fleet)
    prompt = [1, 5, 9, 13, 17]
    (reference,) = fleet.generate([prompt], temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    with start_server(fleet) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=fleet.settings.model_name(), prompt=prompt, max_tokens=TOKENS,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
        ids, chunks, killed = [], [], None
        for chunk in stream:
            chunks.append(chunk)
            if chunk.choices:
                ids += chunk.choices[0].token_ids or []
            if killed is None and len(ids) >= 40:
                killed = next(s for s in fleet.status() if fleet.router.selector.inflight(s.index))
                os.kill(killed.actor_pid, signal.SIGKILL)
    assert killed is not None and len(ids) == TOKENS
    assert ids == reference.token_ids
    final = next(c for c in reversed(chunks) if getattr(c, "nemo_gen", None))
    (move,) = final.nemo_gen["migrations"]
    assert move["from_shard"] == killed.index and move["at_token"] >= 40
    full_strength(fleet)
