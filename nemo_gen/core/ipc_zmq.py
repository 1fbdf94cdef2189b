"""The receiving side of NeMo-RL's colocated refit protocol (``stream_weights_via_ipc_zmq``), with
no torch, zmq or CUDA in it: the framing, the packing rules, the manifest checks and the ACK
discipline. ``nemo_gen.vllm_ext.ipc_zmq`` runs it in each vLLM worker over a ZMQ REP socket, with
CUDA IPC handles; tests run it over real ZMQ with CPU tensors.

The wire, as NeMo-RL's policy worker sends it (a REQ socket bound at ``ipc:///tmp/<GPU-UUID>.sock``;
the engine's worker on the same GPU connects its REP socket there):

- each batch is one pickled tuple ``(cuda_ipc_handle, [names], used_bytes)``: the handle of a
  uint8 buffer holding the named tensors' bytes back to back, each starting on a 512-byte
  boundary, in the order named; ``used_bytes`` is the aligned end of the last one;
- then the pickled ``IPCProtocol.COMPLETE`` (an enum of ``nemo_rl.models.policy.utils``, read
  here without NeMo-RL installed);
- the receiver answers every message with the bytes ``b"ack"``: after a batch once its views
  are dropped (the sender reuses the buffer then), even when the batch failed, and after
  COMPLETE even when the transfer is incomplete — a REP socket that does not answer leaves the
  sender blocked until its timeout.

The names and shapes come from ``prepare_refit_info(state_dict_info)`` beforehand; a batch with a
name seen before or not announced, or an offset that does not end at ``used_bytes``, is an error,
and so is a name never sent by COMPLETE (``IpcManifest``, NeMo-RL's ``_IPCWeightManifest``).
"""

from __future__ import annotations

import enum
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

ALIGNMENT = 512  # bytes: NeMo-RL's calculate_aligned_size
ACK = b"ack"  # IPCProtocol.ACK.value.encode()
SOCKET_TIMEOUT_MS = 120_000  # NeMo-RL's SNDTIMEO / RCVTIMEO on both sides

# Bytes per element of the dtypes a policy sends (torch's names, without "torch.").
ITEMSIZE: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}


class IPCProtocol(enum.Enum):
    """NeMo-RL's ``nemo_rl.models.policy.utils.IPCProtocol``, which its sender pickles."""

    COMPLETE = "complete"
    ACK = "ack"


class IpcManifestError(RuntimeError):
    """The stream did not match the announced state dict (NeMo-RL's ``IPCWeightManifestError``)."""


@dataclass(frozen=True)
class Slice:
    """One tensor's place in a batch's buffer."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


Entry = tuple[str, tuple[int, ...], str]  # name, shape, dtype name: the wire's form of state_dict_info


def aligned(nbytes: int, alignment: int = ALIGNMENT) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` (or its string) -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def entries_of(state_dict_info: Mapping[str, tuple[Any, Any]]) -> tuple[Entry, ...]:
    """NeMo-RL's ``{name: (shape, dtype)}`` as plain entries, in its order (the collective path's
    producer and consumer walk the same order); ``ValueError`` naming an unknown dtype."""
    out = []
    for name, (shape, dtype) in state_dict_info.items():
        dt = dtype_name(dtype)
        if dt not in ITEMSIZE:
            raise ValueError(f"state_dict_info[{name!r}]: dtype {dtype!r} is not one nemo_gen can receive")
        out.append((str(name), tuple(int(d) for d in shape), dt))
    return tuple(out)


def nbytes_of(shape: Sequence[int], dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for d in shape:
        n *= int(d)
    return n


def layout(keys: Sequence[str], info: Mapping[str, Entry], used_bytes: int) -> list[Slice]:
    """Where each named tensor sits in a batch's buffer; ``IpcManifestError`` when the packing
    does not end at ``used_bytes`` (wrong shapes or dtypes announced)."""
    out, offset = [], 0
    for key in keys:
        _, shape, dtype = info[key]
        size = nbytes_of(shape, dtype)
        out.append(Slice(key, offset, size, shape, dtype))
        offset += aligned(size)
    if offset != used_bytes:
        raise IpcManifestError(f"the batch's tensors end at byte {offset}, the sender says {used_bytes}: the "
                               "announced shapes or dtypes (prepare_refit_info) are not what was sent")
    return out


def _keys(label: str, keys: set[str]) -> str:
    ordered = sorted(keys)
    return f"{label} ({len(ordered)}): {ordered[:8]}{' ...' if len(ordered) > 8 else ''}"


class IpcManifest:
    """NeMo-RL's ``_IPCWeightManifest``: which announced names arrived, and what went wrong."""

    def __init__(self, expected: Iterable[str]):
        self.expected = set(expected)
        self.loaded: set[str] = set()
        self.errors: list[str] = []

    def validate_batch(self, keys: Sequence[str]) -> set[str] | None:
        """The batch's names, or None (an error is recorded, the batch is skipped)."""
        batch: set[str] = set()
        dup: set[str] = set()
        for key in keys:
            if key in batch:
                dup.add(key)
            batch.add(key)
        dup |= self.loaded & batch
        unexpected = batch - self.expected
        if dup:
            self.errors.append(_keys("duplicate keys", dup))
        if unexpected:
            self.errors.append(_keys("unexpected keys", unexpected))
        return None if self.errors else batch

    def record_loaded(self, keys: set[str]) -> None:
        self.loaded |= keys

    def record_load_failure(self, error: BaseException) -> None:
        message = f"{type(error).__name__}: {error}"
        self.errors.append(f"weight load failed: {message[:512]}{' ...' if len(message) > 512 else ''}")

    def require_complete(self) -> None:
        details = list(self.errors)
        if missing := self.expected - self.loaded:
            details.append(_keys("missing keys", missing))
        if details:
            raise IpcManifestError("; ".join(details))


