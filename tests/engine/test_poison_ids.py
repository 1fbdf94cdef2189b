"""Poison token ids on real vLLM CPU engines (issue 50, item 2): a 2-shard fleet whose engines have
no tokenizer (``skip_tokenizer_init``: what ``fleet.mode=train`` gets under ``nemo-gen serve``,
where vLLM checks no id and an id past the vocabulary kills the EngineCore) and a 1-shard fleet
with one, each behind the real server. An out-of-vocabulary id is refused on the driver, named by
prompt and position (``RequestError``; 400 over HTTP), and no engine dies. Past the driver's check
(turned off here to stand for a poison it cannot see), vLLM's own refusal is a 400 with no Ray
identifiers, and a request that kills an engine kills exactly one: it is not re-routed. The same
logic on fake shards: tests/fake/test_poison.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.errors import RequestError
from nemo_gen.server import start_server
from nemo_gen.server.http import error_for
from tests.helpers import shutdown_all, wait_until

pytestmark = pytest.mark.engine

VOCAB_SIZE = 512  # the tiny model's config
LEAKS = ("pid=", "ip=", "actor_id", "\x1b", "Traceback", "ray::")


@pytest.fixture(scope="module")
def fleets(ray_cluster, make_settings):
    """Both fleets started side by side, each with its server on a free loopback port."""
    common = dict(fleet__num_shards=1, health__probe_interval_s=60, health__restart_backoff_s=0.2, server__port=0,
                  generation__max_new_tokens=4)
    with ThreadPoolExecutor(2) as pool:
        bare = pool.submit(GenerationFleet.launch, make_settings(
            **{**common, "fleet__num_shards": 2}, fleet__name="poison-bare", generation__vllm_cfg__skip_tokenizer_init=True))
        tok = pool.submit(GenerationFleet.launch, make_settings(**common, fleet__name="poison-tok"))
        started = {"bare": bare.result(), "tok": tok.result()}
    servers = {name: start_server(f) for name, f in started.items()}
    yield started, servers
    for server in servers.values():
        server.stop()
    shutdown_all(started.values())


def deaths(fleet) -> int:
    return sum(1 for h in fleet.health.history() if h["new"] == "dead")


def serving(fleet) -> bool:
    return all(fleet.health.state_of(s) is ShardState.HEALTHY for s in range(fleet.settings.fleet.num_shards))


@pytest.mark.parametrize("name", ["bare", "tok"])
def test_an_out_of_vocabulary_id_is_refused_by_prompt_and_position_and_no_engine_dies(fleets, name):
    started, servers = fleets
    fleet = started[name]
    assert fleet.router.vocab_size == VOCAB_SIZE and serving(fleet)
    with pytest.raises(RequestError, match="prompt 1: token id 600 at position 1 ") as caught:
        fleet.generate([[5, 6], [7, 600]])
    assert caught.value.index == 1
    for ids, position in (([600], 0), ([3, 4, 10**6], 2), ([1, VOCAB_SIZE], 1)):
        response = httpx.post(f"{servers[name].url}/v1/completions", json={"prompt": ids, "max_tokens": 2}, timeout=120)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["message"].startswith(f"prompt 0: token id {ids[position]} at position {position} ")
        assert error["param"] == "prompt"
    assert [r.ok for r in fleet.generate([[1, VOCAB_SIZE - 1]])] == [True]  # the engines serve on
    assert deaths(fleet) == 0 and serving(fleet)


def test_past_the_check_vllms_own_refusal_is_a_400_without_ray_identifiers(fleets):
    """The engine with a tokenizer checks ids itself: its refusal comes back through Ray as the
    caller's RequestError in vLLM's words, never a 500 carrying the actor's pid, IP and id."""
    started, servers = fleets
    fleet = started["tok"]
    fleet.router.vocab_size = None  # stands for an id the driver's check does not catch
    try:
        with pytest.raises(RequestError, match="VLLMValidationError: Token id 600 is out of vocabulary") as caught:
            fleet.generate([[600]])
        body = error_for(caught.value)
        assert body.status == 400
        assert not [leak for leak in LEAKS if leak in str(body.body())], body.body()
    finally:
        fleet.router.vocab_size = VOCAB_SIZE
    assert deaths(fleet) == 0 and serving(fleet)


def test_past_the_check_a_request_that_kills_its_engine_kills_exactly_one(fleets):
    """Without a tokenizer nothing in vLLM stops the id: the EngineCore dies of it (IndexError in
    the embedding). The request fails with EngineCrashError, is sent to no other engine, and the
    killed shard is condemned and restarted as before."""
    started, _ = fleets
    fleet = started["bare"]
    fleet.router.vocab_size = None
    try:
        (result,) = fleet.generate([[600]])
    finally:
        fleet.router.vocab_size = VOCAB_SIZE
    assert not result.ok and result.error.startswith("EngineCrashError: "), result.error
    assert "exited with code 1" in result.error
    assert deaths(fleet) == 1 and fleet.router.rerouted == 0
    assert [r.ok for r in fleet.generate([[5, 6, 7]] * 2)] == [True, True]  # the other shard serves on
    # 180 s: a bound for a restart on a loaded 2-core machine, not a latency target.
    wait_until(lambda: serving(fleet), 180, "the killed shard restarted")
    assert deaths(fleet) == 1
