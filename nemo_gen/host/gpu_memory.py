"""GPU memory as the driver sees it: which process holds how much, per GPU (NVML).

A killed shard is only really gone when its GPU memory is back: an EngineCore that outlives its
actor (``RAY_process_group_cleanup_enabled=0``, a wedged teardown) keeps its whole share of the
device, and a replacement placed on that GPU then fails vLLM's startup check ("Free memory on
device ... is less than desired GPU memory utilization"). These functions answer from NVML,
per process, so the fleet can report it (``fleet.status()``, orphans) and wait for it (the
reaper) — the GPU counterpart of ``nemo_gen.host.processes``. No Ray, no torch: pure queries
over ``pynvml`` (the ``nvidia-ml-py`` package, which vLLM's CUDA build depends on).

API (every function takes ``nvml=`` for tests; default: the real ``pynvml``, initialised once):

- ``available() -> bool``: NVML loads and sees at least one GPU. False on a machine without
  an NVIDIA driver (CI): every query below then returns empty results instead of raising.
- ``devices() -> list[GpuDevice]``: per GPU: ``index`` (NVML's), ``uuid``, ``total_bytes``,
  ``used_bytes``, ``free_bytes``.
- ``gpu_processes() -> list[GpuProcess]``: every compute process NVML lists on every GPU:
  ``pid``, ``gpu_index``, ``gpu_uuid``, ``used_bytes`` (None where the driver does not report
  per-process memory, e.g. some containers/MIG).
- ``used_by_pids(pids) -> dict[int, int]``: bytes of GPU memory each of ``pids`` holds, summed
  over GPUs; a PID that holds none (exited, or never touched a GPU) is absent. A PID listed with
  unknown usage counts as holding memory: it is reported with 0 bytes but present.
- ``wait_released(pids, timeout_s, poll_s=0.05) -> Release``: poll until none of ``pids`` holds
  GPU memory or ``timeout_s`` passes. ``Release.released`` (bool), ``held`` ({pid: bytes} still
  held at the end), ``seconds`` (time waited), ``checked`` (False when NVML was unavailable:
  nothing could be verified, ``released`` is then True only in the sense that nothing is known
  to be held). Pure polling: it never kills anything (``processes.wait_or_kill`` does that).
- ``describe(held) -> str``: ``"pid 123: 71.2 GiB, pid 456: 0.5 GiB"`` for logs and reports.

PIDs are those of the machine NVML runs on: call these on the node where the shard ran (the
driver's node in a local cluster). In a container without the host's PID namespace NVML reports
host PIDs, which match nothing here: ``used_by_pids`` then finds nothing, ``gpu_processes`` still
lists what it sees.

``engine_start_lock()``: engines that share a GPU (``fleet.shards_per_gpu`` > 1) must start one
at a time: vLLM sizes its KV cache from the device's free memory measured around its own
profiling run, so another engine allocating (or freeing) meanwhile is counted as this one's
(a KV cache too small or negative) or trips vLLM's "Error in memory profiling" assertion. The
lock is a file lock per GPU of ``CUDA_VISIBLE_DEVICES`` (node-local, released if the holder
dies); on CPU, or with no GPU visible, it is a no-op.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

_lock = threading.Lock()
_nvml_module: Any = None
_nvml_failed = False


def _nvml(nvml: Any = None) -> Any:
    """The NVML module to use: ``nvml`` when given (tests), else ``pynvml`` initialised once;
    None when NVML is unavailable."""
    global _nvml_module, _nvml_failed
    if nvml is not None:
        return nvml
    with _lock:
        if _nvml_module is None and not _nvml_failed:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_module = pynvml
            except Exception:  # no package, no driver, no device: nothing to query
                _nvml_failed = True
        return _nvml_module


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    gpu_index: int
    gpu_uuid: str
    used_bytes: int | None  # None: the driver does not report per-process memory here


@dataclass
class Release:
    """What ``wait_released`` found."""

    released: bool
    held: dict[int, int] = field(default_factory=dict)
    seconds: float = 0.0
    checked: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"released": self.released, "held": {str(k): v for k, v in self.held.items()},
                "seconds": self.seconds, "checked": self.checked}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _handles(nv: Any) -> list[tuple[int, Any]]:
    return [(i, nv.nvmlDeviceGetHandleByIndex(i)) for i in range(nv.nvmlDeviceGetCount())]


def available(nvml: Any = None) -> bool:
    nv = _nvml(nvml)
    if nv is None:
        return False
    try:
        return nv.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def devices(nvml: Any = None) -> list[GpuDevice]:
    nv = _nvml(nvml)
    if nv is None:
        return []
    out = []
    for index, handle in _handles(nv):
        mem = nv.nvmlDeviceGetMemoryInfo(handle)
        out.append(GpuDevice(index=index, uuid=_text(nv.nvmlDeviceGetUUID(handle)), total_bytes=int(mem.total),
                             used_bytes=int(mem.used), free_bytes=int(mem.free)))
    return out


def gpu_processes(nvml: Any = None) -> list[GpuProcess]:
    nv = _nvml(nvml)
    if nv is None:
        return []
    out = []
    for index, handle in _handles(nv):
        uuid = _text(nv.nvmlDeviceGetUUID(handle))
        for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
            used = getattr(proc, "usedGpuMemory", None)
            out.append(GpuProcess(pid=int(proc.pid), gpu_index=index, gpu_uuid=uuid,
                                  used_bytes=None if used is None else int(used)))
    return out


def used_by_pids(pids: Iterable[int], nvml: Any = None) -> dict[int, int]:
    wanted = {int(p) for p in pids}
    out: dict[int, int] = {}
    if not wanted:
        return out
    for proc in gpu_processes(nvml):
        if proc.pid in wanted:
            out[proc.pid] = out.get(proc.pid, 0) + (proc.used_bytes or 0)
    return out


def wait_released(
    pids: Iterable[int], timeout_s: float, poll_s: float = 0.05, nvml: Any = None,
    clock: Any = time.monotonic, sleep: Any = time.sleep,
) -> Release:
    pids = [int(p) for p in pids]
    t0 = clock()
    if not pids:
        return Release(released=True, seconds=0.0)
    if not available(nvml):
        return Release(released=True, seconds=0.0, checked=False)
    deadline = t0 + timeout_s
    while True:
        held = used_by_pids(pids, nvml)
        now = clock()
        if not held:
            return Release(released=True, seconds=now - t0)
        if now >= deadline:
            return Release(released=False, held=held, seconds=now - t0)
        sleep(min(poll_s, max(0.0, deadline - now)))


def describe(held: dict[int, int]) -> str:
    return ", ".join(f"pid {pid}: {nbytes / 2**30:.1f} GiB" for pid, nbytes in sorted(held.items()))


# -- engines that share a GPU start one at a time --------------------------------------------


def visible_gpus(environ: Any = None) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (Ray sets it for an
    actor with GPUs); empty when it is unset or empty (CPU actors)."""
    value = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    return [v.strip() for v in value.split(",") if v.strip() and v.strip() != "-1"]


class EngineStartLock:
    """File locks (``fcntl.flock``), one per visible GPU, taken in a fixed order (no deadlock
    between two engines that share two GPUs). ``acquire`` blocks; ``release`` is idempotent. The
    kernel drops a lock when its holder dies, so a killed engine never leaves a GPU locked."""

    def __init__(self, gpus: list[str], lock_dir: str = "/tmp"):
        self.paths = [os.path.join(lock_dir, f"nemo-gen-gpu-start-{g.replace('/', '_')}.lock") for g in sorted(gpus)]
        self._fds: list[int] = []
        self.waited_s = 0.0

    def acquire(self) -> "EngineStartLock":
        t0 = time.monotonic()
        for path in self.paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fds.append(fd)
        self.waited_s = time.monotonic() - t0
        return self

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in reversed(fds):
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "EngineStartLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def engine_start_lock(environ: Any = None, lock_dir: str = "/tmp") -> EngineStartLock:
    """The start lock for the GPUs this process sees (no-op lock when it sees none)."""
    return EngineStartLock(visible_gpus(environ), lock_dir)

