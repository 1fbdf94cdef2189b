"""The gateway's session store on its own (``nemo_gen.server.session_store``): records fsync'd and
read back, a torn or corrupt last record dropped (the file truncated to the last whole one) with
every earlier record kept, removal, the directory's rules (0700, a symlink or a file refused,
one writer); and the pure pieces a restart rests on (``SessionTable.restore``,
``Trajectory.replay`` / ``rollback``). The gateway's restart over HTTP: test_gateway_restart.py."""

from __future__ import annotations

import os
import stat

import pytest

from nemo_gen.core.session_table import SessionError, SessionLimits, SessionTable
from nemo_gen.core.trajectory import Plan, Trajectory
from nemo_gen.errors import ConfigError
from nemo_gen.server.session_store import SessionStore, decode, encode

SID = "sess-0123456789abcdef"


@pytest.fixture
def store(tmp_path):
    s = SessionStore(tmp_path / "sessions").open()
    yield s
    s.close()


def _turn(k: int) -> dict:
    return {"kind": "turn", "t": 100.0 + k, "turn": {"index": k, "token_ids": [k, k + 1]}}


def test_records_come_back_in_order_and_the_directory_is_private(store, tmp_path):
    store.create(SID, {"kind": "open", "id": SID, "t": 1.0})
    for k in range(3):
        assert store.append(SID, _turn(k)) == len(encode(_turn(k)))
    (got,) = store.load()
    assert got.id == SID and got.dropped_bytes == 0
    assert got.records == [{"kind": "open", "id": SID, "t": 1.0}] + [_turn(k) for k in range(3)]
    assert stat.S_IMODE(os.stat(tmp_path / "sessions").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "sessions" / f"{SID}.jsonl").st_mode) == 0o600
    with pytest.raises(FileExistsError):
        store.create(SID, {"kind": "open", "id": SID, "t": 2.0})


@pytest.mark.parametrize("tear", ["half a record", "no newline", "a flipped byte"])
def test_a_torn_last_record_is_dropped_and_every_earlier_one_kept(store, tmp_path, tear):
    store.create(SID, {"kind": "open", "id": SID, "t": 1.0})
    store.append(SID, _turn(0))
    store.append(SID, _turn(1))
    path = tmp_path / "sessions" / f"{SID}.jsonl"
    whole = path.read_bytes()
    last = encode(_turn(2))
    torn = {"half a record": last[: len(last) // 2], "no newline": last[:-1],
            "a flipped byte": last[:20] + bytes([last[20] ^ 1]) + last[21:]}[tear]
    path.write_bytes(whole + torn)
    (got,) = store.load()
    assert got.records[1:] == [_turn(0), _turn(1)] and got.dropped_bytes == len(torn)
    assert path.read_bytes() == whole  # truncated back: the next append follows the last whole record
    store.append(SID, _turn(2))
    assert store.load()[0].records[1:] == [_turn(0), _turn(1), _turn(2)]


def test_remove_takes_the_records_off_disk(store, tmp_path):
    store.create(SID, {"kind": "open", "id": SID, "t": 1.0})
    store.remove(SID)
    assert not (tmp_path / "sessions" / f"{SID}.jsonl").exists() and store.load() == []
    store.remove(SID)  # nothing there: nothing to do


def test_only_session_ids_name_files(store):
    for bad in ("../x", "sess-a/b", "LOCK", "sess-"):
        with pytest.raises(ValueError, match="not a session id"):
            store.append(bad, {})


def test_the_directory_is_never_a_symlink_a_file_or_shared(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink") as err:
        SessionStore(tmp_path / "link").open()
    assert err.value.field == "server.sessions_dir"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        SessionStore(tmp_path / "file").open()
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o755)
    os.chmod(wide, 0o755)
    one = SessionStore(wide).open()
    assert stat.S_IMODE(os.stat(wide).st_mode) == 0o700  # narrowed
    with pytest.raises(ConfigError, match="in use by another server"):
        SessionStore(wide).open()
    one.close()
    SessionStore(wide).open().close()  # the lock went with the first store


def test_settings_refuse_a_symlinked_sessions_dir(make_settings, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="server.sessions_dir"):
        make_settings(server__sessions_dir=str(tmp_path / "link"))
    settings = make_settings(fleet__name="a/b")
    assert settings.sessions_dir() == settings.home / "sessions" / "a_b"
    assert make_settings(server__sessions_dir=str(tmp_path / "s")).sessions_dir() == tmp_path / "s"


def test_decode_refuses_what_encode_did_not_write():
    line = encode({"a": 1})
    assert decode(line[:-1]) == {"a": 1}
    assert decode(b"00000000 {}") is None and decode(b"zz") is None and decode(b"") is None


def test_restored_sessions_count_against_max_sessions_and_keep_their_bytes_and_age():
    now = [1000.0]
    table: SessionTable[str] = SessionTable(SessionLimits(ttl_s=10, max_sessions=2, max_bytes=100),
                                            clock=lambda: now[0])
    table.restore("sess-a", "a", 40, idle_s=8)
    table.restore("sess-b", "b", 0, idle_s=1)
    table.restore("sess-c", "c", 0, idle_s=2)  # more than max_sessions: none dropped
    assert len(table) == 3 and table.bytes_of("sess-a") == 40
    with pytest.raises(SessionError) as err:
        table.open("new")
    assert err.value.status == 429 and err.value.param == "server.max_sessions"
    with pytest.raises(SessionError):
        table.charge("sess-a", 61)  # the restored bytes count
    now[0] += 3  # a idle 11 s > ttl: it expires first, in order of last use
    assert [sid for sid, _ in table.expire()] == ["sess-a"]
    table.refund("sess-b", 5)
    assert table.bytes_of("sess-b") == 0


def _record(traj: Trajectory, plan: Plan, messages: list, prompt: list, sampled: list) -> None:
    traj.record(plan, messages, None, "text", prompt, sampled, [-0.5] * len(sampled),
                request={"messages": plan.new, "first_message": plan.at}, message={"role": "assistant", "content": "x"},
                finish_reason="stop", shard=0, weight_version=3, weight_versions=[[3, len(sampled)]])


def test_a_trajectory_replays_from_its_turns_json_and_rolls_back_a_turn():
    traj = Trajectory("s")
    m1 = [{"role": "user", "content": "a"}]
    _record(traj, traj.plan(m1, None), m1, [1, 2], [3, 4])
    m2 = traj.messages + [{"role": "user", "content": "b"}]
    _record(traj, traj.plan(m2, None), m2, [1, 2, 3, 4, 5], [6])
    m3 = [{"role": "user", "content": "edited"}]
    _record(traj, traj.plan(m3, None), m3, [9], [8, 7])
    again = Trajectory("s")
    for turn in traj.to_json()["turns"]:
        again.replay(turn, None)
    assert again.to_json() == traj.to_json() and again.messages == traj.messages
    mark = again.mark()
    m4 = again.messages + [{"role": "user", "content": "c"}]
    _record(again, again.plan(m4, None), m4, [9, 8, 7, 1], [2])
    again.rollback(mark)
    assert again.to_json() == traj.to_json() and again.messages == traj.messages
