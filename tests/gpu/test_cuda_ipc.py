"""The nemo_gen_ipc transport on a real GPU: a trainer process and an engine process on one
device, the engine loading the trainer's tensors in place through CUDA IPC.

Needs CUDA (skipped elsewhere; CI machines have none). Run on a GPU machine with
``python -m pytest tests/gpu``. Torch only: the vLLM side of the backend
(``CudaIpcWeightTransferEngine``) feeds these same views to the model's loaders.
"""

from __future__ import annotations

import pickle

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def make_policy(seed: int) -> torch.nn.Module:
    """A small model with the layouts a trainer has: separate parameters, a buffer of several
    tensors in one storage (Megatron-style flat buffers), and a transposed (non-contiguous) view."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.LayerNorm(512), torch.nn.Linear(512, 128))
    return model.cuda()


def named(policy: torch.nn.Module, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    out = list(policy.named_parameters())
    out.append(("flat.a", flat[:1024].view(32, 32)))
    out.append(("flat.b", flat[1024:1536]))
    out.append(("flat.t", flat[2048:4096].view(64, 32).t()))  # non-contiguous
    return out


def engine(conn) -> None:
    """The engine process: its own copy of every tensor, loaded from the trainer's views."""
    from nemo_gen.vllm_ext.cuda_ipc import IpcReceiver

    torch.cuda.set_device(0)
    receiver = IpcReceiver(torch.device("cuda", 0))
    params: dict[str, torch.Tensor] = {}
    conn.send("ready")
    while (msg := conn.recv()) != "stop":
        try:
            for name, view in receiver.tensors(msg):
                dst = params.setdefault(name, torch.empty(view.shape, dtype=view.dtype, device="cuda"))
                dst.copy_(view)  # what the model's weight loaders do
            torch.cuda.synchronize()
            conn.send({"sums": {n: float(p.double().sum()) for n, p in params.items()},
                       "mapped": len(receiver._mapped)})
        except Exception as exc:  # sent back: the test asserts on it
            conn.send({"error": f"{type(exc).__name__}: {exc}"})


@pytest.fixture(scope="module")
def engine_proc():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child,))
    proc.start()
    assert parent.recv() == "ready"
    yield parent
    parent.send("stop")
    proc.join(timeout=60)


def sums(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
    return {n: float(t.detach().double().sum()) for n, t in tensors}


def test_engine_loads_the_trainers_tensors_in_place_and_handles_are_shared_once(engine_proc):
    from nemo_gen.core.manifest import layout_only
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    policy, flat = make_policy(0), torch.randn(4096, device="cuda")
    sender = IpcSender()
    tensors = named(policy, flat)
    info = sender.update_info(tensors)
    # one handle per storage: 6 parameters, the flat buffer, the private copy of the transposed view
    assert len(pickle.loads(info["handles"])) == 8 and len(info["names"]) == 9
    engine_proc.send(info)
    got = engine_proc.recv()
    assert got.get("error") is None, got
    assert got["sums"] == pytest.approx(sums(tensors), rel=1e-6)
    assert got["mapped"] == 8

    # An optimizer step writes in place: the next refit sends the same handles, opens nothing new.
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(-2.0).add_(0.5)
        flat.add_(1.0)
    again = sender.update_info(named(policy, flat))
    assert again["layout"] == info["layout"] and again["handles"] == info["handles"]
    engine_proc.send(again)
    got = engine_proc.recv()
    assert got["sums"] == pytest.approx(sums(named(policy, flat)), rel=1e-6) and got["mapped"] == 8

    # The short form of the layout the engine loaded last (what a fleet's client sends it): the
    # same views, so the next in-place step is read through them.
    with torch.no_grad():
        flat.mul_(3.0)
    assert sender.update_info(named(policy, flat)) is again  # (it refreshes the transposed view's copy)
    engine_proc.send(layout_only(again))
    got = engine_proc.recv()
    assert got.get("error") is None, got
    assert got["sums"] == pytest.approx(sums(named(policy, flat)), rel=1e-6) and got["mapped"] == 8

    # A parameter replaced by a new tensor: exported under a new key; the old one is let go on both sides.
    old_key = again["storages"][0]
    policy[0].weight = torch.nn.Parameter(torch.ones_like(policy[0].weight))
    third = sender.update_info(named(policy, flat))
    assert third["layout"] != info["layout"]
    assert third["storages"][0] != old_key and old_key not in pickle.loads(third["handles"])
    engine_proc.send(third)
    got = engine_proc.recv()
    assert got["sums"]["0.weight"] == pytest.approx(float(policy[0].weight.numel())) and got["mapped"] == 8

    # The short form of a layout the engine no longer holds is refused, not read through stale views.
    engine_proc.send(layout_only(info))
    got = engine_proc.recv()
    assert "alone, but this engine holds" in got["error"] and "send the whole update info" in got["error"]
    sender.close()


def test_a_cpu_tensor_is_refused_by_name():
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    with pytest.raises(ValueError, match="lm_head.weight is on cpu"):
        IpcSender().update_info([("lm_head.weight", torch.ones(2))])


def test_an_engine_on_another_gpu_is_told_to_use_nccl(engine_proc):
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    info = dict(IpcSender().update_info([("w", torch.ones(4, device="cuda"))]))
    handles = pickle.loads(info["handles"])
    info["handles"] = pickle.dumps({k: {"GPU-not-this-one": next(iter(v.values()))} for k, v in handles.items()})
    engine_proc.send(info)
    got = engine_proc.recv()
    assert "needs the trainer on this engine's GPU" in got["error"] and "nccl" in got["error"]
