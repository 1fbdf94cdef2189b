"""The generation contract: config and data shapes, and the ``GenerationInterface`` ABC.

This module owns what every generation backend agrees on, mirroring NeMo-RL's
``nemo_rl.models.generation.interfaces``:

- the config TypedDicts (``GenerationConfig`` and its vLLM extension ``VllmConfig``), declared in
  ``config_shapes`` and re-exported here;
- the batch shapes that go in and come out (``GenerationDatumSpec``,
  ``GenerationOutputSpec``) and the right-padding check both must pass, declared in
  ``batch_shapes`` and re-exported here;
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
from typing import TYPE_CHECKING, Any

from nemo_gen.generation.batch_shapes import GenerationDatumSpec, GenerationOutputSpec, verify_right_padding
from nemo_gen.generation.config_shapes import (
    CheckpointEngineConfig,
    ColocationConfig,
    GenerationConfig,
    GenerationSamplingParams,
    OptionalResourcesConfig,
    ResourcesConfig,
    VllmConfig,
    VllmSpecificArgs,
    should_use_async_rollouts,
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
