"""The generation API of NeMo-RL's ``nemo_rl.models.generation``, re-created for nemo_gen.

This package owns the steps a driver takes between reading its settings and launching
engines:

- ``maybe_configure_engine_reaping_env``: let the raylet reap an orphaned EngineCore
  (call before Ray starts);
- ``configure_generation_config``: fill in and cross-check the ``generation`` config once
  the tokenizer exists;
- ``resolve_generation_class``: map ``generation.backend`` to its ``GenerationInterface``
  class, importing the backend only then;
- ``draft_full_refit_enabled``: the policy-side fact ``configure_generation_config`` needs
  about drafter refit.

Importing it changes no environment variable and imports neither torch, transformers,
vLLM, Ray nor Prefect: ``TokenizerType`` is resolved on first access and backends on
first resolution. The config and backend contracts live in ``interfaces``.
"""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_gen.errors import ConfigError
from nemo_gen.generation.constants import (
    DYNAMO_BACKEND,
    MTP_SPECULATIVE_METHODS,
    NEMO_RL_ONLY_BACKENDS,
    VLLM_BACKEND,
    VLLM_SPARSE_REFIT_TRANSPORTS,
)
from nemo_gen.generation.interfaces import GenerationConfig, GenerationInterface

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as TokenizerType

__all__ = [
    "TokenizerType",
    "configure_generation_config",
    "draft_full_refit_enabled",
    "maybe_configure_engine_reaping_env",
    "resolve_generation_class",
]

logger = logging.getLogger(__name__)

# Backend name -> "module:Class". Adding a backend is one line here; its module is
# imported only when a config selects it.
_BACKEND_CLASSES: dict[str, str] = {
    VLLM_BACKEND: "nemo_gen.generation.vllm:VllmGeneration",
}

# Where a vLLM worker extension can be named. NeMo-RL reads the top-level key; the vllm_cfg
# and vllm_kwargs spellings reach the same vLLM argument, so all are refused off vLLM.
_WORKER_EXTENSION_KEYS: tuple[tuple[str | None, str], ...] = (
    (None, "worker_extension_cls_fqn"),
    ("vllm_cfg", "worker_extension_cls"),
    ("vllm_cfg", "worker_extension_cls_fqn"),
    ("vllm_kwargs", "worker_extension_cls"),
)


def __getattr__(name: str) -> Any:
    # TokenizerType is transformers' PreTrainedTokenizerBase, imported on first access so
    # that importing this package does not pull in transformers (and through it torch).
    if name == "TokenizerType":
        from transformers import PreTrainedTokenizerBase

        globals()["TokenizerType"] = PreTrainedTokenizerBase
        return PreTrainedTokenizerBase
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"TokenizerType"})


def _config_error(message: str, field: str) -> ConfigError:
    """A ``ConfigError`` whose text is exactly ``message`` and whose ``field`` is set.

    The messages below keep NeMo-RL's wording, which already names the field, so the
    ``field:`` prefix ``ConfigError`` would add is left out.
    """
    error = ConfigError(message)
    error.field = field
    return error


def _require_backend(config: Mapping[str, Any]) -> Any:
    """``config["backend"]``, or a ``ConfigError`` naming ``generation.backend``."""
    if "backend" not in config:
        raise _config_error(
            f"generation.backend is missing; known backends: {sorted(_BACKEND_CLASSES)}",
            field="generation.backend",
        )
    return config["backend"]


