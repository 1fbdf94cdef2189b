"""The weights' content digest (``wd1``): its definition, how per-tensor digests combine into one,
how two sets are compared, and how results are stamped with it. Pure logic: the torch kernel
that computes it on the weights' own device is ``nemo_gen.vllm_ext.digest``, held to the
reference here (``reference_digest``) by tests.

A tensor's digest is a 64-bit hash of its bytes: the bytes as little-endian signed 64-bit words
``w_j`` (the tail, if any, zero-padded to one more word), each mixed with its position,
``v_j = mix(w_j XOR j*K1)`` where ``mix`` is splitmix64's multiply / xor-shift / multiply, summed
modulo 2**64, and the sum finished with the byte length (``finish``). Why this and not a
cryptographic hash: it is elementwise work plus one sum, so torch computes it on the device the
weights live on (a GPU reduces it at its memory bandwidth; nothing is copied to the host), the
sum's order does not matter (any reduction tree gives the same bits), and CPU and GPU agree.
What it guarantees: ``mix`` is a bijection of 64-bit words, so a change of any single word (one
flipped byte, one changed element) always changes the digest; a change of several words goes
unseen only if their differences cancel modulo 2**64, about 2**-64 for corruption, a bad
transport or a wrong tensor. It is not a defence against an adversary who crafts weights.

The fleet's digest of a refit (``combine``) is a BLAKE2b over every (name, tensor digest) pair,
sorted, so it names one set of weights whatever order they were staged in. Results carry it per
version span (``weight_digests`` beside ``weight_versions``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

ALGORITHM = "wd1"
MASK = (1 << 64) - 1
# splitmix64's constants (odd: multiplying by them is a bijection modulo 2**64)
K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
K3 = 0x94D049BB133111EB
SHIFT = 31
WORD = 8  # bytes a word
# The words of one tensor that a device reduces at once: bounds the temporaries (8 bytes a word).
CHUNK_WORDS = 1 << 24
# How a shard's refusal of mismatched bytes starts: the driver tells it from other refusals by it.
MISMATCH = "weight digest mismatch"


def signed(k: int) -> int:
    """A 64-bit constant as the signed int64 torch computes with."""
    k &= MASK
    return k - (1 << 64) if k >= 1 << 63 else k


def mix(v: int) -> int:
    """splitmix64's finalizer, without its last xor-shift (a bijection of 64-bit words)."""
    v = (v * K2) & MASK
    v ^= v >> SHIFT
    return (v * K3) & MASK


def finish(total: int, nbytes: int) -> int:
    """The tensor's digest from its words' sum: the byte length mixed in (a tensor and the same
    bytes with zeros appended differ), then a full splitmix64 finalizer."""
    v = mix((total ^ (nbytes * K1)) & MASK)
    return v ^ (v >> SHIFT)


def reference_digest(data: bytes) -> int:
    """The definition, in plain Python (slow: for tests of the torch kernel, and small tensors)."""
    padded = data + b"\0" * (-len(data) % WORD)
    total = 0
    for j in range(len(padded) // WORD):
        w = int.from_bytes(padded[WORD * j:WORD * (j + 1)], "little", signed=True) & MASK
        total += mix(w ^ ((j * K1) & MASK))
    return finish(total & MASK, len(data))


def hex64(value: int) -> str:
    return f"{value & MASK:016x}"


def combine(pairs: Iterable[tuple[str, int]]) -> str:
    """One digest for a set of tensors: ``wd1:`` and 32 hex digits."""
    h = hashlib.blake2b(digest_size=16)
    for name, value in sorted((n, v & MASK) for n, v in pairs):
        h.update(f"{name}\0{value:016x}\n".encode())
    return f"{ALGORITHM}:{h.hexdigest()}"


@dataclass(frozen=True)
class WeightDigest:
    """A refit's weights: each tensor's digest, in staging order, and the fleet's digest of them."""

    names: tuple[str, ...]
    values: tuple[int, ...]

    @property
    def digest(self) -> str:
        return combine(zip(self.names, self.values))


def first_mismatch(names: Sequence[str], expected: Sequence[int], got: Sequence[int]) -> str | None:
    """Why the bytes a shard read are not the trainer's (the first tensor that differs, in
    staging order), or None when every digest agrees. Lists of unequal length are a mismatch."""
    if len(expected) != len(got) or len(names) != len(got):
        return f"{MISMATCH}: the trainer sent {len(expected)} tensor digests, the shard read {len(got)} tensors"
    for name, want, have in zip(names, expected, got):
        if want & MASK != have & MASK:
            return (f"{MISMATCH} at tensor {name!r}: the trainer's bytes hash to {hex64(want)}, "
                    f"this shard read bytes that hash to {hex64(have)}")
    return None


def is_mismatch(error: str | None) -> bool:
    """A shard's refusal says its bytes are not the trainer's (``first_mismatch``)."""
    return error is not None and MISMATCH in error


def span_digests(spans: Sequence[Sequence[object]], digest_of: Callable[[int | None], str | None]
                 ) -> list[str | None]:
    """The digest of the weights that made each (version, count) span, in the spans' order;
    None where the fleet has no digest for the version (weights it did not stage itself)."""
    return [digest_of(span[0]) for span in spans]  # type: ignore[arg-type]


class DigestBook:
    """The digests of the versions a fleet served, by version: what stamps each result's spans.
    A version's digest is the trainer's, which every shard serving it matched before loading."""

    def __init__(self, keep: int = 64):
        self._by_version: dict[int, str] = {}
        self._keep = keep  # results of old versions may still arrive; a few dozen is plenty

    def record(self, version: int, digest: str | None) -> None:
        if digest is None:
            self._by_version.pop(version, None)  # weights this fleet did not digest: say nothing
            return
        self._by_version[version] = digest
        for old in sorted(self._by_version)[:-self._keep]:
            del self._by_version[old]

    def of(self, version: int | None) -> str | None:
        return None if version is None else self._by_version.get(version)

    def as_dict(self) -> Mapping[int, str]:
        return dict(self._by_version)
