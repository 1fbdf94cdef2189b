"""Flow parameters of the deployments: pydantic models, per-field errors, allowed paths.

Prefect already checks parameter *types* against the flow signature when a run is created
(``prefect deployment run ... --param``). These models add what a signature cannot say (ranges,
files that must exist) and report every bad field at once, by name. Paths are checked against
``prefect.allowed_paths`` (empty: the current directory and ``home``) only for runs of a
deployment: a parameter there comes from whoever can reach the API or edit a schedule, while a
person at a terminal (``nemo-gen refit --checkpoint``) already has their own filesystem.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")

    config: str | None = Field(None, description="settings YAML for the fleet")
    overrides: list[str] = Field(default_factory=list, description="dotted.key=value settings overrides")

    @field_validator("overrides", mode="before")
    @classmethod
    def _none_is_empty(cls, value: Any) -> Any:
        return [] if value is None else value

    #: parameter names that hold filesystem paths (checked against allowed paths)
    path_fields: ClassVar[tuple[str, ...]] = ("config",)


class FleetParams(_Params):
    """fleet-up / fleet-down."""


class GenerateParams(_Params):
    input: str = Field(..., min_length=1, description="JSONL of prompts")
    output: str | None = Field(None, description="JSONL to write; unset: <home>/outputs/<flow>-<time>.jsonl")
    batch_size: int | None = Field(None, ge=1, description="prompts in flight at once (run.batch_size)")
    max_new_tokens: int | None = Field(None, ge=1, description="tokens to generate per prompt")
    resume: bool = Field(False, description="keep the lines `output` already holds (a killed run's) and "
                                            "generate only the rest (run.resume)")

    path_fields: ClassVar[tuple[str, ...]] = ("config", "input", "output")


class EvalParams(GenerateParams):
    weight_version: int = Field(..., ge=0, description="the weight version this eval is pinned to")


class RefitParams(_Params):
    checkpoint: str = Field(..., min_length=1, description="HF safetensors checkpoint directory")
    version: int | None = Field(None, ge=0, description="weight version to install")
    in_flight: Literal["drain", "abort", "keep"] | None = Field(
        None, description="what the refit does to running requests (default: refit.in_flight)")

    path_fields: ClassVar[tuple[str, ...]] = ("config", "checkpoint")


PARAMS: dict[str, type[_Params]] = {
    "fleet-up": FleetParams,
    "fleet-down": FleetParams,
    "generate": GenerateParams,
    "eval": EvalParams,
    "refit": RefitParams,
}


def validate_params(model: type[_Params], values: Mapping[str, Any], flow: str,
                    allow_missing: bool = False) -> _Params | None:
    """``model`` built from ``values``, or a ConfigError listing every bad parameter by name.
    ``allow_missing``: check only what is given (a deployment's defaults may leave a required
    parameter to each run); returns None then if something is missing."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if allow_missing and err["type"] == "missing":
                continue
            name = ".".join(str(p) for p in err["loc"]) or "(parameters)"
            msg = "unknown parameter" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append((name, msg))
        if not problems:
            return None
        err = ConfigError(f"invalid parameters for flow {flow!r}: " + "; ".join(f"{n}: {m}" for n, m in problems),
                          field=None)
        err.field = problems[0][0]
        err.fields = [n for n, _ in problems]  # type: ignore[attr-defined]
        raise err from None


def allowed_roots(settings: NemoGenSettings, base: Path | None = None) -> list[Path]:
    """The directories path parameters may point into; relative ones are taken from ``base``
    (default: the current directory, where a deployment's run starts: the repository root)."""
    base = base or Path.cwd()
    roots = settings.prefect.allowed_paths or [base, settings.home]
    return [_real(r, base) for r in roots]


def _real(path: str | Path, base: Path) -> Path:
    return Path(os.path.realpath(base / Path(path).expanduser()))


def check_allowed_paths(values: _Params | Mapping[str, Any], settings: NemoGenSettings,
                        base: Path | None = None, fields: tuple[str, ...] | None = None) -> None:
    """Raise ConfigError naming the first path parameter that resolves outside the allowed roots.
    Symlinks and ``..`` are resolved first, so neither can step outside."""
    base = base or Path.cwd()
    roots = allowed_roots(settings, base)
    if isinstance(values, _Params):
        fields, values = values.path_fields, values.model_dump()
    for name in fields or ():
        value = values.get(name)
        if value is None:
            continue
        real = _real(value, base)
        if not any(real == root or root in real.parents for root in roots):
            raise ConfigError(
                f"{value!r} is outside the allowed paths {[str(r) for r in roots]} "
                "(set prefect.allowed_paths to allow it)",
                field=f"parameter {name}",
            )


def in_deployment() -> bool:
    """True inside a flow run created from a deployment (a worker runs it)."""
    from prefect.runtime import deployment

    return deployment.id is not None


def checked(model: type[_Params], values: Mapping[str, Any], flow: str,
            settings_for=None) -> tuple[_Params, NemoGenSettings]:
    """Validate the parameters, load the settings they name, and — for a deployment's run —
    check every path parameter against the allowed paths. Nothing is started before this."""
    params = validate_params(model, values, flow)
    settings = (settings_for or _settings)(params)
    if in_deployment():
        check_allowed_paths(params, settings)
    return params, settings


def _settings(params: _Params) -> NemoGenSettings:
    return NemoGenSettings.load(params.config, params.overrides)


def fleet_settings(config: str | None, overrides: list[str] | None, flow: str) -> NemoGenSettings:
    """Settings of a flow that acts on a long-lived fleet (fleet-up, fleet-down, heal): its
    parameters checked, and a Ray cluster that outlives the run required."""
    _, settings = checked(FleetParams, dict(config=config, overrides=overrides), flow)
    require_ray_address(settings)
    return settings


def require_ray_address(settings: NemoGenSettings) -> None:
    """A fleet that outlives one run needs a Ray cluster that does too."""
    if settings.ray.address is None:
        raise ConfigError(
            "a fleet that outlives one command needs a Ray cluster that does too: start one with "
            "deployments/ray/start-node.sh and set ray.address (e.g. --set ray.address=auto)",
            field="ray.address",
        )
