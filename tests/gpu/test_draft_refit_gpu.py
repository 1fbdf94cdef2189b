"""Draft-weight (speculative decoding) refit inside a CUDA engine: vLLM's ``draft_model`` drafter
(the tiny model drafting for itself) refit by a colocated trainer through
``fleet.weight_sync_client(draft=True)`` over ``nemo_gen_ipc``, and from a checkpoint.

The CPU tier (tests/engine/test_refit_draft.py) proves the same on vLLM's CPU engine; this is the
path users run. Needs CUDA and vLLM's CUDA build (skipped elsewhere). On the GPU host::

    python -m pytest tests/gpu/test_draft_refit_gpu.py -v
"""

from __future__ import annotations

import pytest
import ray
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from nemo_gen.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("gpu-draft-models")
    return make_tiny_model(root / "a"), make_tiny_model(root / "other", seed=7)


@pytest.fixture(scope="module")
def spec_fleet(models, tmp_path_factory):
    from nemo_gen import GenerationFleet
    from nemo_gen.settings import NemoGenSettings

    settings = NemoGenSettings.load(overrides={
        "home": str(tmp_path_factory.mktemp("gpu-draft-home")),
        "model.path": str(models[0]),
        "fleet.name": "gpu-draft",
        "fleet.device": "gpu",
        "fleet.num_shards": 1,
        "fleet.engine_start_timeout_s": 400,
        "ray.namespace": "nemo_gen_gpu_draft",
        "generation.max_new_tokens": TOKENS,
        "generation.vllm_cfg.precision": "bfloat16",
        "generation.vllm_cfg.enforce_eager": True,
        "generation.vllm_cfg.max_model_len": 256,
        "generation.vllm_cfg.gpu_memory_utilization": 0.2,
        "generation.vllm_kwargs": {"speculative_config": {
            "method": "draft_model", "model": str(models[0]), "num_speculative_tokens": 3}},
        "refit.backend": "nemo_gen_ipc",
        "refit.draft": True,
    })
    fleet = GenerationFleet.launch(settings)
    yield fleet
    fleet.shutdown()


@pytest.fixture(scope="module")
def at_launch(spec_fleet) -> list[float]:
    """(policy, drafter) digests as launched from disk (taken before the first refit)."""
    return digests(spec_fleet)


def digests(fleet) -> list[float]:
    actor = fleet.shards[0].actor
    return ray.get([actor.call.remote("digest", "policy"), actor.call.remote("digest", "draft")], timeout=60)


def greedy(fleet, prompts) -> list[list[int]]:
    results = fleet.generate(prompts, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    assert all(r.ok for r in results), [r.error for r in results]
    return [r.token_ids for r in results]


PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is"]


def test_a_colocated_trainer_refits_the_cuda_drafter_only(spec_fleet, models, at_launch):
    """A torch module on the engine's GPU sent as draft weights by vLLM's trainer API over
    nemo_gen_ipc: the drafter holds new weights, the policy does not change, and greedy output
    stays the policy's (speculative decoding is lossless) under the new version."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import CudaIpcTrainerInitInfo

    fleet = spec_fleet
    assert fleet.resolved.generation_config["_draft_weights_from_refit"] is True
    before = greedy(fleet, PROMPTS)
    policy0, draft0 = at_launch
    drafter = AutoModelForCausalLM.from_pretrained(str(models[1]), dtype=torch.bfloat16).cuda()
    client = fleet.weight_sync_client(draft=True)
    engine = WeightTransferTrainerFactory.trainer_init(CudaIpcTrainerInitInfo(), client=client,
                                                       source=ModuleSource(drafter))
    try:
        engine.send_weights()
        assert client.report.ok, client.report
        policy1, draft1 = digests(fleet)
        assert policy1 == policy0  # the policy's weights were not touched
        assert draft1 != draft0  # the drafter's were
        after = fleet.generate(PROMPTS, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
        assert [r.token_ids for r in after] == before
        assert {r.weight_version for r in after} == {client.report.version}
        engine.send_weights()  # the same tensors again: the engine replays what it loaded
        assert client.report.ok and digests(fleet) == [policy1, draft1]
    finally:
        engine.shutdown()


def test_a_checkpoint_draft_refit_restores_the_drafter(spec_fleet, models, at_launch):
    """The drafter's launch weights back from its checkpoint (``draft.`` names), after the
    trainer's refit: both digests are those of the engine as launched from disk."""
    from safetensors.torch import load_file

    fleet = spec_fleet
    before = greedy(fleet, PROMPTS)
    tensors = {"draft." + k: v for k, v in load_file(str(models[0] / "model.safetensors")).items()}
    report = fleet.refit(tensors)
    assert report.ok, report
    assert digests(fleet) == at_launch
    after = fleet.generate(PROMPTS, temperature=0, max_new_tokens=TOKENS, ignore_eos=True)
    assert [r.token_ids for r in after] == before and {r.weight_version for r in after} == {report.version}
