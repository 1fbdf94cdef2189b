"""The driver's side of a refit: check, stage, verify on every shard, then load.

Phase 0 (driver): the source's manifest is checked against the engine's own (names, shapes,
dtypes; ``draft.`` names against the drafter) — a bad checkpoint is refused before a byte
moves. Then the tensors are staged, bucket by bucket, into the fleet's shared-memory file.
Phase 1 (every shard): each shard's workers open the staged tensors; any failure refuses the
refit fleet-wide, and no shard has changed. Phase 2 (every shard, in parallel): load. A shard
that fails here is condemned (it holds half-loaded weights and never serves again until it
is restarted and refit); the others serve the new version.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray

from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.refit import (
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
from nemo_gen.core.retry import is_retriable
from nemo_gen.fleet.shard import root_cause
from nemo_gen.refit.sources import as_source

if TYPE_CHECKING:  # pragma: no cover
    from nemo_gen.fleet.fleet import GenerationFleet

log = logging.getLogger(__name__)

# Shards that hold an engine and can take weights: serving ones, and STALE ones (a train-mode
# fleet before its first refit, or a replacement) — which a refit re-admits.
_REFITTABLE = (ShardState.HEALTHY, ShardState.SUSPECT, ShardState.STALE)


def _expected(fleet: "GenerationFleet", target: str) -> dict[str, Any]:
    """The engine's own manifest for ``target`` (cached: every shard runs the same model).
    Asked of each refittable shard in turn, so a shard lost right now does not fail the refit."""
    cache = fleet._manifest_cache
    if target not in cache:
        errors = []
        for index in _targets(fleet):
            try:
                cache[target] = ray.get(
                    fleet._shards[index].actor.expected_manifest.remote(target), timeout=fleet.settings.refit.timeout_s
                )
                break
            except Exception as exc:
                if not is_retriable(exc):
                    raise
                errors.append(f"shard {index}: {root_cause(exc)}")
        else:
            raise RefitError(f"no shard could describe its weights: {'; '.join(errors)}")
    return cache[target]


def _targets(fleet: "GenerationFleet") -> list[int]:
    targets = [s.dp_shard_idx for s in fleet.health.snapshot() if s.state in _REFITTABLE]
    if not targets:
        raise RefitError(f"no shard can take a refit; fleet state is {fleet.health.state_summary()}")
    return targets


def _check(fleet: "GenerationFleet", metas: list[TensorMeta]) -> list[tuple[str, list[TensorMeta]]]:
    """Check the manifest against the engine; return (target, tensors) groups to load."""
    policy, draft = split_draft(metas)
    groups: list[tuple[str, list[TensorMeta]]] = []
    gen_cfg = fleet.resolved.generation_config
    if policy:
        exp = _expected(fleet, "policy")
        check_manifest(_metas(exp), policy, optional=exp["optional"], what="model")
        groups.append(("policy", policy))
    if draft:
        exp = _expected(fleet, "draft")
        if not exp["available"]:
            raise RefitError(
                f"the refit carries {len(draft)} '{DRAFT_PREFIX}' tensors but the engines run no "
                "draft model (generation.vllm_kwargs.speculative_config)"
            )
        full = bool(gen_cfg.get("_draft_full_refit"))
        check_manifest(_metas(exp), draft, optional=exp["optional"], partial=not full, what="draft model")
        groups.append(("draft", draft))
    elif gen_cfg.get("_draft_full_refit"):
        raise RefitError(
            f"_draft_full_refit is set (draft_full_refit_enabled) but the refit has no '{DRAFT_PREFIX}' tensors"
        )
    if not groups:
        raise RefitError("the weight source is empty")
    return groups


def _metas(expected: dict[str, Any]) -> dict[str, TensorMeta]:
    return {name: TensorMeta.of(name, shape, dtype) for name, (shape, dtype) in expected["tensors"].items()}


@dataclass
class StagedRefit:
    """A refit's bytes in the staging file and the metadata the shards need to load them.
    Kept by the fleet after a refit succeeds: a replacement or spare catches up from it."""

    version: int
    path: str
    total: int
    groups: list  # (target, [(name, shape, dtype, offset)]) in load order
    tensors: int
    stage_seconds: float
    source: str | None  # the checkpoint directory, when the weights came from one

    @property
    def entries(self) -> list:
        return [e for _, entries in self.groups for e in entries]


def run_refit(fleet: "GenerationFleet", source: Any, version: int | None) -> RefitReport:
    with fleet.refit_lock:
        new_version = next_version(fleet.weight_version, version)
        targets = _targets(fleet)
        staged = stage(fleet, source, new_version)
        report = RefitReport(
            version=new_version, bytes=staged.total, tensors=staged.tensors,
            stage_seconds=staged.stage_seconds, load_seconds=0.0,
        )
        t1 = time.perf_counter()
        handles = refit_members(fleet, targets)
        outcome = apply_staged(fleet.settings.refit.timeout_s, staged, handles)
        for key, (ok, seconds, error) in outcome.items():
            settle(fleet, report, key, handles[key].name, new_version, None if ok else error, seconds)
        report.load_seconds = time.perf_counter() - t1
        if any(s.ok for s in report.shards):
            fleet.record_weights(new_version, staged.source)
            fleet.staged_refit = staged
        return report


def refit_members(fleet: "GenerationFleet", targets: list[int] | None = None) -> dict[Any, Any]:
    """Who takes a refit: slot -> handle for each refittable shard (``targets``, default all),
    and ("spare", name) -> handle for each warm spare — so one can serve the moment it is
    promoted."""
    handles: dict[Any, Any] = {i: fleet._shards[i] for i in (_targets(fleet) if targets is None else targets)}
    handles.update({("spare", h.name): h for h in fleet.spare_handles()})
    return handles


def settle(fleet: "GenerationFleet", report: RefitReport, key: Any, name: str, version: int,
           error: str | None, seconds: float) -> None:
    """Record one member's refit outcome: a spare that failed is replaced; a slot whose actor
    ``name`` was replaced meanwhile is left alone (recovery waits for the refit before
    installing); a slot that loaded serves ``version``, one that failed is quarantined."""
    if isinstance(key, tuple):
        if error:
            fleet.drop_spare(key[1], error)
        return
    if not fleet.is_current(key, name):
        return
    if error:
        _quarantine(fleet, report, key, error)
    else:
        fleet.health.report_refit(key, version)
        report.shards.append(ShardRefit(key, ok=True, seconds=seconds))


def stage(fleet: "GenerationFleet", source: Any, version: int) -> StagedRefit:
    """Check the source's manifest against the engine's, then copy its tensors into the
    fleet's staging file (one copy per node). Raises ``RefitError`` before a byte moves."""
    import torch

    settings = fleet.settings.refit
    src = as_source(source)
    engine_dtype = getattr(torch, fleet.engine_dtype)
    # Floating tensors are staged in the engine's dtype, so the check compares like with like.
    metas = [
        TensorMeta(m.name, m.shape, fleet.engine_dtype if is_floating(m.dtype) else m.dtype) for m in src.manifest()
    ]
    groups = _check(fleet, metas)

    # Bucket by bucket into reused shared-memory pages. Tensors are placed under their source
    # names (a drafter's "draft.x" and the policy's "x" both exist).
    t0 = time.perf_counter()
    items = [
        (target, (DRAFT_PREFIX + m.name) if target == "draft" else m.name, m) for target, group in groups for m in group
    ]
    staged = [TensorMeta(src_name, m.shape, m.dtype) for _, src_name, m in items]
    placed, total = layout(staged)
    where = {p.name: p for p in placed}
    staging = fleet.staging()
    fleet.staged_refit = None  # the file no longer holds the current version's bytes
    staging.ensure(total)
    for bucket in buckets(staged, settings.bucket_bytes):
        for name, tensor in src.read([m.name for m in bucket]):
            staging.write(where[name], tensor, engine_dtype)
    # Workers get target-space names: the drafter's tensors without their prefix.
    entry_groups = [
        (target, [(m.name, m.shape, m.dtype, where[src_name].offset) for t, src_name, m in items if t == target])
        for target, _ in groups
    ]
    return StagedRefit(
        version=version,
        path=str(staging.path),
        total=total,
        groups=entry_groups,
        tensors=len(items),
        stage_seconds=time.perf_counter() - t0,
        source=str(source) if isinstance(source, (str, os.PathLike)) else None,
    )


