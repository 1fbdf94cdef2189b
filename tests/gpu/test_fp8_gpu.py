"""An FP8 fleet (``generation.vllm_cfg.precision: fp8``, vLLM's online per-tensor FP8) refit from
bf16 weights: from a checkpoint, from a live module through ``nemo_gen_ipc`` (quantized in the
engine), and trainer-quantized (fp8 + scales, ``refit.quantize: trainer``'s path).

Needs CUDA (skipped elsewhere: vLLM's CPU FP8 kernels need AMX). One fleet of one shard, launched
from model A: its greedy tokens are a fresh FP8 engine's of A. Each refit goes to model B (tokens
must change) and back to A (tokens must be the fresh engine's again), prompt by prompt, batch 1.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 200, 12], [1, 100, 7, 7, 250, 33, 2]]
TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("fp8-models")
    return make_tiny_model(root / "a"), make_tiny_model(root / "b", seed=1)


@pytest.fixture(scope="module")
def modules(models):
    """Models A and B as a trainer holds them: bf16 on the GPU."""
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(str(m), torch_dtype=torch.bfloat16).cuda().eval() for m in models]


@pytest.fixture(scope="module")
def fleet(models, tmp_path_factory):
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    f = GenerationFleet.launch(NemoGenSettings.load(overrides={
        "home": str(tmp_path_factory.mktemp("fp8-home")), "model.path": str(models[0]), "fleet.name": "fp8-tests",
        "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 400,
        "ray.namespace": "nemo_gen_fp8_tests", "generation.vllm_cfg.precision": "fp8",
        "generation.vllm_cfg.enforce_eager": True, "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": 0.2, "refit.backend": "nemo_gen_ipc",
        "health.probe_interval_s": 30.0}))
    yield f
    f.shutdown()


def greedy(fleet):
    out = []
    for p in PROMPTS:
        (r,) = fleet.generate([p], temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
        assert r.ok, r.error
        out.append(r.token_ids)
    return out


@pytest.fixture(scope="module")
def fresh(fleet):
    return greedy(fleet)


def _send(fleet, module, quantize=None):
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo

    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(quantize=quantize), client=client,
                                                       source=ModuleSource(module))
    try:
        engine.send_weights()
        assert client.report.ok, client.report.to_json()
        return engine.source
    finally:
        engine.shutdown()


def test_the_fleet_serves_in_fp8(fleet, fresh):
    assert fleet.settings.generation.vllm_cfg.precision == "fp8"
    assert all(len(t) == TOKENS for t in fresh)


def test_a_checkpoint_refit_from_bf16_gives_a_fresh_fp8_engines_tokens(fleet, fresh, models):
    assert fleet.refit(str(models[1])).ok
    other = greedy(fleet)
    assert other != fresh  # the refit took effect
    assert fleet.refit(str(models[0])).ok
    assert greedy(fleet) == fresh


def test_a_live_bf16_refit_is_quantized_in_the_engine(fleet, fresh, modules):
    _send(fleet, modules[1])
    assert greedy(fleet) != fresh
    _send(fleet, modules[0])
    assert greedy(fleet) == fresh


def test_a_trainer_quantized_refit_gives_the_same_tokens_with_half_the_linear_bytes(fleet, fresh, modules):
    _send(fleet, modules[1], quantize="fp8")
    assert greedy(fleet) != fresh
    source = _send(fleet, modules[0], quantize="fp8")
    assert greedy(fleet) == fresh
    bf16 = sum(p.numel() * 2 for p in modules[0].parameters())
    linear = sum(p.numel() * 2 for n, p in modules[0].named_parameters() if "_proj" in n)
    assert source.nbytes() < bf16 - 0.45 * linear, (source.nbytes(), bf16, linear)
    print(f"\ntrainer-quantized refit: {source.nbytes()} bytes against bf16's {bf16}")
