"""``NemoGenSettings``, the root of all settings, and how it is loaded: the YAML source (a
document ``load`` parsed), the ``NEMO_GEN_*`` environment source that keeps the case of
``generation.vllm_cfg.env_vars`` keys, overrides (``parse_override``), the cross-section checks,
and the mapping of pydantic's errors onto one ``ConfigError`` naming every dotted field.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from pydantic import BaseModel, Field, PrivateAttr, ValidationError, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from nemo_gen.core.modes import RefitMode
from nemo_gen.errors import ConfigError
from nemo_gen.settings.base import ENV_PREFIX, GPU_SHARE_HEADROOM, invalid, invalid_keys
from nemo_gen.settings.fleet import FleetSettings, HealthSettings, RefitSettings
from nemo_gen.settings.generation import ColocatedCfg, GenerationSettings, ModelSettings, VllmCfg
from nemo_gen.settings.runtime import PrefectSettings, RaySettings, RunSettings
from nemo_gen.settings.server import ServerSettings

log = logging.getLogger(__name__)


class _YamlSource(PydanticBaseSettingsSource):
    """Feeds the YAML document ``load`` parsed (held in a context variable for one call)."""

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _YAML_DATA.get()


_YAML_DATA: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("_YAML_DATA", default={})
# What ``load`` set aside as not used, for the settings object it builds.
_NOT_USED: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("_NOT_USED", default=[])


class _EnvKeepingCase(PydanticBaseSettingsSource):
    """The ``NEMO_GEN_*`` environment as pydantic-settings reads it, but with the keys of
    ``generation.vllm_cfg.env_vars`` as written: the reader lowercases every variable's name
    before splitting it at ``__`` (the sections' names need that), and an environment variable's
    name is case-sensitive."""

    KEPT = (("generation", "vllm_cfg", "env_vars"),)

    def __init__(self, settings_cls: type[BaseSettings], inner: PydanticBaseSettingsSource):
        super().__init__(settings_cls)
        self.inner = inner

    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        data = self.inner()
        for path in self.KEPT:
            prefix = (ENV_PREFIX + "__".join(path) + "__").lower()
            written: dict[str, str] = {}
            for name in os.environ:
                if name.lower().startswith(prefix):
                    key = name[len(prefix):]
                    other = written.setdefault(key.lower(), key)
                    if other != key:
                        raise ConfigError(f"{name[:len(prefix)]}{other} and {name} set one key: the environment "
                                          "is read without regard to case", field=".".join((*path, key)))
            target: Any = data
            for part in path[:-1]:
                target = target.get(part) if isinstance(target, dict) else None
            if isinstance(target, dict) and isinstance(target.get(path[-1]), dict):
                target[path[-1]] = {written.get(k, k): v for k, v in target[path[-1]].items()}
        return data


class NemoGenSettings(BaseSettings):
    """Root of all settings. Build it with ``NemoGenSettings.load(...)``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
        nested_model_default_partial_update=True,
    )

    home: Path = Field(
        Path(".nemo-gen"),
        description="Working directory for the tiny model, the managed Prefect server, outputs and the "
        "trajectory gateway's sessions (server.sessions_dir).",
    )
    model: ModelSettings = Field(default_factory=ModelSettings, description="The model to serve.")
    generation: GenerationSettings = Field(
        default_factory=GenerationSettings, description="NeMo-RL generation config."
    )
    fleet: FleetSettings = Field(default_factory=FleetSettings, description="Fleet shape.")
    health: HealthSettings = Field(default_factory=HealthSettings, description="Fleet health policy.")
    refit: RefitSettings = Field(default_factory=RefitSettings, description="Weight refit.")
    ray: RaySettings = Field(default_factory=RaySettings, description="Ray cluster.")
    prefect: PrefectSettings = Field(default_factory=PrefectSettings, description="Prefect API.")
    run: RunSettings = Field(default_factory=RunSettings, description="`nemo-gen run` inputs/outputs.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="The OpenAI-compatible HTTP server.")

    _not_used: list[Any] = PrivateAttr(default_factory=list)

    def model_post_init(self, context: Any) -> None:
        self._not_used = list(_NOT_USED.get())

    @model_validator(mode="after")
    def _model_from_generation_model_name(self) -> "NemoGenSettings":
        """NeMo-RL loads ``generation.model_name``; so does nemo_gen when ``model.path`` is unset."""
        if self.model.path is None and self.generation.model_name:
            self.model.path = Path(self.generation.model_name)
        return self

    @model_validator(mode="after")
    def _check_recompute_kv(self) -> "NemoGenSettings":
        """Only ``keep`` leaves requests running on KV from older weights: elsewhere
        ``refit.recompute_kv`` could not act."""
        if self.refit.recompute_kv and self.refit.in_flight is not RefitMode.KEEP:
            raise invalid(type(self).__name__, ("refit", "recompute_kv"), True, "recompute_kv",
                          "refit.recompute_kv re-computes the KV of requests a refit kept running, but "
                          "refit.in_flight is {mode}, which keeps none; set refit.in_flight=keep",
                          {"mode": self.refit.in_flight})
        return self

    @model_validator(mode="after")
    def _check_rollout(self) -> "NemoGenSettings":
        """``refit.wave_size`` / ``refit.min_serving`` act only in waves, and only where a wave can move."""
        from nemo_gen.core.waves import rollout_problem

        r = self.refit
        problem = rollout_problem(r.rollout, r.wave_size, r.min_serving, self.fleet.num_shards, r.in_flight)
        if problem:
            key, why = problem
            raise invalid(type(self).__name__, ("refit", key), getattr(r, key), "rollout", "{why}", {"why": why})
        return self

    @model_validator(mode="after")
    def _check_quantize(self) -> "NemoGenSettings":
        """``refit.quantize: trainer`` acts only on an FP8 fleet."""
        from nemo_gen.core.fp8 import quantize_problem

        problem = quantize_problem(self.refit.quantize, self.generation.vllm_cfg.precision)
        if problem:
            raise invalid(type(self).__name__, ("refit", "quantize"), self.refit.quantize, "quantize", "{why}",
                          {"why": problem})
        return self

    @model_validator(mode="after")
    def _check_gpu_share(self) -> "NemoGenSettings":
        """``fleet.shards_per_gpu`` engines must fit one GPU together."""
        k = self.fleet.shards_per_gpu
        util = self.generation.vllm_cfg.gpu_memory_utilization
        limit = 1.0 - GPU_SHARE_HEADROOM
        if k > 1 and k * util > limit + 1e-9:
            raise invalid(type(self).__name__, ("fleet", "shards_per_gpu"), k, "gpu_share",
                          "{k} engines per GPU x generation.vllm_cfg.gpu_memory_utilization {util} = {total} of "
                          "the device, more than {limit}; lower generation.vllm_cfg.gpu_memory_utilization to "
                          "at most {most} or fleet.shards_per_gpu",
                          {"k": k, "util": util, "total": round(k * util, 4), "limit": round(limit, 4),
                           "most": int(limit / k * 1000) / 1000})
        return self

    @model_validator(mode="after")
    def _cpu_env_vars(self) -> "NemoGenSettings":
        """On a CPU fleet each engine's threads, cores and KV cache are the fleet's to set too."""
        from nemo_gen.core.engine_args import CPU_FLEET_ENV, env_var_problems

        if self.fleet.device == "cpu":
            env_vars = self.generation.vllm_cfg.env_vars
            problems = [p for p in env_var_problems(env_vars, "cpu") if p[0] in CPU_FLEET_ENV]
            if problems:
                raise invalid_keys(type(self).__name__, ("generation", "vllm_cfg", "env_vars"), problems, env_vars)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Highest first: overrides (passed as init kwargs) > environment > YAML > defaults.
        return (init_settings, _EnvKeepingCase(settings_cls, env_settings), _YamlSource(settings_cls))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike | None = None,
        overrides: Sequence[str] | Mapping[str, Any] | None = None,
    ) -> "NemoGenSettings":
        """Read ``path`` (YAML through OmegaConf: ``defaults:`` inheritance, ``${...}``
        interpolations; a NeMo-RL recipe is mapped, see ``nemo_gen.config.loader``), then
        ``NEMO_GEN_*`` env vars, then ``overrides``; validate once.

        Raises ``ConfigError`` naming every bad dotted field (and the file it came from). Keys
        read but not used by nemo_gen are in ``settings.not_used``.
        """
        from nemo_gen.config import loader as config_loader

        known = {"": cls.model_fields, "generation": GenerationSettings.model_fields,
                 "generation.vllm_cfg": VllmCfg.model_fields, "generation.colocated": ColocatedCfg.model_fields}
        prepared = config_loader.prepare(path, _override_pairs(overrides), known)
        tokens = (_YAML_DATA.set(prepared.file_data), _NOT_USED.set(list(prepared.not_used)))
        try:
            settings = cls(**prepared.override_data)
        except ValidationError as exc:
            raise _config_error(exc, path) from None
        finally:
            _YAML_DATA.reset(tokens[0])
            _NOT_USED.reset(tokens[1])
        if prepared.not_used:
            log.info("%d settings keys are not used by nemo_gen (`nemo-gen config` lists them): %s",
                     len(prepared.not_used), ", ".join(n.key for n in prepared.not_used))
        return settings

    @property
    def not_used(self) -> list[Any]:
        """Keys the sources set that nemo_gen read and does not use (``config_loader.NotUsed``:
        key, value, reason): a NeMo-RL recipe's trainer sections, NeMo-RL generation keys whose
        value asks for nothing nemo_gen lacks."""
        return list(self._not_used)

    # -- derived values (computed here so every caller agrees) --------------------------------

    def model_dir(self) -> Path:
        """The model directory the engines load (the tiny model when ``model.path`` is unset)."""
        return Path(self.model.path) if self.model.path else self.home / "tiny-model"

    def tokenizer_dir(self) -> Path:
        return Path(self.model.tokenizer) if self.model.tokenizer else self.model_dir()

    def sessions_dir(self) -> Path:
        """Where the trajectory gateway keeps its sessions (``server.sessions_dir``, else under ``home``)."""
        if self.server.sessions_dir:
            return Path(self.server.sessions_dir)
        return self.home / "sessions" / (re.sub(r"[^A-Za-z0-9_.-]", "_", self.fleet.name).lstrip(".") or "_")

    def model_name(self) -> str:
        return self.model.name or self.generation.model_name or self.model_dir().name

    def is_eval(self) -> bool:
        return self.fleet.mode == "eval"


