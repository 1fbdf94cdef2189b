"""Refit on real vLLM CPU engines: a 2-shard fleet on model A, and a fresh engine on model B
(same architecture and tokenizer, other weights) as the reference for what B generates."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import ray
import torch
from safetensors.torch import load_file, save_file

from nemo_gen import GenerationFleet
from nemo_gen.core.fleet_health import ShardState
from nemo_gen.core.manifest import RefitError
from nemo_gen.core.wire import LoadRefit
from nemo_gen.tiny_model import make_tiny_model
from tests.helpers import SharedFleet, shutdown_all, wait_until

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, my name is", "A fleet of engines"]


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models-b") / "tiny-b", seed=1)


@pytest.fixture(scope="module")
def shared(ray_cluster, make_settings, model_b):
    """The main fleet (2 shards on model A, recovery off: tests that want it switch it on) and,
    beside it, a fresh one on model B, the reference for what B generates. Each test gets the main
    fleet checked on entry (``on_model_a``); the one that leaves a slot dead spends it."""
    def launch_main():
        # refit.timeout_s: two tests freeze a shard and wait this long for the refit to give up
        # on it. A bound, not a latency target: a healthy refit of this 0.5 MB model takes
        # ~0.03 s (bench/refit.py measures it), so 10 s is ~300x that (the same bound as
        # tests/e2e/test_fleet_cli.py's frozen-shard refit).
        return GenerationFleet.launch(make_settings(fleet__name="refit", fleet__num_shards=2,
                                                    refit__timeout_s=10, health__auto_recover=False))

    with ThreadPoolExecutor(2) as pool:
        main = pool.submit(launch_main)
        fresh = pool.submit(GenerationFleet.launch, make_settings(fleet__name="fresh-b", fleet__num_shards=1,
                                                                   model__path=str(model_b)))
        main, fresh = main.result(), fresh.result()
    reference_a = greedy(main)

    def on_model_a(fleet):
        """Every slot HEALTHY at the fleet's version, serving model A's greedy answers."""
        assert {s.state for s in fleet.status()} == {"healthy"}, fleet.health.state_summary()
        assert {s.weight_version for s in fleet.health.snapshot()} == {fleet.weight_version}
        assert greedy(fleet) == reference_a, "the fleet is not on model A: a test before this one left it changed"

    shared = SharedFleet(launch_main, check=on_model_a, first=main)
    yield shared, fresh
    shutdown_all([fresh])
    shared.close()


@pytest.fixture
def fleets(shared):
    return {"main": shared[0].get(), "fresh_b": shared[1]}


def greedy(fleet):
    return [r.token_ids for r in fleet.generate(PROMPTS * 2, temperature=0)]


def broken_checkpoint(src_dir, dst_dir, mutate):
    tensors = load_file(str(src_dir / "model.safetensors"))
    mutate(tensors)
    dst_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst_dir / "model.safetensors"))
    return dst_dir


def test_refit_to_a_checkpoint_matches_a_fresh_engine_and_back(fleets, tiny_model_dir, model_b):
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    version, original = fleet.weight_version, greedy(fleet)
    expected_b = greedy(fresh)
    assert original != expected_b

    report = fleet.refit(str(model_b))
    assert report.ok and report.version == version + 1 == fleet.weight_version
    assert [s.shard for s in report.shards] == [0, 1]
    assert report.bytes >= sum(os.path.getsize(model_b / "model.safetensors") for _ in [0]) - 4096
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0, 1}
    assert all(r.weight_version == version + 1 for r in results)
    assert [r.token_ids for r in results] == expected_b

    back = fleet.refit(str(tiny_model_dir))
    assert back.ok and back.version == version + 2
    assert greedy(fleet) == original


def test_live_tensors_refit_without_disk(fleets, tiny_model_dir, model_b):
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    tensors = load_file(str(model_b / "model.safetensors"))
    before = fleet.weight_version
    report = fleet.refit(lambda: tensors)  # a trainer's named tensors, no file
    assert report.ok and report.version == before + 1
    assert greedy(fleet) == greedy(fresh)
    fleet.refit(str(tiny_model_dir))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.__setitem__("model.norm.weight", torch.ones(7)), "model.norm.weight: shape [7] but the model has [128]"),
        (lambda t: t.pop("model.layers.1.mlp.down_proj.weight"), "missing tensors: model.layers.1.mlp.down_proj.weight"),
        (lambda t: t.__setitem__("model.layers.9.extra.weight", torch.zeros(3)), "unexpected tensors: model.layers.9.extra.weight"),
    ],
    ids=["wrong-shape", "missing", "extra"],
)
def test_bad_checkpoint_is_refused_before_any_shard_changes(fleets, tiny_model_dir, tmp_path, mutate, message):
    fleet = fleets["main"]
    version, outputs = fleet.weight_version, greedy(fleet)
    bad = broken_checkpoint(tiny_model_dir, tmp_path / "bad", mutate)
    with pytest.raises(RefitError, match="no weight was changed") as err:
        fleet.refit(str(bad))
    assert message in str(err.value)
    assert fleet.weight_version == version
    assert {s.state for s in fleet.status()} == {"healthy"}
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert [r.token_ids for r in results] == outputs
    assert all(r.weight_version == version for r in results)


def test_draft_tensors_need_a_drafter(fleets, tiny_model_dir):
    fleet = fleets["main"]
    tensors = {"draft." + k: v for k, v in load_file(str(tiny_model_dir / "model.safetensors")).items()}
    with pytest.raises(RefitError, match="engines run no draft model"):
        fleet.refit(tensors)


def test_versions_only_move_forward(fleets, tiny_model_dir):
    fleet = fleets["main"]
    with pytest.raises(RefitError, match="not newer"):
        fleet.refit(str(tiny_model_dir), version=fleet.weight_version)
    target = fleet.weight_version + 10  # read before the refit: the version asked for
    report = fleet.refit(str(tiny_model_dir), version=target)
    assert report.ok and report.version == target and fleet.weight_version == target
    assert [s.weight_version for s in fleet.status()] == [target, target]
    assert {r.weight_version for r in fleet.generate(PROMPTS, temperature=0)} == {target}
    with pytest.raises(RefitError, match="not newer"):  # and it is the new floor
        fleet.refit(str(tiny_model_dir), version=target - 1)


def test_sharded_checkpoint_with_index(fleets, tiny_model_dir, model_b, tmp_path):
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    tensors = load_file(str(model_b / "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    ckpt = tmp_path / "sharded"
    ckpt.mkdir()
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(ckpt / fname))
        weight_map.update({n: fname for n in part})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert fleet.refit(str(ckpt)).ok
    assert greedy(fleet) == greedy(fresh)
    fleet.refit(str(tiny_model_dir))


def _trainer(fleet, model_dir, tmp_path, mutate=None):
    """vLLM's trainer-side API, as an RL trainer uses it, with this fleet as the client: a
    torch module (the "policy") as the weight source, nemo_gen's shared-memory backend."""
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from nemo_gen.vllm_ext.vllm_backend import SharedMemoryTrainerInitInfo

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if mutate is not None:
        mutate(policy)
    client = fleet.weight_sync_client()
    engine = WeightTransferTrainerFactory.trainer_init(
        SharedMemoryTrainerInitInfo(staging_dir=str(tmp_path)), client=client, source=ModuleSource(policy)
    )
    return client, engine


