"""NeMo-RL's colocated refit protocol (``stream_weights_via_ipc_zmq``), received by
``nemo_gen.core.ipc_zmq.receive`` over real ZMQ sockets, on CPU: the sender below packs CPU tensors
the way NeMo-RL's ``stream_weights_via_ipc_zmq_impl`` packs CUDA ones (ping-pong halves, 512-byte
alignment, an oversized tensor in its own buffer, an ACK awaited before a buffer is reused,
COMPLETE pickled as NeMo-RL's own enum) and sends the buffer where NeMo-RL sends its CUDA IPC
handle. The CUDA IPC part runs in tests/gpu/test_colocated_gpu.py."""

from __future__ import annotations

import enum
import pickle
import sys
import threading
import types

import pytest

from nemo_gen.core.ipc_zmq import (
    ACK, IPCProtocol, IpcManifestError, aligned, entries_of, is_complete, layout, loads, receive,
)

zmq = pytest.importorskip("zmq")
torch = pytest.importorskip("torch")


@pytest.fixture
def nemo_rl_protocol(monkeypatch):
    """NeMo-RL's ``IPCProtocol``, importable under its own module name (for pickling only)."""
    module = types.ModuleType("nemo_rl.models.policy.utils")

    class NemoRlIPCProtocol(enum.Enum):
        COMPLETE = "complete"
        ACK = "ack"

    NemoRlIPCProtocol.__module__ = module.__name__
    NemoRlIPCProtocol.__qualname__ = NemoRlIPCProtocol.__name__ = "IPCProtocol"
    module.IPCProtocol = NemoRlIPCProtocol
    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.policy"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return NemoRlIPCProtocol


def nemo_rl_send(sock, params, buffer_size_bytes: int, complete) -> int:
    """NeMo-RL's sender, on CPU; returns the batches sent."""
    half = buffer_size_bytes // 2
    buffers = [torch.empty(aligned(half), dtype=torch.uint8) for _ in range(2)]
    current, used, names, await_recv, groups = 0, 0, [], False, 0

    def send(buffer, names, used, await_recv):
        if await_recv:
            assert sock.recv() == ACK
        sock.send_pyobj((buffer[:used].clone(), list(names), used))  # where NeMo-RL sends the IPC handle

    def pack(buffer, tensor, used):
        nbytes = tensor.numel() * tensor.element_size()
        buffer[used:used + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        return used + aligned(nbytes)

    for name, tensor in params:
        size = aligned(tensor.numel() * tensor.element_size())
        if size > half:  # its own buffer, its ACK taken before the buffer goes
            if names:
                send(buffers[current], names, used, await_recv)
                await_recv, groups, current, used, names = True, groups + 1, 1 - current, 0, []
            own = torch.empty(size, dtype=torch.uint8)
            send(own, [name], pack(own, tensor, 0), await_recv)
            assert sock.recv() == ACK
            await_recv, groups = False, groups + 1
            continue
        if used + size > half:
            send(buffers[current], names, used, await_recv)
            await_recv, groups, current, used, names = True, groups + 1, 1 - current, 0, []
        names.append(name)
        used = pack(buffers[current], tensor, used)
    if names:
        send(buffers[current], names, used, await_recv)
        await_recv, groups = True, groups + 1
    if await_recv:
        assert sock.recv() == ACK
    sock.send_pyobj(complete)
    assert sock.recv() == ACK
    return groups


def params():
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(64, 32, dtype=torch.bfloat16),  # 4 KiB: bigger than a half, its own buffer
        "layers.0.q.weight": torch.randn(8, 8),
        "layers.0.norm.weight": torch.randn(7, dtype=torch.float16),  # 14 bytes: padded to 512
        "layers.0.k.weight": torch.randn(8, 8),
        "lm_head.weight": torch.randn(16, 4),
    }


