"""The CPU transport: one shared-memory staging file per fleet and process, written once per
refit by the driver and read in place by every shard's workers on the node; and the sweep
that removes the files of processes that died without closing theirs.

Where it lives: ``<refit.staging_dir>/nemo_gen-<fleet>-uid<uid>/``, a directory of ours at
mode 0700 (a symlink, another user's directory or anything not a directory there refuses the
refit; a wider mode of our own is narrowed). In it, ``<pid>.<start>.<pidns>.<random>.staging``:
a random name created with ``O_CREAT|O_EXCL|O_NOFOLLOW`` at mode 0600, so a name planted in
advance is never opened, and the owner's pid, start time and pid namespace are in the name —
what the sweep needs to tell a dead owner (removed) from a live one (never touched).

The file is kept and reused across refits: the first touch of fresh pages costs ~30x a memory
copy here, so a refit into pages touched before runs at copy speed. When a larger model
arrives its space is reserved (``posix_fallocate``) before a byte is written: a full tmpfs is a
``RefitError`` naming the bytes needed and free, never a SIGBUS in the middle of a copy, and
the staged bytes of the current version are left as they were. It is removed when the fleet
shuts down.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any, Iterable

from nemo_gen.core.manifest import RefitError, StagedTensor
from nemo_gen.vllm_ext.digest import staged_form

log = logging.getLogger(__name__)

_SUFFIX = ".staging"
# pid . start time (clock ticks after boot, "x" where /proc is not there) . pid namespace . random
_NAME = re.compile(r"^(\d+)\.(\d+|x)\.(\d+|x)\.[0-9a-f]{16}\.staging$")
_NAME_ATTEMPTS = 16  # O_EXCL collisions on a 64-bit random name only happen when planted
_DIR_ATTEMPTS = 3  # another process of the fleet may remove the (empty) directory meanwhile


def staging_dir_of(directory: str | os.PathLike, name: str) -> Path:
    """The private directory of ``name``'s staging files under ``directory``. The name is cut to
    path-safe characters; two names that map to one directory share it harmlessly (every file
    in it has its own owner)."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)[:80] or "_"
    return Path(directory) / f"nemo_gen-{safe}-uid{os.geteuid()}"


def _own_pid_ns() -> str:
    try:
        return re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "x"
    except OSError:
        return "x"


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of ``pid`` from /proc, or None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), fields[19].decode()  # fields 3 and 22 of proc(5)


def _token() -> str:
    return secrets.token_hex(8)


def _alive(pid: int, start: str, pid_ns: str) -> bool:
    """Whether the process that made a file may still use it. Unknown counts as alive: a file
    of another pid namespace (a container sharing the directory) is never judged from here."""
    if pid_ns != _own_pid_ns():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists
    seen = _proc_stat(pid)
    if seen is None:
        return True
    state, started = seen
    if state == "Z":  # exited, not yet waited for: it holds no file and never writes again
        return False
    return start == "x" or started == start  # another start time: the pid was reused


