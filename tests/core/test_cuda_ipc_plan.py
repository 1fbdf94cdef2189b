"""nemo_gen_ipc's grouping of a trainer's tensors by storage (CPU tensors stand in: the plan is
the same on any device; the CUDA side runs in tests/gpu)."""

from __future__ import annotations

import pytest
import torch

from nemo_gen.vllm_ext.cuda_ipc import plan


def test_tensors_sharing_a_storage_are_one_export_with_byte_offsets():
    flat = torch.zeros(100)
    alone = torch.ones(3)
    rows, storages = plan([("a", flat[:10].view(2, 5)), ("b", flat[16:32]), ("c", alone)])
    ptr = flat.untyped_storage().data_ptr()
    assert [(name, p == ptr, t.data_ptr() - p) for name, t, p in rows] == [("a", True, 0), ("b", True, 64), ("c", False, 0)]
    assert {p: v.numel() for p, v in storages.items()} == {ptr: 400, alone.untyped_storage().data_ptr(): 12}
    assert storages[ptr].dtype == torch.uint8  # whole storages, as bytes: what gets exported


def test_a_non_contiguous_tensor_is_named():
    with pytest.raises(ValueError, match="w.t is not contiguous"):
        plan([("w.t", torch.zeros(4, 3).t())])


def test_a_cpu_tensor_is_refused_by_name_before_any_cuda_call():
    """The refusal needs no GPU: it happens before anything touches CUDA (on this CPU build of
    torch, any CUDA call would raise "Torch not compiled with CUDA enabled" instead). The same
    check as tests/gpu/test_cuda_ipc.py's, which skips here with the rest of that module."""
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    sender = IpcSender()
    with pytest.raises(ValueError, match="nemo_gen_ipc sends CUDA tensors; lm_head.weight is on cpu"):
        sender.update_info([("lm_head.weight", torch.ones(2))])
    with pytest.raises(ValueError, match="model.norm.weight is on cpu"):  # the first CPU one, by name
        sender.update_info([("model.norm.weight", torch.ones(2)), ("lm_head.weight", torch.ones(2))])
