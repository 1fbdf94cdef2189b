"""Typed tensor views into byte buffers: how every transport reads and writes a tensor in
place (the shared-memory staging file, a trainer's CUDA storages). Torch only."""

from __future__ import annotations

import math
from typing import Any, Sequence


def typed_view(buf: Any, offset: int, shape: Sequence[int], dtype: Any):
    """The tensor of ``shape`` and ``dtype`` (a torch dtype or its name) stored at byte
    ``offset`` of the uint8 tensor ``buf``; no copy."""
    import torch

    dt = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    nbytes = math.prod(int(d) for d in shape) * dt.itemsize
    return buf[offset : offset + nbytes].view(dt).view(tuple(int(d) for d in shape))
