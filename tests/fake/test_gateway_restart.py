"""Durable gateway sessions (issue 48, item 3): a server restarted on its ``server.sessions_dir``
serves the same sessions and trajectories. The restart is real: a server over fake shards in its
own process (tests/gateway_server.py), SIGKILLed by PID after turn 2 of a 3-turn agent session and
started again on the directory, the official ``openai`` client for the turns; its trajectory must
equal that of a session that ran its 3 turns with no restart. Then, in this process (the server
stopped and started on one directory): a torn last record dropped and every earlier turn kept,
TTL expiry and DELETE removing the files, restored sessions counted against
``server.max_sessions`` and ``server.max_session_bytes``."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.fakes import FakeDriver, fake_fleet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
START_S = 180.0  # a server process's start (imports) on a loaded 2-core machine, with a wide margin


def _overrides(model_dir, home, sessions_dir, **extra) -> dict:
    return {"home": str(home), "model.path": str(model_dir), "fleet.device": "cpu", "fleet.name": "fake-restart",
            "fleet.num_shards": 2, "health.probe_interval_s": 60, "health.auto_recover": False, "server.port": 0,
            "generation.max_new_tokens": 5, "generation.vllm_cfg.skip_tokenizer_init": True,
            "generation.vllm_cfg.max_model_len": 1024, "server.sessions_dir": str(sessions_dir), **extra}


class ServerProcess:
    def __init__(self, overrides: dict, log: Path):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.gateway_server", json.dumps(overrides)],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self.log)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(START_S) or self.proc.poll() is not None:
            self.kill()
            pytest.fail(f"the server process did not start: {log.read_text()[-3000:]}")
        self.url = self.proc.stdout.readline().decode().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)  # by its PID: no shutdown, nothing flushed
        self.proc.wait(30)
        self.log.close()


def _turns(url: str, sid: str, messages: list, count: int) -> list:
    client = openai.OpenAI(base_url=f"{url}/nemo_gen/sessions/{sid}/v1", api_key="unused", max_retries=0)
    outs = []
    for k in range(count):
        if messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": f"and turn {len(messages) // 2 + 1}?"})
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                             extra_body={"return_token_ids": True})
        outs.append(out)
        messages.append({"role": "assistant", "content": out.choices[0].message.content})
    return outs


def _open(url: str) -> str:
    r = httpx.post(f"{url}/nemo_gen/sessions")
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _trajectory(url: str, sid: str) -> dict:
    r = httpx.get(f"{url}/nemo_gen/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    return r.json()


def _comparable(traj: dict) -> dict:
    """A trajectory without what may differ between two sessions of one conversation: the id and
    each turn's shard (a restored session is placed afresh)."""
    turns = [{k: v for k, v in t.items() if k != "shard"} for t in traj["turns"]]
    return {**{k: v for k, v in traj.items() if k not in ("id", "turns")}, "turns": turns}


def test_a_session_continues_after_its_server_is_sigkilled_as_if_never_restarted(tiny_model_dir, tmp_path):
    overrides = _overrides(tiny_model_dir, tmp_path / "home", tmp_path / "sessions")
    server = ServerProcess(overrides, tmp_path / "server.log")
    try:
        straight = _open(server.url)  # the run with no restart
        straight_outs = _turns(server.url, straight, [{"role": "user", "content": "Weather in Paris?"}], 3)
        reference = _trajectory(server.url, straight)
        restarted = _open(server.url)
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        outs = _turns(server.url, restarted, messages, 2)
        before = _trajectory(server.url, restarted)
    finally:
        server.kill()  # SIGKILL right after turn 2's answer
    assert server.proc.returncode == -signal.SIGKILL
    server = ServerProcess(overrides, tmp_path / "server.log")
    try:
        assert _trajectory(server.url, restarted) == before  # the same session, as it was
        outs += _turns(server.url, restarted, messages, 1)
        after = _trajectory(server.url, restarted)
        assert _trajectory(server.url, straight) == reference  # the other session is served too
    finally:
        server.kill()
    assert len(after["turns"]) == 3 and len(after["segments"]) == 1
    assert after["turns"][2]["new_segment_reason"] is None  # turn 3 extends the restored turns' tokens
    assert _comparable(after) == _comparable(reference)  # token ids, loss mask, logprobs, versions, turns
    for mine, theirs in zip(outs, straight_outs):
        assert mine.choices[0].token_ids == theirs.choices[0].token_ids
    assert after["token_ids"] == reference["token_ids"] and after["loss_mask"] == reference["loss_mask"]
    assert [t["weight_versions"] for t in after["turns"]] == [t["weight_versions"] for t in reference["turns"]]


