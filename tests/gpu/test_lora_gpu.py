"""LoRA adapters on a CUDA fleet (one shard; bf16, and at ``precision: fp8``: the adapters over
vLLM's online FP8 base weights), against a fresh vLLM CUDA engine of the same precision that loads the
same PEFT directories itself (``tests/engine/lora_reference.py``, its own process, run to the end
before the fleet starts: engines that share a GPU start one at a time).

Needs CUDA. The CPU tier (tests/engine/test_lora.py) holds the full set of rules in float32; this
one checks the CUDA path (vLLM's Punica kernels, adapters staged from CUDA tensors) gives a fresh
engine's tokens. Prompt by prompt on both sides: in bf16 a token may depend on the batch it ran in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.lora_adapters import write_adapter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 40, 41, 200, 12], [1, 100, 7, 7, 250, 33, 2]]
TOKENS = 16
MAX_RANK = 8


# precision -> what the fresh engine gets: a fleet at precision fp8 runs vLLM's fp8_per_tensor
PRECISIONS = {"bfloat16": {}, "fp8": {"quantization": "fp8_per_tensor"}}


@pytest.fixture(scope="module", params=list(PRECISIONS))
def precision(request):
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("lora-gpu-model") / "tiny")


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("lora-gpu-adapters")
    return {name: write_adapter(root / name, model, targets=targets, seed=seed)
            for name, targets, seed in [("a1", ("q_proj", "v_proj"), 1), ("a2", ("q_proj", "v_proj"), 2),
                                        ("b", ("o_proj", "down_proj"), 3)]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model, adapters, precision):
    work = tmp_path_factory.mktemp("lora-gpu-ref")
    spec, out = work / "spec.json", work / "out.json"
    spec.write_text(json.dumps({"model": str(model), "max_rank": MAX_RANK, "prompts": PROMPTS, "max_tokens": TOKENS,
                                "adapters": {k: str(v) for k, v in adapters.items()}, "dtype": "bfloat16",
                                "gpu_memory_utilization": 0.15, "one_by_one": True, **PRECISIONS[precision]}))
    done = subprocess.run([sys.executable, "-m", "tests.engine.lora_reference", str(spec), str(out)],
                          env=dict(os.environ), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fleet(model, reference, precision, tmp_path_factory):
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    f = GenerationFleet.launch(NemoGenSettings.load(overrides={
        "home": str(tmp_path_factory.mktemp("lora-gpu-home")), "model.path": str(model), "fleet.name": "lora-gpu",
        "fleet.device": "gpu", "fleet.num_shards": 1, "fleet.engine_start_timeout_s": 400,
        "ray.namespace": "nemo_gen_lora_gpu", "generation.vllm_cfg.precision": precision,
        "generation.vllm_cfg.enforce_eager": True, "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": 0.2, "refit.backend": "nemo_gen_ipc",
        "generation.vllm_cfg.lora.enabled": True, "generation.vllm_cfg.lora.max_rank": MAX_RANK,
        "generation.vllm_cfg.lora.max_adapters": 2, "health.probe_interval_s": 30.0}))
    yield f
    f.shutdown()


def greedy(fleet, adapter=None):
    out = []
    for p in PROMPTS:
        (r,) = fleet.generate([p], adapter=adapter, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
        assert r.ok, r.error
        out.append(r)
    return out


def tokens(results):
    return [r.token_ids for r in results]


def test_a_peft_directory_refit_gives_a_fresh_cuda_engines_tokens(fleet, reference, adapters):
    assert reference["a1"] != reference["base"]  # the adapter changes greedy tokens at all
    assert tokens(greedy(fleet)) == reference["base"]
    report = fleet.refit_adapter("a", str(adapters["a1"]))
    assert (report.name, report.version) == ("a", 1)
    results = greedy(fleet, "a")
    assert tokens(results) == reference["a1"]
    assert {(r.adapter, r.adapter_version) for r in results} == {("a", 1)}
    assert tokens(greedy(fleet)) == reference["base"]  # the base model serves on beside it


def test_live_cuda_tensors_under_the_same_name_are_served_from_the_first_request(fleet, reference, adapters):
    from safetensors.torch import load_file

    old = fleet.adapters.registry.current("a")
    live = {"config": json.loads((adapters["a2"] / "adapter_config.json").read_text()),
            "tensors": {k: v.cuda() for k, v in load_file(str(adapters["a2"] / "adapter_model.safetensors")).items()}}
    report = fleet.refit_adapter("a", live)
    assert report.version == 2 and report.engine_id != old.engine_id
    results = greedy(fleet, "a")
    assert tokens(results) == reference["a2"]
    assert {r.adapter_version for r in results} == {2}


def test_two_adapters_at_once_each_answer_under_its_own_name(fleet, reference, adapters):
    import asyncio

    fleet.refit_adapter("b", str(adapters["b"]))
    assert tokens(greedy(fleet, "b")) == reference["b"]

    async def both():
        return await asyncio.gather(*[fleet.generate_async(p, adapter=name, temperature=0, ignore_eos=True,
                                                           max_new_tokens=TOKENS)
                                      for name in ("a", "b") for p in PROMPTS])

    results = asyncio.run(both())
    n = len(PROMPTS)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [(r.adapter, r.adapter_version) for r in results] == [("a", 2)] * n + [("b", 1)] * n
    # Mixed in one batch, bf16 may flip a near-tied token: most tokens must still be each adapter's own.
    for got, want in ((results[:n], reference["a2"]), (results[n:], reference["b"])):
        pairs = [(x, y) for r, w in zip(got, want) for x, y in zip(r.token_ids, w)]
        assert sum(x == y for x, y in pairs) >= 0.9 * len(pairs), (tokens(got), want)