def _direct_calls(fleet) -> list[int]:
    return [ray.get(h.actor.info.remote(), timeout=30).direct_calls for h in fleet.shards]


@pytest.mark.parametrize("transport", ["direct line", "Ray"])
@pytest.mark.parametrize("protocol", ["one call", "three steps"])
def test_a_vllm_trainer_engine_refits_the_fleet_through_its_weight_sync_client(fleets, tiny_model_dir, model_b, tmp_path,
                                                                              protocol, transport):
    """Over each shard's direct line (refit.control_channel, the default: the shards run on the
    driver's node), and over Ray calls."""
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    before, original = fleet.weight_version, greedy(fleet)
    fleet.driver.channels = transport == "direct line"
    calls = _direct_calls(fleet)
    client, engine = _trainer(fleet, model_b, tmp_path)
    if protocol == "three steps":
        from nemo_gen.vllm_ext.vllm_backend import vllm_steps_only

        engine.client = vllm_steps_only(client)
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
        fleet.driver.channels = True
    steps = 2 if protocol == "one call" else 4  # init + apply, or init + start + update + finish
    assert _direct_calls(fleet) == [n + (steps if transport == "direct line" else 0) for n in calls]
    if transport == "direct line":
        assert fleet.driver.lines() == {h.name for h in fleet.shards}
    report = client.report
    assert report.ok and report.version == before + 1 == fleet.weight_version
    assert [s.shard for s in report.shards] == [0, 1]
    on_disk = load_file(str(model_b / "model.safetensors"))
    assert report.tensors == len(on_disk)
    assert report.bytes == sum(t.numel() * 4 for t in on_disk.values())  # counted in the engines' float32
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0, 1} and {r.weight_version for r in results} == {before + 1}
    assert [r.token_ids for r in results] == greedy(fresh)
    assert fleet.refit(str(tiny_model_dir)).ok
    assert greedy(fleet) == original


