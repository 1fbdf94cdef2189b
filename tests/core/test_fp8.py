"""FP8 on the refit wire without an engine: the trainer's quantization reproduces the engine's
own (vLLM's per-tensor online FP8 over each fused layer), the wire's manifest and its checks,
the engine side's dequantization, and the settings that cannot act."""

from __future__ import annotations

import pytest
import torch

from nemo_gen.core.fp8 import FP8_DTYPE, fold_scales, quantizable, quantize_problem, scale_group, wire_metas
from nemo_gen.core.manifest import RefitError, TensorMeta, chunk_metas, check_manifest
from nemo_gen.errors import ConfigError
from nemo_gen.settings import NemoGenSettings
from nemo_gen.vllm_ext.fp8 import Fp8Source, dequantized

FP8 = torch.float8_e4m3fn


class _Meta:
    def __init__(self, name, dtype, shape):
        self.name, self.dtype, self.shape = name, dtype, shape


class _Source:
    """A vLLM WeightSource over a dict of tensors."""

    def __init__(self, tensors):
        self.tensors = tensors

    def metadata(self):
        return [_Meta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self):
        return iter(self.tensors.items())


def _layer(seed=0, hidden=64, inter=96):
    g = torch.Generator().manual_seed(seed)
    def w(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": w(128, hidden),
        p + "self_attn.q_proj.weight": w(hidden, hidden),
        p + "self_attn.k_proj.weight": w(hidden, hidden, std=0.05),  # a larger amax than q's
        p + "self_attn.v_proj.weight": w(hidden, hidden),
        p + "self_attn.o_proj.weight": w(hidden, hidden),
        p + "mlp.gate_proj.weight": w(inter, hidden),
        p + "mlp.up_proj.weight": w(inter, hidden, std=0.03),
        p + "mlp.down_proj.weight": w(hidden, inter),
        p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": w(128, hidden),
    }


def _engine_quant(weight):
    """vLLM's Fp8PerTensorOnlineLinearMethod.process_weights_after_loading, in torch: one scale
    (amax / 448) over the whole (fused) tensor, true division."""
    scale = weight.abs().amax().to(torch.float32) / torch.tensor(448.0)
    return (weight.to(torch.float32) / scale).clamp(-448, 448).to(FP8), scale


def _fused(tensors, parts):
    return torch.cat([tensors[p] for p in parts], dim=0)


def test_which_tensors_are_quantized_and_their_scale_groups():
    names = {n: t for n, t in _layer().items()}
    q = sorted(n for n, t in names.items() if quantizable(n, tuple(t.shape), str(t.dtype)))
    assert all("_proj" in n for n in q) and len(q) == 7
    assert scale_group("model.layers.0.self_attn.k_proj.weight") == "model.layers.0.self_attn.qkv_proj.weight"
    assert scale_group("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.gate_up_proj.weight"
    assert scale_group("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"


def test_trainer_quantization_reproduces_the_engines_own_after_dequantization():
    """What the engine holds after a trainer-quantized refit (dequantized to bf16, re-quantized by
    vLLM's rule over each fused layer) equals what it holds after a bf16 refit: same scales, same
    fp8 values. Fails if the trainer's scale were per part instead of per fused layer."""
    tensors = _layer()
    src = Fp8Source(_Source(tensors))
    sent = list(src)
    assert [n for n, _ in sent if n.endswith("_scale")]  # scales travel
    loaded = dict(dequantized(sent, torch.bfloat16))
    assert set(loaded) == set(tensors)
    assert loaded["model.embed_tokens.weight"] is tensors["model.embed_tokens.weight"]  # passed through
    p = "model.layers.0."
    groups = [[p + f"self_attn.{x}_proj.weight" for x in "qkv"], [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
              [p + "self_attn.o_proj.weight"], [p + "mlp.down_proj.weight"]]
    for parts in groups:
        want_q, want_s = _engine_quant(_fused(tensors, parts))
        got_q, got_s = _engine_quant(_fused(loaded, parts))
        assert got_s == want_s
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), parts


def test_trainer_quantization_halves_the_linear_bytes_and_reuses_its_buffers():
    tensors = _layer()
    src = Fp8Source(_Source(tensors))
    bf16 = sum(t.numel() * 2 for t in tensors.values())
    linear = sum(t.numel() * 2 for n, t in tensors.items() if "_proj" in n)
    assert src.nbytes() == bf16 - linear // 2 + 7 * 4  # fp8 linears plus one float32 scale each
    first = {n: t.data_ptr() for n, t in src}
    tensors["model.layers.0.mlp.down_proj.weight"].mul_(2)
    second = dict(src)
    assert {n: t.data_ptr() for n, t in second.items()} == first  # the same storages: IPC shares them once
    assert second["model.layers.0.mlp.down_proj.weight_scale"].item() == pytest.approx(
        tensors["model.layers.0.mlp.down_proj.weight"].abs().amax().float().item() / 448)


def test_wire_manifest_folds_back_to_the_models():
    tensors = _layer()
    metas = [TensorMeta.of(n, tuple(t.shape), "bfloat16") for n, t in tensors.items()]
    wire = wire_metas(metas)
    assert sum(m.dtype == FP8_DTYPE for m in wire) == 7 and len(wire) == len(metas) + 7
    info = {"entries": [[m.name, list(m.shape), m.dtype, 0] for m in wire]}
    check_manifest({m.name: m for m in metas}, chunk_metas(info, "bfloat16"))


def test_an_fp8_tensor_without_its_scale_is_refused_by_name():
    rows = [("a.q_proj.weight", (4, 4), FP8_DTYPE), ("b.o_proj.weight", (4, 4), "bfloat16")]
    with pytest.raises(RefitError, match="a.q_proj.weight"):
        fold_scales(rows)
    with pytest.raises(RefitError, match="b.o_proj.weight_scale"):
        fold_scales(rows + [("a.q_proj.weight_scale", (1,), "float32"), ("b.o_proj.weight_scale", (1,), "float32")])
    with pytest.raises(RefitError, match="a.q_proj.weight"):
        list(dequantized([("a.q_proj.weight", torch.zeros(4, 4, dtype=FP8))], torch.bfloat16))


def test_dequantized_takes_the_scale_before_or_after_its_tensor():
    q = torch.tensor([[1.0, -2.0]]).to(FP8)
    s = torch.tensor([0.5])
    for order in ([("w", q), ("w_scale", s)], [("w_scale", s), ("w", q)]):
        (name, t), = dequantized(order, torch.bfloat16)
        assert name == "w" and t.dtype == torch.bfloat16 and t.tolist() == [[0.5, -1.0]]


def test_trainer_quantization_needs_an_fp8_fleet():
    assert quantize_problem("engine", "bfloat16") is None and quantize_problem("trainer", "fp8") is None
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(overrides=["refit.quantize=trainer", "generation.vllm_cfg.precision=bfloat16"])
    assert info.value.field == "refit.quantize" and "generation.vllm_cfg.precision=fp8" in str(info.value)
    assert NemoGenSettings.load(overrides=["refit.quantize=trainer", "generation.vllm_cfg.precision=fp8"]).refit.quantize == "trainer"
