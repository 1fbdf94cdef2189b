"""Refit bookkeeping: tensor manifests, their checks, staging layout, and the refit report.

Pure: names, shapes, dtype strings and byte offsets only. A refit is all-or-nothing per
shard, so everything that can be checked without touching a weight is checked here first:
missing, unexpected and duplicate names, shape and dtype mismatches — all listed in one error.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from nemo_gen.errors import DataError

DRAFT_PREFIX = "draft."

# Bytes per element for the dtype names torch and safetensors use.
DTYPE_BYTES = {
    "float64": 8, "F64": 8, "float32": 4, "F32": 4, "float16": 2, "F16": 2, "bfloat16": 2, "BF16": 2,
    "int64": 8, "I64": 8, "int32": 4, "I32": 4, "int16": 2, "I16": 2, "int8": 1, "I8": 1,
    "uint8": 1, "U8": 1, "bool": 1, "BOOL": 1, "float8_e4m3fn": 1, "F8_E4M3": 1, "float8_e5m2": 1, "F8_E5M2": 1,
}
# safetensors header names -> torch dtype names, so manifests from both sides compare equal.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
    "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}

# Staging offsets are aligned so every tensor view starts on a cache line (and any dtype's
# natural alignment).
ALIGN = 64

# A trainer-quantized tensor (refit.quantize: trainer; nemo_gen/core/fp8.py) travels as fp8 with
# a float32 "<name>_scale" beside it.
FP8_DTYPE = "float8_e4m3fn"
SCALE_SUFFIX = "_scale"


class RefitError(DataError):
    """A refit was refused before any weight changed (bad manifest, bad source)."""


def canonical_dtype(dtype: str) -> str:
    name = str(dtype).removeprefix("torch.")
    return _SAFETENSORS_DTYPES.get(name, name)


def is_floating(dtype: str) -> bool:
    """A floating dtype name (what a refit stages, and the engines load, in the engine's dtype)."""
    return canonical_dtype(dtype).startswith(("float", "bfloat"))


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, name: str, shape: Iterable[int], dtype: str) -> "TensorMeta":
        return cls(name, tuple(int(d) for d in shape), canonical_dtype(dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        try:
            return self.numel * DTYPE_BYTES[self.dtype]
        except KeyError:
            raise RefitError(f"tensor {self.name!r}: unsupported dtype {self.dtype!r}") from None


@dataclass(frozen=True)
class StagedTensor:
    """Where one tensor lives in a staging buffer."""

    meta: TensorMeta
    offset: int

    @property
    def name(self) -> str:
        return self.meta.name


def layout(metas: Sequence[TensorMeta]) -> tuple[list[StagedTensor], int]:
    """Pack tensors into one buffer, each aligned; returns their places and the total size."""
    placed, offset = [], 0
    for meta in metas:
        offset = _align(offset)
        placed.append(StagedTensor(meta, offset))
        offset += meta.nbytes
    return placed, _align(offset)


def buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    """Group tensors, in order, into buckets of at most ``bucket_bytes`` (a tensor larger than
    a bucket gets one of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    out: list[list[TensorMeta]] = []
    current: list[TensorMeta] = []
    size = 0
    for meta in metas:
        if current and size + meta.nbytes > bucket_bytes:
            out.append(current)
            current, size = [], 0
        current.append(meta)
        size += meta.nbytes
    if current:
        out.append(current)
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def split_draft(metas: Iterable[TensorMeta]) -> tuple[list[TensorMeta], list[TensorMeta]]:
    """(policy tensors, drafter tensors with the ``draft.`` prefix stripped)."""
    policy, draft = [], []
    for m in metas:
        if m.name.startswith(DRAFT_PREFIX):
            draft.append(TensorMeta(m.name[len(DRAFT_PREFIX):], m.shape, m.dtype))
        else:
            policy.append(m)
    return policy, draft


def check_manifest(
    expected: Mapping[str, TensorMeta],
    offered: Sequence[TensorMeta],
    *,
    optional: Iterable[str] = (),
    partial: bool = False,
    what: str = "model",
) -> None:
    """Raise ``RefitError`` listing every problem of ``offered`` against ``expected``.

    ``optional``: names that may be absent (a tied ``lm_head.weight``). ``partial``: a subset
    is acceptable (a drafter refit that streams only some tensors), but every offered name must
    still exist with the right shape and dtype.
    """
    problems: list[str] = []
    counts = Counter(m.name for m in offered)
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        problems.append(f"duplicate tensors: {_names(dupes)}")
    names = set(counts)
    unexpected = sorted(names - set(expected))
    if unexpected:
        problems.append(f"unexpected tensors: {_names(unexpected)}")
    if not partial:
        missing = sorted(set(expected) - names - set(optional))
        if missing:
            problems.append(f"missing tensors: {_names(missing)}")
    for m in offered:
        want = expected.get(m.name)
        if want is None:
            continue
        if want.shape != m.shape:
            problems.append(f"{m.name}: shape {list(m.shape)} but the {what} has {list(want.shape)}")
        elif want.dtype != m.dtype:
            problems.append(f"{m.name}: dtype {m.dtype} but the {what} has {want.dtype}")
    if problems:
        raise RefitError(f"refit refused, no weight was changed: {'; '.join(problems)}")


def _names(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


def next_version(current: int | None, requested: int | None) -> int:
    """The version a refit installs: ``requested``, else the previous + 1 (0 after none).
    Versions only move forward: a fleet never goes back to an older number."""
    if requested is None:
        return 0 if current is None else current + 1
    if current is not None and requested <= current:
        raise RefitError(f"refit version {requested} is not newer than the fleet's version {current}")
    return requested


@dataclass
class ShardRefit:
    shard: int
    ok: bool
    seconds: float = 0.0
    error: str | None = None


@dataclass
class RefitReport:
    """What a refit did, per shard, with its cost."""

    version: int
    bytes: int
    tensors: int
    stage_seconds: float
    load_seconds: float
    shards: list[ShardRefit] = field(default_factory=list)
    # The trainer's digest of the weights (``nemo_gen.core.digest``), which every shard that took
    # them matched before loading; the seconds the trainer side spent computing it (in stage_seconds).
    digest: str | None = None
    digest_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.stage_seconds + self.load_seconds

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.shards)

    @property
    def failed(self) -> list[ShardRefit]:
        return [s for s in self.shards if not s.ok]

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "bytes": self.bytes,
            "tensors": self.tensors,
            "stage_seconds": self.stage_seconds,
            "load_seconds": self.load_seconds,
            "seconds": self.seconds,
            "gb_per_s": self.gb_per_s,
            "ok": self.ok,
            "digest": self.digest,
            "digest_seconds": self.digest_seconds,
            "shards": [s.__dict__ for s in self.shards],
        }


# -- vLLM's weight-sync protocol, driven across a fleet (nemo_gen.fleet.weight_sync) ---------

# nemo_gen's own weight-transfer backends (nemo_gen.vllm_ext.vllm_backend). Their worker engines
# skip the tensors an EAGLE-style drafter shares with the policy; vLLM's would write through.
SHM_BACKEND = "nemo_gen_shm"
IPC_BACKEND = "nemo_gen_ipc"
OWN_BACKENDS = (SHM_BACKEND, IPC_BACKEND)


def chunk_metas(update_info: Mapping[str, Any], engine_dtype: str) -> list[TensorMeta] | None:
    """The tensors one ``update_weights`` chunk carries, from any backend's update info:
    vLLM's own (``names`` / ``shapes`` / ``dtype_names``: ipc, nccl) or nemo_gen_shm's
    (``entries`` of [name, shape, dtype, offset]). None when the chunk does not say (a backend
    with another layout: it is passed on unchecked). Floating dtypes are taken as the engine's:
    the engines' loaders cast, so only names and shapes must match."""
    if "entries" in update_info:
        rows = [(e[0], e[1], e[2]) for e in update_info["entries"]]
    elif "names" in update_info and "shapes" in update_info:
        dtypes = update_info.get("dtype_names") or [engine_dtype] * len(update_info["names"])
        rows = list(zip(update_info["names"], update_info["shapes"], dtypes))
    else:
        return None
    metas = []
    for name, shape, dtype in fold_scales(rows):  # fp8 tensors' scales are read with them
        dtype = canonical_dtype(str(dtype))
        metas.append(TensorMeta.of(name, shape, engine_dtype if is_floating(dtype) else dtype))
    return metas


def fold_scales(rows: Sequence[tuple[str, Sequence[int], str]]) -> list[tuple[str, Sequence[int], str]]:
    """The (name, shape, dtype) rows of a chunk as the model's manifest sees them: every fp8
    tensor's ``_scale`` row dropped (it is read with its tensor). Raises ``RefitError`` for an fp8
    tensor without its scale or a scale without its fp8 tensor."""
    fp8 = {name for name, _, dtype in rows if canonical_dtype(str(dtype)) == FP8_DTYPE}
    names = {name for name, _, _ in rows}
    scales = {name[: -len(SCALE_SUFFIX)] for name in names if name.endswith(SCALE_SUFFIX)}
    unscaled = sorted(fp8 - scales)
    if unscaled:
        raise RefitError(f"refit refused, no weight was changed: fp8 tensors without their "
                         f"'{SCALE_SUFFIX}' tensor: {', '.join(unscaled[:8])}")
    orphan = sorted(n for n in scales if n not in fp8 and n in names)
    if orphan:
        raise RefitError(f"refit refused, no weight was changed: scale tensors for tensors that are "
                         f"not fp8: {', '.join(n + SCALE_SUFFIX for n in orphan[:8])}")
    return [r for r in rows if not (r[0].endswith(SCALE_SUFFIX) and r[0][: -len(SCALE_SUFFIX)] in fp8)]


def layout_only(update_info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The short form of a layout-numbered update (nemo_gen_ipc's): its layout number alone,
    for an engine that opened that layout with the last update it loaded. A trainer that
    refits the same tensors sends the same layout every time, and the whole form is ~300 bytes
    a tensor (135 KB for 450: over Ray's inline limit, and copied twice more on its way into
    the workers). None: the update has no layout number and always travels whole."""
    layout = update_info.get("layout")
    if layout is None or update_info.get("layout_only"):
        return None
    digests = {k: update_info[k] for k in ("digests", "digest") if k in update_info}  # new values, checked
    return {"layout": layout, "layout_only": True, **digests}


def needs_whole(update_info: Mapping[str, Any], held_layout: object) -> bool:
    """An engine whose workers loaded ``held_layout`` last cannot take ``update_info``: it is
    a layout's short form, and not of that layout (the sender must send it whole)."""
    return bool(update_info.get("layout_only")) and update_info.get("layout") != held_layout


def nccl_rank_offsets(workers_per_engine: Sequence[int], first: int = 1) -> list[int]:
    """NCCL ranks of each engine's first worker when one trainer rank (0) broadcasts to several
    independent engines: vLLM numbers an engine's workers from the ``rank_offset`` it is given,
    so engine i starts where engine i-1's workers end. The group's world size is the last
    offset plus that engine's workers."""
    offsets, nxt = [], first
    for n in workers_per_engine:
        if n < 1:
            raise ValueError(f"an engine has {n} workers")
        offsets.append(nxt)
        nxt += n
    return offsets
