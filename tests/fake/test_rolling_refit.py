"""The rolling refit on the fake tier (tests/fakes.py: our own refit, routing and session logic,
the real staging file; fake engines): under load, waves keep refit.min_serving shards serving and
cut no request, each result on one version; new requests go to the newest version; an open
session's turns stay on its version while its wave waits for it, where `all` switches it; a roll
stopped mid-way names each shard's version. Real engines: tests/engine/test_rolling_refit.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from nemo_gen.core.manifest import RefitError
from nemo_gen.fleet.rolling import serving_now
from tests.fakes import fake_fleet

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _tensors(scale=1.0):
    return {"w": torch.ones(4, 4) * scale, "b": torch.zeros(4)}


class Load:
    """Requests sent back to back from two threads; every result kept."""

    def __init__(self, fleet, threads=2):
        self.fleet, self.results, self.errors, self.stop = fleet, [], [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self):
        while not self.stop.is_set():
            try:
                self.results += self.fleet.generate(PROMPTS, max_new_tokens=6)
            except Exception as exc:  # noqa: BLE001 - every failure is the test's to see
                self.errors.append(exc)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(30)


def _sample_serving(fleet, stop, seen):
    while not stop.is_set():
        roll = fleet.members.table.roll()
        if roll is not None:
            seen.append((len(serving_now(fleet.members.table.ledger, roll)), roll.moving))
        time.sleep(0.005)


def test_waves_keep_the_floor_serving_and_cut_nothing(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(fleet__num_shards=4, refit__rollout="waves", refit__wave_size=1,
                                   refit__min_serving=3, refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, driver) as fleet:
        for h in fleet.shards:
            driver.set_token_s(h.name, 0.01)
        table, waves = fleet.members.table, []
        begin_wave = table.begin_wave
        table.begin_wave = lambda slots: waves.append(tuple(slots)) or begin_wave(slots)  # noted as it moves
        seen, stop = [], threading.Event()
        sampler = threading.Thread(target=_sample_serving, args=(fleet, stop, seen), daemon=True)
        sampler.start()
        with Load(fleet) as load:
            time.sleep(0.2)
            report = fleet.refit(_tensors())
            time.sleep(0.2)
        stop.set()
        sampler.join(5)
        assert report.ok and sorted(s.shard for s in report.shards) == [0, 1, 2, 3]
        assert not load.errors
        assert seen and min(n for n, _ in seen) >= 3  # never under refit.min_serving
        assert sorted(waves) == [(0,), (1,), (2,), (3,)]  # one shard at a time, each once
        assert all(len(m) <= 1 for _, m in seen)
        assert all(r.finish_reason != "abort" and len(r.weight_versions) == 1 for r in load.results)
        assert {r.weight_version for r in load.results} == {0, 1}
        assert all(s.weight_version == 1 and s.rolling is None for s in fleet.status())
        assert fleet.members.table.roll() is None
        assert fleet.metrics()["gen_fleet/shard_weight_version/3"] == 1.0


def test_new_requests_go_to_the_newest_version_during_the_roll(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(fleet__num_shards=3, refit__rollout="waves", refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, driver) as fleet:
        table = fleet.members.table
        table.begin_roll(0, 1)
        table.record_refit(_member(fleet, 0), 1)
        table.begin_wave([1])
        try:
            assert {r.shard for r in fleet.generate(PROMPTS * 2)} == {0}  # only the newest (shard 0, v1)
            rows = {s.index: s.rolling for s in fleet.status()}
            assert rows == {0: "moved", 1: "moving", 2: "waiting"}
        finally:
            table.end_roll()
        assert {r.shard for r in fleet.generate(PROMPTS * 2)} == {0, 1, 2}


def _member(fleet, slot):
    from nemo_gen.core.members import Member

    return Member(fleet.handle(slot).name, slot)


def _three_turns(fleet, between):
    """An open session's three turns, ``between()`` called after the first; its trajectory."""
    with fleet.session() as s:
        messages = [{"role": "user", "content": "q"}]
        for turn in range(3):
            r = s.chat(messages, max_new_tokens=4)
            messages += [{"role": "assistant", "content": r.text}, {"role": "user", "content": f"r{turn}"}]
            if turn == 0:
                between()
        return s.trajectory().to_json()


