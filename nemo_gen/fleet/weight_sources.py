"""Weight sources: where a refit's tensors come from.

A source has a ``manifest()`` (names, shapes, dtypes — read without loading any data) and
``read(names)`` yielding ``(name, tensor)`` for the names asked, so the refit can stream it
bucket by bucket. ``CheckpointSource`` reads an HF safetensors directory (one file or sharded
with ``model.safetensors.index.json``); ``TensorSource`` streams live tensors from a trainer
(an ``nn.Module``, a mapping of names to tensors, or a callable returning one) with no disk.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from nemo_gen.core.manifest import RefitError, TensorMeta

INDEX_FILE = "model.safetensors.index.json"


class WeightSource(ABC):
    @abstractmethod
    def manifest(self) -> list[TensorMeta]:
        """Names, shapes and dtypes of every tensor, without reading their data."""

    @abstractmethod
    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        """Yield ``(name, tensor)`` for ``names``, in the order given where the format allows."""

    def describe(self) -> str:
        return type(self).__name__


class CheckpointSource(WeightSource):
    """An HF checkpoint directory of ``*.safetensors`` files."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._files = self._find_files()
        self._where: dict[str, Path] = {}
        self._metas: list[TensorMeta] | None = None

    def describe(self) -> str:
        return str(self.path)

    def _find_files(self) -> list[Path]:
        if not self.path.is_dir():
            raise RefitError(f"checkpoint {self.path} is not a directory")
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise RefitError(f"{index}: not a safetensors index ({exc})") from None
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [str(f.name) for f in files if not f.is_file()]
            if missing:
                raise RefitError(f"{index} names shard files that do not exist: {missing}")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise RefitError(f"checkpoint {self.path} holds no *.safetensors file")
        return files

    def manifest(self) -> list[TensorMeta]:
        if self._metas is None:
            from safetensors import safe_open

            metas = []
            for f in self._files:
                try:
                    with safe_open(str(f), framework="pt") as st:
                        for name in st.keys():
                            sl = st.get_slice(name)
                            metas.append(TensorMeta.of(name, sl.get_shape(), sl.get_dtype()))
                            self._where.setdefault(name, f)
                except Exception as exc:  # safetensors raises its own types for a bad header
                    raise RefitError(f"{f}: cannot read safetensors header ({exc})") from None
            self._metas = metas
        return list(self._metas)

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        from safetensors import safe_open

        self.manifest()
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._where[name], []).append(name)
        for f, file_names in by_file.items():
            with safe_open(str(f), framework="pt") as st:
                for name in file_names:
                    yield name, st.get_tensor(name)


class TensorSource(WeightSource):
    """Live tensors: an ``nn.Module`` (its ``state_dict``), a mapping of names to tensors, or a
    zero-argument callable returning such a mapping (called once per refit)."""

    def __init__(self, tensors: Any):
        self._tensors = tensors
        self._snapshot: Mapping[str, Any] | None = None

    def _named(self) -> Mapping[str, Any]:
        if self._snapshot is None:
            t = self._tensors
            if hasattr(t, "state_dict"):
                t = t.state_dict()
            elif callable(t):
                t = t()
            if not isinstance(t, Mapping):
                raise RefitError(f"a tensor source must give a mapping of names to tensors, got {type(t).__name__}")
            self._snapshot = t
        return self._snapshot

    def manifest(self) -> list[TensorMeta]:
        return [TensorMeta.of(n, t.shape, str(t.dtype)) for n, t in self._named().items()]

    def read(self, names: Iterable[str]) -> Iterator[tuple[str, Any]]:
        named = self._named()
        for name in names:
            yield name, named[name]


def as_source(source: Any) -> WeightSource:
    """A checkpoint path, a WeightSource, or live tensors (module / mapping / callable)."""
    if isinstance(source, WeightSource):
        return source
    if isinstance(source, (str, os.PathLike)):
        return CheckpointSource(source)
    if isinstance(source, Mapping) or hasattr(source, "state_dict") or callable(source):
        return TensorSource(source)
    raise RefitError(f"cannot refit from a {type(source).__name__}: give a checkpoint directory or named tensors")
