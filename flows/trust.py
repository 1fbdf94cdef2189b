"""What the caller of a deployment run may set: the trust boundary of flow-run parameters.

A flow run of a deployment is created by whoever reaches the Prefect API or edits a schedule, so
its parameters are untrusted input (DESIGN.md invariant 8). The worker's own settings — its
``NEMO_GEN_*`` environment and the defaults, which the operator chose when starting the worker —
are the anchor everything the run brings is checked against, before anything is started:

- ``overrides`` may set only ``DEPLOYMENT_OVERRIDES`` (sampling, batch size, fleet size, engine
  shape, deadlines and retries: numbers, flags and closed choices). Any other key is refused by
  name — ``prefect.*``, ``run.input``/``run.output``, ``model.*``, ``env_vars``, ``vllm_kwargs``,
  ``worker_extension_cls``, ``refit.staging_dir``, ``home``, anything path-like — and so is a
  ``${...}`` interpolation in a value (OmegaConf's ``oc.env`` would read the worker's environment).
- The allowed paths are the worker's (``prefect.allowed_paths``; empty: the run's working
  directory and ``home``): the run's ``config`` cannot change them.
- Every path parameter, the ``config`` file and each file its ``defaults:`` chain names (checked
  before it is read), and every path of the resolved settings that differs from the worker's own
  must resolve — symlinks and ``..`` followed first — inside them. A path the worker's own settings
  hold (``model.path`` from ``NEMO_GEN_MODEL__PATH``, ``refit.staging_dir``'s ``/dev/shm``) is the
  operator's and is not checked.

- The run's Prefect ``job_variables`` (what the work pool's worker builds the flow-run process
  from) may set only ``JOB_VARIABLES``. ``command``, ``env`` and ``working_dir`` would choose the
  process the worker starts, its environment — the ``NEMO_GEN_*`` anchor above, ``LD_PRELOAD`` —
  and its directory: nemo-gen's work pool (``flows.pool``) does not let a run set them, and a run
  that tries is refused by name at its start all the same (a run reaches a worker of another
  pool, or one whose template was changed back).

A person at a terminal (``nemo-gen ...``) or a flow called as a function is not checked: they
already have their own filesystem. Nothing here imports Prefect.
"""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from nemo_gen.config import document as config_document
from nemo_gen.config import loader as config_loader
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings, parse_override

#: The settings a deployment run's ``overrides`` may set. Each takes a number, a flag or one of a
#: closed set of values; none names a file, a directory, a host, code, an environment variable or a
#: permission. A constant, not a setting: whatever a caller could set, it could widen.
DEPLOYMENT_OVERRIDES: frozenset[str] = frozenset({
    # sampling
    "generation.max_new_tokens", "generation.temperature", "generation.n", "generation.top_p",
    "generation.top_k", "generation.stop_token_ids", "generation.stop_strings", "generation.bad_words",
    "generation.ignore_eos",
    # batching
    "run.batch_size",
    # the fleet's size and its engines' shape
    "fleet.num_shards", "fleet.spares", "fleet.shards_per_gpu",
    "generation.vllm_cfg.max_model_len", "generation.vllm_cfg.gpu_memory_utilization",
    "generation.vllm_cfg.tensor_parallel_size", "generation.vllm_cfg.pipeline_parallel_size",
    "generation.vllm_cfg.enable_prefix_caching", "generation.vllm_cfg.async_engine",
    # deadlines, retries and recovery
    "fleet.request_timeout_s", "fleet.max_reroutes", "fleet.busy_retries", "fleet.busy_backoff_s",
    "fleet.max_pending_requests", "fleet.engine_start_timeout_s", "fleet.placement_timeout_s",
    "health.probe_interval_s", "health.probe_timeout_s", "health.unhealthy_threshold",
    "health.healthy_threshold", "health.max_restart_attempts_per_shard", "health.restart_backoff_s",
    "health.restart_backoff_max_s", "health.restart_jitter",
    # refits
    "refit.timeout_s", "refit.in_flight", "refit.resume_aborted", "refit.max_staleness", "refit.recompute_kv",
})

#: Why the keys a caller would most want to widen are refused (dotted key or section -> reason).
#: Every key outside DEPLOYMENT_OVERRIDES is refused; these get their reason in the message.
REFUSED: dict[str, str] = {
    "prefect": "it would change which paths a deployment run may touch (prefect.allowed_paths is the worker's)",
    "run.input": "it is a path: give the input parameter, which is checked against prefect.allowed_paths",
    "run.output": "it is a path: give the output parameter, which is checked against prefect.allowed_paths",
    "model": "it names the model and tokenizer files the engines load",
    "generation.model_name": "it names the model directory the engines load",
    "generation.vllm_cfg.env_vars": "it sets environment variables of every engine process (LD_PRELOAD, "
                                    "PYTHONPATH: code the engines run)",
    "generation.vllm_kwargs": "it goes to vLLM verbatim (trust_remote_code, download_dir, ...: code and files)",
    "generation.vllm_cfg.worker_extension_cls": "it names a class every vLLM worker imports (code the engines run)",
    "generation.worker_extension_cls_fqn": "it names a class every vLLM worker imports (code the engines run)",
    "refit.staging_dir": "it is a directory the refit writes to",
    "refit.backend": "it picks the weight-transfer backend (vLLM's ipc turns on insecure deserialization)",
    "home": "it is the directory nemo_gen writes the model, outputs and Prefect state to",
    "ray": "it picks the Ray cluster and namespace the run acts on",
    "server": "it configures the HTTP server's address, key and refit route",
}


