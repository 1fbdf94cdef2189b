"""The fleet as a weight-sync client (``fleet.weight_sync_client()``) on a fake driver: the
one-call update (``apply_weight_update``) and vLLM's three steps keep the same rules — checks
before any shard changes, versions forward only, quarantine of a shard that fails, the refit
lock released on every path. The same paths on real engines: tests/engine/test_refit.py."""

from __future__ import annotations

import pytest

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.manifest import RefitError
from tests.fakes import fake_fleet

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]] * 2
# nemo_gen_shm's update info for the fake engines' manifest (w: 4x4, b: 4, float32)
CHUNK = {"path": "/nonexistent", "total": 80, "entries": [["w", [4, 4], "float32", 0], ["b", [4], "float32", 64]]}


@pytest.fixture
def settings(fake_fleet_settings):
    return fake_fleet_settings


def steps_sent(driver) -> list[str]:
    return [msg.step.value for _, method, msg in driver.remote_calls if method == "weight_sync"]


def three_steps(client, chunk):
    client.start_weight_update()
    client.update_weights(chunk)
    return client.finish_weight_update()


@pytest.mark.parametrize("send", [lambda c, chunk: c.apply_weight_update(chunk), three_steps],
                         ids=["one call", "three steps"])
def test_an_update_moves_every_shard_and_spare(settings, driver, send):
    with fake_fleet(settings(fleet__spares=1), driver) as fleet:
        client = fleet.weight_sync_client()
        report = send(client, CHUNK)
        assert report is client.report and report.ok and report.version == 1 == fleet.weight_version
        assert report.tensors == 2 and report.bytes == 80
        assert {driver.shard(h).weight_version for h in fleet.shards + fleet.members.spares()} == {1}
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


