"""The weights' content digest computed by torch on the device the tensors live on (the
definition, its guarantees and the reference are ``nemo_gen.core.digest``).

A tensor's bytes are read as 32-bit words in place (no copy, no trip to the host), each chunk of
words is mixed and summed on the device, and only the 64-bit sums cross to Python. On CUDA the
chunk's arithmetic is compiled into one fused kernel (``torch.compile``) that reads the weights
once, at the device's memory bandwidth; anywhere else, and if compiling fails, it runs eagerly
(the same integer arithmetic: the same bits on every device).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from nemo_gen.core.digest import CHUNK_WORDS, K1, K2, K3, MASK, SHIFT, finish, mix, signed

log = logging.getLogger(__name__)

_K1, _K2, _K3 = signed(K1), signed(K2), signed(K3)
_LOW = (1 << (64 - SHIFT)) - 1  # torch's >> on int64 is arithmetic: mask it into a logical shift
_compiled: Any = None  # the fused CUDA kernel, once built (False: compiling failed, eager it is)


def _chunk_sum(words: Any, start: Any) -> Any:
    """The sum (int64, wrapping) of mix(w_j XOR j*K1) over a chunk of words starting at word ``start``."""
    import torch

    idx = torch.arange(words.numel(), dtype=torch.int64, device=words.device) + start
    v = words.to(torch.int64) ^ (idx * _K1)
    v = v * _K2
    v = v ^ ((v >> SHIFT) & _LOW)
    return (v * _K3).sum()


def _summer(device_type: str, fused: bool):
    global _compiled
    if device_type != "cuda" or not fused:
        return _chunk_sum
    if _compiled is None:
        try:
            import torch

            _compiled = torch.compile(_chunk_sum, dynamic=True)
        except Exception as exc:  # no compiler here: eager is correct, only slower
            log.warning("weight digest: torch.compile unavailable (%s); hashing eagerly", exc)
            _compiled = False
    return _compiled or _chunk_sum


def _words(flat: Any) -> Any:
    """The whole 32-bit words of a contiguous uint8 tensor, viewed in place where aligned."""
    import torch

    body = flat[: flat.numel() // 4 * 4]
    try:
        return body.view(torch.int32)
    except RuntimeError:  # a byte offset not divisible by 4: one copy of this tensor
        return body.clone().view(torch.int32)


def tensor_digest(tensor: Any, fused: bool = True) -> int:
    """The ``wd1`` digest of ``tensor``'s bytes (any dtype, any device; never copied to the host).
    ``fused`` False: eager even on CUDA (the same bits; benchmarks compare the two)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    words = _words(flat)
    total = None
    if words.numel():
        summer = _summer(words.device.type, fused)
        for start in range(0, words.numel(), CHUNK_WORDS):
            part = summer(words[start:start + CHUNK_WORDS], start)
            total = part if total is None else total + part
    acc = 0 if total is None else int(total.item()) & MASK
    tail = nbytes % 4
    if tail:  # the last bytes, zero-padded to a word (at most 3 bytes reach the host)
        j = nbytes // 4
        word = int.from_bytes(bytes(flat[nbytes - tail:].cpu().tolist()) + b"\0" * (4 - tail), "little", signed=True)
        acc = (acc + mix((word & MASK) ^ ((j * K1) & MASK))) & MASK
    return finish(acc, nbytes)


def tensor_digests(tensors: Iterable[Any]) -> list[int]:
    """``tensor_digest`` of each, in order."""
    return [tensor_digest(t) for t in tensors]


def staged_form(tensor: Any, dtype: Any) -> Any:
    """``tensor`` as a refit stages it: floating tensors in the engine's ``dtype``, on the device
    they live on (so the trainer's digest is of the very bytes the engines receive)."""
    src = tensor.detach()
    if src.is_floating_point() and src.dtype != dtype:
        src = src.to(dtype)
    return src
