"""The rules of a generation config, as pure logic: the backend names configs are matched
against, ``configure_generation_config`` (fill in and cross-check the ``generation`` config
once the tokenizer exists), ``draft_full_refit_enabled``, and the backend-name check that
``resolve_generation_class`` makes before it imports anything.

``nemo_gen.generation`` (the NeMo-RL API) re-exports these; the fleet calls them here, so
nothing below the compatibility layer depends on it. Only ``VLLM_BACKEND`` is implemented;
the other backend names are here so that a NeMo-RL config naming one of them is refused with
a clear message instead of being reported as a typo.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Collection, Mapping
from typing import Any, Protocol

from nemo_gen.errors import ConfigError


class TokenizerType(Protocol):
    """What configure_generation_config reads of a tokenizer (NeMo-RL passes a Hugging Face one)."""

    pad_token_id: int | None
    eos_token_id: int | None


# The NeMo-RL module's logger name: its messages are the seed API's.
logger = logging.getLogger("nemo_gen.generation")

GenerationConfig = dict[str, Any]  # the TypedDict of the same name lives in nemo_gen.generation.interfaces

VLLM_BACKEND = "vllm"
SGLANG_BACKEND = "sglang"
MEGATRON_BACKEND = "megatron"
DYNAMO_BACKEND = "dynamo"
TRTLLM_BACKEND = "trtllm"

# NeMo-RL backends that nemo_gen knows by name but does not implement.
NEMO_RL_ONLY_BACKENDS: frozenset[str] = frozenset(
    {SGLANG_BACKEND, MEGATRON_BACKEND, DYNAMO_BACKEND, TRTLLM_BACKEND}
)

# Refit transports that send XOR/overwrite deltas against the weights vLLM loaded from
# disk at start-up, so the engine must start from the real checkpoint (load_format="auto").
VLLM_SPARSE_REFIT_TRANSPORTS: frozenset[str] = frozenset({"vllm_s3_sparse", "vllm_zmq_sparse"})

# speculative_config.method values whose drafter is the policy's own MTP layer. Its weights
# are loaded from disk after start (or arrive in the policy refit stream), so these methods
# can start from dummy weights; any other drafter (Eagle, draft_model, ...) cannot.
MTP_SPECULATIVE_METHODS: frozenset[str] = frozenset({"deepseek_mtp", "mtp"})

# Backends nemo_gen implements (``nemo_gen.generation`` maps each to its class).
IMPLEMENTED_BACKENDS: frozenset[str] = frozenset({VLLM_BACKEND})

# Where a vLLM worker extension can be named. NeMo-RL reads the top-level key; the vllm_cfg
# and vllm_kwargs spellings reach the same vLLM argument, so all are refused off vLLM.
_WORKER_EXTENSION_KEYS: tuple[tuple[str | None, str], ...] = (
    (None, "worker_extension_cls_fqn"),
    ("vllm_cfg", "worker_extension_cls"),
    ("vllm_cfg", "worker_extension_cls_fqn"),
    ("vllm_kwargs", "worker_extension_cls"),
)


def config_error(message: str, field: str) -> ConfigError:
    """A ``ConfigError`` whose text is exactly ``message`` and whose ``field`` is set.

    The messages below keep NeMo-RL's wording, which already names the field, so the
    ``field:`` prefix ``ConfigError`` would add is left out.
    """
    error = ConfigError(message)
    error.field = field
    return error


def require_backend(config: Mapping[str, Any], implemented: Collection[str] = IMPLEMENTED_BACKENDS) -> Any:
    """``config["backend"]``, or a ``ConfigError`` naming ``generation.backend``."""
    if "backend" not in config:
        raise config_error(
            f"generation.backend is missing; known backends: {sorted(implemented)}",
            field="generation.backend",
        )
    return config["backend"]


def check_backend(config: Mapping[str, Any], implemented: Collection[str] = IMPLEMENTED_BACKENDS) -> str:
    """``generation.backend``, or a ``ConfigError`` for a missing, NeMo-RL-only or unknown one.
    ``implemented``: the backends that resolve (``nemo_gen.generation``'s registry)."""
    backend = require_backend(config, implemented)
    known = sorted(implemented)
    # Only strings are looked up: a YAML list or mapping here is a typo, not a crash.
    if isinstance(backend, str) and backend in implemented:
        return backend
    if isinstance(backend, str) and backend in NEMO_RL_ONLY_BACKENDS:
        raise config_error(
            f"Generation backend {backend!r} is a NeMo-RL backend that nemo_gen does "
            f"not implement; known backends: {known}",
            field="generation.backend",
        )
    raise config_error(
        f"Unknown generation backend: {backend!r}; known backends: {known}",
        field="generation.backend",
    )


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


def configured_worker_extension(config: Mapping[str, Any]) -> str | None:
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
    backend = require_backend(config)
    if backend != VLLM_BACKEND:
        key = configured_worker_extension(config)
        if key is not None:
            raise config_error(
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
            config["vllm_cfg"] = {}
        config["vllm_cfg"]["load_format"] = "auto" if is_eval else "dummy"

    if backend != VLLM_BACKEND:
        return config

    vllm_cfg: dict[str, Any] = config["vllm_cfg"]

    # 4. real_quant export: only colocated CUDA-IPC refit can skip the CPU offload.
    if config.get("real_quant"):
        export_cpu_offload = config.get("real_quant_export_cpu_offload")
        if not isinstance(export_cpu_offload, bool):
            raise config_error(
                "generation.real_quant_export_cpu_offload must be a boolean",
                field="generation.real_quant_export_cpu_offload",
            )
        colocated = config.get("colocated")
        if not export_cpu_offload and (
            colocated is None
            or not colocated.get("enabled")
            or config.get("refit_transport") is not None
        ):
            raise config_error(
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
