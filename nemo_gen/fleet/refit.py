"""The driver's side of a refit: check, stage, verify on every shard, then load.

Phase 0 (driver): the source's manifest is checked against the engine's own (names, shapes,
dtypes; ``draft.`` names against the drafter) — a bad checkpoint is refused before a byte
moves. Then the tensors are staged, bucket by bucket, into the fleet's shared-memory file.
Phase 1 (every shard): each shard's workers open the staged tensors; any failure refuses the
refit fleet-wide, and no shard has changed. Phase 2 (every shard, in parallel): load. A shard
that fails here, or has not answered by ``refit.timeout_s``, is quarantined (it holds
half-loaded weights and never serves again: recovery restarts it and it catches up); the others
serve the new version.

``Refitter`` owns these steps and the rules every refit path shares (who takes a refit, how
each member's outcome is settled, catching a newcomer up); the weight-sync client builds on
its public methods. The state it acts on is the fleet's weights (``FleetWeights``) and, through
the slot table's transactions (``SlotTable.record_refit``, ``quarantine``), its members'.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from nemo_gen.core.digest import WeightDigest, is_mismatch
from nemo_gen.core.fleet_health import ABSENT_STATES
from nemo_gen.core.members import Member
from nemo_gen.core.modes import RefitMode, WeightTarget
from nemo_gen.core.slots import SlotTable
from nemo_gen.core.manifest import (
    DRAFT_PREFIX,
    RefitError,
    RefitReport,
    ShardRefit,
    TensorMeta,
    buckets,
    check_manifest,
    is_floating,
    layout,
    next_version,
    split_draft,
)
from nemo_gen.core.wire import CheckRefit, EngineManifest, InFlight, LoadRefit
from nemo_gen.errors import NemoGenError, ShardDiedError, StaleShard
from nemo_gen.fleet.driver import ShardDriver
from nemo_gen.fleet.members import Membership
from nemo_gen.fleet.handles import ShardHandle
from nemo_gen.fleet.weights import FleetWeights, StagedRefit
from nemo_gen.fleet.weight_sources import as_source
from nemo_gen.core.waves import Rollout, WavePlan
from nemo_gen.fleet.rolling import RollingRefit

log = logging.getLogger(__name__)

# How a newcomer that serves nothing yet takes its catch-up refit.
_DRAIN = InFlight(RefitMode.DRAIN)
# refit.timeout_s bounds each phase on a shard, the load's wait for running requests (drain)
# included: the workers enforce it inside, and the driver stops waiting at the same deadline,
# so a shard frozen mid-phase is given up on (and quarantined) then, not later.
_CHECK_MARGIN_S = 0.0
_LOAD_MARGIN_S = 0.0


def metas_of(expected: EngineManifest) -> dict[str, TensorMeta]:
    """An engine manifest (name -> (shape, dtype)) as TensorMetas."""
    return {name: TensorMeta.of(name, shape, dtype) for name, (shape, dtype) in expected.tensors.items()}


class Refitter:
    def __init__(self, *, slots: SlotTable, members: Membership, weights: FleetWeights,
                 driver: ShardDriver, generation_config: dict[str, Any], bucket_bytes: int, digest: bool = True):
        self.slots = slots
        self.health = slots.ledger  # read only: every write is a table transaction
        self.members = members
        self.weights = weights
        self.driver = driver
        self._generation_config = generation_config
        self.bucket_bytes = bucket_bytes
        self.digest = digest  # refit.digest: hash what is staged, and have every shard check it
        # Refits that landed (on at least one shard), their seconds and bytes: metrics.
        self.totals = {"refits": 0, "seconds": 0.0, "bytes": 0}
        # Run on a newcomer after it caught up, under the refit lock (the fleet's LoRA adapters).
        self.after_catch_up: list[Callable[[Member, ShardHandle], None]] = []
        # Run before weights move, under the refit lock (a sleeping fleet wakes its weights: nemo_gen.fleet.sleep);
        # before_catch_up: the same for one newcomer (a sleep may have reached it before its catch-up).
        self.before_refit: list[Callable[[], None]] = []
        self.before_catch_up: list[Callable[[Member, ShardHandle], None]] = []
        self._rollout: tuple[Any, Callable[[int], int]] | None = None  # (settings, open sessions per slot)

    def roll_in_waves(self, settings: Any, open_sessions: Callable[[int], int]) -> None:
        """Refits follow ``settings.refit.rollout`` as it is at each refit: with ``waves`` they go
        through ``nemo_gen.fleet.rolling`` (``open_sessions``: a slot's open sessions, which its wave waits for)."""
        self._rollout = (settings, open_sessions)

    @property
    def waves(self) -> RollingRefit | None:
        """The rolling refit, when ``refit.rollout`` is ``waves`` now."""
        if self._rollout is None or (s := self._rollout[0]).refit.rollout is not Rollout.WAVES:
            return None
        if self.weights.version is None:  # train mode's first refit: nothing serves yet, all move at once
            return None
        return RollingRefit(self, WavePlan.of(s.refit.wave_size, s.refit.min_serving, s.fleet.num_shards),
                            self._rollout[1])

    @property
    def draft_full(self) -> bool:
        """The trainer streams the drafter's whole state dict (``draft_full_refit_enabled``)."""
        return bool(self._generation_config.get("_draft_full_refit"))

    # -- who takes a refit, and what the engines expect ------------------------------------------

    def targets(self) -> list[int]:
        """Slots holding an engine that can take weights: serving and STALE ones (a refit is how
        a STALE shard is re-admitted)."""
        targets = [s.dp_shard_idx for s in self.health.snapshot()
                   if s.state not in ABSENT_STATES and self.members.has_slot(s.dp_shard_idx)]
        if not targets:
            raise RefitError(f"no shard can take a refit; fleet state is {self.health.state_summary()}")
        return targets

    def refit_members(self) -> dict[Member, ShardHandle]:
        """Every refittable slot and every warm spare (so one can serve the moment it is promoted)."""
        return self.members.members(self.targets())

    def ready_weights(self) -> None:
        """Make every member's weights loadable (the ``before_refit`` hooks), under the refit lock."""
        for hook in self.before_refit:
            hook()

    def expected(self, target: WeightTarget) -> EngineManifest:
        """The engine's own manifest for ``target``, asked of each refittable shard in turn (so
        a shard lost right now does not fail the refit), then cached."""
        def ask() -> EngineManifest:
            errors = []
            for slot in self.targets():
                handle = self.members.handle(slot)
                try:
                    return self.driver.expected_manifest(handle, target)
                except ShardDiedError as exc:
                    errors.append(f"shard {slot}: {exc}")
            raise RefitError(f"no shard could describe its weights: {'; '.join(errors)}")

        return self.weights.manifest(target, ask)

    @property
    def engine_dtype(self) -> str:
        """The dtype the engines compute in (refit stages floating tensors in it)."""
        return next(h.info.dtype for h in self.members.slots() + self.members.spares() if h.info.dtype)

    # -- checkpoint / live-tensor refit ----------------------------------------------------------

    def refit(self, source: Any, version: int | None, in_flight: InFlight) -> RefitReport:
        """``in_flight``: what the shards do to running requests (``policies.in_flight``)."""
        if (waves := self.waves) is not None:
            return waves.refit(source, version, in_flight)
        with self.weights.refitting():
            new_version, members, staged, report = self.prepare(source, version)
            t1 = time.perf_counter()
            self.settle_outcome(report, new_version, self.apply_staged(staged, members, in_flight), may_refuse=True)
            report.load_seconds = time.perf_counter() - t1
            if any(s.ok for s in report.shards):
                self.weights.landed(new_version, staged.source, staged)
                self.count(report)
            return report

    def prepare(self, source: Any, version: int | None
                ) -> tuple[int, dict[Member, ShardHandle], StagedRefit, RefitReport]:
        """Under the refit lock: the new version, who takes it, its staged bytes and the report to fill."""
        new_version = next_version(self.weights.version, version)
        self.ready_weights()
        members = self.refit_members()
        staged = self.stage(source, new_version)
        report = RefitReport(version=new_version, bytes=staged.total, tensors=staged.tensors,
                             stage_seconds=staged.stage_seconds, load_seconds=0.0, digest=staged.digest,
                             digest_seconds=staged.digest_seconds)
        return new_version, members, staged, report

    def count(self, report: RefitReport) -> None:
        """A refit landed: add it to the totals."""
        self.totals["refits"] += 1
        self.totals["seconds"] += report.stage_seconds + report.load_seconds
        self.totals["bytes"] += report.bytes

    def _groups(self, metas: list[TensorMeta]) -> list[tuple[WeightTarget, list[TensorMeta]]]:
        """Check the manifest against the engine; return (target, tensors) groups to load."""
        policy, draft = split_draft(metas)
        groups: list[tuple[WeightTarget, list[TensorMeta]]] = []
        if policy:
            exp = self.expected(WeightTarget.POLICY)
            check_manifest(metas_of(exp), policy, optional=exp.optional, what="model")
            groups.append((WeightTarget.POLICY, policy))
        if draft:
            exp = self.expected(WeightTarget.DRAFT)
            if not exp.available:
                raise RefitError(
                    f"the refit carries {len(draft)} '{DRAFT_PREFIX}' tensors but the engines run no "
                    "draft model (generation.vllm_kwargs.speculative_config)"
                )
            check_manifest(metas_of(exp), draft, optional=exp.optional, partial=not self.draft_full,
                           what="draft model")
            groups.append((WeightTarget.DRAFT, draft))
        elif self.draft_full:
            raise RefitError(
                f"_draft_full_refit is set (draft_full_refit_enabled) but the refit has no '{DRAFT_PREFIX}' tensors"
            )
        if not groups:
            raise RefitError("the weight source is empty")
        return groups

    def stage(self, source: Any, version: int) -> StagedRefit:
        """Check the source's manifest against the engine's, then copy its tensors into the
        fleet's staging file (one copy per node). Raises ``RefitError`` before a byte moves."""
        import torch

        from nemo_gen.vllm_ext.digest import staged_form, tensor_digest

        src = as_source(source)
        dtype_name = self.engine_dtype
        engine_dtype = getattr(torch, dtype_name)
        # Floating tensors are staged in the engine's dtype, so the check compares like with like.
        metas = [TensorMeta(m.name, m.shape, dtype_name if is_floating(m.dtype) else m.dtype) for m in src.manifest()]
        groups = self._groups(metas)

        # Bucket by bucket into reused shared-memory pages. Tensors are placed under their source
        # names (a drafter's "draft.x" and the policy's "x" both exist).
        t0 = time.perf_counter()
        items = [(target, (DRAFT_PREFIX + m.name) if target is WeightTarget.DRAFT else m.name, m)
                 for target, group in groups for m in group]
        staged = [TensorMeta(src_name, m.shape, m.dtype) for _, src_name, m in items]
        placed, total = layout(staged)
        where = {p.name: p for p in placed}
        staging = self.weights.staging()
        # Space first: a staging directory too small refuses the refit with the staged bytes of
        # the current version intact (a newcomer still catches up from them).
        staging.ensure(total)
        self.weights.begin_staging()
        digests: dict[str, int] = {}
        digest_s = 0.0
        for bucket in buckets(staged, self.bucket_bytes):
            for name, tensor in src.read([m.name for m in bucket]):
                tensor = staged_form(tensor, engine_dtype)
                if self.digest:
                    t_digest = time.perf_counter()
                    digests[name] = tensor_digest(tensor)  # the trainer's side, on the tensor's device
                    digest_s += time.perf_counter() - t_digest
                staging.write(where[name], tensor, engine_dtype)
        # Workers get target-space names: the drafter's tensors without their prefix.
        entry_groups = [
            (target, [(m.name, m.shape, m.dtype, where[src_name].offset) for t, src_name, m in items if t == target])
            for target, _ in groups
        ]
        ordered = WeightDigest(tuple(m.name for _, _, m in items), tuple(digests[src_name] for _, src_name, _ in items)
                               ) if self.digest else None
        return StagedRefit(
            version=version, path=str(staging.path), total=total, groups=entry_groups, tensors=len(items),
            stage_seconds=time.perf_counter() - t0,
            source=str(source) if isinstance(source, (str, os.PathLike)) else None,
            digests=ordered.values if ordered else (), digest=ordered.digest if ordered else None,
            digest_seconds=digest_s,
        )

    def apply_staged(self, staged: StagedRefit, handles: dict[Member, ShardHandle],
                     in_flight: InFlight) -> dict[Member, tuple[bool, float, str | None]]:
        """Phase 1 then phase 2 on ``handles``; returns member -> (ok, seconds, error). Phase 1:
        every shard reads the staged tensors, nothing changes; a shard that is dead or hung is
        left out, any other failure refuses the refit everywhere (``RefitError``). Phase 2: all
        load at once; a failure there leaves that shard with no version."""
        timeout = self.driver.timeouts.refit_s
        outcome: dict[Member, tuple[bool, float, str | None]] = {}
        checks = self.driver.fan_out(handles, CheckRefit(staged.path, staged.total, staged.entries, timeout,
                                                         staged.digests), _CHECK_MARGIN_S)
        for member, answer in checks.items():
            if answer.ok:
                continue
            if is_mismatch(answer.error):  # this shard's bytes are not the trainer's: it loads nothing
                outcome[member] = (False, 0.0, f"refit to version {staged.version} refused on this shard, "
                                               f"nothing loaded: {answer.error}")
                continue
            if not answer.infra:
                raise RefitError(
                    f"refit refused, no weight was changed: shard {member.label} cannot read the staged "
                    f"weights: {answer.error}"
                )
            outcome[member] = (False, 0.0, f"lost before loading version {staged.version}: {answer.error}")
        loading = {m: h for m, h in handles.items() if m not in outcome}
        loads = self.driver.fan_out(
            loading, LoadRefit(staged.path, staged.total, staged.groups, staged.version, timeout, staged.source,
                               in_flight),
            _LOAD_MARGIN_S,
        )
        for member, answer in loads.items():
            outcome[member] = ((True, answer.value, None) if answer.ok else
                               (False, 0.0, f"refit to version {staged.version} failed: {answer.error}"))
        return outcome

    # -- outcomes ----------------------------------------------------------------------------------

    def settle_outcome(self, report: RefitReport, version: int,
                       outcome: dict[Member, tuple[bool, float, str | None]], may_refuse: bool) -> None:
        """Settle each shard's answer to a load of ``version`` into ``report``. With ``may_refuse``
        (no shard has this version yet): RefitError, nothing settled, when every shard refused the
        bytes as not the trainer's: none loaded any, so the fleet serves on."""
        refused = [error for ok, _, error in outcome.values() if not ok]
        if may_refuse and refused and len(refused) == len(outcome) and all(map(is_mismatch, refused)):
            raise RefitError(f"refit refused, no weight was changed: {refused[0]}")
        for member, (ok, seconds, error) in outcome.items():
            self.settle(report, member, version, None if ok else error, seconds)

    def settle(self, report: RefitReport, member: Member, version: int, error: str | None, seconds: float) -> None:
        """Record one member's refit outcome: a spare that failed is replaced; a slot whose actor
        was replaced meanwhile is left alone (recovery waits for the refit before installing); a
        slot that loaded serves ``version``, one that failed is quarantined (DEAD, and a
        ``ShardLost`` so the self-healing fleet restarts it)."""
        if not error:
            self.members.note_version(member, version)
        if member.is_spare:
            if error:
                self.members.condemn(member, error)  # recovery drops and replaces it
            return
        if not self.members.is_current(member):
            return
        if error:
            # The shard may hold half-loaded weights or none: out of service until restarted and refit.
            self.slots.quarantine(member, error)
            report.shards.append(ShardRefit(member.slot, ok=False, error=error))
            log.warning("shard %d quarantined: %s", member.slot, error)
        else:
            self.slots.record_refit(member, version)
            report.shards.append(ShardRefit(member.slot, ok=True, seconds=seconds))

    # -- newcomers -----------------------------------------------------------------------------------

    def catch_up(self, member: Member, handle: ShardHandle) -> bool:
        """Bring a fresh engine (a replacement slot, or a spare) to the fleet's weight version.
        Returns False when there is no version to catch up to yet (a train-mode fleet before its
        first refit: the shard stays STALE). Raises ``StaleShard`` when the version came from
        live tensors another process pushed, ``ShardDiedError`` when the load fails."""
        if self.weights.version is None:
            return False
        with self.weights.refitting():
            version = self.weights.version
            staged = self.weights.staged
            if handle.info.weight_version == version and staged is None:
                pass  # it loaded the checkpoint at start, and no refit has happened since (eval, v0)
            else:
                if staged is None or staged.version != version:
                    if not self.weights.source:
                        raise self._stale(member, version)
                    # Another process did the last refit (its staging is gone): stage it again.
                    staged = self.stage(self.weights.source, version)
                    self.weights.keep_staged(staged)
                for hook in self.before_catch_up:
                    hook(member, handle)
                # A fresh engine runs nothing: there is no request to keep or cut.
                ok, _, error = self.apply_staged(staged, {member: handle}, _DRAIN)[member]
                if not ok:
                    if not member.is_spare:  # (a spare is not in the table yet)
                        self.slots.quarantine(member, error)
                    raise ShardDiedError(-1 if member.is_spare else member.slot, error)
            handle.info = handle.info.with_version(version)  # not installed yet: Membership does not know it
            for hook in self.after_catch_up:
                hook(member, handle)
            if not member.is_spare:
                self.slots.record_refit(member, version)
        return True

    def _stale(self, member: Member, version: int) -> NemoGenError:
        reason = (
            f"no source for weight version {version} in this process (it came from live tensors "
            "pushed by another process): stays STALE until the next refit"
        )
        if not member.is_spare:
            self.slots.keep_stale(member.slot)  # STALE, with the reason on record
        log.warning("shard %s: %s", member.label, reason)
        return StaleShard(reason)

