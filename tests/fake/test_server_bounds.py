"""Every route of the HTTP server bounded, over fake shards (tests/fakes.py) behind the real app
on real uvicorn on 127.0.0.1: /tokenize and /detokenize held under server.max_in_flight, chat
tools and tool-call arguments counted toward server.max_prompt_chars, session keys of bounded
length, and connections that never finish their request headers closed after
server.header_timeout_s (real sockets)."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from tests import helpers
from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HEADER_TIMEOUT_S = 1.0
MAX_PROMPT_CHARS = 5000


@pytest.fixture(scope="module")
def driver():
    d = FakeDriver()
    yield d
    d.close()


@pytest.fixture(scope="module")
def served(make_settings, driver):
    from nemo_gen.server import start_server

    settings = make_settings(fleet__name="fake-bounds", fleet__num_shards=2, health__probe_interval_s=60,
                             health__auto_recover=False, server__port=0, server__max_in_flight=4,
                             server__max_prompt_chars=MAX_PROMPT_CHARS, server__header_timeout_s=HEADER_TIMEOUT_S,
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
    yield fleet
    helpers.wait_until(lambda: all(s.running == 0 for s in driver.shards.values()), 10, "the shards idle")


def url(served, path: str) -> str:
    return served[1].url + path


def held(served) -> int:
    return served[1].server.config.app.app.state.gateway.api.inflight.held


def _tools(count: int, description_chars: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"f{i}", "description": "d" * description_chars,
                                              "parameters": {"type": "object"}}} for i in range(count)]


# -- max_prompt_chars counts tools and tool-call arguments --------------------------------------------


def test_a_10mb_tools_tokenize_is_refused_by_max_prompt_chars(served, fleet):
    tools = _tools(9000, 1000)  # ~10 MB: rendering it took tens of seconds before it was bounded
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert len(json.dumps(body)) > 9_000_000
    answer = httpx.post(url(served, "/tokenize"), json=body, timeout=300)
    assert answer.status_code == 400, answer.text[:200]
    error = answer.json()["error"]
    assert error["param"] == "tools" and "server.max_prompt_chars=5000" in error["message"]
    assert held(served) == 0


def test_tools_and_tool_call_arguments_count_toward_max_prompt_chars(served, fleet):
    small = {"messages": [{"role": "user", "content": "hi"}], "tools": _tools(1, 10), "max_tokens": 2}
    assert httpx.post(url(served, "/tokenize"), json={k: v for k, v in small.items() if k != "max_tokens"}
                      ).status_code == 200
    over = {**small, "tools": _tools(6, 1000)}  # 6,000+ characters of tools, 2 of content
    for path in ("/v1/chat/completions", "/tokenize"):
        body = over if path != "/tokenize" else {k: v for k, v in over.items() if k != "max_tokens"}
        answer = httpx.post(url(served, path), json=body, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools", (path, answer.text[:200])
    call = {"id": "call_1", "type": "function", "function": {"name": "f0", "arguments": json.dumps({"x": "a" * 6000})}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        body = {"messages": messages, "tools": _tools(1, 10)}
        answer = httpx.post(url(served, path), json=body, timeout=60)
        assert answer.status_code == 400, (path, answer.text[:200])
        error = answer.json()["error"]
        assert error["param"] == "messages" and "server.max_prompt_chars" in error["message"], error
    assert held(served) == 0


# -- /tokenize and /detokenize under server.max_in_flight -----------------------------------------------


def test_tokenize_and_detokenize_are_held_under_max_in_flight(served, fleet, driver):
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.02)

    def long_request():
        httpx.post(url(served, "/v1/completions"), json={"prompt": [1, 2], "max_tokens": 100}, timeout=60)

    holders = [threading.Thread(target=long_request) for _ in range(4)]  # server.max_in_flight=4
    for t in holders:
        t.start()
    try:
        helpers.wait_until(lambda: sum(s.running for s in driver.shards.values()) == 4, 10, "4 requests held")
        for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
            refused = httpx.post(url(served, path), json=body)
            assert refused.status_code == 503, (path, refused.text[:200])
            assert refused.headers["retry-after"] and "server.max_in_flight" in refused.json()["error"]["message"]
    finally:
        for t in holders:
            t.join(60)
    assert held(served) == 0
    # every way a /tokenize ends gives its place back: answered, refused for its input
    assert httpx.post(url(served, "/tokenize"), json={"prompt": "hello"}).status_code == 200
    assert httpx.post(url(served, "/detokenize"), json={"tokens": [1, 2]}).status_code == 200
    assert httpx.post(url(served, "/tokenize"), json={"prompt": "hello", "nope": 1}).status_code == 400
    assert httpx.post(url(served, "/detokenize"), json={"tokens": [10**9]}).status_code == 400
    assert held(served) == 0


# -- session keys of bounded length ---------------------------------------------------------------------


@pytest.mark.parametrize("where", ["user", "session_id", "x-session-id"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_session_key_past_its_bound_is_refused_naming_the_field(served, fleet, where, path):
    from nemo_gen.server.protocol import MAX_SESSION_KEY_CHARS

    body = {"max_tokens": 1} | ({"prompt": "hi"} if path == "/v1/completions"
                                else {"messages": [{"role": "user", "content": "hi"}]})

    def ask(key: str) -> httpx.Response:
        if where == "x-session-id":
            return httpx.post(url(served, path), json=body, headers={"x-session-id": key})
        return httpx.post(url(served, path), json={**body, where: key})

    assert ask("k" * MAX_SESSION_KEY_CHARS).status_code == 200
    answer = ask("k" * (2**20 if where != "x-session-id" else 8000))
    assert answer.status_code == 400, answer.text[:200]
    error = answer.json()["error"]
    assert error["param"] == where and str(MAX_SESSION_KEY_CHARS) in error["message"]
    assert held(served) == 0


# -- connections: header-read bound, keep-alive, connection limit -----------------------------------------


def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass  # a 408 or whatever the server says before it closes
    except (TimeoutError, socket.timeout):
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_a_half_sent_request_header_is_closed_within_the_bound(served, fleet):
    handle = served[1]
    half = socket.create_connection((handle.host, handle.port))
    silent = socket.create_connection((handle.host, handle.port))
    try:
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        # generous margins: the bound is 1 s, a loaded machine may be slow to close
        assert _closed_within(half, HEADER_TIMEOUT_S + 15) is not None, "a half-sent header is still open"
        assert _closed_within(silent, HEADER_TIMEOUT_S + 15) is not None, "a silent connection is still open"
    finally:
        half.close()
        silent.close()
    assert httpx.get(url(served, "/health")).status_code == 200


def test_the_header_bound_does_not_cut_slow_headers_in_time_or_long_answers(served, fleet, driver):
    handle = served[1]
    for h in fleet.shards:
        driver.set_token_s(h.name, 0.02)  # 100 tokens: about 2 s, past the 1 s header bound
    body = json.dumps({"prompt": [1, 2], "max_tokens": 100}).encode()
    with socket.create_connection((handle.host, handle.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        time.sleep(HEADER_TIMEOUT_S / 4)
        sock.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.settimeout(60)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_the_server_runs_with_a_connection_limit_and_keep_alive_bound(served):
    config, settings = served[1].server.config, served[2]
    assert config.limit_concurrency == settings.server.max_connections
    assert config.timeout_keep_alive == settings.server.keep_alive_s
