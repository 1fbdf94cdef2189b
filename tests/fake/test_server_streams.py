"""How a streamed response ends, over fake shards (tests/fakes.py) behind the real app, router and
uvicorn, the official openai client in front: whatever ends it — its end, an error, a client that
leaves mid-way, a client that stops reading (``server.stream_idle_timeout_s``) — its
``server.max_in_flight`` slots and its gateway session's turn are given back, and its requests
stop on their engines. The engines' side: tests/engine/test_slow_is_not_dead.py."""

from __future__ import annotations

import gc
import json
import logging
import socket
import time

import httpx
import openai
import psutil
import pytest

from tests import helpers
from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

IDLE_S = 1.0


@pytest.fixture(scope="module")
def served(make_settings):
    from nemo_gen.server import start_server

    driver = FakeDriver()  # the shards' fakes: one token per token_s, stopped when cancelled
    fleet = fake_fleet(make_settings(
        fleet__name="fake-streams", fleet__num_shards=2, health__probe_interval_s=60, health__auto_recover=False,
        server__port=0, server__max_in_flight=64, server__session_ttl_s=6.0, server__stream_idle_timeout_s=IDLE_S,
        generation__vllm_cfg__skip_tokenizer_init=True, generation__vllm_cfg__max_model_len=32768), driver)
    handle = start_server(fleet)
    yield fleet, handle, driver
    handle.stop()
    fleet.shutdown()
    driver.close()


@pytest.fixture
def driver(served):
    driver = served[2]
    for h in served[0].shards:
        driver.set_token_s(h.name, 0.01)
    return driver


def api_of(served):
    return served[1].server.config.app.app.state.gateway.api  # Gate -> FastAPI -> its state


def gateway_of(served):
    return served[1].server.config.app.app.state.gateway


def producing(driver) -> int:
    """Fake engine streams still making tokens (neither cancelled nor at their end)."""
    return sum(1 for e in driver.shards.values() for s in e.streams if not s.cancelled and not s._task.done())


def abandon(stream, chunks: int = 3) -> None:
    """Read a few chunks, then leave as a client does: ``break`` out of the iterator, close."""
    for k, _ in enumerate(stream):
        if k + 1 == chunks:
            break
    stream.close()


def test_streams_abandoned_mid_way_leave_no_slot_held_and_stop_on_their_engines(served, driver):
    api = api_of(served)
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key="x", max_retries=0)
    model = served[0].settings.model_name()
    for _ in range(50):  # 50 x n=2: 100 samples, past server.max_in_flight=64 were any kept
        abandon(client.completions.create(model=model, prompt=[1, 2], max_tokens=2000, n=2, stream=True))
    helpers.wait_until(lambda: api.inflight.held == 0, 10, "every slot given back")
    helpers.wait_until(lambda: producing(driver) == 0, 10, "every engine stream stopped")
    for _ in range(10):  # chat, too
        abandon(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2000, stream=True))
    helpers.wait_until(lambda: api.inflight.held == 0, 10, "every chat stream's slot given back")
    out = client.completions.create(model=model, prompt=[1, 2], max_tokens=2, n=64)  # the whole bound: free
    assert len(out.choices) == 64 and api.inflight.held == 0


def test_an_abandoned_streamed_turn_ends_the_turn_and_the_session_expires_by_its_ttl(served, driver):
    api, gateway = api_of(served), gateway_of(served)
    url = served[1].url
    sessions = [httpx.post(url + "/nemo_gen/sessions").json() for _ in range(2)]
    clients = [openai.OpenAI(base_url=s["url"], api_key="x", max_retries=0) for s in sessions]
    hi = [{"role": "user", "content": "hi"}]
    for c in clients:
        abandon(c.chat.completions.create(model="tiny", messages=hi, max_tokens=2000, stream=True))
    helpers.wait_until(lambda: api.inflight.held == 0, 10, "the turns' slots given back")
    first = sessions[0]["id"]
    helpers.wait_until(lambda: not gateway.table._entries[first].busy, 5, "the abandoned turn ended")
    answer = clients[0].chat.completions.create(model="tiny", messages=hi, max_tokens=2)  # no 409
    assert answer.choices[0].finish_reason == "length"
    # left alone: gone once its TTL passes, as any idle session. The TTL is long enough that the
    # first session's next turn, sent once its abandoned turn has ended, never races it on a loaded machine.
    second = sessions[1]["id"]
    helpers.wait_until(lambda: httpx.get(f"{url}/nemo_gen/sessions/{second}/trajectory").status_code == 404, 40,
                       "the abandoned session expired")
    assert producing(driver) == 0


