"""Flow parameters of the deployments: pydantic models, per-field errors, and the checks a run
passes before anything starts.

Prefect already checks parameter *types* against the flow signature when a run is created
(``prefect deployment run ... --param``). These models add what a signature cannot say (ranges,
files that must exist) and report every bad field at once, by name. For runs of a deployment the
parameters are untrusted (``flows.trust``: the keys ``overrides`` may set, every path against
``prefect.allowed_paths``): a parameter there comes from whoever can reach the API or edit a
schedule, while a person at a terminal (``nemo-gen refit --checkpoint``) already has their own
filesystem.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from flows.trust import allowed_roots, check_allowed_paths, check_job_variables, deployment_settings
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings

__all__ = ["PARAMS", "allowed_roots", "check_allowed_paths", "checked", "fleet_settings", "validate_params"]


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
    overwrite: bool = Field(False, description="replace an `output` that already holds rows (run.overwrite); "
                                               "unset, such an output is refused before anything starts")

    path_fields: ClassVar[tuple[str, ...]] = ("config", "input", "output")


class EvalParams(GenerateParams):
    weight_version: int = Field(..., ge=0, description="the weight version this eval is pinned to")


class RefitParams(_Params):
    checkpoint: str = Field(..., min_length=1, description="HF safetensors checkpoint directory")
    version: int | None = Field(None, ge=0, description="weight version to install")
    in_flight: Literal["drain", "abort", "keep"] | None = Field(
        None, description="what the refit does to running requests (default: refit.in_flight)")

    path_fields: ClassVar[tuple[str, ...]] = ("config", "checkpoint")


class PipelineParams(_Params):
    """generation-pipeline (not in deployments/prefect.yaml; checked all the same if deployed)."""

    # names the default output file, <home>/outputs/<name>-<time>.jsonl: no separator, no dot first
    name: str = Field("run", pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$", max_length=100,
                      description="run name, in the default output's file name")


PARAMS: dict[str, type[_Params]] = {
    "fleet-up": FleetParams,
    "fleet-down": FleetParams,
    "generate": GenerateParams,
    "eval": EvalParams,
    "refit": RefitParams,
    "generation-pipeline": PipelineParams,
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


def in_deployment() -> bool:
    """True inside a flow run created from a deployment (a worker runs it)."""
    from prefect.runtime import deployment

    return deployment.id is not None


def run_job_variables() -> dict[str, Any]:
    """The Prefect job variables this flow run was created with ({} outside a flow run)."""
    from prefect.runtime import flow_run

    return dict(flow_run.job_variables or {})


def checked(model: type[_Params], values: Mapping[str, Any], flow: str,
            settings_for=None, deployment: bool | None = None) -> tuple[_Params, NemoGenSettings]:
    """Validate the parameters and load the settings they name; for a deployment's run
    (``deployment``; unset: ``in_deployment()``) with ``flows.trust``'s checks — the run's job
    variables, override keys, path parameters, config files, resolved paths. Nothing is started
    before this."""
    if deployment is None:
        deployment = in_deployment()
    if deployment:
        check_job_variables(run_job_variables())
    params = validate_params(model, values, flow)
    load = settings_for or _settings
    return params, deployment_settings(params, load) if deployment else load(params)


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
