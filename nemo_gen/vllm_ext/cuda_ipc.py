"""The colocated GPU transport: a trainer's CUDA tensors read in place by engines on the same
GPU through CUDA IPC, with every memory handle shared once and only metadata per refit.

Torch only (no vLLM, no Ray): ``nemo_gen.vllm_ext.vllm_backend`` wraps it as the ``nemo_gen_ipc``
weight-transfer backend, and ``bench/cuda_ipc_refit.py`` measures it on a GPU.

Why not vLLM's ``ipc`` backend: per refit it either exports and opens one IPC handle per tensor
(unpacked) or packs every tensor into one reused buffer, waits for each chunk to be consumed,
and clones every tensor out of it before the model copies it into place (packed): more copies
and handles than the bytes need (docs/performance.md compares the two). Here the trainer's own
storages are exported once (a ``reduce_tensor`` per storage, kept while the trainer keeps the
storage) and opened once per engine; a refit is a list of (storage, offset, shape, dtype) and
the model's loaders copy straight out of the trainer's memory: one device copy per byte.

The contract that makes the zero-copy views safe: the trainer does not write its weights
between ``start_weight_update`` and ``finish_weight_update`` (its ``send_weights`` call blocks
for exactly that span), and it synchronizes its stream before sending.
"""

from __future__ import annotations

import itertools
import pickle
import secrets
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from nemo_gen.vllm_ext.views import typed_view

_serials = itertools.count(1)
# Layout numbers and storage keys name things across processes (an engine may take weights from
# several trainers in turn): this process's token makes them unique beyond one counter.
_TOKEN = secrets.token_hex(6)


def _serial() -> str:
    return f"{_TOKEN}-{next(_serials)}"


@dataclass(frozen=True)
class SharedTensor:
    """Where one tensor lives in the trainer's exported storages."""

    name: str
    storage: str  # the export's key: unique per exported storage, never reused
    offset: int  # bytes from the storage's start
    shape: tuple[int, ...]
    dtype: str


def plan(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[tuple[str, torch.Tensor, int]], dict[int, torch.Tensor]]:
    """Group tensors by the storage they live in: [(name, tensor, storage pointer)] and
    pointer -> a byte view of that whole storage. Non-contiguous tensors are not handled here
    (the sender copies them into its own storage first)."""
    rows, storages = [], {}
    for name, tensor in named:
        if not tensor.is_contiguous():
            raise ValueError(f"{name} is not contiguous")
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in storages:
            storages[ptr] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage)
        rows.append((name, tensor, ptr))
    return rows, storages


