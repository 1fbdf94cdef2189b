"""Draft-weight refit on a real speculative-decoding engine (vLLM CPU, method draft_model, the
tiny model drafting for itself): the drafter changes, the policy and its outputs do not."""

from __future__ import annotations

import pytest
import ray
from safetensors.torch import load_file

from nemo_gen import GenerationFleet
from nemo_gen.core.manifest import RefitError
from nemo_gen.tiny_model import make_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def launched(ray_cluster, make_settings, tiny_model_dir):
    settings = make_settings(
        fleet__name="draft", fleet__num_shards=1, refit__draft=True,
        generation__vllm_kwargs={"speculative_config": {
            "method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3}},
    )
    with GenerationFleet.launch(settings) as fleet:
        yield fleet, digests(fleet)


@pytest.fixture
def spec_fleet(launched):
    """The module's fleet, checked on entry: its policy and drafter hold the weights they started
    with (each test that changes the drafter puts it back)."""
    fleet, original = launched
    assert {s.state for s in fleet.status()} == {"healthy"}
    assert digests(fleet) == original, "a test before this one left the drafter changed"
    return fleet


def digests(fleet):
    actor = fleet.shards[0].actor
    return ray.get([actor.call.remote("digest", "policy"), actor.call.remote("digest", "draft")], timeout=60)


def draft_tensors(path):
    return {"draft." + k: v for k, v in load_file(str(path / "model.safetensors")).items()}


def test_draft_refit_changes_the_drafter_and_not_the_policy(spec_fleet, tiny_model_dir, tmp_path):
    fleet = spec_fleet
    assert fleet.resolved.generation_config["_draft_weights_from_refit"] is True
    before = [r.token_ids for r in fleet.generate(PROMPTS, temperature=0)]
    policy0, draft0 = digests(fleet)

    other = make_tiny_model(tmp_path / "other", seed=7)
    report = fleet.refit(draft_tensors(other))
    assert report.ok and report.tensors == len(load_file(str(other / "model.safetensors")))
    policy1, draft1 = digests(fleet)
    assert policy1 == policy0  # the policy's weights were not touched
    assert draft1 != draft0  # the drafter holds new weights
    # Speculative decoding is lossless: greedy outputs are the policy's, whatever the drafter.
    results = fleet.generate(PROMPTS, temperature=0)
    assert [r.token_ids for r in results] == before
    assert all(r.weight_version == report.version for r in results)

    fleet.refit(draft_tensors(tiny_model_dir))  # back to the original drafter weights
    assert digests(fleet) == [policy0, draft0]


def test_a_vllm_trainer_engine_refits_the_drafter_only(spec_fleet, tiny_model_dir, tmp_path):
    """vLLM's trainer API with fleet.weight_sync_client(draft=True): the drafter's weights change
    (including the embeddings it loads as its own), the policy's do not."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import SharedMemoryTrainerInitInfo

    fleet = spec_fleet
    before = [r.token_ids for r in fleet.generate(PROMPTS, temperature=0)]
    policy0, draft0 = digests(fleet)
    drafter = AutoModelForCausalLM.from_pretrained(str(make_tiny_model(tmp_path / "other", seed=7)))
    client = fleet.weight_sync_client(draft=True)
    engine = WeightTransferTrainerFactory.trainer_init(
        SharedMemoryTrainerInitInfo(staging_dir=str(tmp_path)), client=client, source=ModuleSource(drafter)
    )
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    assert client.report.ok and client.report.version == fleet.weight_version
    policy1, draft1 = digests(fleet)
    assert policy1 == policy0 and draft1 != draft0
    results = fleet.generate(PROMPTS, temperature=0)
    assert [r.token_ids for r in results] == before  # lossless speculative decoding
    assert {r.weight_version for r in results} == {client.report.version}
    fleet.refit(draft_tensors(tiny_model_dir))
    assert digests(fleet) == [policy0, draft0]


def test_partial_draft_refit_is_accepted_and_bad_names_are_not(spec_fleet, tiny_model_dir):
    fleet = spec_fleet
    tensors = draft_tensors(tiny_model_dir)
    partial = {k: v for k, v in tensors.items() if ".layers.0." in k}
    assert fleet.refit(partial).ok  # _draft_full_refit is off: a subset is fine
    with pytest.raises(RefitError, match="unexpected tensors: model.layers.5.mlp.up_proj.weight"):
        fleet.refit({**partial, "draft.model.layers.5.mlp.up_proj.weight": next(iter(partial.values()))})


def test_full_draft_refit_requires_draft_tensors(spec_fleet, tiny_model_dir):
    fleet = spec_fleet
    cfg = fleet.resolved.generation_config
    cfg["_draft_full_refit"] = True  # as configure_generation_config(draft_full_refit=True) sets it
    try:
        policy_only = load_file(str(tiny_model_dir / "model.safetensors"))
        with pytest.raises(RefitError, match="no 'draft.' tensors"):
            fleet.refit(policy_only)
        partial = {k: v for k, v in draft_tensors(tiny_model_dir).items() if ".layers.0." in k}
        with pytest.raises(RefitError, match="missing tensors"):
            fleet.refit(partial)
    finally:
        cfg["_draft_full_refit"] = False


def test_a_refit_that_splits_a_stacked_layer_is_refused_before_any_change(spec_fleet, tiny_model_dir, tmp_path):
    fleet = spec_fleet
    before, version = digests(fleet), fleet.weight_version
    other = load_file(str(make_tiny_model(tmp_path / "other", seed=3) / "model.safetensors"))
    q_only = {"draft.model.layers.0.self_attn.q_proj.weight": other["model.layers.0.self_attn.q_proj.weight"]}
    with pytest.raises(RefitError, match="no weight was changed") as err:
        fleet.refit(q_only)
    assert "model.layers.0.self_attn.qkv_proj lacks" in str(err.value)
    assert digests(fleet) == before and fleet.weight_version == version
    assert {s.state for s in fleet.status()} == {"healthy"}
    # The whole stacked layer is fine, and changes the drafter only (the digest sees the norm: the
    # packed linear weights live in the CPU kernel, not in parameters).
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"] + ["model.layers.0.input_layernorm.weight"]
    other["model.layers.0.input_layernorm.weight"] = other["model.layers.0.input_layernorm.weight"] * 1.5
    assert fleet.refit({"draft." + n: other[n] for n in names}).ok
    policy, draft = digests(fleet)
    assert policy == before[0] and draft != before[1]
    fleet.refit(draft_tensors(tiny_model_dir))  # back to the original drafter weights
    assert digests(fleet) == before
