"""FP8 on the refit wire: which tensors a trainer quantizes, how their scales travel, and the
checks on both ends. Pure (names, shapes, dtype strings); the torch side is
``nemo_gen/vllm_ext/fp8.py``.

An engine at ``generation.vllm_cfg.precision: fp8`` quantizes its linear layers online with one
scale per (fused) tensor: vLLM's ``fp8_per_tensor`` scheme, ``scale = amax / 448``. With
``refit.quantize: trainer`` the trainer sends those layers as ``float8_e4m3fn`` plus a float32
``<name>_scale`` beside each (half the bytes of bf16); the engine dequantizes them into its bf16
load and vLLM re-quantizes as on any load. The trainer's scale is shared by the parts of one
fused layer (q/k/v, gate/up) exactly as the engine fuses them, so the engine's re-quantization
finds the same scale and the same fp8 values: the tokens equal a fresh FP8 engine's up to the
rounding of an exact midpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from nemo_gen.core.manifest import FP8_DTYPE, SCALE_SUFFIX, TensorMeta, canonical_dtype, fold_scales, is_floating

__all__ = ["FP8_DTYPE", "SCALE_SUFFIX", "fold_scales"]  # the wire's fp8 names live in manifest.py (its checks)

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_DTYPE = "float32"
QUANTIZE_MODES = ("engine", "trainer")
# vLLM's packed_modules_mapping for the decoder families it fuses: the parts of one engine tensor
# (one scale), by their checkpoint leaf names.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_NOT_LINEAR = ("embed", "lm_head", "norm", "wte", "wpe")


def quantizable(name: str, shape: Sequence[int], dtype: str) -> bool:
    """A linear layer's weight that the engine quantizes: 2-D, floating, ``*.weight``, not an
    embedding, an output head or a norm."""
    return (len(shape) == 2 and is_floating(dtype) and canonical_dtype(dtype) != FP8_DTYPE
            and name.endswith(".weight") and not any(part in name for part in _NOT_LINEAR))


def scale_group(name: str) -> str:
    """The tensor whose amax sets ``name``'s scale: its fused layer (``...self_attn.qkv_proj``)
    when it is one of the parts vLLM fuses, else itself."""
    head, _, tail = name.rpartition(".")  # tail: weight
    parent, _, leaf = head.rpartition(".")
    for fused, parts in FUSED.items():
        if leaf in parts:
            return f"{parent}.{fused}.{tail}"
    return name


def wire_metas(metas: Iterable[TensorMeta]) -> list[TensorMeta]:
    """What a trainer-quantized refit carries: each quantizable tensor as fp8, followed by its
    one-element float32 scale; everything else as it was."""
    out: list[TensorMeta] = []
    for m in metas:
        if quantizable(m.name, m.shape, m.dtype):
            out.append(TensorMeta(m.name, m.shape, FP8_DTYPE))
            out.append(TensorMeta(m.name + SCALE_SUFFIX, (1,), SCALE_DTYPE))
        else:
            out.append(m)
    return out


def quantize_problem(quantize: str, precision: str) -> str | None:
    """Why ``refit.quantize`` cannot act with this precision, or None. ``trainer`` acts only on
    an FP8 fleet: elsewhere the engine would load fp8-rounded weights into a bf16 model, a
    silent loss of precision."""
    if quantize not in QUANTIZE_MODES:
        return f"{quantize!r} is not a mode; use one of {list(QUANTIZE_MODES)}"
    if quantize == "trainer" and precision != "fp8":
        return (f"trainer sends fp8 weights, but generation.vllm_cfg.precision is {precision!r}: "
                "set generation.vllm_cfg.precision=fp8, or refit.quantize=engine")
    return None