_NOT_LISTED = "it is not one of the keys a deployment override may set"

#: The Prefect job variables a deployment's run may set: ``stream_output`` (whether the worker
#: echoes the run's output) and nothing that names a command, a file, a directory or an
#: environment variable. A constant, like DEPLOYMENT_OVERRIDES: whatever a caller could set, it
#: could widen. nemo-gen's work pool template (``flows.pool``) declares exactly these.
JOB_VARIABLES: frozenset[str] = frozenset({"stream_output"})

#: Why the job variables of Prefect's default process template are refused.
REFUSED_JOB_VARIABLES: dict[str, str] = {
    "command": "it is the command the worker runs for the flow run (any program, as the worker's user)",
    "env": "it sets the flow-run process's environment (NEMO_GEN_PREFECT__ALLOWED_PATHS, LD_PRELOAD, "
           "PYTHONPATH: the worker's settings and code the run executes)",
    "working_dir": "it is the directory the flow-run process starts in (where relative paths and "
                   "the allowed paths' default resolve from)",
    "name": "it names the flow-run process; the worker names it after the flow run",
    "labels": "it labels the flow-run process's events; the worker labels them itself",
}


def override_problems(overrides: Sequence[str] | None) -> list[tuple[str, str]]:
    """(key, why) for every key of ``overrides`` a deployment run may not set. A dict value is
    looked into (``generation={"vllm_cfg": {"env_vars": ...}}`` sets ``generation.vllm_cfg.env_vars``)."""
    problems: list[tuple[str, str]] = []
    for item in overrides or ():
        if not isinstance(item, str):
            problems.append((repr(item), "an override must be a 'dotted.key=value' string"))
            continue
        key, value = parse_override(item)
        leaves = list(config_loader.flat_items(value, f"{key}.")) if isinstance(value, Mapping) and value \
            else [(key, value)]
        for leaf, leaf_value in leaves:
            why = _refusal(leaf)
            if why is None and _interpolates(leaf_value):
                why = "its value holds a ${...} interpolation, which could read the worker's environment"
            if why is not None and all(leaf != k for k, _ in problems):
                problems.append((leaf, why))
    return problems


def check_overrides(overrides: Sequence[str] | None) -> None:
    """Raise ConfigError naming every override key a deployment run may not set."""
    problems = override_problems(overrides)
    if not problems:
        return
    listed = any(why == _NOT_LISTED for _, why in problems)
    err = ConfigError(
        "; ".join(f"{key}: not allowed in a deployment override: {why}" for key, why in problems)
        + (f" (a deployment override may set only: {', '.join(sorted(DEPLOYMENT_OVERRIDES))})" if listed else ""))
    err.field = problems[0][0]
    err.fields = [key for key, _ in problems]  # type: ignore[attr-defined]
    raise err