@pytest.fixture
def patient_driver():
    """A fake driver whose refit deadline (refit.timeout_s: how long a wave waits for its sessions)
    outlasts a loaded machine's three turns."""
    from nemo_gen.fleet.driver import DriverTimeouts
    from tests.fakes import FakeDriver

    d = FakeDriver(timeouts=DriverTimeouts(control_s=0.5, stop_s=0.5, engine_grace_s=0.1, refit_s=60.0))
    yield d
    d.close()


@pytest.mark.parametrize("rollout", ["waves", "all"])
def test_an_open_session_keeps_its_version_through_a_roll_and_all_switches_it(rollout, fake_fleet_settings,
                                                                              patient_driver, tmp_path):
    settings = fake_fleet_settings(refit__rollout=rollout, refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, patient_driver) as fleet:
        done = []
        refit = threading.Thread(target=lambda: done.append(fleet.refit(_tensors())), daemon=True)

        def start_refit():
            refit.start()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not _refit_visible(fleet, rollout, done):
                time.sleep(0.01)

        traj = _three_turns(fleet, start_refit)
        refit.join(30)
        assert done and done[0].ok
        versions = [t["weight_versions"] for t in traj["turns"]]
        if rollout == "waves":
            assert versions == [[[0, 4]]] * 3  # every turn on the version the session began on
            assert len({t["shard"] for t in traj["turns"]}) == 1
        else:
            assert versions[0] == [[0, 4]] and versions[1:] == [[[1, 4]]] * 2  # the spans show the switch
        assert {r.weight_version for r in fleet.generate(PROMPTS)} == {1}


def test_a_session_that_outlives_the_wait_moves_at_a_turn_boundary(fake_fleet_settings, driver, tmp_path):
    """The wave waits refit.timeout_s (the fake driver's: 1 s) at most; then the session's next turn
    runs on the new version, whole."""
    settings = fake_fleet_settings(refit__rollout="waves", refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, driver) as fleet:
        with fleet.session() as s:
            messages = [{"role": "user", "content": "q"}]
            first = s.chat(messages, max_new_tokens=4)
            report = fleet.refit(_tensors())  # returns once the wait ran out and the last wave moved
            messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "r"}]
            second = s.chat(messages, max_new_tokens=4)
        assert report.ok and first.weight_versions == [(0, 4)] and second.weight_versions == [(1, 4)]


def _refit_visible(fleet, rollout, done):
    """The roll is waiting on the session's shard (waves), or the refit landed (all)."""
    if rollout == "all":
        return bool(done)
    roll = fleet.members.table.roll()
    return roll is not None and any(s.weight_version == 1 for s in fleet.status())


def test_a_roll_stopped_mid_way_names_each_shards_version(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(fleet__num_shards=3, refit__rollout="waves", refit__staging_dir=str(tmp_path),
                                   health__auto_recover=False)
    with fake_fleet(settings, driver) as fleet:
        driver.shard(fleet.handle(2)).refuse_refit = "cannot map the staged file"
        with pytest.raises(RefitError) as err:
            fleet.refit(_tensors())
        text = str(err.value)
        assert "cannot map the staged file" in text
        assert "shards [0, 1] serve version 1, shards [2] version 0" in text
        assert {s.index: s.weight_version for s in fleet.status()} == {0: 1, 1: 1, 2: 0}
        assert fleet.members.table.roll() is None
        # every result on one version, from either
        assert all(len(r.weight_versions) == 1 for r in fleet.generate(PROMPTS * 3))


def test_in_flight_keep_is_refused_in_waves_naming_the_field(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(refit__rollout="waves", refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, driver) as fleet:
        with pytest.raises(RefitError, match="refit.in_flight 'keep' cannot act with refit.rollout waves"):
            fleet.refit(_tensors(), in_flight="keep")
        assert fleet.weight_version == 0


def test_a_train_fleets_first_refit_in_waves_moves_every_shard(fake_fleet_settings, driver, tmp_path):
    settings = fake_fleet_settings(fleet__mode="train", fleet__num_shards=3, refit__rollout="waves",
                                   refit__staging_dir=str(tmp_path))
    with fake_fleet(settings, driver) as fleet:
        assert fleet.weight_version is None  # dummy weights: nothing serves, nothing to keep serving
        report = fleet.refit(_tensors())
        assert report.ok and sorted(s.shard for s in report.shards) == [0, 1, 2]
        assert {r.weight_version for r in fleet.generate(PROMPTS * 2)} == {report.version}
        again = fleet.refit(_tensors(2.0))  # and the next one rolls
        assert again.ok and {s.weight_version for s in fleet.status()} == {again.version}
