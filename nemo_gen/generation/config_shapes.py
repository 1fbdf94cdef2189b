"""The generation config's shapes, as NeMo-RL declares them: the TypedDicts (``GenerationConfig``
and its vLLM extension ``VllmConfig``), which backend rolls out asynchronously, and the sampling
profile of one rollout. Re-exported by ``nemo_gen.generation.interfaces``, NeMo-RL's home for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

from nemo_gen.errors import ConfigError
from nemo_gen.generation.constants import (
    DYNAMO_BACKEND,
    MEGATRON_BACKEND,
    SGLANG_BACKEND,
    TRTLLM_BACKEND,
    VLLM_BACKEND,
)


class ResourcesConfig(TypedDict):
    gpus_per_node: int
    num_nodes: int


class OptionalResourcesConfig(TypedDict):
    """``ResourcesConfig`` whose fields may be null; filled in by the caller's setup."""

    gpus_per_node: int | None
    num_nodes: int | None


class ColocationConfig(TypedDict):
    """Whether generation shares GPUs with training, and on which resources if not."""

    enabled: bool
    resources: OptionalResourcesConfig


class CheckpointEngineConfig(TypedDict):
    """Normalised internal form of a checkpoint-engine refit (``nixl`` or a plugin)."""

    # "nixl", or a "module:ClassName" path to a checkpoint-engine implementation.
    backend: str
    # Fraction of total device memory each transfer bucket may use.
    update_weights_bucket_memory_ratio: float
    # Constructor kwargs per backend, keyed by the configured backend string.
    engine_kwargs: dict[str, dict[str, Any]]


class GenerationConfig(TypedDict):
    """Backend-independent generation settings (the ``generation`` config section).

    Required keys: ``backend``, ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``val_temperature``, ``val_top_p``, ``val_top_k``, ``stop_token_ids`` and
    ``stop_strings`` (the last two may be None; ``configure_generation_config`` fills
    ``stop_token_ids`` from the tokenizer when it is None).

    The keys starting with ``_`` are written by ``configure_generation_config`` or by the
    caller's setup; a user-provided value is overridden.
    """

    backend: str
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    # Validation-only sampling. Configs interpolate these from the training values, so
    # validation samples like training unless overridden.
    val_temperature: float
    val_top_p: float
    val_top_k: int | None
    stop_token_ids: list[int] | None
    stop_strings: list[str] | None
    # Optional in the type because the caller's setup copies it from policy.model_name;
    # VllmGeneration needs it.
    model_name: NotRequired[str]
    bad_words: NotRequired[list[str] | None]
    colocated: NotRequired[ColocationConfig]
    port_range_low: NotRequired[int]
    port_range_high: NotRequired[int]
    use_async_rollouts: NotRequired[bool]
    # A vLLM worker extension; configure_generation_config refuses it on other backends.
    worker_extension_cls_fqn: NotRequired[str | None]
    # Internal: the tokenizer's pad id, used to right-pad every batch in and out.
    _pad_token_id: NotRequired[int]
    # Internal: the drafter's (Eagle/draft model) weights arrive in the refit stream.
    _draft_weights_from_refit: NotRequired[bool]
    # Internal: that stream carries the drafter's FULL weight set (Automodel co-training).
    _draft_full_refit: NotRequired[bool]
    # Internal: the MTP layer's weights arrive in the policy refit stream (trained MTP).
    _mtp_weights_from_refit: NotRequired[bool]
    # Internal, debug only: measure the exact generation arguments sent over Ray.
    _debug_payload_metrics: NotRequired[bool]