def apply_staged(timeout_s: float, staged: StagedRefit, handles: dict[Any, Any]) -> dict[Any, tuple[bool, float, str | None]]:
    """Phase 1 then phase 2 on ``handles`` (key -> ShardHandle); returns key -> (ok, seconds,
    error). Phase 1: every shard reads the staged tensors, nothing changes; a shard that is dead
    or hung is left out, any other failure refuses the refit everywhere (``RefitError``).
    Phase 2: all load at once; a failure there leaves that shard with no version."""
    outcome: dict[Any, tuple[bool, float, str | None]] = {}
    checks = {
        k: h.actor.check_refit.remote(staged.path, staged.total, staged.entries, timeout_s) for k, h in handles.items()
    }
    for key, ref in checks.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except Exception as exc:
            if not is_retriable(exc):
                raise RefitError(
                    f"refit refused, no weight was changed: shard {_label(key)} cannot read the staged "
                    f"weights: {root_cause(exc)}"
                ) from None
            outcome[key] = (False, 0.0, f"lost before loading version {staged.version}: {root_cause(exc)}")
    loads = {
        k: h.actor.load_refit.remote(staged.path, staged.total, staged.groups, staged.version, timeout_s, staged.source)
        for k, h in handles.items()
        if k not in outcome
    }
    for key, ref in loads.items():
        try:
            outcome[key] = (True, ray.get(ref, timeout=timeout_s + 60), None)
        except Exception as exc:
            outcome[key] = (False, 0.0, f"refit to version {staged.version} failed: {root_cause(exc)}")
    return outcome


def _label(key: Any) -> str:
    return key[1] if isinstance(key, tuple) else str(key)


def _quarantine(fleet: "GenerationFleet", report: RefitReport, shard: int, reason: str) -> None:
    """The shard may hold half-loaded weights or none: it leaves serving until restarted and refit."""
    fleet.health.mark_dead(shard, reason)
    report.shards.append(ShardRefit(shard, ok=False, error=reason))
    log.warning("shard %d quarantined: %s", shard, reason)
