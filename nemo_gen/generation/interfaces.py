"""The generation contract: config and data shapes, and the ``GenerationInterface`` ABC.

This module owns what every generation backend agrees on, mirroring NeMo-RL's
``nemo_rl.models.generation.interfaces``:

- the config TypedDicts (``GenerationConfig`` and its vLLM extension ``VllmConfig``);
- the batch shapes that go in and come out (``GenerationDatumSpec``,
  ``GenerationOutputSpec``) and the right-padding check both must pass;
- ``GenerationInterface``, the ABC a backend (``nemo_gen.generation.vllm.VllmGeneration``)
  implements, with NeMo-RL's defaults for the optional hooks.

It imports nothing heavy at module import: torch is imported inside
``verify_right_padding``, and tensor / ``ray.ObjectRef`` annotations are real types only
for type checkers (``Any`` at runtime), so ``import nemo_gen.generation`` stays cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict

from nemo_gen.errors import ConfigError
from nemo_gen.generation.constants import (
    DYNAMO_BACKEND,
    MEGATRON_BACKEND,
    SGLANG_BACKEND,
    TRTLLM_BACKEND,
    VLLM_BACKEND,
)

if TYPE_CHECKING:
    from ray import ObjectRef
    from torch import Tensor
else:
    ObjectRef = Any
    Tensor = Any

__all__ = [
    "CheckpointEngineConfig",
    "CollectiveSenderSpec",
    "ColocationConfig",
    "GenerationConfig",
    "GenerationDatumSpec",
    "GenerationInterface",
    "GenerationOutputSpec",
    "GenerationSamplingParams",
    "OptionalResourcesConfig",
    "ResourcesConfig",
    "VllmConfig",
    "VllmSpecificArgs",
    "should_use_async_rollouts",
    "verify_right_padding",
]


# --------------------------------------------------------------------------------------
# Config shapes
# --------------------------------------------------------------------------------------


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
    ``num_first_layers_in_bf16``, ``num_last_layers_in_bf16`` and ``worker_extension_cls``.
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


# --------------------------------------------------------------------------------------
# Batch shapes
# --------------------------------------------------------------------------------------


class GenerationDatumSpec(TypedDict):
    """A generation request batch.

    - ``input_ids``: 2-D token ids, **right-padded** with ``_pad_token_id``.
    - ``input_lengths``: the unpadded length of each row.
    - ``stop_strings``: optional, a list of stop strings per sample.
    - ``__extra__``: backend-specific fields may ride along.

    Example, lengths [3, 5, 2]::

        input_ids = [[101, 2054, 2003,    0,    0],
                     [101, 2054, 2003, 2001, 1996],
                     [101, 2054,    0,    0,    0]]
        input_lengths = [3, 5, 2]

    Producers and consumers keep the padding on the right; ``verify_right_padding``
    checks it.
    """

    input_ids: Tensor
    input_lengths: Tensor
    stop_strings: NotRequired[list[list[str] | None]]
    __extra__: Any


class GenerationOutputSpec(TypedDict):
    """A generation result batch, row-aligned with the request.

    - ``output_ids``: the prompt, immediately followed by the generated tokens, then
      ``_pad_token_id`` padding (right-padded).
    - ``generation_lengths``: generated tokens only.
    - ``unpadded_sequence_lengths``: prompt length plus generated length.
    - ``logprobs``: same shape as ``output_ids``; 0 at prompt and padding positions, the
      sampled token's logprob at generated positions.
    - ``truncated``: optional bool per row, True when generation stopped on the length
      limit (vLLM ``finish_reason == "length"``).
    - ``routed_experts`` and ``r3_routed_experts_{missing,expected,actual}_routes``:
      optional MoE routing, in the narrowest signed int that fits (int8 up to 128 experts,
      int16 up to 32,768, else int32; int16 when the count is unknown); -1 marks a
      missing route.

    Example, prompts of 3 and 5 tokens, 4 and 2 generated::

        output_ids = [[101, 2054, 2003, 2023, 2003, 1037, 2200, 0],
                      [101, 2054, 2003, 2001, 1996, 3014, 2005, 0]]
        generation_lengths = [4, 2]
        unpadded_sequence_lengths = [7, 7]
    """

    output_ids: Tensor
    generation_lengths: Tensor
    unpadded_sequence_lengths: Tensor
    logprobs: Tensor
    truncated: NotRequired[Tensor]
    routed_experts: NotRequired[Tensor]
    r3_routed_experts_missing_routes: NotRequired[Tensor]
    r3_routed_experts_expected_routes: NotRequired[Tensor]
    r3_routed_experts_actual_routes: NotRequired[Tensor]
    __extra__: Any


def verify_right_padding(
    data: Mapping[str, Any], pad_value: int, raise_error: bool = True
) -> tuple[bool, str | None]:
    """Check that a batch is right-padded with ``pad_value`` beyond each row's length.

    ``data`` holds either ``input_ids`` + ``input_lengths`` (a ``GenerationDatumSpec``) or
    ``output_ids`` + ``unpadded_sequence_lengths`` (a ``GenerationOutputSpec``); the
    request pair is checked when both are present.

    Args:
        data: The batch; any mapping (a dict or a batched-data dict).
        pad_value: The pad token id, normally the config's ``_pad_token_id``.
        raise_error: Raise ``ValueError`` on the first violation instead of returning it.

    Returns:
        ``(True, None)`` when the padding is right, else ``(False, message)``; the message
        describes the first violating row.

    Raises:
        ValueError: ``pad_value`` is None (always, whatever ``raise_error`` says: it is a
            caller bug, not a data problem), or a violation was found and ``raise_error``.
    """
    import torch  # deferred: keeps `import nemo_gen.generation` free of torch

    if pad_value is None:
        # NeMo-RL asserts here; a ValueError survives `python -O`.
        raise ValueError(
            "pad_value is None: the tokenizer has no pad_token_id. Load the tokenizer so "
            "that pad_token_id is set (NeMo-RL's get_tokenizer(...) sets it when absent) "
            "and pass the generation config's _pad_token_id."
        )

    def _fail(message: str) -> tuple[bool, str | None]:
        if raise_error:
            raise ValueError(message)
        return False, message

    if "input_ids" in data and "input_lengths" in data:
        tensor, lengths = data["input_ids"], data["input_lengths"]
    elif "output_ids" in data and "unpadded_sequence_lengths" in data:
        tensor, lengths = data["output_ids"], data["unpadded_sequence_lengths"]
    else:
        return _fail(
            "Could not find the required pairs of fields. Expected either (input_ids, "
            "input_lengths) or (output_ids, unpadded_sequence_lengths). "
            f"Got keys: {list(data.keys())}"
        )

    tensor = torch.as_tensor(tensor)
    lengths = torch.as_tensor(lengths).reshape(-1)
    if tensor.ndim != 2:
        return _fail(f"Expected 2D tensor for padding check, got shape {tuple(tensor.shape)}")
    batch_size, seq_len = tensor.shape
    if lengths.shape[0] != batch_size:
        return _fail(
            f"Mismatch between tensor batch size ({batch_size}) and lengths tensor size "
            f"({lengths.shape[0]})"
        )

    # One vectorised pass, then report the first offending row the way a row-by-row scan
    # would (length problems and stray tokens are reported in row order).
    lengths = lengths.to(device=tensor.device, dtype=torch.long)
    after_length = torch.arange(seq_len, device=tensor.device)[None, :] >= lengths[:, None]
    stray = after_length & (tensor != pad_value)
    bad_length = (lengths > seq_len) | (lengths < 0)
    bad_rows = torch.nonzero(bad_length | stray.any(dim=1)).flatten()
    if bad_rows.numel() == 0:
        return True, None
    i = int(bad_rows[0])
    length = int(lengths[i])
    if length > seq_len:
        return _fail(f"Length {length} at index {i} exceeds tensor sequence dimension {seq_len}")
    if length < 0:
        return _fail(f"Length {length} at index {i} is negative")
    positions = torch.nonzero(stray[i]).flatten().tolist()
    return _fail(
        f"Non-padding values found after specified length at index {i}: positions {positions}"
    )


# --------------------------------------------------------------------------------------
# The backend contract
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveSenderSpec:
    """What the policy side needs to pack and send weights over NCCL to this backend."""

    nccl_peer: str = "nemo"
    buffer_size_bytes: int | None = None
    num_buffers: int | None = None


class GenerationInterface(ABC):
    """A generation backend: takes right-padded token batches, returns generations.

    Subclasses implement the five abstract methods. The remaining methods are optional
    hooks whose defaults are NeMo-RL's: capabilities a backend lacks report False/None/{}
    where "not supported" is a valid answer, and raise ``NotImplementedError`` where a
    caller relying on them would otherwise silently get wrong behaviour (refit paths,
    fleet health).
    """

    # ---- required -------------------------------------------------------------------

    @abstractmethod
    def init_collective(
        self, ip: str, port: int, world_size: int, *, train_world_size: int
    ) -> list[ObjectRef]:
        """Join the trainer's weight-transfer collective at ``ip:port``.

        Returns the Ray futures of the workers' joins; the caller waits on them together
        with the trainer's side, since neither completes alone.
        """

    @abstractmethod
    def generate(self, data: Mapping[str, Any], greedy: bool = False) -> Mapping[str, Any]:
        """Generate for a ``GenerationDatumSpec`` batch; return a ``GenerationOutputSpec``."""

    @abstractmethod
    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Ready the engine for a generation phase (start or wake it).

        Idempotent: on an engine that is already awake it must be safe and cheap.
        """

    @abstractmethod
    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        """Wind down after a generation phase.

        Callers may pass ``release_gpu`` (keyword, default True): True means the caller
        needs the GPUs (a training step, a checkpoint save), so even a colocated engine
        must stand down fully; False means only that the phase is over. Only a colocated
        Megatron backend honours it in NeMo-RL; engines on dedicated GPUs ignore it.
        """

    @abstractmethod
    def shutdown(self) -> bool:
        """Release every generation resource; calling it again must be safe."""

    # ---- optional hooks: capabilities -------------------------------------------------

    @property
    def requires_kv_scale_sync(self) -> bool:
        """Whether FP8 KV-cache scales must be synchronised from the trainer on refit."""
        return False

    def get_collective_sender_spec(self) -> CollectiveSenderSpec:
        """The NCCL protocol and packed-buffer geometry the policy side must use."""
        return CollectiveSenderSpec()

    def get_inference_world_size(self) -> int | None:
        """A backend-specific collective world size, or None to use the default."""
        return None

    def invalidate_kv_cache(self) -> bool:
        """Drop reusable caches (prefix/KV) after a weight update; False if none exist."""
        return False

    def blocks_training(self) -> bool:
        """Whether the engine must stand down before a training step (shares its GPUs)."""
        return False

    def wake_carries_weight_updates(self) -> bool:
        """Whether ``prepare_for_generation`` alone makes the engine serve the newest weights.

        Backends whose wake does not reload weights return False, so the caller refits.
        """
        return False

    def clear_logger_metrics(self) -> None:
        """Reset collected performance metrics; a no-op for backends that collect none."""
        return None

    def get_logger_metrics(self) -> dict[str, Any]:
        """Collected performance metrics, in a backend-specific layout; ``{}`` if none."""
        return {}

    # ---- optional hooks: refit and fleet health (refuse unless implemented) -----------

    def _unsupported(self, hook: str, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} does not implement {hook}() ({what}); "
            "this optional GenerationInterface hook must be overridden by backends that "
            "support it"
        )

    def prepare_refit_info(self, state_dict_info: dict[str, Any]) -> None:
        """Record the names, shapes and dtypes of the weights the trainer will send."""
        raise self._unsupported("prepare_refit_info", "refit metadata")

    def update_weights_via_ipc_zmq(self) -> list[ObjectRef]:
        """Receive new weights over colocated CUDA IPC handles sent through ZMQ."""
        raise self._unsupported("update_weights_via_ipc_zmq", "colocated CUDA-IPC refit")

    def update_weights_from_collective(
        self, refit_timeout_s: float | None = None
    ) -> list[ObjectRef]:
        """Receive new weights from the trainer's NCCL broadcast.

        ``refit_timeout_s`` is in every backend's signature because the refit caller
        passes it polymorphically; a backend that cannot enforce a deadline must refuse a
        non-None value rather than ignore it.
        """
        raise self._unsupported("update_weights_from_collective", "collective refit")

    def prepare_nccl_reshard_refit_info(self, refit_info: dict[str, Any]) -> None:
        """Record per-layer parameter metadata for the ``nccl_reshard`` transport."""
        raise self._unsupported("prepare_nccl_reshard_refit_info", "nccl_reshard refit")

    def nccl_reshard_refit(self, refit_timeout_s: float | None = None) -> list[ObjectRef]:
        """Receive weights from the training workers via ``nccl_reshard``."""
        raise self._unsupported("nccl_reshard_refit", "nccl_reshard refit")

    def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
        """Route shard selection through fleet health (``monitor`` + ``selector``).

        Declared on the interface, not probed with ``hasattr``, so an unsupported backend
        says so itself.
        """
        raise NotImplementedError(
            "async_rl.generation_fleet_health.enabled=true is not supported for the "
            f"{type(self).__name__} generation backend"
        )