def parse_override(item: str) -> tuple[str, Any]:
    """``'fleet.num_shards=4'`` -> ``('fleet.num_shards', 4)``; the value is parsed as YAML."""
    import yaml

    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like dotted.key=value", field="--set")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _override_pairs(overrides: Sequence[str] | Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [(str(k), v) for k, v in overrides.items()]
    if isinstance(overrides, (str, bytes)):
        raise ConfigError("overrides must be a list of 'dotted.key=value' strings or a dict", field="overrides")
    return [parse_override(item) for item in overrides]


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """The field names of the settings model that holds ``loc``'s last part."""
    model: Any = NemoGenSettings
    for part in loc[:-1]:
        info = getattr(model, "model_fields", {}).get(str(part))
        ann = info.annotation if info is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(getattr(model, "model_fields", {}))


def _config_error(exc: ValidationError, path: str | os.PathLike | None) -> ConfigError:
    from nemo_gen.config.loader import NEMO_RL_KEYS, suggest

    problems = []
    for err in exc.errors():
        dotted = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            foreign = NEMO_RL_KEYS.get(dotted)
            if foreign is not None:
                msg = f"a NeMo-RL key that nemo_gen does not use here: {foreign.reason}"
            else:
                msg = "unknown setting" + suggest(str(err["loc"][-1]), _fields_at(err["loc"]))
        else:
            msg = f"{err['msg'].removeprefix('Value error, ')} (got {err.get('input')!r})"
        problems.append((dotted, msg))
    source = f" (from settings file {path}, NEMO_GEN_* environment or overrides)" if path is not None else ""
    first_field = problems[0][0] if problems else None
    lines = "; ".join(f"{field}: {msg}" for field, msg in problems)
    err = ConfigError(f"invalid settings{source}: {lines}")
    err.field = first_field
    err.fields = [field for field, _ in problems]  # type: ignore[attr-defined]
    return err


# --------------------------------------------------------------------------------------------