class Recorded(logging.Handler):
    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def stalled_request(handle, body: dict) -> socket.socket:
    """A client that sends ``body``, reads the response's first bytes and then reads no more,
    its socket left open (a small receive buffer, so the server's writes back up soon)."""
    conn = socket.socket()
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.connect((handle.host, handle.port))
    raw = json.dumps(body).encode()
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
    assert conn.recv(200).startswith(b"HTTP/1.1 200")
    return conn


def test_a_reader_that_stops_reading_is_ended_at_its_idle_deadline_and_costs_no_memory(served, driver):
    api = api_of(served)
    for h in served[0].shards:
        driver.set_token_s(h.name, 0.002)  # 60 samples x 500 tokens/s: a buffer per step would grow fast
    uvicorn_errors = Recorded(logging.ERROR)
    logging.getLogger("uvicorn.error").addHandler(uvicorn_errors)
    gc.collect()
    before = psutil.Process().memory_info().rss
    t0 = time.monotonic()
    conn = stalled_request(served[1], {"prompt": "hi", "max_tokens": 20000, "n": 60, "stream": True})
    try:
        helpers.wait_until(lambda: api.inflight.held == 0, 30, "the stalled stream's slots given back")
        ended_after = time.monotonic() - t0
        helpers.wait_until(lambda: producing(driver) == 0, 10, "its engine stream stopped")
        grown_mb = (psutil.Process().memory_info().rss - before) / 2**20
    finally:
        conn.close()
        logging.getLogger("uvicorn.error").removeHandler(uvicorn_errors)
    assert ended_after >= IDLE_S  # not before its deadline
    assert grown_mb < 20, f"the driver grew {grown_mb:.1f} MB behind one stalled reader"
    assert uvicorn_errors.messages == []  # ended on purpose: said once, as our warning, not as uvicorn's error
    # a reader that keeps reading is not cut: a stream longer than the deadline runs to its end
    for h in served[0].shards:
        driver.set_token_s(h.name, 0.01)
    client = openai.OpenAI(base_url=served[1].url + "/v1", api_key="x", max_retries=0)
    chunks = list(client.completions.create(model=served[0].settings.model_name(), prompt=[3], max_tokens=200, n=2,
                                            stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason == "length") == 2
    assert api.inflight.held == 0


def test_a_stream_ended_by_a_lost_shard_or_by_the_server_stopping_gives_back_its_slots(make_settings):
    import threading

    from nemo_gen.server import start_server

    driver = FakeDriver()
    fleet = fake_fleet(make_settings(fleet__name="fake-stream-ends", fleet__num_shards=2, health__probe_interval_s=60,
                                     health__auto_recover=False, server__port=0,
                                     fleet__migration__mode="off",  # (on: the lost stream would go on)
                                     generation__vllm_cfg__skip_tokenizer_init=True,
                                     generation__vllm_cfg__max_model_len=4096), driver)
    try:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        handle = start_server(fleet)
        api = handle.server.config.app.app.state.gateway.api
        body = {"prompt": [1, 2], "max_tokens": 2000, "n": 2, "stream": True}
        with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line)
            driver.set_dead(fleet.handle(int(response.headers["x-nemo-gen-shard"])).name)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]  # ended by an error event
        helpers.wait_until(lambda: api.inflight.held == 0, 5, "the broken stream's slots given back")
        read: list[str] = []

        def reader() -> None:  # a live reader the server stops under
            try:
                with httpx.stream("POST", handle.url + "/v1/completions", json=body, timeout=30) as response:
                    read.extend(response.iter_lines())
            except httpx.HTTPError:
                pass

        thread = threading.Thread(target=reader)
        thread.start()
        helpers.wait_until(lambda: len(read) > 2, 10, "the second stream under way")
        assert api.inflight.held == 2
        handle.stop()  # its grace passes, then uvicorn cancels the stream
        thread.join(10)
        assert api.inflight.held == 0
        helpers.wait_until(lambda: producing(driver) == 0, 10, "every engine stream stopped")
    finally:
        fleet.shutdown()
        driver.close()


def in_flight_metric(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("nemo_gen_server_in_flight "):
            return float(line.split()[1])
    raise AssertionError("no nemo_gen_server_in_flight series on /metrics")


def test_metrics_show_the_slots_a_stream_holds_and_their_return(served, driver):
    """An operator sees a leak where it would be: /metrics reads the admission count when scraped."""
    url = served[1].url
    assert in_flight_metric(url) == 0
    assert "nemo_gen_server_max_in_flight 64.0" in httpx.get(url + "/metrics").text
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="hi", n=3, max_tokens=2000, stream=True)
    next(iter(stream))
    assert in_flight_metric(url) == 3
    stream.close()
    helpers.wait_until(lambda: in_flight_metric(url) == 0, 10, "the stream's slots given back on /metrics")