class IpcSender:
    """Trainer side. ``update_info(named_tensors)`` returns what one refit sends: the tensors'
    places, and the handles of every storage they live in (exported on first sight and kept,
    with a reference to the storage so its address is not reused while engines map it, until an
    update no longer sends it)."""

    def __init__(self):
        self._exports: dict[int, tuple[str, torch.Tensor, tuple]] = {}  # ptr -> (key, storage view, args)
        self._private: dict[str, torch.Tensor] = {}  # name -> contiguous copy of a non-contiguous tensor
        self._last: tuple[list, dict[str, Any]] | None = None  # (layout signature, its update info)

    def update_info(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        tensors = []
        for name, tensor in named:
            if not tensor.is_contiguous():  # kept and reused: its pages are touched once
                private = self._private.get(name)
                if private is None or private.shape != tensor.shape or private.dtype != tensor.dtype:
                    private = self._private[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                private.copy_(tensor)
                tensor = private
            tensors.append((name, tensor))
        # A trainer refits the same tensors over and over (an optimizer writes in place): the
        # same layout is the same update info, built once; a new ``layout`` number tells the
        # engines to rebuild their views. This runs on every refit (~1 us a tensor counts here).
        signature = [(n, t.data_ptr(), t.shape, t.dtype) for n, t in tensors]
        if self._last is None or self._last[0] != signature:
            # Devices are checked for a new layout only: an unchanged one has every tensor at the
            # address a CUDA tensor had (CUDA's unified addressing keeps host memory elsewhere).
            for name, tensor in tensors:
                if tensor.device.type != "cuda":
                    raise ValueError(f"nemo_gen_ipc sends CUDA tensors; {name} is on {tensor.device}")
            self._last = (signature, self._build(tensors))
        # The engines read these bytes after this call returns: the trainer's queued writes
        # (an optimizer step) must have landed.
        torch.cuda.synchronize()
        return self._last[1]

    def _build(self, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        from torch.multiprocessing.reductions import reduce_tensor

        rows, storages = plan(tensors)
        uuid = str(torch.cuda.get_device_properties(rows[0][1].device).uuid) if rows else ""
        for ptr in [p for p in self._exports if p not in storages]:
            del self._exports[ptr]  # not sent any more: let the trainer free it (engines drop it too)
        live = {}
        for ptr, view in storages.items():
            if ptr not in self._exports or self._exports[ptr][1].numel() != view.numel():
                self._exports[ptr] = (f"{_serial()}-{ptr:x}", view, reduce_tensor(view)[1])
            key, _, args = self._exports[ptr]
            live[key] = {uuid: args}
        names, shapes, dtypes, keys, offsets = [], [], [], [], []
        for name, tensor, ptr in rows:
            names.append(name)
            shapes.append(list(tensor.shape))
            dtypes.append(str(tensor.dtype).removeprefix("torch."))
            keys.append(self._exports[ptr][0])
            offsets.append(tensor.data_ptr() - ptr)
        # Pickled once per layout: every update info carries the handles (an engine that joined
        # late needs them; a nemo_gen fleet's client sends an engine that loaded this layout last
        # only its number), as one opaque blob that costs a copy, not a pickling of each handle.
        return {"names": names, "shapes": shapes, "dtype_names": dtypes, "storages": keys, "offsets": offsets,
                "handles": pickle.dumps(live), "layout": _serial()}

    def close(self) -> None:
        self._exports.clear()
        self._private.clear()
        self._last = None


class IpcReceiver:
    """Engine side: opens each exported storage once (kept across refits, dropped when the
    trainer no longer lists it) and returns (name, view) pairs in place — no copy until the
    model's loaders copy into their parameters. Views are kept per layout: a refit with the
    layout of the last one costs no work here, and may name that layout alone (``layout_only``,
    what a nemo_gen fleet's client sends an engine that loaded it last)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._mapped: dict[str, torch.Tensor] = {}
        self._views: tuple[Any, list[tuple[str, torch.Tensor]]] | None = None  # (layout, its views)

    def tensors(self, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        layout = info.get("layout")
        held = None if self._views is None else self._views[0]
        if info.get("layout_only"):
            if layout is None or held != layout:
                raise ValueError(f"nemo_gen_ipc: an update names layout {layout!r} alone, but this engine holds "
                                 f"{held!r}: send the whole update info")
            return self._views[1]
        if layout is None or held != layout:
            self._views = (layout, self._open(info))
        return self._views[1]

    def _open(self, info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        handles = info["handles"]
        if isinstance(handles, bytes):
            handles = pickle.loads(handles)  # from the trainer that this engine takes weights from
        for key in [k for k in self._mapped if k not in handles]:
            del self._mapped[key]  # the trainer let that storage go
        for key, per_gpu in handles.items():
            if key in self._mapped:
                continue
            if uuid not in per_gpu:
                raise ValueError(
                    f"nemo_gen_ipc needs the trainer on this engine's GPU ({uuid}); the trainer's tensors are on "
                    f"{sorted(per_gpu)}: use a backend that crosses GPUs (nccl)"
                )
            args = list(per_gpu[uuid])
            args[6] = index  # the device index as this process numbers it
            self._mapped[key] = rebuild_cuda_tensor(*args)
        return [
            (name, typed_view(self._mapped[key], offset, shape, dtype))
            for name, shape, dtype, key, offset in zip(
                info["names"], info["shapes"], info["dtype_names"], info["storages"], info["offsets"]
            )
        ]

    def close(self) -> None:
        self._mapped.clear()
        self._views = None

