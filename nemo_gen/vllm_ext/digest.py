"""The weights' content digest computed by torch on the device the tensors live on (the
definition, its guarantees and the reference are ``nemo_gen.core.digest``).

A tensor's bytes are read as 64-bit words in place (no copy, no trip to the host), each chunk of
words is mixed and summed on the device, and only the 64-bit sums cross to Python. On CUDA the
chunk's arithmetic is compiled into one fused kernel (``torch.compile``) that reads the weights
once, at the device's memory bandwidth. Eagerly (CPU, or where compiling fails) each step writes
into scratch buffers kept per thread and device, so a refit's many tensors touch the same pages
rather than fresh ones (a first touch costs more than the arithmetic). The same integer
arithmetic either way: the same bits on every device.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterable, Iterator

from nemo_gen.core.digest import CHUNK_WORDS, K1, K2, K3, MASK, SHIFT, WORD, finish, mix, signed

log = logging.getLogger(__name__)

_K1, _K2, _K3 = signed(K1), signed(K2), signed(K3)
_LOW = (1 << (64 - SHIFT)) - 1  # torch's >> on int64 is arithmetic: mask it into a logical shift
_EAGER_CHUNK = 1 << 20  # words per eager step: 8 MB scratch buffers, reused
_compiled: Any = None  # the fused CUDA kernel, once built (False: compiling failed, eager it is)
_scratch = threading.local()  # per thread: device -> (positions * K1, two scratch buffers)


def _chunk_sum(words: Any, start: Any) -> Any:
    """The sum (int64, wrapping) of mix(w_j XOR j*K1) over a chunk of words starting at word ``start``
    (the form ``torch.compile`` fuses into one kernel)."""
    import torch

    idx = torch.arange(words.numel(), dtype=torch.int64, device=words.device) + start
    v = words ^ (idx * _K1)
    v = v * _K2
    v = v ^ ((v >> SHIFT) & _LOW)
    return (v * _K3).sum()


def _buffers(device: Any) -> tuple[Any, Any, Any]:
    import torch

    cache = getattr(_scratch, "by_device", None)
    if cache is None:
        cache = _scratch.by_device = {}
    if device not in cache:
        base = torch.arange(_EAGER_CHUNK, dtype=torch.int64, device=device) * _K1
        cache[device] = (base, torch.empty_like(base), torch.empty_like(base))
    return cache[device]


def _eager_sum(words: Any) -> Any:
    """``_chunk_sum`` over all of ``words``, step by step into reused buffers (the same bits)."""
    import torch

    base, v, tmp = _buffers(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    with _one_thread(words.device.type == "cpu"):
        for start in range(0, words.numel(), _EAGER_CHUNK):
            part = words[start:start + _EAGER_CHUNK]
            n = part.numel()
            vv, tt = v[:n], tmp[:n]
            torch.add(base[:n], signed(start * K1), out=tt)  # (j + start) * K1 = j * K1 + start * K1
            torch.bitwise_xor(part, tt, out=vv)
            vv.mul_(_K2)
            torch.bitwise_right_shift(vv, SHIFT, out=tt)
            tt.bitwise_and_(_LOW)
            vv.bitwise_xor_(tt)
            vv.mul_(_K3)
            total += vv.sum()
    return total


@contextlib.contextmanager
def _one_thread(on: bool) -> Iterator[None]:
    """Torch's CPU ops on one thread for the block: each eager step is milliseconds of work, and
    on a host whose cores are all busy, splitting it over threads that must meet at every step
    costs ~10x the work itself (measured 0.06 against 1.1 GB/s on 2 loaded cores). The caller
    (a refit's driver, or a worker between engine steps) runs no other torch work meanwhile."""
    import torch

    before = torch.get_num_threads()
    if on and before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if on and before != 1:
            torch.set_num_threads(before)


def _fused():
    global _compiled
    if _compiled is None:
        try:
            import torch

            _compiled = torch.compile(_chunk_sum, dynamic=True)
        except Exception as exc:  # no compiler here: eager is correct, only slower
            log.warning("weight digest: torch.compile unavailable (%s); hashing eagerly", exc)
            _compiled = False
    return _compiled


def _words(flat: Any) -> Any:
    """The whole 64-bit words of a contiguous uint8 tensor, viewed in place where aligned."""
    import torch

    body = flat[: flat.numel() // WORD * WORD]
    try:
        return body.view(torch.int64)
    except RuntimeError:  # a byte offset not divisible by 8: one copy of this tensor
        return body.clone().view(torch.int64)


def tensor_digest(tensor: Any, fused: bool = True) -> int:
    """The ``wd1`` digest of ``tensor``'s bytes (any dtype, any device; never copied to the host).
    ``fused`` False: eager even on CUDA (the same bits; benchmarks compare the two)."""
    import torch

    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    words = _words(flat)
    acc = 0
    if words.numel():
        kernel = _fused() if fused and words.device.type == "cuda" else None
        if kernel:
            total = None
            for start in range(0, words.numel(), CHUNK_WORDS):
                part = kernel(words[start:start + CHUNK_WORDS], start)
                total = part if total is None else total + part
        else:
            total = _eager_sum(words)
        acc = int(total.item()) & MASK
    tail = nbytes % WORD
    if tail:  # the last bytes, zero-padded to a word (at most 7 bytes reach the host)
        j = nbytes // WORD
        word = int.from_bytes(bytes(flat[nbytes - tail:].cpu().tolist()) + b"\0" * (WORD - tail), "little",
                              signed=True)
        acc = (acc + mix((word & MASK) ^ ((j * K1) & MASK))) & MASK
    return finish(acc, nbytes)


def tensor_digests(tensors: Iterable[Any]) -> list[int]:
    """``tensor_digest`` of each, in order."""
    return [tensor_digest(t) for t in tensors]


def staged_form(tensor: Any, dtype: Any) -> Any:
    """``tensor`` as a refit stages it: floating tensors in the engine's dtype, on the device
    they live on (so the trainer's digest is of the very bytes the engines receive)."""
    src = tensor.detach()
    if src.is_floating_point() and src.dtype != dtype:
        src = src.to(dtype)
    return src
