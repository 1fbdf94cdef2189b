"""The weights' content digest on real vLLM CPU engines: each shard's workers hash the bytes they
load and check them against the trainer's digest; a shard whose staged weights are corrupted by
one byte (``nemo_gen_fault_staged``: its own copy, as a bad transport would) fails its refit on
the digest check naming the tensor, loads nothing (its engine still holds the old version), and
is quarantined, while the other moves on; every result's digest is the trainer's digest of the
weights that produced it, computed here independently from the checkpoint."""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file

from nemo_gen import GenerationFleet
from nemo_gen.core.digest import combine
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.tiny_model import make_tiny_model
from nemo_gen.vllm_ext.digest import tensor_digest
from tests.helpers import shutdown_all

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def fleet(ray_cluster, make_settings):
    fleet = GenerationFleet.launch(make_settings(fleet__name="digest", fleet__num_shards=2,
                                                 health__auto_recover=False))
    yield fleet
    shutdown_all([fleet])


def worker(handle, method, *args):
    """A worker extension method on one shard's engine (its first worker's answer)."""
    def call(actor, method, args):
        return actor.shard.engine._llm.collective_rpc(method, args=args)

    return ray.get(handle.actor.__ray_call__.remote(call, method, args), timeout=120)[0]


def trainer_digest(model_dir, dtype_name):
    """The trainer's digest of a checkpoint, from its file: every tensor as a refit stages it."""
    dtype = getattr(torch, dtype_name)
    tensors = load_file(str(model_dir / "model.safetensors"))
    return combine((n, tensor_digest(t.to(dtype) if t.is_floating_point() else t)) for n, t in tensors.items())


def test_a_trainer_engine_sends_its_digest_the_shards_check_it_and_results_carry_it(fleet, tmp_path_factory):
    """vLLM's trainer API (nemo_gen_shm from a torch module): the trainer engine hashes what it
    stages, every shard's workers check it before loading, and results carry it."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import SharedMemoryTrainerInitInfo

    model = make_tiny_model(tmp_path_factory.mktemp("digest") / "trainer", seed=13)
    policy = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    want = combine((n, tensor_digest(t)) for n, t in ModuleSource(policy))  # float32: staged as it is
    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(
        SharedMemoryTrainerInitInfo(staging_dir=str(tmp_path_factory.mktemp("trainer-staging"))), client=client,
        source=ModuleSource(policy))
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    report = client.report
    assert report.ok and report.digest == want
    results = fleet.generate(PROMPTS, temperature=0)
    assert all(r.weight_versions == [(report.version, len(r.token_ids))] and r.weight_digests == [want]
               for r in results)


def test_every_result_carries_the_trainers_digest_and_a_corrupted_shard_keeps_its_old_weights(
        fleet, tmp_path_factory, tiny_model_dir):
    dtype = fleet.refitter.engine_dtype
    models = [make_tiny_model(tmp_path_factory.mktemp("digest") / f"m{seed}", seed=seed) for seed in (11, 12)]

    first = fleet.refit(str(models[0]))
    assert first.ok and first.digest == trainer_digest(models[0], dtype)
    assert first.digest != trainer_digest(tiny_model_dir, dtype)
    assert [worker(h, "nemo_gen_weights_digest") for h in fleet.shards] == [first.digest] * 2  # each shard's own
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0, 1}
    assert all(r.weight_versions == [(first.version, len(r.token_ids))] and r.weight_digests == [first.digest]
               for r in results)

    victim, other = fleet.shards[1], fleet.shards[0]
    worker(victim, "nemo_gen_fault_staged", CORRUPTED)  # one byte of one tensor, in shard 1's copy only
    second = fleet.refit(str(models[1]))
    (failed,) = second.failed
    assert failed.shard == 1 and f"weight digest mismatch at tensor '{CORRUPTED}'" in failed.error
    assert worker(victim, "nemo_gen_weights_digest") == first.digest  # nothing loaded: the old weights
    assert ray.get(victim.actor.info.remote(), timeout=30).weight_version == first.version
    assert fleet.health.state_of(1) is ShardState.DEAD  # quarantined through the slot table
    assert worker(other, "nemo_gen_weights_digest") == second.digest == trainer_digest(models[1], dtype)
    assert fleet.weight_version == second.version
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0}
    assert all(r.weight_digests == [second.digest] for r in results)
    worker(victim, "nemo_gen_fault_staged", None)
