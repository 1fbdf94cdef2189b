"""nemo_gen.host.gpu_memory over a fake NVML (the real one runs in tests/gpu on an H200)."""

from __future__ import annotations

import multiprocessing
import os
import time
from types import SimpleNamespace

from nemo_gen.host import gpu_memory as gm

GiB = 2**30


class FakeNvml:
    """Two GPUs; ``procs[i]`` lists (pid, used bytes or None) on GPU i and can change over time."""

    def __init__(self, procs):
        self.procs = procs

    def nvmlDeviceGetCount(self):
        return len(self.procs)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}".encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(self, h):
        used = sum(u or 0 for _, u in self.procs[h])
        return SimpleNamespace(total=80 * GiB, used=used, free=80 * GiB - used)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in self.procs[h]]


def test_processes_devices_and_usage_by_pid():
    nv = FakeNvml([[(10, 3 * GiB), (11, None)], [(10, 1 * GiB), (12, 5 * GiB)]])
    assert gm.available(nv)
    assert [(d.index, d.uuid, d.used_bytes) for d in gm.devices(nv)] == [(0, "GPU-0", 3 * GiB), (1, "GPU-1", 6 * GiB)]
    assert [(p.pid, p.gpu_uuid, p.used_bytes) for p in gm.gpu_processes(nv)] == [
        (10, "GPU-0", 3 * GiB), (11, "GPU-0", None), (10, "GPU-1", 1 * GiB), (12, "GPU-1", 5 * GiB)]
    # summed over GPUs; unknown usage still counts as holding; unknown PIDs absent
    assert gm.used_by_pids([10, 11, 99], nv) == {10: 4 * GiB, 11: 0}
    assert gm.used_by_pids([], nv) == {}
    assert gm.describe({10: 4 * GiB, 11: 0}) == "pid 10: 4.0 GiB, pid 11: 0.0 GiB"


def test_wait_released_returns_when_the_memory_is_gone():
    nv = FakeNvml([[(10, 3 * GiB), (20, 1 * GiB)]])
    now = [0.0]

    def sleep(s):  # the driver frees pid 10's memory at t = 0.3 s
        now[0] += s
        if now[0] >= 0.3:
            nv.procs[0] = [(20, 1 * GiB)]

    r = gm.wait_released([10], timeout_s=5, poll_s=0.1, nvml=nv, clock=lambda: now[0], sleep=sleep)
    assert r.released and r.checked and r.held == {} and 0.3 <= r.seconds < 0.5


def test_wait_released_reports_what_stayed_held_at_the_deadline():
    nv = FakeNvml([[(10, 3 * GiB)]])
    now = [0.0]

    def sleep(s):
        now[0] += s

    r = gm.wait_released([10, 11], timeout_s=1.0, poll_s=0.25, nvml=nv, clock=lambda: now[0], sleep=sleep)
    assert not r.released and r.held == {10: 3 * GiB} and r.seconds == 1.0
    assert r.to_json() == {"released": False, "held": {"10": 3 * GiB}, "seconds": 1.0, "checked": True}


def test_without_nvml_nothing_is_known_to_be_held():
    class NoGpu(FakeNvml):
        def nvmlDeviceGetCount(self):
            raise RuntimeError("NVML Shared Library Not Found")

    nv = NoGpu([])
    assert not gm.available(nv)
    r = gm.wait_released([10], timeout_s=5, nvml=nv)
    assert r.released and not r.checked and r.seconds == 0.0
    assert gm.wait_released([], timeout_s=5, nvml=FakeNvml([[(10, 1)]])).released


def test_visible_gpus_follow_cuda_visible_devices():
    assert gm.visible_gpus({"CUDA_VISIBLE_DEVICES": "0,3"}) == ["0", "3"]
    assert gm.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gm.visible_gpus({}) == []
    assert gm.engine_start_lock({"CUDA_VISIBLE_DEVICES": ""}).paths == []


def _hold(lock_dir, started, release):
    lock = gm.engine_start_lock({"CUDA_VISIBLE_DEVICES": "1,0"}, lock_dir).acquire()
    started.set()
    release.wait(30)
    lock.release()


def test_engines_on_one_gpu_start_one_at_a_time(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), started, release))
    holder.start()
    try:
        assert started.wait(30)
        other_gpu = gm.engine_start_lock({"CUDA_VISIBLE_DEVICES": "2"}, str(tmp_path))
        with other_gpu:  # another GPU: not held up
            assert other_gpu.waited_s < 1
        same = gm.engine_start_lock({"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path))
        t0 = time.monotonic()
        ctx_timer = __import__("threading").Timer(0.5, release.set)
        ctx_timer.start()
        with same:
            waited = time.monotonic() - t0
        assert waited >= 0.4, waited  # waited for the holder of GPU 0
    finally:
        release.set()
        holder.join(30)


def test_a_dead_holder_leaves_no_gpu_locked(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), started, release))
    holder.start()
    assert started.wait(30)
    os.kill(holder.pid, 9)
    holder.join(30)
    lock = gm.engine_start_lock({"CUDA_VISIBLE_DEVICES": "0,1"}, str(tmp_path))
    with lock:
        assert lock.waited_s < 1