def maybe_configure_engine_reaping_env(enabled: bool) -> None:
    """Let the raylet reap a dead generation worker's EngineCore, on runs the driver owns.

    A vLLM generation worker spawns its EngineCore as a plain multiprocessing child --
    ``context.Process(target=EngineCoreProc.run_engine_core)``, no ``setsid``, not a
    daemon -- and that child owns the CUDA context and the KV cache. Every cleanup path
    that exists runs INSIDE the dying process, so SIGKILL defeats all of them: vLLM's
    ``weakref.finalize`` never fires, a non-daemon multiprocessing child is designed to
    outlive its parent, and Ray's default ``RAY_kill_child_processes_on_worker_exit`` is
    the worker's own exit handler. The orphan then holds its GPU for the life of the job:
    measured on 4xGB200, one SIGKILLed shard left 114.95 GiB of a 184.31 GiB device still
    held, and it did not come back across five restart attempts -- the replacement could
    not fit, so re-admission failed while the survivors carried on. Because the
    EngineCore never calls ``setsid`` it stays in the worker's process group, which is
    exactly what per-worker process-group cleanup reaches.

    **The raylet is the only reader, and this only reaches the raylet on runs where the
    driver starts it.** Ray reads ``process_group_cleanup_enabled`` in the raylet, at the
    raylet's own startup. Call this **before** Ray is initialised (``init_ray()``), like
    NeMo-RL's ``maybe_configure_data_plane_env``: on a local/single-node run ``ray.init``
    forks a raylet that inherits this environment, so it lands. On a Slurm or k8s cluster
    it does NOT: ``ray start`` has already run on every node before the driver process
    exists, and ``init_ray()`` then attaches to it with ``address="auto"``. Nothing the
    driver sets afterwards can change a raylet that is already up. Those deployments set
    the flag where the raylet is actually launched -- NeMo-RL exports
    ``RAY_process_group_cleanup_enabled`` in ``ray.sub`` -- which means it is unconditional
    there, not scoped to fleet health.

    So the gate below buys scoping on exactly one deployment shape. It is still worth
    having: a raylet-wide behaviour change should not follow from ``import nemo_gen``, and
    a run that starts no EngineCore has nothing to reap. But it is not a property of the
    flag, it is a property of who started the raylet. (Ray 2.60, which nemo_gen runs on,
    already defaults the cleanup to on; setting it keeps the behaviour when that default
    is absent or changes.)

    ``setdefault``, not assignment: an operator debugging a wedged engine may want the
    corpse, and an explicit ``RAY_process_group_cleanup_enabled=0`` stays honoured. It is
    logged as a warning when honoured, because that run will leak a killed shard's memory.

    Args:
        enabled: Whether this run can lose a generation worker and keep going. A ``bool``
            rather than the fleet-health config, so any entrypoint that builds vLLM
            generation can call it -- the leak is not specific to fleet health, it just
            takes a run that survives the loss to leave the orphan behind. Note this is
            ``fleet_health.enabled``, not ``restart_dead_shards``: any shard loss leaks
            that GPU, restarting is only what makes the loss survivable.
    """
    if not enabled:
        return
    flag = "RAY_process_group_cleanup_enabled"
    existing = os.environ.get(flag)
    os.environ.setdefault(flag, "1")
    # Ray parses its boolean env settings as "1" or "true" (any case); anything else
    # disables the cleanup.
    if existing is not None and existing.strip().lower() not in ("1", "true"):
        logger.warning(
            "%s=%r is set in the environment and is honoured: the EngineCore of a killed "
            "generation worker will not be reaped and keeps its device memory",
            flag,
            existing,
        )


def resolve_generation_class(
    generation_config: GenerationConfig | Mapping[str, Any],
) -> type[GenerationInterface]:
    """Map ``generation_config`` to its ``GenerationInterface`` class.

    The backend's module is imported here, not at package import, so selecting vLLM is
    what loads vLLM.

    Raises:
        ConfigError: (a ``ValueError``) ``generation.backend`` is missing, names one of
            NeMo-RL's backends that nemo_gen does not implement, or is unknown.
        ImportError: the backend's registered class cannot be found.
    """
    backend = _require_backend(generation_config)
    known = sorted(_BACKEND_CLASSES)
    # Only strings are looked up: a YAML list or mapping here is a typo, not a crash.
    name = backend if isinstance(backend, str) else None
    target = _BACKEND_CLASSES.get(name) if name is not None else None
    if target is None:
        if name in NEMO_RL_ONLY_BACKENDS:
            raise _config_error(
                f"Generation backend {backend!r} is a NeMo-RL backend that nemo_gen does "
                f"not implement; known backends: {known}",
                field="generation.backend",
            )
        raise _config_error(
            f"Unknown generation backend: {backend!r}; known backends: {known}",
            field="generation.backend",
        )
    module_name, _, class_name = target.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, GenerationInterface)):
        raise ImportError(
            f"generation backend {backend!r} is registered as {target!r}, but "
            f"{module_name} has no GenerationInterface subclass named {class_name}"
        )
    return cls


