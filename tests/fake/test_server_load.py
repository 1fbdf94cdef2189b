"""The HTTP server under load and bad input, over fake shards (tests/fakes.py) that generate one
token per ``token_s`` and stop when cancelled: it sheds load with 503 + Retry-After, answers a
passed deadline with 504, refuses oversized or malformed bodies before any work (413, 400), and
cancels the requests of a client that disconnects. The real app on real uvicorn, the real router,
the official openai client and httpx. /health's latency under load is bench/overload.py's."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest

from tests import helpers
from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def wait_until(predicate, timeout_s: float = 10.0, what: str = "the condition"):
    return helpers.wait_until(predicate, timeout_s, what, poll_s=0.005)


@pytest.fixture(scope="module")
def driver():
    d = FakeDriver()
    yield d
    d.close()


@pytest.fixture(scope="module")
def served(make_settings, driver):
    from nemo_gen.server import start_server

    settings = make_settings(fleet__name="fake-load", fleet__num_shards=2, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, server__max_in_flight=4,
                             server__retry_after_s=2, server__max_body_bytes=64 * 1024, server__max_prompt_chars=5000,
                             fleet__busy_backoff_s=0.01, generation__vllm_cfg__skip_tokenizer_init=True)
    fleet = fake_fleet(settings, driver)
    handle = start_server(fleet)
    yield fleet, handle, settings
    handle.stop()
    fleet.shutdown()


@pytest.fixture
def fleet(served, driver):
    fleet = served[0]
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.0)
        driver.shards[h.name].busy = 0
        driver.shards[h.name].tokens_made.clear()
    yield fleet
    wait_until(lambda: all(s.running == 0 for s in driver.shards.values()), 10, "the shards idle")


def url(served, path: str) -> str:
    return served[1].url + path


def client(served, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url(served, "/v1"), api_key="x", max_retries=0, **kw)


def test_past_max_in_flight_the_server_answers_503_with_retry_after_at_once(served, fleet, driver):
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.02)
    model = served[2].model_name()

    def long_request():
        client(served).completions.create(model=model, prompt=[1, 2], max_tokens=100)

    held = [threading.Thread(target=long_request) for _ in range(4)]  # server.max_in_flight=4
    for t in held:
        t.start()
    wait_until(lambda: sum(s.running for s in driver.shards.values()) == 4, what="4 requests on the shards")
    t0 = time.monotonic()
    refused = httpx.post(url(served, "/v1/completions"), json={"prompt": [3], "max_tokens": 2})
    assert time.monotonic() - t0 < 1.0
    assert refused.status_code == 503 and refused.headers["retry-after"] == "2"
    assert "server.max_in_flight" in refused.json()["error"]["message"]
    assert httpx.get(url(served, "/health")).status_code == 200  # never held back by the bound
    for t in held:
        t.join(30)
    assert client(served).completions.create(model=model, prompt=[3], max_tokens=2).choices  # room again
    too_many = httpx.post(url(served, "/v1/completions"), json={"prompt": [3], "n": 5, "max_tokens": 2})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"  # it could never fit


def test_a_fleet_of_busy_shards_is_a_503_never_a_500(served, fleet, driver):
    for h in fleet.shards:
        driver.set_busy(h.name)
    with pytest.raises(openai.InternalServerError) as info:
        client(served).chat.completions.create(model=served[2].model_name(), max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "2"
    assert "FleetBusy" in info.value.body["message"]
    assert all(s.state.value == "healthy" for s in fleet.health.snapshot())


@pytest.mark.parametrize("how", ["body", "header"])
def test_a_request_past_its_deadline_is_a_504_and_is_aborted(served, fleet, driver, how):
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.02)
    body = {"prompt": [1, 2, 3], "max_tokens": 200} | ({"timeout_s": 0.5} if how == "body" else {})
    headers = {"x-nemo-gen-timeout-s": "0.5"} if how == "header" else {}
    t0 = time.monotonic()
    answer = httpx.post(url(served, "/v1/completions"), json=body, headers=headers, timeout=30)
    assert answer.status_code == 504 and "RequestTimeout" in answer.json()["error"]["message"]
    assert time.monotonic() - t0 < 3
    wait_until(lambda: all(s.running == 0 for s in driver.shards.values()), 2, "the request aborted")
    assert all(s.state.value == "healthy" and s.restart_attempts == 0 for s in fleet.health.snapshot())
    bad = httpx.post(url(served, "/v1/completions"), json={"prompt": [1], "timeout_s": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "timeout_s"


def test_a_client_that_disconnects_cancels_its_request(served, fleet, driver):
    """Non-streamed: the server notices the disconnect while the fleet generates and cancels
    the request (before, it generated to the end for nobody)."""
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.04)
    body = json.dumps({"prompt": [4, 5], "max_tokens": 250}).encode()
    with socket.create_connection((served[1].host, served[1].port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: sum(s.running for s in driver.shards.values()) == 1, what="the request on a shard")
        time.sleep(0.3)  # a few tokens made, then the client goes away
    t0 = time.monotonic()
    wait_until(lambda: all(s.running == 0 for s in driver.shards.values()), 2, "the request cancelled")
    assert time.monotonic() - t0 < 1.0
    made = max((n for s in driver.shards.values() for n in s.tokens_made.values()), default=0)
    assert 0 < made < 100


def test_bodies_past_the_bound_are_413_before_they_are_read(served, fleet):
    big = json.dumps({"prompt": "x" * (70 * 1024)})
    answer = httpx.post(url(served, "/v1/completions"), content=big, headers={"content-type": "application/json"})
    assert answer.status_code == 413 and "server.max_body_bytes=65536" in answer.json()["error"]["message"]

    def chunks():  # no Content-Length: refused as the bytes come, not after all of them
        for _ in range(100):
            yield b"x" * 4096

    answer = httpx.post(url(served, "/v1/completions"), content=chunks(), headers={"content-type": "application/json"})
    assert answer.status_code == 413


def test_malformed_and_oversized_requests_are_400s_naming_the_field(served, fleet):
    deep = b"[" * 30000 + b"]" * 30000
    answer = httpx.post(url(served, "/v1/completions"), content=deep, headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"]
    answer = httpx.post(url(served, "/v1/completions"), json={"prompt": "hi", "max_tokens": 10**9})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "max_tokens" and "max_model_len=256" in error["message"]
    answer = httpx.post(url(served, "/v1/chat/completions"),
                        json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 300})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_completion_tokens"
    answer = httpx.post(url(served, "/v1/completions"), json={"prompt": "y" * 6000})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == "prompt" and "server.max_prompt_chars=5000" in error["message"]
    answer = httpx.post(url(served, "/v1/chat/completions"),
                        json={"messages": [{"role": "user", "content": "z" * 6000}]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"


def test_tokenizing_and_building_responses_happen_off_the_servers_event_loop(served, fleet, monkeypatch):
    """The loop that answers /health must never tokenize a long prompt, render a chat template or
    build a heavy response body (logprobs, parsers, many tokens): each of those ran there, so one
    4 MB prompt held /health for 7-16 s. A short prompt and a light response are made on the loop:
    a thread hop costs more server CPU than they do (bench serve --fake)."""
    from nemo_gen.fleet.requests import ON_LOOP_CHARS
    from nemo_gen.server import responses

    seen: dict[str, list[int]] = {}
    router = fleet.router
    real_requests = type(router).requests
    real_response = responses.completion_response

    def spy(name, fn):
        def wrapped(*a, **kw):
            seen.setdefault(name, []).append(threading.get_ident())
            return fn(*a, **kw)
        return wrapped

    monkeypatch.setattr(type(router), "requests", spy("requests", real_requests))
    monkeypatch.setattr(responses, "completion_response", spy("response", real_response))
    server_thread = next(t for t in threading.enumerate() if t.name == "nemo-gen-http").ident

    def threads(path, body):
        seen.clear()
        answer = httpx.post(url(served, path), json=body)
        return answer, seen.get("requests", []), seen.get("response", [])

    # long text (refused as too long for the context, after tokenizing it), chat, logprobs: off the loop
    _, made, _ = threads("/v1/completions", {"prompt": "ab " * (ON_LOOP_CHARS // 3 + 1), "max_tokens": 2})
    assert made and server_thread not in made
    answer, made, _ = threads("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200 and made and server_thread not in made
    answer, _, built = threads("/v1/completions", {"prompt": "hello there", "max_tokens": 2, "logprobs": 0})
    assert answer.status_code == 200 and built and server_thread not in built
    # a short prompt's request and a light response: on the loop
    answer, made, built = threads("/v1/completions", {"prompt": "hello there", "max_tokens": 2})
    assert answer.status_code == 200 and made == [server_thread] and built == [server_thread]