def _open_private_dir(path: Path) -> int:
    """An fd of ``path``, a directory of ours at mode 0700, made if missing. Refuses a symlink,
    a non-directory or another user's directory (``RefitError`` naming it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = "a symlink" if path.is_symlink() else "not a directory"
            raise RefitError(
                f"refit refused, no weight was changed: the staging directory {path} is {what}; "
                "remove it, or set refit.staging_dir elsewhere"
            ) from None
        raise
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        os.close(fd)
        raise RefitError(
            f"refit refused, no weight was changed: the staging directory {path} belongs to uid "
            f"{st.st_uid}, not to this process (uid {os.geteuid()}); remove it, or set refit.staging_dir elsewhere"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        if st.st_mode & 0o077:
            log.warning("staging directory %s had mode %o; narrowed to 0700", path, stat.S_IMODE(st.st_mode))
        os.fchmod(fd, 0o700)
    return fd


def reclaim_stale(directory: str | os.PathLike, name: str) -> list[Path]:
    """Remove the staging files under ``directory`` of ``name`` whose process is dead (a driver
    that was SIGKILLed never closed its file: a model-sized piece of tmpfs). Only regular files
    of ours with a parseable owner are judged; a live owner's file is never touched. Returns the
    paths removed; never raises (a sweep must not stop a fleet from starting)."""
    path = staging_dir_of(directory, name)
    removed: list[Path] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("staging sweep skipped %s: %s", path, exc)
        return removed
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            log.warning("staging sweep skipped %s: it is not this user's", path)
            return removed
        for entry in os.listdir(fd):
            m = _NAME.match(entry)
            if m is None:
                continue
            try:
                st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    continue
                if _alive(int(m.group(1)), m.group(2), m.group(3)):
                    continue
                os.unlink(entry, dir_fd=fd)
                removed.append(path / entry)
            except OSError as exc:  # removed meanwhile by another sweep, or not ours to remove
                log.debug("staging sweep: %s: %s", entry, exc)
    finally:
        os.close(fd)
    if removed:
        log.info("removed %d staging file(s) of dead processes from %s", len(removed), path)
    return removed


class SharedMemoryStaging:
    """This process's staging file for ``name`` (a fleet, or a trainer engine) under ``directory``.
    ``path`` is None until the first ``ensure``."""

    def __init__(self, directory: str | os.PathLike, name: str):
        self.directory = staging_dir_of(directory, name)
        self.path: Path | None = None
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._buf = None
        self.size = 0

    def _create(self) -> None:
        """Open a fresh file under a random name; a name that exists (planted, or a collision)
        is never opened, and another is drawn."""
        stat_fields = _proc_stat(os.getpid())
        prefix = f"{os.getpid()}.{stat_fields[1] if stat_fields else 'x'}.{_own_pid_ns()}."
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for _ in range(_DIR_ATTEMPTS):
            try:
                dfd = _open_private_dir(self.directory)
            except FileNotFoundError:
                continue  # made, then removed (empty) by another process of the fleet at once
            try:
                for _ in range(_NAME_ATTEMPTS):
                    entry = prefix + _token() + _SUFFIX
                    try:
                        fd = os.open(entry, flags, 0o600, dir_fd=dfd)
                    except FileExistsError:
                        continue
                    os.fchmod(fd, 0o600)  # exactly, whatever the umask
                    self._fd, self.path = fd, self.directory / entry
                    return
                raise RefitError(
                    f"refit refused, no weight was changed: {_NAME_ATTEMPTS} random staging file "
                    f"names in {self.directory} all existed already"
                )
            except FileNotFoundError:
                continue  # the directory was removed (empty) by another process of the fleet
            finally:
                os.close(dfd)
        raise RefitError(f"refit refused, no weight was changed: the staging directory {self.directory} "
                         "kept disappearing")

    def ensure(self, size: int) -> None:
        """Make the file at least ``size`` bytes, keeping (already touched) pages when it fits.
        Growing reserves the space first: not enough of it is a ``RefitError`` with the bytes
        needed and free, and the file, with any bytes staged in it, is left as it was."""
        import torch

        size = max(int(size), 1)  # (a mapping cannot be empty)
        if self._buf is not None and size <= self.size:
            return
        created = self._fd is None
        if created:
            self._create()
        try:
            held = os.fstat(self._fd).st_blocks * 512
            needed = max(0, size - held)
            free = self._free()
            if needed > free:
                raise self._no_space(size, needed, free)
            try:
                os.posix_fallocate(self._fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise
                raise self._no_space(size, needed, self._free()) from None
        except BaseException:
            if created:
                self.close()
            raise
        # Mapped through our own descriptor: the file is never opened by name again.
        mapped = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._release_map()
        self._map = mapped
        self._buf = torch.frombuffer(mapped, dtype=torch.uint8)
        self.size = size

    def _free(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def _no_space(self, size: int, needed: int, free: int) -> RefitError:
        return RefitError(
            f"refit refused, no weight was changed: staging it needs {size} bytes in {self.path} "
            f"({needed} bytes more than the file holds) but {self.directory} has {free} bytes free; "
            "free space there or set refit.staging_dir to a larger shared-memory filesystem"
        )

    def write(self, placed: StagedTensor, tensor: Any, dtype: Any) -> None:
        """Copy ``tensor`` (cast to ``dtype`` when it is floating) into its place."""
        src = staged_form(tensor, dtype)
        if src.device.type != "cpu":
            src = src.cpu()
        nbytes = placed.meta.nbytes
        dst = self._buf[placed.offset : placed.offset + nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)

    def entries(self, placed: Iterable[StagedTensor]) -> list[tuple[str, tuple[int, ...], str, int]]:
        """The metadata the workers need (all that crosses the RPC)."""
        return [(p.meta.name, p.meta.shape, p.meta.dtype, p.offset) for p in placed]

    def _release_map(self) -> None:
        self._buf = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # a view of it is still referenced; the mapping goes with that view
            self._map = None

    def close(self) -> None:
        """Remove the file, and the directory if no other process has a file in it."""
        self._release_map()
        self.size = 0
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is None:
            return  # never made: the directory was not checked as ours, leave it be
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        self.path = None
        try:
            self.directory.rmdir()
        except OSError:
            pass  # another process's file is in it, or it is gone
