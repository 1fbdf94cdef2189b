"""``generate``: a JSONL file of prompts through the running fleet, JSONL out — the deployment
counterpart of ``nemo-gen generate``. ``run_generation`` is shared with ``eval``.

Parameters: ``input`` (JSONL), ``output`` (unset: ``<home>/outputs/generate-<time>.jsonl``),
``batch_size``, ``max_new_tokens``, ``config``, ``overrides``, ``resume``, ``overwrite``.
Malformed lines are reported in the output and the summary; the other lines are still
generated. Each line is written to ``output`` as it finishes (``pipeline.generate_lines``);
``resume`` (``run.resume``) keeps the lines a killed run left there and generates the rest;
``overwrite`` (``run.overwrite``) replaces an earlier run's output, which is otherwise refused.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import flow

from flows.artifacts import progress_artifact, publish_fleet_health, publish_throughput
from flows.params import GenerateParams, checked
from nemo_gen import pipeline
from nemo_gen.errors import DataError
from nemo_gen.settings import NemoGenSettings
from tasks import fleet as fleet_tasks
from tasks import lifecycle
from tasks import setup as setup_tasks


def settings_for(params: GenerateParams) -> NemoGenSettings:
    """The run's settings: its config and overrides, then the parameters that map onto settings."""
    extra = [f"run.input={json.dumps(params.input)}"]
    if params.output is not None:
        extra.append(f"run.output={json.dumps(params.output)}")
    if params.batch_size is not None:
        extra.append(f"run.batch_size={params.batch_size}")
    if params.max_new_tokens is not None:
        extra.append(f"generation.max_new_tokens={params.max_new_tokens}")
    if params.resume:
        extra.append("run.resume=true")
    if params.overwrite:
        extra.append("run.overwrite=true")
    return NemoGenSettings.load(params.config, [*params.overrides, *extra])


def run_generation(settings: NemoGenSettings, name: str, pinned_version: int | None = None) -> dict[str, Any]:
    """read prompts -> attach -> (pinned: check the version) -> generate with a progress
    artifact -> write JSONL -> publish throughput and fleet health -> detach."""
    lines = fleet_tasks.load_prompts(settings)  # a bad file fails before anything is attached
    pipeline.resumable(settings, lines)  # so does a bad output to resume (run.resume)
    settings = pipeline.with_output(settings, name)  # each line is written there as it finishes
    setup_tasks.configure_environment(settings)
    fleet = lifecycle.attach(settings)
    try:
        if pinned_version is not None:
            lifecycle.check_weight_version(fleet, pinned_version)
        valid = sum(1 for line in lines if line.error is None)
        with progress_artifact(f"{name}: {valid} prompts on fleet {settings.fleet.name!r}"):
            t0 = time.perf_counter()
            results = fleet_tasks.generate(fleet, lines, settings.run.batch_size)
            seconds = time.perf_counter() - t0
        path = fleet_tasks.write_outputs(lines, results, settings.run.output)
        summary = pipeline.summarize(fleet, lines, results, path, seconds)
        publish_throughput(summary)
        publish_fleet_health(settings.fleet.name, fleet.status())
    finally:
        fleet.detach()
    if pinned_version is not None and summary["weight_versions"] not in ([], [pinned_version]):
        # A refit landed mid-run: these samples are not the pinned model's.
        raise DataError(f"pinned to weight version {pinned_version} but results came from versions "
                        f"{summary['weight_versions']} (a refit ran during the eval); output: {path}")
    return summary


@flow(name="generate")
def generate(
    input: str,
    output: str | None = None,
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Generate over ``input`` on the running fleet; returns the run summary. ``resume``: continue
    the killed or interrupted run whose ``output`` this is (its finished lines are kept);
    ``overwrite``: replace an ``output`` that holds an earlier run's rows (else it is refused)."""
    _, settings = checked(GenerateParams, dict(input=input, output=output, batch_size=batch_size,
                                               max_new_tokens=max_new_tokens, config=config,
                                               overrides=overrides, resume=resume, overwrite=overwrite),
                          "generate", settings_for)
    return run_generation(settings, "generate")