@pytest.fixture
def restartable(make_settings, tmp_path):
    """start(**server settings) -> a server over one fake fleet, on ``tmp_path``/sessions; the
    previous one stopped first (its store closed), as a restart does."""
    from nemo_gen.server import start_server

    driver, made = FakeDriver(), []

    def start(**extra):
        for handle, fleet in made:
            handle.stop()
            fleet.shutdown()
        made.clear()
        settings = make_settings(fleet__name="fake-restart-local", fleet__num_shards=2, health__probe_interval_s=60,
                                 health__auto_recover=False, server__port=0, generation__max_new_tokens=5,
                                 generation__vllm_cfg__skip_tokenizer_init=True,
                                 generation__vllm_cfg__max_model_len=1024,
                                 server__sessions_dir=str(tmp_path / "sessions"), **extra)
        fleet = fake_fleet(settings, driver)
        made.append((start_server(fleet), fleet))
        return made[-1]

    yield start
    for handle, fleet in made:
        handle.stop()
        fleet.shutdown()
    driver.close()


def _file(tmp_path: Path, sid: str) -> Path:
    return tmp_path / "sessions" / f"{sid}.jsonl"


def test_a_torn_last_record_loses_that_turn_only(restartable, tmp_path):
    handle, _ = restartable()
    sid = _open(handle.url)
    messages = [{"role": "user", "content": "q"}]
    _turns(handle.url, sid, messages, 2)
    full = _trajectory(handle.url, sid)
    path = _file(tmp_path, sid)
    data = path.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1  # where turn 2's record starts
    handle, _ = restartable()  # stopped and started again: the file is read back at start
    path.write_bytes(data[: last + (len(data) - last) // 2])  # turn 2's record half written
    handle, _ = restartable()
    torn = _trajectory(handle.url, sid)
    assert torn["turns"] == full["turns"][:1]  # turn 1 kept whole, turn 2 lost
    assert path.read_bytes() == data[:last]  # truncated back to the last whole record
    # the agent sends turn 2 again: it extends turn 1 as it did the first time
    again = _turns(handle.url, sid, messages[:2], 1)
    assert _trajectory(handle.url, sid)["turns"][1]["token_ids"] == again[0].choices[0].token_ids \
        == full["turns"][1]["token_ids"]


def test_expiry_and_delete_remove_the_records_from_disk(restartable, tmp_path):
    handle, _ = restartable(server__session_ttl_s=0.6)
    gone, kept = _open(handle.url), _open(handle.url)
    _turns(handle.url, gone, [{"role": "user", "content": "q"}], 1)
    assert _file(tmp_path, gone).exists() and _file(tmp_path, kept).exists()
    r = httpx.delete(f"{handle.url}/nemo_gen/sessions/{kept}")
    assert r.status_code == 200 and not _file(tmp_path, kept).exists()
    deadline = time.monotonic() + 30  # the sweep runs every ttl/4; generous for a loaded machine
    while _file(tmp_path, gone).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _file(tmp_path, gone).exists()  # expired with no request: the sweep removed it
    # one that expires while the server is down is removed when the next one starts
    late = _open(handle.url)
    handle, _ = restartable(server__session_ttl_s=0.6)  # restored: 0.6 s of TTL left
    handle, _ = restartable(server__session_ttl_s=0.3)
    time.sleep(0.4)
    handle, _ = restartable(server__session_ttl_s=0.3)
    assert not _file(tmp_path, late).exists()
    assert httpx.get(f"{handle.url}/nemo_gen/sessions/{late}/trajectory").status_code == 404


def test_restored_sessions_count_against_the_bounds(restartable, tmp_path):
    handle, fleet = restartable(server__max_sessions=2)
    one, two = _open(handle.url), _open(handle.url)
    _turns(handle.url, one, [{"role": "user", "content": "q"}], 2)
    charged = handle.server.config.app.app.state.gateway.table.bytes_of(one)
    handle, fleet = restartable(server__max_sessions=2)
    gateway = handle.server.config.app.app.state.gateway
    assert len(gateway.table) == 2 and gateway.table.bytes_of(one) == charged > 0
    full = httpx.post(f"{handle.url}/nemo_gen/sessions")
    assert full.status_code == 429 and "server.max_sessions=2" in full.json()["error"]["message"]
    assert sorted(fleet.router.affinity.placement.counts().values()) == [1, 1]  # placed afresh
    # a lower bound after the restart: none dropped, new ones refused until enough end
    handle, _ = restartable(server__max_sessions=1)
    assert httpx.post(f"{handle.url}/nemo_gen/sessions").status_code == 429
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{two}")
    assert httpx.post(f"{handle.url}/nemo_gen/sessions").status_code == 429  # still one open: `one`
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{one}")
    opened = httpx.post(f"{handle.url}/nemo_gen/sessions")
    assert opened.status_code == 200
    httpx.delete(f"{handle.url}/nemo_gen/sessions/{opened.json()['id']}")
    # the restored bytes count against server.max_session_bytes: a turn that fitted before the
    # restart (its bytes again on top of the restored ones) no longer does
    fresh = _open(handle.url)
    messages = [{"role": "user", "content": "q " * 300}]
    _turns(handle.url, fresh, messages, 1)
    used = handle.server.config.app.app.state.gateway.table.bytes_of(fresh)
    assert used > 1024
    handle, _ = restartable(server__max_session_bytes=used + 100)
    with pytest.raises(openai.APIStatusError) as err:
        _turns(handle.url, fresh, messages, 1)
    assert err.value.status_code == 413 and "server.max_session_bytes" in str(err.value)
    assert len(_trajectory(handle.url, fresh)["turns"]) == 1  # not recorded; the session stays readable


def test_a_streamed_turn_is_on_disk_when_its_stream_ends(restartable, tmp_path):
    handle, _ = restartable()
    sid = _open(handle.url)
    client = openai.OpenAI(base_url=f"{handle.url}/nemo_gen/sessions/{sid}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "q"}],
                                                 max_tokens=4, stream=True))
    assert chunks
    streamed = _trajectory(handle.url, sid)
    assert len(streamed["turns"]) == 1 and _file(tmp_path, sid).read_bytes().count(b"\n") == 2  # opening + turn
    handle, _ = restartable()
    assert _trajectory(handle.url, sid) == streamed


def test_a_turn_that_cannot_be_written_is_answered_500_and_not_recorded(restartable, tmp_path, monkeypatch):
    handle, _ = restartable()
    gateway = handle.server.config.app.app.state.gateway
    sid = _open(handle.url)
    messages = [{"role": "user", "content": "q"}]
    _turns(handle.url, sid, messages, 1)
    kept, charged = _trajectory(handle.url, sid), gateway.table.bytes_of(sid)

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gateway.store, "append", full_disk)  # a full disk, which this machine cannot stage
    with pytest.raises(openai.APIStatusError) as err:
        _turns(handle.url, sid, list(messages), 1)
    assert err.value.status_code == 500 and "server.sessions_dir" in str(err.value)
    assert _trajectory(handle.url, sid) == kept and gateway.table.bytes_of(sid) == charged  # taken back
    monkeypatch.undo()
    _turns(handle.url, sid, messages, 1)  # the disk has room again: the turn extends turn 1
    after = _trajectory(handle.url, sid)
    assert len(after["turns"]) == 2 and after["turns"][1]["new_segment_reason"] is None
    handle, _ = restartable()
    assert _trajectory(handle.url, sid) == after
