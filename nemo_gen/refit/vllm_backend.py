"""nemo_gen's shared-memory transport as a backend of vLLM's weight-transfer registry.

vLLM (``vllm/distributed/weight_transfer/``) defines the refit protocol a trainer drives:
``init_weight_transfer_engine`` -> ``start_weight_update`` (or ``start_draft_weight_update``) ->
``update_weights`` (one or more chunks) -> ``finish_weight_update``, with a worker-side engine
and a trainer-side engine per backend, picked by name. Its own backends move GPU tensors (CUDA
IPC for colocated engines, NCCL for separate ones); none moves CPU bytes between processes.
This module registers ours, ``"nemo_gen_shm"``, on both sides:

- ``SharedMemoryWeightTransferEngine`` (worker): an update names a staging file and the
  (name, shape, dtype, offset) of each tensor in it; the worker loads zero-copy views of it
  through ``WeightLoad`` (the direct CPU path, or vLLM's layerwise reload).
- ``SharedMemoryTrainerEngine`` (trainer): stages a vLLM ``WeightSource`` into a reused
  shared-memory file and drives one update through any ``VLLMWeightSyncClient``.

So a trainer written against vLLM's API refits a nemo_gen fleet the same way on CPU (this
backend) and on GPU (vLLM's ``ipc`` / ``nccl``): only the ``TrainerInitInfo`` changes, and the
fleet's ``weight_sync_client()`` is the client either way.

Importing this module registers both engines (idempotent). Worker processes import it through
``nemo_gen.refit.worker_ext``; a trainer imports it to use ``SharedMemoryTrainerInitInfo``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from nemo_gen.refit.worker_ext import ScratchPool, WeightLoad, open_staged, shared_with_policy

BACKEND = "nemo_gen_shm"


@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes arrive in a file both sides open."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the staging file, its size, and [name, shape, dtype, byte offset] per tensor."""

    path: str
    total: int
    entries: list = field(default_factory=list)

    def __post_init__(self):
        if not self.entries:
            raise ValueError("a nemo_gen_shm update names no tensors")
        if not os.path.exists(self.path):
            raise ValueError(f"staging file {self.path} does not exist on this node")

    # The fields vLLM's own update infos carry, so a client can check any backend's chunk alike.
    @property
    def names(self) -> list[str]:
        return [e[0] for e in self.entries]


class SharedMemoryWeightTransferEngine(WeightTransferEngine[SharedMemoryInitInfo, SharedMemoryUpdateInfo]):
    """Worker side: loads staged chunks into the update's target (the policy, or the drafter
    after ``start_draft_weight_update``: vLLM sets ``self.model`` / ``self.model_config``)."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.vllm_config = vllm_config
        self._pool = ScratchPool()  # reused across refits: its pages are touched once
        self._load: WeightLoad | None = None
        self.last_stats: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: SharedMemoryInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        self._load = WeightLoad(self.model, self.vllm_config, self.model_config, self._pool)
        self._load.begin()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises on a machine
        # with no accelerator; these bytes are host memory, loaded synchronously.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SharedMemoryUpdateInfo) -> None:
        if self._load is None:
            raise RuntimeError("update_weights before start_weight_update")
        weights = open_staged(update_info.path, update_info.total, [tuple(e) for e in update_info.entries])
        if self.model is not self._default_model:  # a draft update: never write the policy's tensors
            shared = set(shared_with_policy(self.model, self._default_model))
            weights = ((n, t) for n, t in weights if n not in shared)
        self._load.load(weights)

    def finish_weight_update(self) -> None:
        if self._load is not None:
            self._load.finish()
            self.last_stats = self._load.stats
            self._load = None

    def shutdown(self) -> None:
        self._load = None


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``nemo_gen_shm``: where to stage (a tmpfs every engine's node shares
    with the trainer) and the dtype floating tensors are staged in (None: as the source has
    them; the engines' loaders cast)."""

    backend: ClassVar[str] = BACKEND
    rank: int = field(default=0, kw_only=True)
    staging_dir: str = "/dev/shm"
    dtype: str | None = None


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
    """Stages the source into one reused shared-memory file per engine instance, then drives
    start -> one update -> finish through the client. The file's pages stay touched across
    rounds (a first touch costs ~30x a copy); ``shutdown`` removes it."""

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 staging_dir: str = "/dev/shm", dtype: str | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        from nemo_gen.refit.staging import SharedMemoryStaging

        os.makedirs(staging_dir, exist_ok=True)
        self.staging = SharedMemoryStaging(staging_dir, f"trainer-{id(self):x}")
        self.dtype = getattr(torch, dtype) if dtype else None

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client: Any, source: Any = None):
        if source is None:
            raise ValueError("nemo_gen_shm trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     staging_dir=init_info.staging_dir or tempfile.gettempdir(), dtype=init_info.dtype)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        from nemo_gen.core.refit import TensorMeta, layout

        metas = self.source.metadata()
        staged = []
        for m in metas:
            dtype = self.dtype if (self.dtype is not None and m.dtype.is_floating_point) else m.dtype
            staged.append(TensorMeta.of(m.name, tuple(m.shape), str(dtype).removeprefix("torch.")))
        placed, total = layout(staged)
        where = {p.name: p for p in placed}
        if not self.is_sender:
            return
        self.staging.ensure(total)
        for name, tensor in self.source:
            place = where.get(name)
            if place is None:
                raise ValueError(f"the weight source yielded {name!r}, which its metadata() did not declare")
            self.staging.write(place, tensor, getattr(torch, place.meta.dtype))
        self.client.start_weight_update()
        self.client.update_weights(
            {"path": str(self.staging.path), "total": total, "entries": [list(e) for e in self.staging.entries(placed)]}
        )
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.staging.close()


def register() -> None:
    """Add ``nemo_gen_shm`` to vLLM's worker and trainer registries (once per process)."""
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, SharedMemoryWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, SharedMemoryTrainerEngine)


register()
