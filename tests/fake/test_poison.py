"""Poison token ids and poison requests (issue 50, item 2), on fake shards (tests/fakes.py) and the
real router, server and openai client: an id out of the model's vocabulary is refused on the driver
before any shard sees it (``RequestError`` in the library, 400 naming the prompt and position over
HTTP); a request whose engine fails on its own under it is sent to no other engine (exactly one
death); vLLM's refusals are 400s and no error body carries Ray's pid, IP, actor id or colours. The
same paths on real vLLM engines, with and without a tokenizer: tests/engine/test_poison_ids.py."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
import ray

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.results import out_of_vocab
from nemo_gen.core.retry import client_error, ended_on_its_own, kind_of
from nemo_gen.errors import EngineCrashError, RequestError
from nemo_gen.fleet.faults import classify
from nemo_gen.fleet.resolve import model_vocab_size
from nemo_gen.server.http import error_for
from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

VOCAB_SIZE = 512  # the tiny model's config
POISON = 7  # an id in the vocabulary that the fake engines die of


# -- the check itself (nemo_gen.core) ------------------------------------------------------------------


def test_ids_inside_the_vocabulary_pass():
    assert out_of_vocab(0, [0, 5, VOCAB_SIZE - 1], VOCAB_SIZE) is None
    assert out_of_vocab(0, [], VOCAB_SIZE) is None
    assert out_of_vocab(0, [10**6], None) is None  # no vocab_size known: unchecked


@pytest.mark.parametrize("ids, position, token", [([600], 0, 600), ([1, 2, VOCAB_SIZE], 2, VOCAB_SIZE),
                                                  ([3, -1, 600], 1, -1)])
def test_the_first_id_outside_is_named_by_prompt_and_position(ids, position, token):
    message = out_of_vocab(4, ids, VOCAB_SIZE)
    assert message.startswith(f"prompt 4: token id {token} at position {position} ")
    assert f"vocab_size is {VOCAB_SIZE}" in message


def test_the_bound_is_the_model_configs_vocab_size(tmp_path, make_settings):
    (tmp_path / "config.json").write_text('{"vocab_size": 1000, "text_config": {"vocab_size": 1024}}')
    assert model_vocab_size(tmp_path) == 1024  # the text model's, as vLLM reads it
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert model_vocab_size(tmp_path) is None


@pytest.mark.parametrize("code, own", [(1, True), (-11, True), (-6, True), (-9, False), (-15, False), (0, False),
                                       (None, False)])
def test_an_engine_core_that_ended_on_its_own_is_told_from_one_killed_from_outside(code, own):
    assert ended_on_its_own(code) is own


# -- what comes back through Ray -------------------------------------------------------------------------


def _ray_task_error(cause: BaseException) -> BaseException:
    """Ray's own wrapper of an actor's exception, as a driver receives it (with its frame: ANSI
    colours, the actor's pid, node IP and id)."""
    error = ray.exceptions.RayTaskError(
        "ShardActor.generate", "Traceback (most recent call last):\n  File \"x.py\", line 1, in generate\n"
        f"vllm.exceptions.{type(cause).__name__}: {cause}", cause, proctitle="ray::ShardActor.generate()",
        pid=27638, ip="192.0.2.2", actor_id="b3fb7187aa00")
    return error.as_instanceof_cause()


def _no_internals(text: str) -> None:
    for leak in ("27638", "192.0.2.2", "b3fb7187", "\x1b", "Traceback", "ray::", "pid=", "actor_id"):
        assert leak not in text, (leak, text)


def test_a_vllm_client_error_through_ray_is_a_request_error_in_vllms_words():
    from vllm.exceptions import VLLMValidationError

    wrapped = _ray_task_error(VLLMValidationError("Token id 600 is out of vocabulary"))
    assert kind_of(wrapped) == "data"
    assert type(client_error(wrapped)) is VLLMValidationError  # the actor's own, not Ray's copy
    error = classify(None, wrapped, "generate")
    assert isinstance(error, RequestError)
    assert str(error) == "VLLMValidationError: Token id 600 is out of vocabulary"
    api = error_for(error)
    assert api.status == 400
    _no_internals(str(api.body()))


def test_the_shards_own_error_through_ray_comes_back_without_rays_frame():
    wrapped = _ray_task_error(EngineCrashError(0, "its EngineCore exited with code 1 while it ran this request"))
    assert isinstance(wrapped, EngineCrashError) and "27638" in str(wrapped)  # Ray's copy: both types
    error = classify(None, wrapped, "generate")
    assert type(error) is EngineCrashError and error.shard == 0
    _no_internals(f"{type(error).__name__}: {error}")
    api = error_for(error)
    assert api.status == 500 and api.retry is False
    _no_internals(str(api.body()))


def test_an_unexpected_error_through_ray_is_a_500_without_rays_frame():
    wrapped = _ray_task_error(RuntimeError("vLLM's output for request 0 ended before it finished"))
    api = error_for(classify(None, wrapped, "generate"))
    assert api.status == 500
    assert api.body()["error"]["message"] == \
        "internal error: RuntimeError: vLLM's output for request 0 ended before it finished"
    _no_internals(str(api.body()))


# -- on a fleet: refused before any shard sees it ----------------------------------------------------------


@pytest.fixture
def driver():
    d = FakeDriver()
    yield d
    d.close()


@pytest.fixture
def settings(make_settings):
    def make(**overrides):
        base = dict(fleet__name="poison", fleet__num_shards=2, health__probe_interval_s=60,
                    health__restart_backoff_s=0.0, health__restart_jitter=0.0, health__reap_timeout_s=0.1,
                    health__auto_recover=False, generation__vllm_cfg__skip_tokenizer_init=True)
        base.update(overrides)
        return make_settings(**base)
    return make


def _generated(fleet, driver) -> int:
    return sum(driver.shard(h).generated + len(driver.shard(h).streams) for h in fleet.shards)


def test_an_out_of_vocabulary_id_is_refused_on_every_library_path_and_no_shard_sees_it(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        assert fleet.router.vocab_size == VOCAB_SIZE
        with pytest.raises(RequestError, match="prompt 1: token id 600 at position 2 ") as caught:
            fleet.generate([[1, 2], [3, 4, 600]])
        assert caught.value.index == 1

        async def one():
            return await fleet.generate_async([5, 600])

        with pytest.raises(RequestError, match="prompt 0: token id 600 at position 1 "):
            asyncio.run(one())

        async def streamed():
            return [item async for item in fleet.generate_stream([-3])]

        with pytest.raises(RequestError, match="token id -3 at position 0 "):
            asyncio.run(streamed())
        assert _generated(fleet, driver) == 0
        assert [fleet.health.state_of(s) for s in (0, 1)] == [ShardState.HEALTHY] * 2
        assert [r.ok for r in fleet.generate([[1, VOCAB_SIZE - 1]])] == [True]  # the last id is inside


def test_the_seed_api_goes_through_the_same_check(settings, driver):
    import torch

    from nemo_gen.generation.vllm import VllmGeneration

    with fake_fleet(settings(), driver) as fleet:
        gen = VllmGeneration(fleet=fleet)
        pad = gen.cfg["_pad_token_id"]
        batch = {"input_ids": torch.tensor([[5, 6, pad], [7, 600, 8]]), "input_lengths": torch.tensor([2, 3])}
        with pytest.raises(RequestError, match="prompt 1: token id 600 at position 1 "):
            gen.generate(batch)
        assert _generated(fleet, driver) == 0


# -- a request that kills its engine is not re-routed ------------------------------------------------------


def _poison_every_engine(fleet, driver, exit_code: int = 1) -> None:
    for h in fleet.shards:
        driver.shard(h).crash_on, driver.shard(h).crash_exit = POISON, exit_code


def _crashes(fleet, driver) -> int:
    return sum(driver.shard(h).crashes for h in fleet.shards)


def test_a_request_that_kills_its_engine_fails_and_kills_no_other(settings, driver):
    """Every engine would die of it: on each path exactly one does, and it is condemned."""
    with fake_fleet(settings(fleet__num_shards=3), driver) as fleet:
        _poison_every_engine(fleet, driver)
        (result,) = fleet.generate([[5, POISON]])
        assert not result.ok and result.error.startswith("EngineCrashError: shard ")
        assert "exited with code 1" in result.error and "sent to no other engine" in result.error
        assert _crashes(fleet, driver) == 1
        assert sorted(fleet.health.state_of(s) is ShardState.HEALTHY for s in range(3)) == [False, True, True]

        async def one():
            return await fleet.generate_async([POISON])

        with pytest.raises(EngineCrashError):
            asyncio.run(one())
        assert _crashes(fleet, driver) == 2  # one more request, one more death: never two

        async def streamed():
            return [item async for item in fleet.generate_stream([POISON, 5])]

        with pytest.raises(EngineCrashError):
            asyncio.run(streamed())
        assert _crashes(fleet, driver) == 3
        assert fleet.router.rerouted == 0


def test_an_engine_killed_from_outside_still_has_its_request_re_routed(settings, driver):
    """The control: a core that died of a signal from outside (SIGKILL, the OOM killer) says
    nothing about its request, which is answered by another shard as before."""
    with fake_fleet(settings(), driver) as fleet:
        first = fleet.handle(0)
        driver.shard(first).crash_on, driver.shard(first).crash_exit = POISON, -9
        results = fleet.generate([[POISON]] * 4)
        assert all(r.ok for r in results)
        assert _crashes(fleet, driver) == 1 and fleet.router.rerouted >= 1
        assert {r.shard for r in results} == {1}


# -- over HTTP (no tokenizer on the engines: the router decodes) ------------------------------------------


@pytest.fixture
def served(settings, driver):
    from nemo_gen.server import start_server

    fleet = fake_fleet(settings(server__port=0, generation__max_new_tokens=4), driver)
    handle = start_server(fleet)
    yield fleet, handle
    handle.stop()
    fleet.shutdown()


def test_http_an_out_of_vocabulary_id_is_a_400_naming_prompt_and_position(served, driver):
    fleet, handle = served
    client = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=fleet.settings.model_name(), prompt=[[1, 2], [3, 600]], max_tokens=2)
    error = caught.value.body
    assert error["message"].startswith("prompt 1: token id 600 at position 1 ") and error["param"] == "prompt"
    _no_internals(str(error))
    assert _generated(fleet, driver) == 0
    assert [fleet.health.state_of(s) for s in (0, 1)] == [ShardState.HEALTHY] * 2


def test_http_a_request_that_kills_its_engine_is_a_500_not_to_be_retried(served, driver):
    fleet, handle = served
    _poison_every_engine(fleet, driver)
    response = httpx.post(f"{handle.url}/v1/completions", json={"prompt": [POISON], "max_tokens": 2}, timeout=60)
    assert response.status_code == 500
    assert response.headers["x-should-retry"] == "false"  # the openai client would resend it otherwise
    assert "EngineCrashError" in response.json()["error"]["message"]
    _no_internals(response.text)
    assert _crashes(fleet, driver) == 1


def test_an_engines_death_is_reported_after_the_calls_it_held_have_answered(settings, driver):
    """The actor's watch waits on ``calls_answered``: a call whose engine ended on its own says
    so (EngineCrashError) before the watch's verdict condemns the shard and turns the call into
    a re-routed actor death."""
    from nemo_gen.core.results import GenerationRequest
    from nemo_gen.shard.rules import ANSWER_MARGIN_S
    from nemo_gen.core.sampling import resolve_sampling
    from nemo_gen.fleet.requests import sampling_of
    from tests.helpers import wait_until

    with fake_fleet(settings(), driver) as fleet:
        handle = fleet.handle(0)
        driver.set_token_s(handle.name, 0.05)  # 8 tokens: 0.4 s in the engine
        rules = driver.rules(handle)
        sampling = sampling_of(resolve_sampling(fleet.resolved.generation_config, {"max_new_tokens": 8}))
        call = driver.start_generate(handle, [GenerationRequest(index=0, prompt_token_ids=[1])], sampling)
        wait_until(lambda: rules.calls == 1, 30, "the call in the engine")
        asyncio.run_coroutine_threadsafe(rules.calls_answered(), driver.loop).result(timeout=60)
        assert call.ref.done() and rules.calls == 0
        t0 = time.monotonic()  # an idle engine's death: nothing to wait for, reported at once
        asyncio.run_coroutine_threadsafe(rules.calls_answered(), driver.loop).result(timeout=60)
        assert time.monotonic() - t0 < ANSWER_MARGIN_S
