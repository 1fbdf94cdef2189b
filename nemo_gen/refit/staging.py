"""The CPU transport: one shared-memory staging file per fleet, written once per refit by the
driver and read in place by every shard's workers on the node.

The file is kept and reused across refits: the first touch of fresh pages costs ~30x a memory
copy here, so a refit into pages touched before runs at copy speed. It grows when a larger
model arrives and is removed when the fleet shuts down.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from nemo_gen.core.refit import StagedTensor


class SharedMemoryStaging:
    def __init__(self, directory: str | os.PathLike, name: str):
        self.path = Path(directory) / f"nemo_gen-{name}-{os.getpid()}.staging"
        self._buf = None
        self.size = 0

    def ensure(self, size: int) -> None:
        """Make the file at least ``size`` bytes, keeping (already touched) pages when it fits."""
        import torch

        if self._buf is not None and size <= self.size:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "ab") as f:
            f.truncate(size)
        self._buf = torch.from_file(str(self.path), shared=True, size=size, dtype=torch.uint8)
        self.size = size

    def write(self, placed: StagedTensor, tensor: Any, dtype: Any) -> None:
        """Copy ``tensor`` (cast to ``dtype`` when it is floating) into its place."""
        src = tensor.detach()
        if src.is_floating_point() and src.dtype != dtype:
            src = src.to(dtype)
        if src.device.type != "cpu":
            src = src.cpu()
        nbytes = placed.meta.nbytes
        dst = self._buf[placed.offset : placed.offset + nbytes].view(src.dtype).view(src.shape)
        dst.copy_(src)

    def entries(self, placed: Iterable[StagedTensor]) -> list[tuple[str, tuple[int, ...], str, int]]:
        """The metadata the workers need (all that crosses the RPC)."""
        return [(p.meta.name, p.meta.shape, p.meta.dtype, p.offset) for p in placed]

    def close(self) -> None:
        self._buf = None
        self.size = 0
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
