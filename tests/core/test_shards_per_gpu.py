"""fleet.shards_per_gpu: fractional GPU bundles, and a gpu_memory_utilization that must fit k engines."""

from __future__ import annotations

import pytest

from nemo_gen.core.placement import ClusterResources, gpu_share, plan_fleet_placement
from nemo_gen.errors import ConfigError, PlacementError
from nemo_gen.settings import NemoGenSettings


def test_default_is_one_whole_gpu_per_shard():
    s = NemoGenSettings.load()
    assert s.fleet.shards_per_gpu == 1
    plan = plan_fleet_placement(2, 1, 1, "gpu", 1.0, None)
    assert plan.bundle == {"GPU": 1.0, "CPU": 1.0} and plan.shards_per_gpu == 1


@pytest.mark.parametrize(("k", "share"), [(2, 0.5), (3, 0.3333), (4, 0.25), (7, 0.1428)])
def test_each_bundle_takes_a_ray_sized_fraction_that_k_of_fit_one_gpu(k, share):
    assert gpu_share(k) == share and k * share <= 1.0
    plan = plan_fleet_placement(k, 1, 1, "gpu", 1.0, ClusterResources.from_nodes([{"GPU": 1, "CPU": 16}]), shards_per_gpu=k)
    assert [list(s.bundles) for s in plan.shards] == [[{"GPU": share, "CPU": 1.0}]] * k


def test_one_gpu_holds_k_shards_and_not_one_more():
    one_gpu = ClusterResources.from_nodes([{"GPU": 1, "CPU": 16}])
    plan_fleet_placement(2, 1, 1, "gpu", 1.0, one_gpu, shards_per_gpu=2)
    with pytest.raises(PlacementError) as info:
        plan_fleet_placement(3, 1, 1, "gpu", 1.0, one_gpu, shards_per_gpu=2)
    assert str(info.value).startswith(
        "fleet needs 1.5 GPU (3 shards x tensor_parallel_size 1 x pipeline_parallel_size 1 x 0.5 GPU per worker) "
        "but the Ray cluster has 1 GPU"
    )


def test_shards_per_gpu_is_ignored_on_cpu():
    plan = plan_fleet_placement(2, 1, 1, "cpu", 1.0, None, shards_per_gpu=4)
    assert plan.bundle == {"CPU": 1.0} and plan.shards_per_gpu == 1


def test_several_workers_per_shard_cannot_share_a_gpu():
    with pytest.raises(ConfigError) as info:
        plan_fleet_placement(2, 2, 1, "gpu", 1.0, None, shards_per_gpu=2)
    assert info.value.field == "fleet.shards_per_gpu"
    assert "generation.vllm_cfg.tensor_parallel_size x generation.vllm_cfg.pipeline_parallel_size = 2" in str(info.value)
    with pytest.raises(ConfigError, match="fleet.shards_per_gpu"):
        plan_fleet_placement(1, 1, 1, "gpu", 1.0, None, shards_per_gpu=0)


def test_k_engines_must_fit_the_gpu_memory_a_config_error_names_both_keys():
    with pytest.raises(ConfigError) as info:
        NemoGenSettings.load(overrides=["fleet.shards_per_gpu=2"])  # default utilization 0.6
    err = info.value
    assert err.field == "fleet.shards_per_gpu"
    assert "generation.vllm_cfg.gpu_memory_utilization 0.6 = 1.2 of the device, more than 0.95" in str(err)
    assert "at most 0.475" in str(err)
    ok = NemoGenSettings.load(overrides=["fleet.shards_per_gpu=2", "generation.vllm_cfg.gpu_memory_utilization=0.45"])
    assert ok.fleet.shards_per_gpu == 2
    # k = 1 keeps the old rule (any utilization up to 1)
    assert NemoGenSettings.load(overrides=["generation.vllm_cfg.gpu_memory_utilization=1.0"]).fleet.shards_per_gpu == 1


def test_the_rule_also_holds_for_environment_settings(monkeypatch):
    monkeypatch.setenv("NEMO_GEN_FLEET__SHARDS_PER_GPU", "4")
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__GPU_MEMORY_UTILIZATION", "0.3")
    with pytest.raises(ConfigError, match="4 engines per GPU"):
        NemoGenSettings.load()
    monkeypatch.setenv("NEMO_GEN_GENERATION__VLLM_CFG__GPU_MEMORY_UTILIZATION", "0.2")
    assert NemoGenSettings.load().fleet.shards_per_gpu == 4


def test_resolve_plans_fractional_bundles(tmp_path):
    from nemo_gen.fleet.resolve import resolve_generation

    s = NemoGenSettings.load(overrides={
        "home": str(tmp_path), "fleet.device": "gpu", "fleet.num_shards": 2, "fleet.shards_per_gpu": 2,
        "generation.vllm_cfg.gpu_memory_utilization": 0.4, "generation.vllm_cfg.max_model_len": 128,
    })
    resolved = resolve_generation(s, ClusterResources.from_nodes([{"GPU": 1, "CPU": 8}]))
    assert [spec.bundles for spec in resolved.shards] == [[{"GPU": 0.5, "CPU": 1.0}]] * 2
    assert all(spec.engine_kwargs["gpu_memory_utilization"] == 0.4 for spec in resolved.shards)
