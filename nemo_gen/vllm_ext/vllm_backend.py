"""nemo_gen's shared-memory transport as a backend of vLLM's weight-transfer registry.

vLLM (``vllm/distributed/weight_transfer/``) defines the refit protocol a trainer drives:
``init_weight_transfer_engine`` -> ``start_weight_update`` (or ``start_draft_weight_update``) ->
``update_weights`` (one or more chunks) -> ``finish_weight_update``, with a worker-side engine
and a trainer-side engine per backend, picked by name. Its own backends move GPU tensors (CUDA
IPC for colocated engines, NCCL for separate ones); none moves CPU bytes between processes,
and vLLM's IPC path re-exports or repacks and clones every tensor on every refit
(``bench/cuda_ipc_refit.py`` measures it against ours). This module registers two of ours, on
both sides:

- ``SharedMemoryWeightTransferEngine`` (worker): an update names a staging file and the
  (name, shape, dtype, offset) of each tensor in it; the worker loads zero-copy views of it
  through ``WeightLoad`` (the direct CPU path, or vLLM's layerwise reload).
- ``SharedMemoryTrainerEngine`` (trainer): stages a vLLM ``WeightSource`` into a reused
  shared-memory file and drives one update through any ``VLLMWeightSyncClient``.
- ``"nemo_gen_ipc"`` (``CudaIpcWeightTransferEngine`` / ``CudaIpcTrainerEngine``): a colocated
  GPU trainer's storages shared once through CUDA IPC, metadata only per refit, the engine's
  loaders copying straight out of the trainer's memory (``nemo_gen.vllm_ext.cuda_ipc``).

So a trainer written against vLLM's API refits a nemo_gen fleet the same way on CPU
(``nemo_gen_shm``) and on GPU (``nemo_gen_ipc``, or vLLM's ``ipc`` / ``nccl``): only the
``TrainerInitInfo`` changes, and the fleet's ``weight_sync_client()`` is the client either way.

Importing this module registers the engines (idempotent). Worker processes import it through
``nemo_gen.vllm_ext.worker_entry``; a trainer imports it for ``SharedMemoryTrainerInitInfo`` /
``CudaIpcTrainerInitInfo``.
"""

from __future__ import annotations

import os
import tempfile
import time
from abc import abstractmethod
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

from nemo_gen.core.digest import WeightDigest, first_mismatch
from nemo_gen.core.manifest import IPC_BACKEND
from nemo_gen.core.manifest import SHM_BACKEND as BACKEND
from nemo_gen.vllm_ext.copy_plan import CopyPlan
from nemo_gen.vllm_ext.digest import staged_form, tensor_digest, tensor_digests
from nemo_gen.vllm_ext.direct_load import ScratchPool
from nemo_gen.vllm_ext.worker_ext import WeightLoad, open_staged, shared_with_policy



@dataclass
class SharedMemoryInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the bytes arrive in a file both sides open."""


@dataclass
class SharedMemoryUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the staging file, its size, and [name, shape, dtype, byte offset] per tensor."""

    path: str
    total: int
    entries: list = field(default_factory=list)
    digests: list = field(default_factory=list)  # the trainer's digest of each entry (empty: unchecked)
    digest: str | None = None  # theirs combined (nemo_gen.core.digest)

    def __post_init__(self):
        if not self.entries:
            raise ValueError("a nemo_gen_shm update names no tensors")
        if not os.path.exists(self.path):
            raise ValueError(f"staging file {self.path} does not exist on this node")