def job_variable_problems(job_variables: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(key, why) for every key of a run's ``job_variables`` outside ``JOB_VARIABLES``, in the
    order given. Prefect reads a dotted key (``env.LD_PRELOAD``) as a path into its first part."""
    problems = []
    for key in job_variables or {}:
        name = str(key)
        if name in JOB_VARIABLES:
            continue
        why = REFUSED_JOB_VARIABLES.get(name.split(".")[0],
                                        "it is not one of the job variables a deployment run may set")
        problems.append((name, why))
    return problems


def check_job_variables(job_variables: Mapping[str, Any] | None) -> None:
    """Raise ConfigError naming every job variable a deployment run may not set."""
    problems = job_variable_problems(job_variables)
    if not problems:
        return
    err = ConfigError(
        "; ".join(f"job_variables.{key}: not allowed in a deployment run: {why}" for key, why in problems)
        + f" (a run's job_variables may set only: {', '.join(sorted(JOB_VARIABLES))})")
    err.field = f"job_variables.{problems[0][0]}"
    err.fields = [f"job_variables.{key}" for key, _ in problems]  # type: ignore[attr-defined]
    raise err


def _refusal(key: str) -> str | None:
    if key in DEPLOYMENT_OVERRIDES:
        return None
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        why = REFUSED.get(".".join(parts[:i]))
        if why is not None:
            return why
    if _is_path_field(parts):
        return "it is a path"
    return _NOT_LISTED


def _is_path_field(parts: list[str]) -> bool:
    """Whether the settings field at ``parts`` holds a path (or paths)."""
    model: Any = NemoGenSettings
    for part in parts:
        info = getattr(model, "model_fields", {}).get(part)
        if info is None:
            return False
        model = info.annotation
    return Path in _types_in(model)


def _types_in(ann: Any) -> set[Any]:
    args = typing.get_args(ann)
    return {ann} if not args else set().union(*(_types_in(a) for a in args))


def _interpolates(value: Any) -> bool:
    if isinstance(value, str):
        return "${" in value
    if isinstance(value, Mapping):
        return any(_interpolates(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_interpolates(v) for v in value)
    return False


# --------------------------------------------------------------------------------------------
# allowed paths


def allowed_roots(settings: NemoGenSettings, base: Path | None = None) -> list[Path]:
    """The directories a deployment run's paths may point into; relative ones are taken from
    ``base`` (default: the current directory, where a deployment's run starts: the repository root)."""
    base = base or Path.cwd()
    roots = settings.prefect.allowed_paths or [base, settings.home]
    return [real_path(r, base) for r in roots]


def real_path(path: str | os.PathLike, base: Path) -> Path:
    """``path`` from ``base``, ``~``, ``..`` and every symlink resolved."""
    return Path(os.path.realpath(base / Path(path).expanduser()))


def is_within(real: Path, roots: Iterable[Path]) -> bool:
    return any(real == root or root in real.parents for root in roots)


def check_allowed_paths(values: Any, settings: NemoGenSettings, base: Path | None = None,
                        fields: tuple[str, ...] | None = None) -> None:
    """Raise ConfigError naming the first path parameter that resolves outside the allowed roots.
    ``values``: a parameters model (its ``path_fields`` are checked) or a mapping with ``fields``."""
    base = base or Path.cwd()
    roots = allowed_roots(settings, base)
    if hasattr(values, "path_fields"):
        fields, values = values.path_fields, values.model_dump()
    for name in fields or ():
        value = values.get(name)
        if value is not None and not is_within(real_path(value, base), roots):
            raise ConfigError(f"{value!r} is {_outside(roots)}", field=f"parameter {name}")


def _outside(roots: Sequence[Path]) -> str:
    return (f"outside the allowed paths {[str(r) for r in roots]} (prefect.allowed_paths; empty: the "
            "run's working directory and home)")


def setting_paths(settings: NemoGenSettings) -> list[tuple[str, Path]]:
    """Every path the settings hold, by dotted key (``prefect.allowed_paths``, the roots
    themselves, aside), and the model and tokenizer directories the engines will load."""
    found: list[tuple[str, Path]] = []

    def walk(obj: Any, at: str) -> None:
        for name in type(obj).model_fields:
            value, key = getattr(obj, name), f"{at}{name}"
            if key == "prefect.allowed_paths":
                continue
            if hasattr(type(value), "model_fields"):
                walk(value, f"{key}.")
            elif isinstance(value, Path):
                found.append((key, value))
            elif isinstance(value, (list, tuple)):
                found.extend((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, Path))

    walk(settings, "")
    # model.path unset: the tiny model under home; model.tokenizer unset: the model's directory
    found.extend([("model.path", settings.model_dir()), ("model.tokenizer", settings.tokenizer_dir())])
    return found


def check_resolved(settings: NemoGenSettings, worker: NemoGenSettings, base: Path | None = None) -> None:
    """Raise ConfigError naming the first path of ``settings`` outside ``worker``'s allowed paths
    that the run changed from the worker's own, or the allowed paths themselves, changed."""
    base = base or Path.cwd()
    if [real_path(p, base) for p in settings.prefect.allowed_paths] != \
            [real_path(p, base) for p in worker.prefect.allowed_paths]:
        raise ConfigError("a deployment run's config may not change the allowed paths: they are the worker's "
                          f"(NEMO_GEN_PREFECT__ALLOWED_PATHS), {[str(p) for p in worker.prefect.allowed_paths]}",
                          field="prefect.allowed_paths")
    roots = allowed_roots(worker, base)
    own = {key: real_path(value, base) for key, value in setting_paths(worker)}
    for key, value in setting_paths(settings):
        real = real_path(value, base)
        if own.get(key) != real and not is_within(real, roots):
            raise ConfigError(f"{str(value)!r} is {_outside(roots)}", field=key)


def deployment_settings(params: Any, load: Callable[[Any], NemoGenSettings],
                        base: Path | None = None) -> NemoGenSettings:
    """The settings of a deployment's run, every check above passed: the overrides' keys, the
    path parameters, the config and its ``defaults:`` files (before each is read), the resolved
    paths. ``load(params)`` reads the config with the overrides; nothing else is read first."""
    base = base or Path.cwd()
    check_overrides(params.overrides)
    worker = NemoGenSettings.load()  # the worker's environment and the defaults: the operator's
    check_allowed_paths(params, worker, base)
    roots = allowed_roots(worker, base)
    with config_document.files_only_under(roots, _outside(roots)):
        settings = load(params)
    check_resolved(settings, worker, base)
    return settings
