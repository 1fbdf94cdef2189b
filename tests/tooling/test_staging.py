"""The shared-memory staging file (``nemo_gen.vllm_ext.staging``): private names and modes, planted
symlinks never followed, the sweep of dead processes' files, and free space checked before a
byte is written (invariant 8; reliability review 2026-12-04, finding 9)."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from nemo_gen.core.manifest import RefitError, TensorMeta, layout
from nemo_gen.vllm_ext import staging as staging_mod
from nemo_gen.vllm_ext.staging import SharedMemoryStaging

FLEET = "unit-fleet"
VICTIM_BYTES = b"precious" * 125  # 1000 bytes


def _one_tensor(n: int = 4096):
    placed, total = layout([TensorMeta.of("w", (n,), "float32")])
    return placed[0], total


def _stage(staging: SharedMemoryStaging, n: int = 4096) -> torch.Tensor:
    place, total = _one_tensor(n)
    src = torch.arange(n, dtype=torch.float32)
    staging.ensure(total)
    staging.write(place, src, torch.float32)
    return src


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (the limited /dev/shm of a container), or a skip
    where this machine does not let us mount one."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _child_staging(directory: Path, name: str, nbytes: int = 4096) -> tuple[subprocess.Popen, Path]:
    """A real process that stages a file and then waits to be killed: (process, its file)."""
    code = textwrap.dedent(f"""
        import sys, time
        from nemo_gen.vllm_ext.staging import SharedMemoryStaging
        s = SharedMemoryStaging({str(directory)!r}, {name!r})
        s.ensure({nbytes})
        print(s.path, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line, "the child staged nothing"
    return proc, Path(line)


def _sigkill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


# -- names, modes, symlinks ----------------------------------------------------------------------


def test_file_is_0600_in_a_0700_directory_of_ours_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        staging = SharedMemoryStaging(tmp_path, FLEET)
        src = _stage(staging)
    finally:
        os.umask(old)
    try:
        fst, dst = os.lstat(staging.path), os.lstat(staging.path.parent)
        assert stat.S_ISREG(fst.st_mode) and stat.S_IMODE(fst.st_mode) == 0o600
        assert staging.path.parent == staging_mod.staging_dir_of(tmp_path, FLEET)
        assert stat.S_ISDIR(dst.st_mode) and stat.S_IMODE(dst.st_mode) == 0o700
        assert fst.st_uid == dst.st_uid == os.geteuid()
        # what a shard's worker reads, by the path it is given
        seen = torch.from_file(str(staging.path), shared=True, size=src.numel(), dtype=torch.float32)
        assert torch.equal(seen, src)
    finally:
        staging.close()
    assert not staging_mod.staging_dir_of(tmp_path, FLEET).exists(), "close() left the file or its directory"


def test_two_stagings_of_one_fleet_never_share_a_name(tmp_path):
    a, b = SharedMemoryStaging(tmp_path, FLEET), SharedMemoryStaging(tmp_path, FLEET)
    _stage(a), _stage(b)
    try:
        assert a.path != b.path and a.path.parent == b.path.parent
    finally:
        a.close()
        assert b.path.exists(), "one staging's close removed another's file"
        b.close()


def test_a_symlink_planted_at_the_predictable_name_is_never_followed(tmp_path):
    # The name today's code used (reliability review, probe G: "victim is now 16 bytes").
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    legacy = tmp_path / f"nemo_gen-{FLEET}-{os.getpid()}.staging"
    legacy.symlink_to(victim)
    staging = SharedMemoryStaging(tmp_path, FLEET)
    _stage(staging)
    try:
        assert not staging.path.is_symlink()
    finally:
        staging.close()
    assert victim.read_bytes() == VICTIM_BYTES and os.readlink(legacy) == str(victim)


def test_a_symlink_planted_at_the_next_random_name_is_never_followed(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    private = staging_mod.staging_dir_of(tmp_path, FLEET)
    private.mkdir(mode=0o700)
    # Force the draw: the first name is the planted one, the second is free.
    tokens = iter(["0123456789abcdef", "fedcba9876543210"])
    monkeypatch.setattr(staging_mod, "_token", lambda: next(tokens))
    start = staging_mod._proc_stat(os.getpid())[1]
    planted = private / f"{os.getpid()}.{start}.{staging_mod._own_pid_ns()}.0123456789abcdef.staging"
    planted.symlink_to(victim)

    staging = SharedMemoryStaging(tmp_path, FLEET)
    _stage(staging)
    try:
        assert staging.path.name.endswith(".fedcba9876543210.staging")
        assert not staging.path.is_symlink()
    finally:
        staging.close()
    assert victim.read_bytes() == VICTIM_BYTES and os.readlink(planted) == str(victim)


def test_a_symlink_at_the_directory_is_refused_and_its_target_untouched(tmp_path):
    victim_dir = tmp_path / "victim-dir"
    victim_dir.mkdir(mode=0o755)
    staging_dir = tmp_path / "shm"
    staging_dir.mkdir()
    staging_mod.staging_dir_of(staging_dir, FLEET).symlink_to(victim_dir, target_is_directory=True)
    staging = SharedMemoryStaging(staging_dir, FLEET)
    with pytest.raises(RefitError, match="is a symlink") as err:
        staging.ensure(4096)
    assert str(staging_mod.staging_dir_of(staging_dir, FLEET)) in str(err.value)
    staging.close()
    assert list(victim_dir.iterdir()) == [] and stat.S_IMODE(victim_dir.stat().st_mode) == 0o755
    assert staging_mod.staging_dir_of(staging_dir, FLEET).is_symlink()


def test_a_file_at_the_directory_name_is_refused(tmp_path):
    staging_mod.staging_dir_of(tmp_path, FLEET).write_bytes(VICTIM_BYTES)
    with pytest.raises(RefitError, match="not a directory"):
        SharedMemoryStaging(tmp_path, FLEET).ensure(4096)
    assert staging_mod.staging_dir_of(tmp_path, FLEET).read_bytes() == VICTIM_BYTES


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_another_users_directory_is_refused(tmp_path):
    private = staging_mod.staging_dir_of(tmp_path, FLEET)
    private.mkdir(mode=0o700)
    os.chown(private, 65534, 65534)
    with pytest.raises(RefitError, match="belongs to uid 65534"):
        SharedMemoryStaging(tmp_path, FLEET).ensure(4096)
    assert list(private.iterdir()) == []


def test_a_wider_directory_of_ours_is_narrowed_to_0700(tmp_path):
    private = staging_mod.staging_dir_of(tmp_path, FLEET)
    private.mkdir()
    os.chmod(private, 0o777)
    staging = SharedMemoryStaging(tmp_path, FLEET)
    _stage(staging)
    try:
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
    finally:
        staging.close()


def test_a_fleet_name_cannot_leave_the_staging_directory(tmp_path):
    staging = SharedMemoryStaging(tmp_path / "shm", "../../etc/x")
    _stage(staging)
    try:
        assert staging.path.parent.parent == tmp_path / "shm"
    finally:
        staging.close()


def test_buffer_is_reused_across_refits_and_grows_in_place(tmp_path):
    staging = SharedMemoryStaging(tmp_path, FLEET)
    try:
        _stage(staging, 4096)
        path, buf = staging.path, staging._buf
        _stage(staging, 1024)  # fits: the same pages
        assert staging._buf is buf and staging.path == path
        src = _stage(staging, 65536)  # larger model: the same file, grown
        assert staging.path == path and staging.size >= 65536 * 4
        assert torch.equal(torch.from_file(str(path), shared=True, size=65536, dtype=torch.float32), src)
    finally:
        staging.close()


# -- the sweep of dead processes' files ---------------------------------------------------------------


def test_a_sigkilled_processs_file_is_reclaimed_and_a_live_ones_kept(tmp_path):
    dead, dead_file = _child_staging(tmp_path, FLEET)
    live, live_file = _child_staging(tmp_path, FLEET)
    ours = SharedMemoryStaging(tmp_path, FLEET)
    _stage(ours)
    private = staging_mod.staging_dir_of(tmp_path, FLEET)
    ns = staging_mod._own_pid_ns()
    # a live pid whose start time differs (the pid was reused): dead
    reused = private / f"{live.pid}.1.{ns}.00000000000000aa.staging"
    # a dead pid of another pid namespace (a container sharing the directory): cannot tell, kept
    foreign = private / f"{dead.pid}.1.99.00000000000000bb.staging"
    unrelated = private / "notes.txt"
    for p in (reused, foreign, unrelated):
        p.write_bytes(b"x")
    try:
        _sigkill(dead)
        assert dead_file.exists()
        removed = staging_mod.reclaim_stale(tmp_path, FLEET)
        assert sorted(removed) == sorted([dead_file, reused])
        assert not dead_file.exists() and not reused.exists()
        assert live_file.exists() and ours.path.exists() and foreign.exists() and unrelated.exists()
    finally:
        _sigkill(live)
        ours.close()


def test_an_exited_but_unwaited_process_counts_as_dead(tmp_path):
    child, path = _child_staging(tmp_path, FLEET)
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie: exited, not reaped
    try:
        assert staging_mod.reclaim_stale(tmp_path, FLEET) == [path]
    finally:
        child.wait(timeout=30)


def test_the_sweep_never_follows_or_judges_what_is_not_its_own(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(VICTIM_BYTES)
    private = staging_mod.staging_dir_of(tmp_path / "shm", FLEET)
    private.mkdir(parents=True, mode=0o700)
    link = private / f"999999999.1.{staging_mod._own_pid_ns()}.00000000000000cc.staging"
    link.symlink_to(victim)
    assert staging_mod.reclaim_stale(tmp_path / "shm", FLEET) == []
    assert link.is_symlink() and victim.read_bytes() == VICTIM_BYTES
    # a symlinked staging directory is not swept through
    other = tmp_path / "other"
    other.mkdir()
    (other / f"999999999.1.{staging_mod._own_pid_ns()}.00000000000000dd.staging").write_bytes(b"x")
    linked = staging_mod.staging_dir_of(tmp_path / "shm2", FLEET)
    linked.parent.mkdir()
    linked.symlink_to(other, target_is_directory=True)
    assert staging_mod.reclaim_stale(tmp_path / "shm2", FLEET) == [] and len(list(other.iterdir())) == 1
    assert staging_mod.reclaim_stale(tmp_path / "never-made", FLEET) == []


def test_fleet_weights_sweep_when_the_fleet_starts_and_closes(tmp_path):
    from nemo_gen.fleet.weights import FleetWeights

    record = types.SimpleNamespace(close=lambda: None, write=lambda **_: None)
    dead, dead_file = _child_staging(tmp_path, FLEET)
    _sigkill(dead)
    weights = FleetWeights(version=0, source=None, staging_dir=str(tmp_path), fleet_name=FLEET, record=record)
    assert not dead_file.exists(), "the fleet's start left a dead driver's staging file"

    dead, dead_file = _child_staging(tmp_path, FLEET)
    _sigkill(dead)
    _stage(weights.staging())
    weights.close()
    assert not dead_file.exists(), "the fleet's close left a dead driver's staging file"
    assert not staging_mod.staging_dir_of(tmp_path, FLEET).exists()


# -- free space ------------------------------------------------------------------------------------


def _fake_free(monkeypatch, directory: Path, free: int) -> None:
    """os.statvfs reports ``free`` bytes in ``directory`` and under it (only the number is faked)."""
    real = os.statvfs

    def statvfs(path):
        if directory in (Path(path), *Path(path).parents):
            return types.SimpleNamespace(f_bavail=free // 4096, f_frsize=4096)
        return real(path)

    monkeypatch.setattr(staging_mod.os, "statvfs", statvfs)


def test_too_little_free_space_refuses_before_a_byte_and_keeps_the_staged_bytes(tmp_path, monkeypatch):
    staging = SharedMemoryStaging(tmp_path, FLEET)
    try:
        src = _stage(staging, 4096)  # the current version's bytes
        path, size = staging.path, staging.size
        _fake_free(monkeypatch, tmp_path, 8192)
        place, total = _one_tensor(1 << 20)
        with pytest.raises(RefitError) as err:
            staging.ensure(total)
        message = str(err.value)
        assert f"needs {total} bytes" in message and "has 8192 bytes free" in message
        assert str(path) in message
        assert staging.path == path and staging.size == size and os.path.getsize(path) == size
        assert torch.equal(torch.from_file(str(path), shared=True, size=4096, dtype=torch.float32), src)
    finally:
        staging.close()


def test_a_first_staging_with_no_room_leaves_no_file(tmp_path, monkeypatch):
    _fake_free(monkeypatch, tmp_path, 0)
    staging = SharedMemoryStaging(tmp_path, FLEET)
    with pytest.raises(RefitError, match="has 0 bytes free"):
        staging.ensure(4096)
    assert list(tmp_path.iterdir()) == [], "a refused first staging left its file or directory"


_FULL_TMPFS = """
import os, sys, types
from nemo_gen.core.manifest import RefitError, TensorMeta, layout
from nemo_gen.vllm_ext import staging as m
import torch
if sys.argv[2] == "lie":  # statvfs claims room: the reservation itself must catch ENOSPC
    os.statvfs = lambda p: types.SimpleNamespace(f_bavail=1 << 30, f_frsize=4096)
n = 1 << 19  # 2 MiB of float32 into a 1 MiB tmpfs
placed, total = layout([TensorMeta.of("w", (n,), "float32")])
s = m.SharedMemoryStaging(sys.argv[1], "full")
try:
    s.ensure(total)
    s.write(placed[0], torch.ones(n), torch.float32)
except RefitError as exc:
    print("REFUSED", exc)
    sys.exit(3)
print("STAGED")
"""


@pytest.mark.parametrize("statvfs", ["true", "lie"])
def test_a_full_tmpfs_is_a_refit_error_not_a_sigbus(tmp_path, statvfs):
    # In a child process: today's code dies of SIGBUS writing into a full tmpfs.
    with small_tmpfs(tmp_path / "shm", "1m") as shm:
        child = subprocess.run([sys.executable, "-c", _FULL_TMPFS, str(shm), statvfs],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 3, (child.returncode, child.stdout, child.stderr[-2000:])
        assert f"needs {2 * 2**20} bytes" in child.stdout and "bytes free" in child.stdout
        assert list(shm.rglob("*.staging")) == []