class VllmSpecificArgs(TypedDict):
    """The ``generation.vllm_cfg`` section: engine settings nemo_gen interprets.

    Workers also read keys this type does not declare, as NeMo-RL's do:
    ``enable_prefix_caching`` (absent or None: on iff compute capability >= 8),
    ``enable_vllm_metrics_logger``, ``vllm_metrics_logger_interval``, ``use_deep_gemm``,
    ``num_first_layers_in_bf16``, ``num_last_layers_in_bf16``, ``worker_extension_cls``, and nemo_gen's
    ``max_num_seqs`` and ``max_cudagraph_capture_size`` (vLLM's engine arguments of those names).
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    gpu_memory_utilization: float
    max_model_len: int
    # configure_generation_config sets it when absent.
    skip_tokenizer_init: bool
    async_engine: bool
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"]
    # Engine settings. load_format is set by configure_generation_config.
    load_format: NotRequired[str]
    precision: NotRequired[str]
    logprobs_mode: NotRequired[Literal["processed_logprobs", "raw_logprobs"]]
    cap_max_tokens_to_context: NotRequired[bool]
    is_mx: NotRequired[bool]
    enforce_eager: NotRequired[bool]
    enable_return_routed_experts: NotRequired[bool]
    use_tqdm: NotRequired[bool]
    # OpenAI-compatible HTTP server next to the engine, and its refit endpoints.
    expose_http_server: NotRequired[bool]
    http_refit_api_key_env_var: NotRequired[str | None]
    http_refit_server_port: NotRequired[int | None]
    zmq_refit_server_port: NotRequired[int | None]
    http_server_serving_chat_kwargs: NotRequired[dict[str, Any]]
    tool_parser_plugin: NotRequired[str | None]
    reasoning_parser_plugin: NotRequired[str | None]
    # Video frame settings (NeMo-RL's VllmVideoConfig), pushed into tokenizer and kwargs.
    video: NotRequired[dict[str, Any]]
    reset_encoder_cache_after_weight_update: NotRequired[bool]
    # Environment variables forwarded to every vLLM worker.
    env_vars: NotRequired[dict[str, str]]


class VllmConfig(GenerationConfig):
    """``GenerationConfig`` for ``backend: vllm``."""

    vllm_cfg: VllmSpecificArgs
    # Passed through verbatim to vllm.LLM / AsyncEngineArgs (speculative_config, ...).
    vllm_kwargs: NotRequired[dict[str, Any]]
    # None (CUDA IPC or NCCL broadcast), "vllm_s3_sparse", "vllm_zmq_sparse", "nixl",
    # "nccl_reshard", or a "module:ClassName" custom checkpoint engine.
    refit_transport: NotRequired[str | None]
    refit_cfg: NotRequired[dict[str, Any] | None]
    quant_cfg: NotRequired[dict[str, Any] | None]
    real_quant: NotRequired[bool]
    real_quant_export_cpu_offload: NotRequired[bool]
    real_quant_ignore: NotRequired[list[str] | None]


def should_use_async_rollouts(generation_config: Mapping[str, Any] | None) -> bool:
    """Whether the configured backend produces rollouts asynchronously.

    Per backend: dynamo always; sglang per ``use_async_rollouts``; vllm per
    ``vllm_cfg.async_engine``; trtllm and megatron always, but they refuse a config that
    asks for their removed synchronous engine; anything else (or no config) never.
    """
    if generation_config is None:
        return False
    backend = generation_config.get("backend", "")
    if backend == DYNAMO_BACKEND:
        return True
    if backend == SGLANG_BACKEND:
        return bool(generation_config.get("use_async_rollouts", False))
    if backend == VLLM_BACKEND:
        return bool((generation_config.get("vllm_cfg") or {}).get("async_engine", False))
    if backend == TRTLLM_BACKEND:
        if not (generation_config.get("trtllm_cfg") or {}).get("async_engine", False):
            raise ConfigError(
                "the TRT-LLM backend requires trtllm_cfg.async_engine=true; the synchronous "
                "engine path (async_engine=false) is no longer supported",
                field="generation.trtllm_cfg.async_engine",
            )
        return True
    if backend == MEGATRON_BACKEND:
        mcore_cfg = generation_config.get("mcore_generation_config") or {}
        if mcore_cfg.get("async_engine") is not None:
            raise ConfigError(
                "Megatron inference always uses the async engine; this parameter was removed",
                field="generation.mcore_generation_config.async_engine",
            )
        return True
    return False


@dataclass
class GenerationSamplingParams:
    """The sampling profile of one rollout, passed explicitly to rollout entry points.

    Built from the train (or validation) fields of a ``GenerationConfig`` so the sampling a
    rollout uses is visible at the call site instead of travelling inside the config.
    """

    temperature: float
    top_p: float
    top_k: int | None

    @classmethod
    def from_generation_config(
        cls, generation_config: Mapping[str, Any]
    ) -> GenerationSamplingParams:
        """The train-time profile: ``temperature``, ``top_p`` and ``top_k``."""
        return cls(
            temperature=generation_config["temperature"],
            top_p=generation_config["top_p"],
            top_k=generation_config["top_k"],
        )
