"""NeMo-RL's colocated refit, received in a vLLM worker: ``nemo_gen_update_weights_via_ipc_zmq``
connects a ZMQ REP socket to the policy worker on the same GPU (``ipc:///tmp/<GPU-UUID>.sock``),
rebuilds each batch's buffer from its CUDA IPC handle, and loads the tensors through the same
``WeightLoad`` as every other refit. The protocol (framing, packing, manifest, ACKs) is
``nemo_gen.core.ipc_zmq``'s; this module holds only what needs CUDA and zmq.
"""

from __future__ import annotations

from typing import Any

from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.ipc_zmq import SOCKET_TIMEOUT_MS, Entry, Slice, receive


def device_address(device_index: int) -> str:
    """Where NeMo-RL's policy worker on this GPU binds (its ``get_zmq_address``: NVML's UUID)."""
    import torch

    return f"ipc:///tmp/GPU-{torch.cuda.get_device_properties(device_index).uuid}.sock"


class IpcZmqWorkerMixin:
    """Mixed into nemo_gen's worker extension; ``self`` is the vLLM worker."""

    def nemo_gen_update_weights_via_ipc_zmq(self, entries: list[Entry], timeout_s: float,
                                            address: str | None = None) -> int:
        """Receive one stream and load it; returns the tensors loaded. Raises when the stream did not
        match ``entries`` or a batch failed to load (after answering the sender: it is never left
        waiting); the shard then holds no version and is quarantined."""
        import torch
        import zmq
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = self.device.index
        timeout_ms = int(timeout_s * 1000) if timeout_s else SOCKET_TIMEOUT_MS
        context = zmq.Context()
        sock = context.socket(zmq.REP)
        for option, value in ((zmq.SNDTIMEO, timeout_ms), (zmq.RCVTIMEO, timeout_ms), (zmq.LINGER, 0)):
            sock.setsockopt(option, value)
        sock.connect(address or device_address(index))
        load = self.nemo_gen_weight_load(WeightTarget.POLICY)  # (the worker extension's: every refit loads through it)
        held: list[Any] = []  # the batch's buffer: dropped before its ACK lets the sender reuse it

        def open_buffer(handle: Any) -> Any:
            args = list(handle[0])
            args[6] = index  # the handle names the sender's device ordinal; same GPU, ours
            held.append(rebuild_cuda_tensor(*args))
            return held[-1]

        def load_batch(buffer: Any, slices: list[Slice]) -> None:
            weights = [(s.name, buffer[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape))
                       for s in slices]
            if load.path != "direct":  # a layerwise reload may keep a tensor past this batch's ACK
                weights = [(name, tensor.clone()) for name, tensor in weights]
            load.load(weights)

        def release() -> None:
            torch.cuda.current_stream().synchronize()
            held.clear()

        load.begin()
        try:
            stats = receive(sock.recv, sock.send, entries, open_buffer, load_batch, release, load.finish)
        finally:
            sock.close()
            context.term()
        self.nemo_gen_last_load = load.path
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            getattr(self.model_runner, reset, lambda: None)()
        return stats.tensors
