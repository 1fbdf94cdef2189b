"""FP8 weights on the refit wire, the torch side of ``nemo_gen/core/fp8.py``: the trainer's
quantization (``Fp8Source``, persistent fp8 buffers refilled in place, so ``nemo_gen_ipc`` shares
their storages once) and the engine's dequantization of what arrives (``dequantized``), which
feeds vLLM's own load: its online FP8 path re-quantizes as it does for a bf16 checkpoint."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from nemo_gen.core.fp8 import FP8_DTYPE, FP8_MAX, SCALE_SUFFIX, quantizable, scale_group, wire_metas
from nemo_gen.core.manifest import RefitError, TensorMeta

_FP8 = getattr(torch, FP8_DTYPE)


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """vLLM's per-tensor scale: amax / 448 in float32, as a one-element tensor."""
    return (amax.to(torch.float32) / torch.tensor(FP8_MAX, device=amax.device)).reshape(1)


def quantize_into(out: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``out`` (fp8) := weight / scale rounded, clamped to the fp8 range. On CUDA by vLLM's own
    static per-tensor kernel (``scaled_fp8_quant``, the one its online FP8 runs at load: it
    multiplies by the reciprocal, which rounds a value within an ulp of an fp8 midpoint the other
    way than a true division; on an 8B model thousands of weights differ, enough to flip greedy
    tokens); elsewhere in torch, by true division."""
    if weight.is_cuda:
        from vllm import _custom_ops as ops

        ops.scaled_fp8_quant(weight.contiguous(), scale=scale, output=out)
        return out
    out.copy_((weight.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(_FP8))
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def has_fp8(weights: Iterable[tuple[str, Any]]) -> bool:
    return any(getattr(t, "dtype", None) == _FP8 for _, t in weights)


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every fp8 tensor turned back into ``dtype`` by its ``<name>_scale``
    (which may come before or after it); other tensors pass through untouched. Raises
    ``RefitError`` naming an fp8 tensor whose scale never came."""
    pending: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX) and tensor.numel() == 1 and tensor.dtype == torch.float32:
            base = name[: -len(SCALE_SUFFIX)]
            if base in pending:
                yield base, dequantize(pending.pop(base), tensor, dtype)
            else:
                scales[base] = tensor
        elif tensor.dtype == _FP8:
            if name in scales:
                yield name, dequantize(tensor, scales.pop(name), dtype)
            else:
                pending[name] = tensor
        else:
            yield name, tensor
    if pending:
        raise RefitError(f"fp8 tensors arrived without their '{SCALE_SUFFIX}': {', '.join(sorted(pending)[:8])}")
    if scales:  # a scale whose tensor was not fp8: a bf16 tensor is loaded as is, its scale unused
        raise RefitError(f"scales without an fp8 tensor: {', '.join(n + SCALE_SUFFIX for n in sorted(scales)[:8])}")


class Fp8Source:
    """A vLLM ``WeightSource`` (``metadata()`` and iteration of (name, tensor)) over another one,
    with its linear weights quantized to fp8 by the trainer: a shared scale per fused layer
    (``scale_group``), each tensor followed by its ``_scale``. The fp8 and scale buffers are
    allocated once and refilled on every iteration, so a refit's bytes live at the same
    addresses each time (``nemo_gen_ipc`` exports them once); a caller must not iterate again
    before the previous refit has been read."""

    def __init__(self, inner: Any):
        self.inner = inner
        self._q: dict[str, torch.Tensor] = {}
        self._s: dict[str, torch.Tensor] = {}

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        metas = [TensorMeta.of(m.name, tuple(m.shape), str(m.dtype)) for m in self.inner.metadata()]
        return [ParamMeta(m.name, getattr(torch, m.dtype), tuple(m.shape)) for m in wire_metas(metas)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = list(self.inner)  # the group's amax needs every part before the first is sent
        amax: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            if quantizable(name, tuple(t.shape), str(t.dtype)):
                a = t.detach().abs().amax().to(torch.float32)
                g = scale_group(name)
                amax[g] = a if g not in amax else torch.maximum(amax[g], a)
        for name, t in tensors:
            if not quantizable(name, tuple(t.shape), str(t.dtype)):
                yield name, t
                continue
            if name not in self._q:
                self._q[name] = torch.empty(t.shape, dtype=_FP8, device=t.device)
                self._s[name] = torch.empty(1, dtype=torch.float32, device=t.device)
            scale = self._s[name]
            scale.copy_(fp8_scale(amax[scale_group(name)]))
            yield name, quantize_into(self._q[name], t.detach(), scale)
            yield name + SCALE_SUFFIX, scale

    def nbytes(self) -> int:
        """The bytes one refit of this source carries."""
        return sum(TensorMeta.of(m.name, m.shape, str(m.dtype)).nbytes for m in self.metadata())