def run(tmp_path, sent, announced, complete, buffer_size=2048, load_error=None):
    """Stream ``sent`` from a NeMo-RL sender to ``receive`` announced ``announced``; returns
    (what loaded, the receiver's error, the batches sent)."""
    address = f"ipc://{tmp_path}/GPU-test.sock"
    context = zmq.Context()
    req, rep = context.socket(zmq.REQ), context.socket(zmq.REP)
    for s in (req, rep):
        s.setsockopt(zmq.SNDTIMEO, 20_000)
        s.setsockopt(zmq.RCVTIMEO, 20_000)
        s.setsockopt(zmq.LINGER, 0)
    req.bind(address)
    rep.connect(address)
    out: dict = {"sent": None}
    sender = threading.Thread(target=lambda: out.update(sent=nemo_rl_send(req, sent.items(), buffer_size, complete)))
    sender.start()
    loaded, events = {}, []

    def load(buffer, slices):
        if load_error and any(s.name == load_error for s in slices):
            raise RuntimeError(f"cannot load {load_error}")
        for s in slices:
            loaded[s.name] = buffer[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape).clone()
        events.append("load")

    error = None
    try:
        receive(rep.recv, rep.send, entries_of(announced), lambda handle: handle, load,
                lambda: events.append("release"), lambda: events.append("finalize"))
    except Exception as exc:
        error = exc
    sender.join(30)
    assert not sender.is_alive(), "the sender was left waiting for an ACK"
    req.close()
    rep.close()
    context.term()
    return loaded, error, out["sent"], events


def test_a_nemo_rl_stream_loads_every_tensor_exactly(tmp_path, nemo_rl_protocol):
    sent = params()
    info = {k: (v.shape, v.dtype) for k, v in sent.items()}
    loaded, error, batches, events = run(tmp_path, sent, info, nemo_rl_protocol.COMPLETE)
    assert error is None and batches >= 3  # the oversized embedding, and the rest split over the halves
    assert set(loaded) == set(sent)
    for name, tensor in sent.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert events[-1] == "finalize" and events.count("release") == batches  # each batch released before its ACK


def test_an_unexpected_or_duplicate_name_fails_the_stream_but_the_sender_completes(tmp_path, nemo_rl_protocol):
    sent = params()
    info = {k: (v.shape, v.dtype) for k, v in sent.items() if k != "lm_head.weight"}
    loaded, error, _, events = run(tmp_path, sent, info, nemo_rl_protocol.COMPLETE)
    assert isinstance(error, IpcManifestError) and "unexpected keys (1): ['lm_head.weight']" in str(error)
    assert "finalize" not in events  # post-load processing runs only on a complete stream


def test_a_name_never_sent_is_missing_at_complete(tmp_path, nemo_rl_protocol):
    sent = params()
    info = {k: (v.shape, v.dtype) for k, v in sent.items()}
    info["layers.1.q.weight"] = (torch.Size([8, 8]), torch.float32)
    _, error, _, _ = run(tmp_path, sent, info, nemo_rl_protocol.COMPLETE)
    assert isinstance(error, IpcManifestError) and "missing keys (1): ['layers.1.q.weight']" in str(error)


def test_a_batch_that_fails_to_load_is_acked_and_the_stream_fails_at_complete(tmp_path, nemo_rl_protocol):
    sent = params()
    info = {k: (v.shape, v.dtype) for k, v in sent.items()}
    loaded, error, _, _ = run(tmp_path, sent, info, nemo_rl_protocol.COMPLETE, load_error="layers.0.q.weight")
    assert isinstance(error, IpcManifestError) and "weight load failed: RuntimeError: cannot load" in str(error)


def test_a_wrongly_announced_shape_is_caught_by_the_packing(tmp_path, nemo_rl_protocol):
    sent = params()
    info = {k: (v.shape, v.dtype) for k, v in sent.items()}
    info["layers.0.q.weight"] = (torch.Size([32, 8]), torch.float32)  # 1 KiB: past its 512-byte slot
    _, error, _, _ = run(tmp_path, sent, info, nemo_rl_protocol.COMPLETE)
    assert isinstance(error, IpcManifestError) and "the sender says" in str(error)


def test_complete_is_read_without_nemo_rl_installed(nemo_rl_protocol, monkeypatch):
    frame = pickle.dumps(nemo_rl_protocol.COMPLETE)
    for name in ("nemo_rl", "nemo_rl.models", "nemo_rl.models.policy", "nemo_rl.models.policy.utils"):
        monkeypatch.delitem(sys.modules, name)
    assert loads(frame) is IPCProtocol.COMPLETE and is_complete(loads(frame))
    assert not is_complete(("handle", ["x"], 512))


def test_layout_aligns_each_tensor_to_512_bytes_and_checks_the_end():
    info = {e[0]: e for e in entries_of({"a": ((3,), "torch.float32"), "b": ((600,), "bfloat16")})}
    slices = layout(["a", "b"], info, 512 + 1536)
    assert [(s.offset, s.nbytes) for s in slices] == [(0, 12), (512, 1200)]
    with pytest.raises(IpcManifestError, match="end at byte 2048, the sender says 2000"):
        layout(["a", "b"], info, 2000)
    with pytest.raises(ValueError, match="dtype 'complex64'"):
        entries_of({"c": ((2,), "complex64")})