def draft_full_refit_enabled(policy_cfg: Mapping[str, Any] | None) -> bool:
    """Whether the trainer streams the drafter's FULL weight set on refit.

    True for Automodel draft co-training (dspark/dflash/eagle3), which exports the
    drafter's entire state_dict under the ``draft.`` prefix; the Megatron eagle3 path
    streams a partial set instead. Feeds the ``draft_full_refit`` argument of
    :func:`configure_generation_config`.

    ``automodel_cfg.enabled`` alone identifies the Automodel path. A missing or None
    ``automodel_cfg`` or ``enabled`` means False.
    """
    automodel_cfg = (policy_cfg or {}).get("automodel_cfg")
    if automodel_cfg is None:
        return False
    if isinstance(automodel_cfg, Mapping):
        return bool(automodel_cfg.get("enabled"))
    return bool(getattr(automodel_cfg, "enabled", False))


def _configured_worker_extension(config: Mapping[str, Any]) -> str | None:
    """The dotted key of the first worker-extension setting present, if any."""
    for section, key in _WORKER_EXTENSION_KEYS:
        holder = config if section is None else config.get(section)
        if isinstance(holder, Mapping) and holder.get(key) is not None:
            return f"generation.{section}.{key}" if section else f"generation.{key}"
    return None


def configure_generation_config(
    config: GenerationConfig,
    tokenizer: TokenizerType,
    is_eval: bool = False,
    has_refit_draft_weights: bool = False,
    trains_mtp: bool = False,
    draft_full_refit: bool = False,
) -> GenerationConfig:
    """Apply specific configurations to generation config.

    Fills in what the tokenizer and the run's shape decide, and refuses settings that
    cannot work. Mutates ``config`` and returns the same dict. The rules, in order:

    0. A vLLM worker extension (``worker_extension_cls_fqn`` at the top level or in
       ``vllm_cfg``, ``worker_extension_cls`` in ``vllm_cfg`` or ``vllm_kwargs``) on a
       non-vLLM backend is an error. Checked first, so a refused config is left untouched.
    1. ``_pad_token_id`` is always set from ``tokenizer.pad_token_id``; a value already
       there is internal-only and triggers a ``UserWarning`` before being overridden.
    2. ``stop_token_ids`` becomes ``[tokenizer.eos_token_id]`` only when it is None (an
       explicit ``[]`` means "no stop tokens" and is kept).
    3. For the vllm and dynamo backends, ``vllm_cfg.load_format`` is ``"auto"`` when
       ``is_eval`` and ``"dummy"`` otherwise: in training the first refit brings the
       weights, so reading them from disk would be wasted. ``vllm_cfg`` is created if
       absent.

    vLLM only, from here on:

    4. ``real_quant``: ``real_quant_export_cpu_offload`` must be a bool, and False is only
       allowed with colocated CUDA-IPC refit (``colocated.enabled`` and no
       ``refit_transport``).
    5. A sparse refit transport (``vllm_s3_sparse``, ``vllm_zmq_sparse``) forces
       ``load_format="auto"``: the deltas are applied against the weights vLLM loads
       from disk at start.
    6. Speculative decoding (``vllm_kwargs.speculative_config``) outside eval and without
       draft refit: a non-MTP drafter (Eagle, draft model) would keep dummy weights
       forever, so ``load_format`` is forced to ``"auto"`` with a warning. MTP methods
       (``deepseek_mtp``, ``mtp``) keep ``"dummy"``: the MTP layer is loaded from disk
       after start.
    7. Where the drafter's weights come from: ``_mtp_weights_from_refit = trains_mtp``,
       ``_draft_weights_from_refit = has_refit_draft_weights`` and
       ``_draft_full_refit = draft_full_refit and has_refit_draft_weights``.
    8. ``vllm_cfg.skip_tokenizer_init``, only when the key is absent: False when the
       engine needs its tokenizer (``is_eval``, ``stop_strings`` not None, or
       ``vllm_cfg.expose_http_server``), else True.

    ``draft_full_refit=True`` with ``has_refit_draft_weights=False`` is accepted and stored
    as ``_draft_full_refit=False``, not refused: the flag describes the shape of a drafter
    refit stream, and without draft refit there is no stream to be full. This is also what
    :func:`draft_full_refit_enabled` produces for any Automodel policy, drafter or not, so
    refusing it would reject every Automodel run without a drafter. Nothing is lost: with
    a non-MTP drafter and no draft refit, rule 6 already loads the drafter from disk.

    Args:
        config: The ``generation`` section; mutated in place.
        tokenizer: Anything with ``pad_token_id`` and ``eos_token_id`` (normally a
            ``TokenizerType``); only those two attributes are read.
        is_eval: An evaluation run: weights come from disk, never from a refit.
        has_refit_draft_weights: The trainer streams drafter weights on refit
            (``policy.draft.enabled``).
        trains_mtp: The trainer trains the MTP layer (``bool(mtp_num_layers)``), so its
            weights arrive in the policy refit stream.
        draft_full_refit: The drafter refit stream is the full drafter state_dict
            (:func:`draft_full_refit_enabled`).

    Returns:
        ``config`` itself.

    Raises:
        ConfigError: (a ``ValueError``) no ``backend``, a worker extension off vLLM, or
            an invalid ``real_quant_export_cpu_offload``.
    """
    # 0. Validate before mutating anything.
    backend = _require_backend(config)
    if backend != VLLM_BACKEND:
        key = _configured_worker_extension(config)
        if key is not None:
            raise _config_error(
                f"{key} is only supported by the vLLM backend, got backend={backend!r}",
                field=key,
            )

    # 1. Pad token: internal, always from the tokenizer.
    if "_pad_token_id" in config:
        warnings.warn(
            "'_pad_token_id' found in generation config and will be overridden with "
            "tokenizer.pad_token_id. '_pad_token_id' is internal: configure_generation_config "
            "sets it, and a user-provided value has no effect.",
            UserWarning,
            stacklevel=2,
        )
    config["_pad_token_id"] = tokenizer.pad_token_id

    # 2. Stop tokens: None means "the tokenizer's EOS"; [] is an explicit choice.
    if config.get("stop_token_ids") is None:
        config["stop_token_ids"] = [tokenizer.eos_token_id]

    # 3. load_format, first pass, for every vLLM-backed backend.
    if backend in (VLLM_BACKEND, DYNAMO_BACKEND):
        if config.get("vllm_cfg") is None:
            config["vllm_cfg"] = {}  # type: ignore[typeddict-unknown-key]
        config["vllm_cfg"]["load_format"] = "auto" if is_eval else "dummy"  # type: ignore[typeddict-item]

    if backend != VLLM_BACKEND:
        return config

    vllm_cfg: dict[str, Any] = config["vllm_cfg"]  # type: ignore[typeddict-item]

    # 4. real_quant export: only colocated CUDA-IPC refit can skip the CPU offload.
    if config.get("real_quant"):
        export_cpu_offload = config.get("real_quant_export_cpu_offload")
        if not isinstance(export_cpu_offload, bool):
            raise _config_error(
                "generation.real_quant_export_cpu_offload must be a boolean",
                field="generation.real_quant_export_cpu_offload",
            )
        colocated = config.get("colocated")
        if not export_cpu_offload and (
            colocated is None
            or not colocated.get("enabled")
            or config.get("refit_transport") is not None
        ):
            raise _config_error(
                "generation.real_quant_export_cpu_offload=false requires colocated "
                "CUDA-IPC refit with no explicit refit_transport",
                field="generation.real_quant_export_cpu_offload",
            )

    # 5. Sparse transports diff against the weights loaded from disk at start.
    if config.get("refit_transport") in VLLM_SPARSE_REFIT_TRANSPORTS:
        vllm_cfg["load_format"] = "auto"

    # 6. A drafter nobody refits must start from real weights, unless it is MTP.
    speculative_config = (config.get("vllm_kwargs") or {}).get("speculative_config")
    if speculative_config and not is_eval and not has_refit_draft_weights:
        method = (
            speculative_config.get("method")
            if isinstance(speculative_config, Mapping)
            else getattr(speculative_config, "method", None)
        )
        if method not in MTP_SPECULATIVE_METHODS:
            warnings.warn(
                "Speculative decoding is enabled without draft refit sync. Setting "
                "vllm_cfg['load_format'] to 'auto' so the drafter does not start from "
                "dummy weights.",
                UserWarning,
                stacklevel=2,
            )
            vllm_cfg["load_format"] = "auto"

    # 7. Where drafter weights come from; read by the workers' refit and load paths.
    config["_mtp_weights_from_refit"] = bool(trains_mtp)
    config["_draft_weights_from_refit"] = bool(has_refit_draft_weights)
    config["_draft_full_refit"] = bool(draft_full_refit and has_refit_draft_weights)

    # 8. The engine needs its own tokenizer to detokenize (eval, stop strings, HTTP).
    if "skip_tokenizer_init" not in vllm_cfg:
        needs_tokenizer = (
            is_eval
            or config.get("stop_strings") is not None
            or bool(vllm_cfg.get("expose_http_server"))
        )
        vllm_cfg["skip_tokenizer_init"] = not needs_tokenizer

    return config
