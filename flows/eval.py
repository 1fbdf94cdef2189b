"""``eval``: generation over a prompt file, pinned to one weight version — what a nightly cron
schedule runs. It refuses to start (a clear error naming ``weight_version``) unless the fleet
serves exactly that version, and fails if a refit changes the version under it."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.generate import run_generation, settings_for
from flows.params import EvalParams, checked


@flow(name="eval")
def evaluate(
    input: str,
    weight_version: int,
    output: str | None = None,
    batch_size: int | None = None,
    max_new_tokens: int | None = None,
    config: str | None = None,
    overrides: list[str] | None = None,
    resume: bool = False,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Generate over ``input`` at exactly ``weight_version``; returns the run summary. ``resume``:
    continue a killed run's ``output``; ``overwrite``: replace an earlier run's."""
    _, settings = checked(EvalParams, dict(input=input, weight_version=weight_version, output=output,
                                           batch_size=batch_size, max_new_tokens=max_new_tokens,
                                           config=config, overrides=overrides, resume=resume,
                                           overwrite=overwrite), "eval", settings_for)
    return run_generation(settings, f"eval-v{weight_version}", pinned_version=weight_version)