def test_weight_sync_refuses_a_bad_chunk_before_any_shard_changes(fleets, tiny_model_dir, model_b, tmp_path):
    fleet = fleets["main"]
    version, outputs = fleet.weight_version, greedy(fleet)

    def widen(policy):  # a trainer whose norm has the wrong size
        policy.model.norm.weight = torch.nn.Parameter(torch.ones(7))

    client, engine = _trainer(fleet, model_b, tmp_path, mutate=widen)
    try:
        with pytest.raises(RefitError, match=r"model.norm.weight: shape \[7\] but the model has \[128\]"):
            engine.send_weights()
    finally:
        engine.shutdown()
    assert client.report is None and fleet.weight_version == version
    assert {s.state for s in fleet.status()} == {"healthy"}
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert [r.token_ids for r in results] == outputs and {r.weight_version for r in results} == {version}
    # the session ended everywhere: the fleet's own refit path is free again
    assert fleet.refit(str(tiny_model_dir)).ok


def test_an_abandoned_weight_update_is_aborted_and_the_fleet_serves_on(fleets, tiny_model_dir):
    """A trainer that dies between start and its first chunk (an NCCL broadcast that failed):
    abort_weight_update releases the shards, which keep their version and serve."""
    fleet = fleets["main"]
    version, outputs = fleet.weight_version, greedy(fleet)
    client = fleet.weight_sync_client()
    client.start_weight_update()
    # meanwhile every shard is held and claims no version (its weights may be changing)
    assert [ray.get(h.actor.info.remote(), timeout=30).weight_version for h in fleet.shards] == [None, None]
    assert client.abort_weight_update() is None  # nothing was loaded: no shard to report
    assert fleet.weight_version == version and {s.state for s in fleet.status()} == {"healthy"}
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert [r.token_ids for r in results] == outputs and {r.weight_version for r in results} == {version}
    with pytest.raises(RefitError, match="no weight update in progress"):
        client.finish_weight_update()
    assert fleet.refit(str(tiny_model_dir)).ok  # the refit lock was released


def test_weight_sync_client_gives_each_shard_its_nccl_ranks(fleets):
    client = fleets["main"].weight_sync_client()
    assert client.nccl_world_size() == 3  # the trainer's rank + 2 shards x 1 worker
    with pytest.raises(RefitError, match="world_size 2, but this fleet needs 3"):
        client.init_weight_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
        )
    with pytest.raises(RefitError, match="no weight update in progress"):
        client.update_weights({"entries": []})