class _LoadingEngine(WeightTransferEngine):
    """Worker side of our backends: each update's (name, tensor) pairs go through ``WeightLoad``
    into the update's target (the policy, or the drafter after ``start_draft_weight_update``:
    vLLM sets ``self.model`` / ``self.model_config``). Subclasses say where the tensors are."""

    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.vllm_config = vllm_config
        self._pool = ScratchPool()  # reused across refits: its pages are touched once
        self._load: WeightLoad | None = None
        self._plan: CopyPlan | None = None  # the last policy load, replayable while its sources stay
        self._transfer_s = 0.0  # this update's seconds in update_weights (stats)
        self.last_stats: dict[str, Any] = {}

    @abstractmethod
    def _weights(self, update_info: Any):
        """The update's (name, tensor) pairs, read in place."""

    def init_transfer_engine(self, init_info: Any) -> None:
        pass

    def start_weight_update(self) -> None:
        self._load = WeightLoad(self.model, self.vllm_config, self.model_config, self._pool, plan=self._plan)
        self._load.begin()
        self._transfer_s = 0.0

    def update_weights(self, update_info: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        # The base class ends with torch.accelerator.synchronize(), which raises on a machine
        # with no accelerator.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu":
            torch.accelerator.synchronize()
        # the transport's share of a refit: from the chunk's arrival until its bytes are in place
        self._transfer_s += time.perf_counter() - t0

    def receive_weights(self, update_info: Any) -> None:
        if self._load is None:
            raise RuntimeError("update_weights before start_weight_update")
        weights = self._weights(update_info)
        if update_info.digests:  # the trainer's bytes, or nothing loaded (a fresh read where ``weights`` is one-shot)
            check_digests(weights if isinstance(weights, list) else self._weights(update_info), update_info.digests)
        if self.model is not self._default_model:  # a draft update: never write the policy's tensors
            shared = set(shared_with_policy(self.model, self._default_model))
            self._load.load((n, t) for n, t in weights if n not in shared)
        elif self._load.replays(weights):
            self._load.replay()
        else:  # recorded when ``weights`` is a list the backend keeps (nemo_gen_ipc's views)
            self._plan = self._load.load(weights, record=isinstance(weights, list))

    def finish_weight_update(self) -> None:
        if self._load is not None:
            self._load.finish()
            self.last_stats = {**self._load.stats, "transfer_s": self._transfer_s}
            self._load = None

    def shutdown(self) -> None:
        self._load = None
        self._plan = None


class SharedMemoryWeightTransferEngine(_LoadingEngine):
    """``nemo_gen_shm``, worker side: zero-copy views of the staging file the update names."""

    init_info_cls = SharedMemoryInitInfo
    update_info_cls = SharedMemoryUpdateInfo

    def _weights(self, update_info: SharedMemoryUpdateInfo):
        return open_staged(update_info.path, update_info.total, [tuple(e) for e in update_info.entries])


@dataclass
class CudaIpcInitInfo(WeightTransferInitInfo):
    """Nothing to set up: handles travel with the updates and are opened once."""


@dataclass
class CudaIpcUpdateInfo(WeightTransferUpdateInfo):
    """``IpcSender.update_info``: per tensor its name, shape, dtype, storage key and offset; the
    IPC handle of every storage, per trainer GPU UUID; a layout name (same layout, same views).
    ``layout_only``: the short form, the layout alone, for an engine that loaded it last."""

    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    storages: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    handles: bytes = b""  # pickled {storage key: {GPU UUID: rebuild args}}
    layout: str | None = None
    layout_only: bool = False
    digests: list = field(default_factory=list)  # the trainer's digest of each tensor (empty: unchecked)
    digest: str | None = None  # theirs combined (nemo_gen.core.digest)

    def __post_init__(self):
        n = len(self.names)
        for name in ("shapes", "dtype_names", "storages", "offsets"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"nemo_gen_ipc update: {name} has {len(getattr(self, name))} entries for {n} names")


class CudaIpcWeightTransferEngine(_LoadingEngine):
    """``nemo_gen_ipc``, worker side: views into the trainer's own CUDA storages."""

    init_info_cls = CudaIpcInitInfo
    update_info_cls = CudaIpcUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        from nemo_gen.vllm_ext.cuda_ipc import IpcReceiver

        self._receiver = IpcReceiver(self.device)

    def _weights(self, update_info: CudaIpcUpdateInfo):
        return self._receiver.tensors(vars(update_info))  # its fields as they are (asdict deep-copies)

    def shutdown(self) -> None:
        super().shutdown()
        self._receiver.close()


TRAINER_STAGING = "trainer"  # the staging directory's name of trainer engines (nemo_gen.vllm_ext.staging)


@dataclass
class SharedMemoryTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``nemo_gen_shm``: where to stage (a tmpfs every engine's node shares
    with the trainer) and the dtype floating tensors are staged in (None: as the source has
    them; the engines' loaders cast)."""

    backend: ClassVar[str] = BACKEND
    rank: int = field(default=0, kw_only=True)
    staging_dir: str = "/dev/shm"
    dtype: str | None = None
    quantize: str | None = None  # "fp8": the linear weights sent as fp8 + scales (see trainer_source)


class SharedMemoryTrainerEngine(TrainerWeightTransferEngine[SharedMemoryTrainerInitInfo]):
    """Stages the source into one reused shared-memory file per engine instance, then drives
    start -> one update -> finish through the client. The file's pages stay touched across
    rounds (a first touch costs ~30x a copy); ``shutdown`` removes it."""

    init_info_cls = SharedMemoryTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True,
                 staging_dir: str = "/dev/shm", dtype: str | None = None) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        from nemo_gen.vllm_ext.staging import SharedMemoryStaging, reclaim_stale

        # Every trainer engine of this user shares one private directory, its own file in it;
        # files of trainers that died without shutdown() are removed here.
        reclaim_stale(staging_dir, TRAINER_STAGING)
        self.staging = SharedMemoryStaging(staging_dir, TRAINER_STAGING)
        self.dtype = getattr(torch, dtype) if dtype else None

    @classmethod
    def trainer_init(cls, init_info: SharedMemoryTrainerInitInfo, *, client: Any, source: Any = None):
        if source is None:
            raise ValueError("nemo_gen_shm trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=trainer_source(source, init_info, client), is_sender=init_info.is_sender,
                     staging_dir=init_info.staging_dir or tempfile.gettempdir(), dtype=init_info.dtype)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        from nemo_gen.core.manifest import TensorMeta, layout

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
        digests: dict[str, int] = {}
        for name, tensor in self.source:
            place = where.get(name)
            if place is None:
                raise ValueError(f"the weight source yielded {name!r}, which its metadata() did not declare")
            tensor = staged_form(tensor, getattr(torch, place.meta.dtype))
            if digesting(self.client):
                digests[name] = tensor_digest(tensor)  # on the trainer's device, as staged
            self.staging.write(place, tensor, getattr(torch, place.meta.dtype))
        entries = [list(e) for e in self.staging.entries(placed)]
        send_one_chunk(self.client, {"path": str(self.staging.path), "total": total, "entries": entries,
                                     **digest_fields([e[0] for e in entries], digests)})

    def shutdown(self) -> None:
        self.staging.close()


@dataclass
class CudaIpcTrainerInitInfo(TrainerInitInfo):
    """Trainer side of ``nemo_gen_ipc``: a trainer on the engines' GPU."""

    backend: ClassVar[str] = IPC_BACKEND
    rank: int = field(default=0, kw_only=True)
    quantize: str | None = None  # "fp8": the linear weights sent as fp8 + scales (see trainer_source)


class CudaIpcTrainerEngine(TrainerWeightTransferEngine[CudaIpcTrainerInitInfo]):
    """Exports each of the source's storages once (``IpcSender``) and sends one update of
    metadata per refit; the engines copy out of the trainer's memory while ``send_weights``
    blocks, so the trainer must not write its weights until it returns."""

    init_info_cls = CudaIpcTrainerInitInfo

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        from nemo_gen.vllm_ext.cuda_ipc import IpcSender

        self.sender = IpcSender()

    @classmethod
    def trainer_init(cls, init_info: CudaIpcTrainerInitInfo, *, client: Any, source: Any = None):
        if source is None:
            raise ValueError("nemo_gen_ipc trainer weight transfer requires a WeightSource")
        engine = cls(client=client, source=trainer_source(source, init_info, client), is_sender=init_info.is_sender)
        if engine.is_sender:
            client.init_weight_transfer_engine({})
        return engine

    def send_weights(self) -> None:
        if not self.is_sender:
            return
        named = list(self.source)
        info = self.sender.update_info(iter(named))
        if digesting(self.client):  # after update_info: the trainer's queued writes have landed
            info = {**info, **digest_fields(info["names"], {n: tensor_digest(t) for n, t in named})}
        send_one_chunk(self.client, info)

    def shutdown(self) -> None:
        self.sender.close()


def trainer_source(source: Any, init_info: Any, client: Any) -> Any:
    """The source a trainer engine sends: quantized to fp8 on the trainer (``Fp8Source``) when
    its init info says ``quantize="fp8"`` or the fleet's client does (``refit.quantize: trainer``
    sets ``client.quantize``), else ``source`` itself."""
    quantize = getattr(init_info, "quantize", None) or getattr(client, "quantize", None)
    if quantize is None:
        return source
    if quantize != "fp8":
        raise ValueError(f"trainer-side quantization {quantize!r}: only 'fp8' is known")
    from nemo_gen.vllm_ext.fp8 import Fp8Source

    return Fp8Source(source)


def digesting(client: Any) -> bool:
    """The fleet checks the weights' digest (``refit.digest``; a client that does not say: yes)."""
    return bool(getattr(client, "digest", True))


def digest_fields(names: list[str], digests: dict[str, int]) -> dict[str, Any]:
    """An update's ``digests`` (one per name, in the update's order) and ``digest``; none when
    nothing was digested."""
    if not digests:
        return {}
    values = [digests[n] for n in names]
    return {"digests": values, "digest": WeightDigest(tuple(names), tuple(values)).digest}


def check_digests(weights: Any, digests: list[int]) -> None:
    """Raise, naming the first tensor, unless ``weights`` (name, tensor) hash to ``digests``."""
    pairs = list(weights)
    problem = first_mismatch([n for n, _ in pairs], list(digests), tensor_digests(t for _, t in pairs))
    if problem:
        raise ValueError(problem)


def send_one_chunk(client: Any, update_info: dict[str, Any]) -> None:
    """One refit of one chunk through ``client``: in one call where the client offers it (a
    nemo_gen fleet's ``apply_weight_update``: one round trip into each engine), else as vLLM's
    three protocol steps (any ``VLLMWeightSyncClient``)."""
    apply = getattr(client, "apply_weight_update", None)
    if apply is not None:
        apply(update_info)
        return
    client.start_weight_update()
    client.update_weights(update_info)
    client.finish_weight_update()


class vllm_steps_only:
    """``client`` with vLLM's protocol methods only (no ``apply_weight_update``): a trainer
    engine given it drives start / update / finish, as on any ``VLLMWeightSyncClient`` —
    how benchmarks and tests run the three-step path on a fleet's client."""

    def __init__(self, client: Any):
        self._client = client

    def __getattr__(self, name: str) -> Any:
        if name == "apply_weight_update":
            raise AttributeError(name)
        return getattr(self._client, name)


def register() -> None:
    """Add our backends to vLLM's worker and trainer registries (once per process)."""
    for name, worker, trainer in ((BACKEND, SharedMemoryWeightTransferEngine, SharedMemoryTrainerEngine),
                                  (IPC_BACKEND, CudaIpcWeightTransferEngine, CudaIpcTrainerEngine)):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, worker)
        if name not in WeightTransferTrainerFactory._registry:
            WeightTransferTrainerFactory.register_engine(name, trainer)


register()
