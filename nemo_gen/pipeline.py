"""The generation pipeline's steps as plain functions, and the whole pipeline without Prefect.

Each Prefect task in ``tasks/`` is a thin call into one of these; ``run_pipeline`` chains
them directly, which is what a library user (or the benchmark's baseline) gets with no
orchestrator at all.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from nemo_gen import progress
from nemo_gen.core.results import GenerationResult
from nemo_gen.jsonl import PromptLine, read_prompts, result_row, write_jsonl
from nemo_gen.errors import InfraError
from nemo_gen.settings import NemoGenSettings


def load_prompts(settings: NemoGenSettings) -> list[PromptLine]:
    """The prompts to run: ``run.input`` when set, else the built-in ones."""
    if settings.run.input is not None:
        return read_prompts(settings.run.input)
    return [PromptLine(line=i + 1, prompt=p, record={"prompt": p}) for i, p in enumerate(settings.run.prompts)]


def generate_lines(fleet, lines: Sequence[PromptLine], batch_size: int, **sampling: Any) -> list[GenerationResult | None]:
    """Generate every valid line, ``batch_size`` at a time, reporting progress between batches.
    Malformed lines get ``None`` (their error travels with the line)."""
    valid = [i for i, line in enumerate(lines) if line.error is None]
    out: list[GenerationResult | None] = [None] * len(lines)
    progress.emit("generate", done=0, total=len(valid))
    for start in range(0, len(valid), batch_size):
        chunk = valid[start : start + batch_size]
        results = fleet.generate([lines[i].prompt for i in chunk], **sampling)
        for i, result in zip(chunk, results):
            out[i] = result
        progress.emit("generate", done=min(start + batch_size, len(valid)), total=len(valid))
    return out


def initial_refit(fleet, settings: NemoGenSettings) -> dict[str, Any] | None:
    """Train mode: engines started on dummy weights; load the real ones before any request.
    Returns the refit report (as JSON), or None in eval mode (engines loaded the checkpoint)."""
    if settings.is_eval():
        return None
    progress.emit("step", name="refit", status="running")
    report = fleet.refit(fleet.resolved.model_dir)
    if not report.ok:
        raise InfraError(f"initial refit failed on shards {[s.shard for s in report.failed]}: {report.failed[0].error}")
    progress.emit("refit", **report.to_json())
    return report.to_json()


def default_output(settings: NemoGenSettings, name: str) -> Path:
    if settings.run.output is not None:
        return Path(settings.run.output)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return settings.home / "outputs" / f"{name}-{stamp}.jsonl"


def write_outputs(lines: Sequence[PromptLine], results: Sequence[GenerationResult | None], path: Path) -> Path:
    rows = [result_row(line, result, line.error) for line, result in zip(lines, results)]
    return write_jsonl(path, rows)


def summarize(fleet, lines: Sequence[PromptLine], results: Sequence[GenerationResult | None], path: Path, seconds: float) -> dict[str, Any]:
    done = [r for r in results if r is not None]
    ok = [r for r in done if r.ok]
    tokens = sum(len(r.token_ids) for r in ok)
    per_shard: dict[int, dict[str, int]] = {}
    for r in ok:
        entry = per_shard.setdefault(r.shard, {"requests": 0, "tokens": 0})
        entry["requests"] += 1
        entry["tokens"] += len(r.token_ids)
    return {
        "shards": len(fleet.shards),
        "requests": len(lines),
        "completed": len(ok),
        "failed": len(lines) - len(ok),
        "errors": [
            {"line": line.line, "error": line.error or (result.error if result else None)}
            for line, result in zip(lines, results)
            if line.error or (result is not None and not result.ok)
        ],
        "generated_tokens": tokens,
        "generate_seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "weight_versions": sorted({r.weight_version for r in ok if r.weight_version is not None}),
        "per_shard": {str(k): v for k, v in sorted(per_shard.items())},
        "output": str(path),
    }


def run_pipeline(settings: NemoGenSettings, name: str = "run") -> dict[str, Any]:
    """Every step, in order, as plain calls: the pipeline with no orchestrator."""
    from nemo_gen.environment import configure_environment
    from nemo_gen.fleet.cluster import cluster_resources, init_ray, shutdown_ray
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import resolve_generation
    from nemo_gen.policies import shard_driver

    lines = load_prompts(settings)  # a bad input file fails before anything starts
    configure_environment(settings)
    conn = init_ray(settings.ray)
    fleet = None
    try:
        resolved = resolve_generation(settings, cluster_resources())
        driver = shard_driver(settings)
        handles = driver.launch_all(resolved.shards, progress.shard_event)
        fleet = GenerationFleet(resolved, handles, ray_connection=conn if conn.owned else None, driver=driver)
        refit = initial_refit(fleet, settings)
        t0 = time.perf_counter()
        results = generate_lines(fleet, lines, settings.run.batch_size)
        seconds = time.perf_counter() - t0
        path = write_outputs(lines, results, default_output(settings, name))
        return {**summarize(fleet, lines, results, path, seconds), "refit": refit}
    finally:
        if fleet is not None:
            fleet.shutdown()
        elif conn.owned:
            shutdown_ray(conn)
