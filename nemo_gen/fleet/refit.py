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
import time
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
    cache = fleet._manifest_cache
    if target not in cache:
        shard = fleet._shards[_targets(fleet)[0]]
        cache[target] = ray.get(shard.actor.expected_manifest.remote(target), timeout=120)
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


def run_refit(fleet: "GenerationFleet", source: Any, version: int | None) -> RefitReport:
    import torch

    settings = fleet.settings.refit
    src = as_source(source)
    new_version = next_version(fleet.weight_version, version)
    targets = _targets(fleet)
    engine_dtype = getattr(torch, fleet.engine_dtype)
    # Floating tensors are staged in the engine's dtype, so the check compares like with like.
    metas = [
        TensorMeta(m.name, m.shape, fleet.engine_dtype if _is_float(m.dtype) else m.dtype) for m in src.manifest()
    ]
    groups = _check(fleet, metas)

    # Stage: one copy per node, bucket by bucket, into reused shared-memory pages. Tensors are
    # placed under their source names (a drafter's "draft.x" and the policy's "x" both exist).
    t0 = time.perf_counter()
    items = [
        (target, (DRAFT_PREFIX + m.name) if target == "draft" else m.name, m) for target, group in groups for m in group
    ]
    staged = [TensorMeta(src_name, m.shape, m.dtype) for _, src_name, m in items]
    placed, total = layout(staged)
    where = {p.name: p for p in placed}
    staging = fleet.staging()
    staging.ensure(total)
    for bucket in buckets(staged, settings.bucket_bytes):
        for name, tensor in src.read([m.name for m in bucket]):
            staging.write(where[name], tensor, engine_dtype)
    stage_s = time.perf_counter() - t0
    # Workers get target-space names: the drafter's tensors without their prefix.
    entry_groups = [
        (target, [(m.name, m.shape, m.dtype, where[src_name].offset) for t, src_name, m in items if t == target])
        for target, _ in groups
    ]
    all_entries = [e for _, entries in entry_groups for e in entries]

    # Phase 1: every shard reads the staged tensors; nothing changes yet. A shard that is dead
    # or hung is condemned and left out; any other failure refuses the refit everywhere.
    t1 = time.perf_counter()
    path = str(staging.path)
    report = RefitReport(version=new_version, bytes=total, tensors=len(items), stage_seconds=stage_s, load_seconds=0.0)
    checks = {i: fleet._shards[i].actor.check_refit.remote(path, total, all_entries, settings.timeout_s) for i in targets}
    for i, ref in checks.items():
        try:
            ray.get(ref, timeout=settings.timeout_s)
        except Exception as exc:
            if not is_retriable(exc):
                raise RefitError(
                    f"refit refused, no weight was changed: shard {i} cannot read the staged weights: {root_cause(exc)}"
                ) from None
            _quarantine(fleet, report, i, f"lost before loading version {new_version}: {root_cause(exc)}")
    targets = [i for i in targets if i not in {s.shard for s in report.shards}]

    # Phase 2: load everywhere at once.
    loads = {
        i: fleet._shards[i].actor.load_refit.remote(path, total, entry_groups, new_version, settings.timeout_s)
        for i in targets
    }
    for i, ref in loads.items():
        try:
            seconds = ray.get(ref, timeout=settings.timeout_s + 60)
        except Exception as exc:
            _quarantine(fleet, report, i, f"refit to version {new_version} failed: {root_cause(exc)}")
            continue
        fleet.health.report_refit(i, new_version)
        report.shards.append(ShardRefit(i, ok=True, seconds=seconds))
    report.load_seconds = time.perf_counter() - t1
    if any(s.ok for s in report.shards):
        fleet.weight_version = new_version
    return report


def _quarantine(fleet: "GenerationFleet", report: RefitReport, shard: int, reason: str) -> None:
    """The shard may hold half-loaded weights or none: it leaves serving until restarted and refit."""
    fleet.health.mark_dead(shard, reason)
    report.shards.append(ShardRefit(shard, ok=False, error=reason))
    log.warning("shard %d quarantined: %s", shard, reason)


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))
