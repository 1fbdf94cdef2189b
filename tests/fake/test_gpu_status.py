"""GPU memory as a fact of status and reaping, on the fake driver with an NVML stand-in (the
real NVML path runs in tests/gpu on the H200): each shard's GPU memory in ``fleet.status()``
and the ``fleet status`` table, orphans with what they hold, and a reaper that waits for the
memory and reports what stayed held."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nemo_gen.cli_view import status_table
from nemo_gen.fleet import recovery, status
from nemo_gen.host import gpu_memory
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.core.wire import ShardInfo
from nemo_gen.shard.rules import Host
from tests.fakes import FakeDriver, FakeEngine, fake_fleet


# PIDs no process can have (past the kernel's pid_max): the fleet's close reaps its shards' PIDs,
# and small real ones are kernel threads or someone's processes here, which it would SIGKILL (a
# kernel thread ignores it, and the close waited out health.reap_timeout_s twice: 20 s).
NO_PID = int(Path("/proc/sys/kernel/pid_max").read_text()) + 100


class FakeNvml:
    """What NVML would say: pid -> bytes, each ``used_by_pids`` call one poll."""

    def __init__(self, held: dict[int, int], polls_until_free: int | None = None):
        self.held, self.polls, self.until = held, 0, polls_until_free

    def used_by_pids(self, pids, nvml=None):
        self.polls += 1
        if self.until is not None and self.polls > self.until:
            return {}
        return {p: self.held[p] for p in pids if p in self.held}


@pytest.fixture
def nvml(monkeypatch):
    def install(held, polls_until_free=None):
        fake = FakeNvml(held, polls_until_free)
        monkeypatch.setattr(gpu_memory, "available", lambda nvml=None: True)
        monkeypatch.setattr(gpu_memory, "used_by_pids", fake.used_by_pids)
        return fake
    return install


def test_status_reports_each_shards_gpu_memory_and_the_table_shows_it(make_settings, nvml, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per row: the headers are not wrapped
    driver = FakeDriver()
    with fake_fleet(make_settings(fleet__name="gpu", fleet__num_shards=2), driver) as fleet:
        for i, h in enumerate(fleet.shards):
            driver.rules(h).host = Host(actor_pid=NO_PID + i)
            driver.shard(h).pids = [NO_PID + 10 + i]
        nvml({NO_PID + 10: 30 * 2**30, NO_PID + 11: 2**30})
        rows = fleet.status()
        assert [r.gpu_memory_bytes for r in rows] == [30 * 2**30, 2**30]
        status_table("gpu", [r.to_json() for r in rows])
        out = capsys.readouterr().out
        assert "GPU memory" in out and "30.0 GiB" in out
    driver.close()


def test_without_a_gpu_there_is_no_gpu_column(make_settings, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    driver = FakeDriver()
    with fake_fleet(make_settings(fleet__name="cpu", fleet__num_shards=1), driver) as fleet:
        rows = fleet.status()
        assert rows[0].gpu_memory_bytes is None
        status_table("cpu", [r.to_json() for r in rows])
        assert "GPU memory" not in capsys.readouterr().out
    driver.close()


def test_the_reaper_waits_for_gpu_memory_and_reports_what_stayed_held(nvml, monkeypatch):
    driver = FakeDriver()
    handle = ShardHandle(index=0, name="gone", actor=None, placement_group=None, info=ShardInfo(slot=0, weight_version=0, engine_pids=(4242,)))
    driver.shards["gone"] = FakeEngine("gone", 0, {}, time.monotonic)
    # The processes have exited (as far as the kernel says); their GPU memory is another matter.
    monkeypatch.setattr(recovery, "processes", lambda pids: [type("P", (), {"pid": p})() for p in pids])
    monkeypatch.setattr(recovery, "wait_or_kill", lambda procs, timeout: ([p.pid for p in procs], []))

    freed = nvml({4242: 40 * 2**30}, polls_until_free=3)  # back after three polls
    report = recovery.reap_shard(driver, handle, timeout_s=5)
    assert report.gpu_held == {} and freed.polls == 4 and report.gpu_seconds > 0

    nvml({4242: 40 * 2**30})  # never comes back: the bound is health.reap_timeout_s
    t0 = time.monotonic()
    report = recovery.reap_shard(driver, handle, timeout_s=0.2)
    # The whole reap waits out its bound; the GPU wait is what is left of it after the process
    # checks (0.19998 s once, which a ">= 0.2" on the GPU wait alone failed).
    assert report.gpu_held == {4242: 40 * 2**30} and time.monotonic() - t0 >= 0.2 - 1e-6 and report.gpu_seconds > 0.1
    driver.close()


def test_orphans_carry_the_gpu_memory_they_hold(nvml, monkeypatch):
    monkeypatch.setattr(status, "alive", lambda pid: True)
    nvml({7: 3 * 2**30})
    assert status._with_gpu([{"shard": 0, "pid": 7, "rss_bytes": 1}]) == [
        {"shard": 0, "pid": 7, "rss_bytes": 1, "gpu_bytes": 3 * 2**30}]