class _Unpickler(pickle.Unpickler):
    """pickle's, with NeMo-RL's IPCProtocol read as ours (NeMo-RL need not be installed here)."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "IPCProtocol" and module.startswith("nemo_rl."):
            return IPCProtocol
        return super().find_class(module, name)


def loads(frame: bytes) -> Any:
    """One message as ``recv_pyobj`` would read it."""
    return _Unpickler(io.BytesIO(frame)).load()


def is_complete(message: Any) -> bool:
    return message is IPCProtocol.COMPLETE or (isinstance(message, str) and message == "complete")


@dataclass
class ReceiveStats:
    batches: int = 0
    tensors: int = 0
    bytes: int = 0


def receive(recv: Callable[[], bytes], send: Callable[[bytes], None], entries: Sequence[Entry],
            open_buffer: Callable[[Any], Any], load: Callable[[Any, list[Slice]], None],
            release: Callable[[], None], finalize: Callable[[], None]) -> ReceiveStats:
    """Serve one stream: for each batch, ``open_buffer(handle)`` -> ``load(buffer, slices)`` ->
    ``release()`` (synchronize, drop every view) -> ACK; at COMPLETE, the manifest must be complete,
    then ``finalize()``; ACK in every case. Raises ``IpcManifestError`` (or what ``finalize`` raised)
    after answering COMPLETE; a socket error (the sender died) propagates as it is."""
    info = {e[0]: e for e in entries}
    manifest = IpcManifest(info)
    stats = ReceiveStats()
    while True:
        message = loads(recv())
        if is_complete(message):
            try:
                manifest.require_complete()
                finalize()
            finally:
                send(ACK)
            return stats
        try:
            handle, keys, used_bytes = message
            batch = manifest.validate_batch(keys)
            if batch is not None:
                slices = layout(keys, info, used_bytes)
                load(open_buffer(handle), slices)
                manifest.record_loaded(batch)
                stats.batches += 1
                stats.tensors += len(slices)
                stats.bytes += int(used_bytes)
        except Exception as exc:  # recorded; the stream goes on so the sender is never left waiting
            manifest.record_load_failure(exc)
        finally:
            try:
                release()
            finally:
                send(ACK)


@dataclass(frozen=True)
class IpcZmqRefit:
    """The fleet tells a shard: receive NeMo-RL's stream (``entries``, announced by
    ``prepare_refit_info``) and serve it as ``version``. ``address``: the REP socket's peer (None:
    ``ipc:///tmp/<GPU-UUID>.sock`` of the worker's GPU, where NeMo-RL's policy worker binds);
    ``timeout_s`` bounds each message (NeMo-RL's 120 s); ``in_flight``: how running requests
    meet it (``nemo_gen.core.wire.InFlight``)."""

    entries: tuple[Entry, ...]
    version: int
    timeout_s: float
    in_flight: Any
    address: str | None = None