def test_one_call_is_one_message_to_each_shard(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        driver.remote_calls.clear()
        fleet.weight_sync_client().apply_weight_update(CHUNK)
        assert steps_sent(driver) == ["apply", "apply"]
        driver.remote_calls.clear()
        three_steps(fleet.weight_sync_client(), CHUNK)
        assert steps_sent(driver) == ["start"] * 2 + ["update"] * 2 + ["finish"] * 2


@pytest.mark.parametrize("chunk, message", [
    ({**CHUNK, "entries": [["w", [3, 4], "float32", 0], ["b", [4], "float32", 48]]}, r"w: shape \[3, 4\]"),
    ({**CHUNK, "entries": [["w", [4, 4], "float32", 0]]}, "leaves out 1 tensor"),
    ({**CHUNK, "entries": [["w", [4, 4], "float32", 0], ["b", [4], "float32", 64], ["x", [2], "float32", 80]]}, "x"),
], ids=["wrong shape", "a tensor left out", "an unknown tensor"])
def test_a_bad_one_call_update_reaches_no_shard(settings, driver, chunk, message):
    with fake_fleet(settings(), driver) as fleet:
        client = fleet.weight_sync_client()
        driver.remote_calls.clear()
        with pytest.raises(RefitError, match=message):
            client.apply_weight_update(chunk)
        assert steps_sent(driver) == [] and client.report is None
        assert fleet.weight_version == 0 and fleet.health.serving_shards() == [0, 1]
        assert client.apply_weight_update(CHUNK).ok  # the lock was released, the client is reusable


def test_a_shard_failing_a_one_call_update_is_quarantined_the_rest_move_on(settings, driver):
    with fake_fleet(settings(health__auto_recover=False), driver) as fleet:
        driver.shard(fleet.handle(1)).fail_load = "out of memory while loading"
        report = fleet.weight_sync_client().apply_weight_update(CHUNK, weight_version=5)
        assert report.version == 5 == fleet.weight_version
        assert [(s.shard, s.ok) for s in sorted(report.shards, key=lambda s: s.shard)] == [(0, True), (1, False)]
        (lost,) = report.failed
        assert "refit to version 5 failed" in lost.error and "out of memory while loading" in lost.error
        assert fleet.health.state_of(1) is ShardState.DEAD
        assert {(r.shard, r.weight_version) for r in fleet.generate(PROMPTS)} == {(0, 5)}


def test_every_shard_failing_moves_no_version(settings, driver):
    with fake_fleet(settings(health__auto_recover=False), driver) as fleet:
        for h in fleet.shards:
            driver.shard(h).fail_load = "bad bytes"
        report = fleet.weight_sync_client().apply_weight_update(CHUNK)
        assert not report.ok and len(report.failed) == 2 and fleet.weight_version == 0
        assert fleet.health.serving_shards() == []  # none serves half-loaded weights


def test_one_call_versions_only_move_forward(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        assert fleet.weight_sync_client(version=3).apply_weight_update(CHUNK).version == 3
        with pytest.raises(RefitError, match="not newer"):
            fleet.weight_sync_client(version=3).apply_weight_update(CHUNK)
        with pytest.raises(RefitError, match="update_info for all of its shards"):
            fleet.weight_sync_client().apply_weight_update([CHUNK, CHUNK])
        assert fleet.weight_version == 3 and fleet.weight_sync_client().apply_weight_update(CHUNK).version == 4


def test_a_client_mid_update_refuses_a_one_call_update(settings, driver):
    with fake_fleet(settings(), driver) as fleet:
        client = fleet.weight_sync_client()
        client.start_weight_update()
        with pytest.raises(RefitError, match="already in progress"):
            client.apply_weight_update(CHUNK)
        client.update_weights(CHUNK)
        assert client.finish_weight_update().ok and fleet.weight_version == 1


def test_the_same_update_info_is_checked_once_per_layout(settings, driver):
    """nemo_gen_ipc's sender gives the same update info object while the layout is unchanged:
    its check is kept; a new layout (or another object) is checked again."""
    with fake_fleet(settings(), driver) as fleet:
        client = fleet.weight_sync_client()
        info = {"names": ["w", "b"], "shapes": [[4, 4], [4]], "dtype_names": ["float32"] * 2, "layout": 1}
        first = client.apply_weight_update(info)
        again = client.apply_weight_update(info)
        assert (first.tensors, first.bytes) == (again.tensors, again.bytes) == (2, 80) and again.version == 2
        info["shapes"], info["layout"] = [[3, 4], [4]], 2  # a new layout of the same names: checked
        with pytest.raises(RefitError, match=r"w: shape \[3, 4\]"):
            client.apply_weight_update(info)
        assert fleet.weight_version == 2


IPC_INFO = {"names": ["w", "b"], "shapes": [[4, 4], [4]], "dtype_names": ["float32"] * 2, "handles": b"h" * 64,
            "layout": "a-1"}


def updates_sent(driver) -> list[dict]:
    return [msg.chunk() for _, method, msg in driver.remote_calls if method == "weight_sync" and msg.chunk() is not None]


@pytest.mark.parametrize("send", [lambda c, chunk: c.apply_weight_update(chunk), three_steps],
                         ids=["one call", "three steps"])
def test_a_shard_that_loaded_a_layout_last_is_sent_its_number_alone(settings, driver, send):
    """nemo_gen_ipc's update of an unchanged layout is the same places and handles every refit:
    after a shard loaded it once, each refit sends it the layout's short form."""
    with fake_fleet(settings(), driver) as fleet:
        client = fleet.weight_sync_client()
        driver.remote_calls.clear()
        send(client, IPC_INFO)
        assert updates_sent(driver) == [IPC_INFO, IPC_INFO]
        driver.remote_calls.clear()
        report = send(client, IPC_INFO)
        assert updates_sent(driver) == [{"layout": "a-1", "layout_only": True}] * 2
        assert report.ok and report.version == 2 == fleet.weight_version and (report.tensors, report.bytes) == (2, 80)
        assert {driver.shard(h).weight_version for h in fleet.shards} == {2}
        driver.remote_calls.clear()
        send(client, {**IPC_INFO, "layout": "a-2"})  # a new layout goes whole
        assert updates_sent(driver) == [{**IPC_INFO, "layout": "a-2"}] * 2
        driver.remote_calls.clear()
        send(client, CHUNK)  # an update with no layout number always goes whole
        assert updates_sent(driver) == [CHUNK, CHUNK]


def test_a_shard_that_holds_another_layout_is_sent_the_whole_update(settings, driver):
    """Another client refit the shards since (their workers hold its layout now): the short
    form is answered 'unknown' before anything is touched, and the whole update follows."""
    with fake_fleet(settings(health__auto_recover=False), driver) as fleet:
        mine, other = fleet.weight_sync_client(), fleet.weight_sync_client()
        mine.apply_weight_update(IPC_INFO)
        other.apply_weight_update({**IPC_INFO, "layout": "b-1"})
        driver.remote_calls.clear()
        report = mine.apply_weight_update(IPC_INFO)
        assert updates_sent(driver) == [{"layout": "a-1", "layout_only": True}] * 2 + [IPC_INFO] * 2
        assert report.ok and report.version == 3 and fleet.health.serving_shards() == [0, 1]
        assert {driver.shard(h).layout for h in fleet.shards} == {"a-1"}

