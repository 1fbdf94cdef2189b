"""The fleet's weight state, with one owner: the version it serves and where it came from,
the staged refit a newcomer catches up from, the engines' manifests, the shared-memory
staging file, the fleet record (which outlives every shard), and the refit lock.

Only ``refitting()`` takes the lock: one refit, catch-up or spare promotion at a time, since
they share the staging file and the version. A weight-sync session that spans several calls
(start ... finish) enters it through an ``ExitStack`` and closes it when the session ends.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from nemo_gen.core.digest import DigestBook
from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.wire import EngineManifest
from nemo_gen.fleet.record import RecordWriter


@dataclass
class StagedRefit:
    """A refit's bytes in the staging file and the metadata the shards need to load them.
    Kept after a refit succeeds: a replacement or spare catches up from it."""

    version: int
    path: str
    total: int
    groups: list  # (target, [(name, shape, dtype, offset)]) in load order
    tensors: int
    stage_seconds: float
    source: str | None  # the checkpoint directory, when the weights came from one
    # The trainer's digest of each tensor, in ``entries`` order (``nemo_gen.core.digest``), and
    # their combined digest; the seconds computing them took. Empty: not digested.
    digests: tuple[int, ...] = ()
    digest: str | None = None
    digest_seconds: float = 0.0

    @property
    def entries(self) -> list:
        return [e for _, entries in self.groups for e in entries]


class FleetWeights:
    def __init__(self, *, version: int | None, source: str | None, staging_dir: str, fleet_name: str, record: RecordWriter):
        self._version = version
        self._source = source
        self._staged: StagedRefit | None = None
        self._manifests: dict[WeightTarget, EngineManifest] = {}
        self._staging = None
        self._staging_dir = staging_dir
        self._fleet_name = fleet_name
        self._record = record  # a RecordWriter
        self._lock = threading.RLock()
        self.digests = DigestBook()  # each version's digest, what results' spans are stamped with
        self.reclaim_staging()

    def reclaim_staging(self) -> list:
        """Remove the staging files that processes of this fleet which died without closing them
        left behind (a SIGKILLed driver's model-sized tmpfs file); a live process's is kept. Run
        when the fleet starts (or is attached to) and when this process closes it."""
        from nemo_gen.vllm_ext.staging import reclaim_stale

        return reclaim_stale(self._staging_dir, self._fleet_name)

    @property
    def version(self) -> int | None:
        """The version the fleet serves (None: train mode before its first refit)."""
        return self._version

    @property
    def source(self) -> str | None:
        """The checkpoint the current version came from (None: live tensors, or the launch weights)."""
        return self._source

    @property
    def staged(self) -> StagedRefit | None:
        """The staging file's contents, while they are the current version's bytes."""
        return self._staged

    @property
    def record(self) -> RecordWriter:
        """The fleet record's writer (``nemo_gen.fleet.record.RecordWriter``)."""
        return self._record

    @contextlib.contextmanager
    def refitting(self) -> Iterator["FleetWeights"]:
        """Hold the refit lock for the block (re-entrant: a catch-up inside a refit is fine)."""
        with self._lock:
            yield self

    def manifest(self, target: WeightTarget, ask: Callable[[], EngineManifest]) -> EngineManifest:
        """The engines' manifest for ``target``; every shard runs the same
        model, so ``ask`` is called once per target."""
        if target not in self._manifests:
            self._manifests[target] = ask()
        return self._manifests[target]

    def staging(self):
        """The fleet's shared-memory staging file, created on first use and reused (first touch
        of fresh pages is slow: reuse is what makes a refit run at copy speed)."""
        if self._staging is None:
            from nemo_gen.vllm_ext.staging import SharedMemoryStaging

            self._staging = SharedMemoryStaging(self._staging_dir, self._fleet_name)
        return self._staging

    def begin_staging(self) -> None:
        """The staging file is about to be overwritten: it no longer holds the current version."""
        self._staged = None

    def landed(self, version: int, source: str | None, staged: StagedRefit | None, digest: str | None = None) -> None:
        """A refit landed on at least one shard: the fleet serves ``version`` now. ``staged``:
        its bytes, when they are in the staging file (None for a weight-sync refit, whose
        trainer's ``digest`` the shards checked, if any)."""
        self._version = version
        self._source = source
        self._staged = staged
        self.digests.record(version, staged.digest if staged is not None else digest)
        self._record.write_version(version, source)

    def note_slot(self, slot: int, restarts: int, retired: str | None) -> None:
        """Keep slot ``slot``'s restart count and retirement in the fleet record, which outlives
        every shard and every process that attaches."""
        self._record.write_slot(slot, restarts, retired)

    def keep_staged(self, staged: StagedRefit) -> None:
        """A catch-up re-staged the current version (another process did the last refit)."""
        self._staged = staged

    def close(self) -> None:
        """Wait until the record holds this process's writes; remove the staging file this
        process wrote (the shards read it only during a refit), and dead processes' ones."""
        self._record.close()
        self.reclaim_staging()  # first: the directory goes with this process's file when it empties
        if self._staging is not None:
            self._staging.close()