def test_a_shard_killed_during_a_weight_sync_update_is_quarantined_and_comes_back(
    fleets, tiny_model_dir, model_b, tmp_path
):
    """The trainer's update reaches shard 0; shard 1's actor is SIGKILLed as it arrives. Shard 0
    serves the new version alone; shard 1 is restarted, stays STALE (a trainer-pushed version
    has no source to catch up from), and the next refit re-admits it."""
    from nemo_gen.fleet.recovery import restart_shard

    fleet, fresh = fleets["main"], fleets["fresh_b"]
    victim = fleet.status()[1].actor_pid
    client, engine = _trainer(fleet, model_b, tmp_path)

    class KillsShard1OnUpdate:  # the real client; the kill lands as the update is sent
        def __getattr__(self, name):
            return getattr(client, name)

        def apply_weight_update(self, info):
            os.kill(victim, signal.SIGKILL)
            return client.apply_weight_update(info)

    engine.client = KillsShard1OnUpdate()
    try:
        engine.send_weights()
    finally:
        engine.shutdown()
    report = client.report
    assert [s.shard for s in report.shards if s.ok] == [0] and fleet.weight_version == report.version
    (lost,) = report.failed
    assert lost.shard == 1 and f"refit to version {report.version} failed" in lost.error
    assert fleet.health.state_of(1) is ShardState.DEAD
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0} and {r.weight_version for r in results} == {report.version}
    assert [r.token_ids for r in results] == greedy(fresh)

    assert restart_shard(fleet, 1)["action"] == "restarted-stale"
    assert fleet.health.state_of(1) is ShardState.STALE
    assert fleet.refit(str(model_b)).ok  # re-admits the replacement
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0, 1} and [r.token_ids for r in results] == greedy(fresh)
    assert fleet.refit(str(tiny_model_dir)).ok


def test_a_shard_frozen_while_loading_is_given_up_on_at_the_deadline_and_healed(fleets, model_b, tiny_model_dir):
    """A self-healing fleet (``health.auto_recover`` on for this test, off again after): shard 1
    passes the refit's check, then its EngineCore freezes (SIGSTOP) as the load goes out. The
    refit gives up on it at refit.timeout_s and quarantines it; recovery replaces the live but
    untrusted shard, and the replacement serves the fleet's new version."""
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    victim = fleet.handle(1)
    core = next(p for p in victim.engine_pids if "EngineCore" in psutil.Process(p).name())
    send = fleet.driver.fan_out

    def freezing_on_load(handles, message, margin_s):
        if isinstance(message, LoadRefit):
            os.kill(core, signal.SIGSTOP)
        return send(handles, message, margin_s)

    fleet.settings.health.auto_recover = True
    try:
        fleet.driver.fan_out = freezing_on_load
        try:
            t0 = time.monotonic()
            report = fleet.refit(str(model_b))
            elapsed = time.monotonic() - t0
        finally:
            fleet.driver.fan_out = send
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)  # alive again, and still not to be trusted
        (lost,) = report.failed
        assert lost.shard == 1 and "load_refit did not answer" in lost.error
        # Given up on at refit.timeout_s=10 (it was 10 + 60 s); the bound leaves room for a
        # loaded machine and stays below the old deadline.
        assert elapsed < fleet.settings.refit.timeout_s + 45
        # A bound, not a target: an engine start here is ~35 s, under load several times that.
        wait_until(lambda: fleet.health.state_of(1) is ShardState.HEALTHY and fleet.handle(1).name != victim.name,
                   timeout_s=400, what="slot 1 replaced and serving")
        results = fleet.generate(PROMPTS * 2, temperature=0)
        assert {r.weight_version for r in results} == {report.version} and {r.shard for r in results} == {0, 1}
        assert [r.token_ids for r in results] == greedy(fresh)
        assert fleet.refit(str(tiny_model_dir)).ok  # back to model A for the next test
    finally:
        fleet.settings.health.auto_recover = False


def test_a_shard_lost_during_refit_never_serves(shared, fleets, model_b):
    """Shard 1's actor is frozen (SIGSTOP) while the refit runs, then killed; recovery is off, so
    the fleet stays one shard short: it is spent."""
    shared[0].spend()
    fleet, fresh = fleets["main"], fleets["fresh_b"]
    victim = fleet.status()[1]
    os.kill(victim.actor_pid, signal.SIGSTOP)
    try:
        report = fleet.refit(str(model_b))  # gives up on the frozen shard after refit.timeout_s=10
    finally:
        os.kill(victim.actor_pid, signal.SIGKILL)
    assert [s.shard for s in report.shards if s.ok] == [0]
    (lost,) = report.failed
    assert lost.shard == 1 and "GetTimeoutError" in lost.error
    assert fleet.health.state_of(1) is ShardState.DEAD
    results = fleet.generate(PROMPTS * 2, temperature=0)
    assert {r.shard for r in results} == {0}
    assert all(r.weight_version == report.version for r in results)
    assert [r.token_ids for r in results] == greedy(fresh)
