"""GPU placement on this CPU machine: the session cluster declares 4 logical GPUs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import ray
from ray.util.placement_group import placement_group_table, remove_placement_group

from nemo_gen.errors import ConfigError, PlacementError
from nemo_gen.fleet.cluster import cluster_resources
from nemo_gen.fleet.resolve import resolve_generation
from nemo_gen.fleet.launch import launch_shard, reserve_placement

pytestmark = pytest.mark.ray


# How long a placement that cannot be made is waited for before PlacementError. Only the
# placement meant to fail uses it; those meant to succeed get the shipped default (a loaded
# machine can take seconds to create a placement group, and a short bound there would flake).
FULL_CLUSTER_TIMEOUT_S = 3


def gpu_settings(make_settings, **kw):
    return make_settings(fleet__device="gpu", **kw)


def test_bundles_are_tp_x_pp_gpus_packed_per_shard(ray_cluster, make_settings):
    settings = gpu_settings(make_settings, fleet__num_shards=2, generation__vllm_cfg__tensor_parallel_size=2)
    resolved = resolve_generation(settings, cluster_resources())
    assert resolved.device == "gpu"
    groups = []
    try:
        for spec in resolved.shards:
            assert spec.bundles == [{"GPU": 1.0, "CPU": 1.0}, {"GPU": 1.0, "CPU": 1.0}]
            assert spec.engine_kwargs["distributed_executor_backend"] == "ray"
            groups.append(reserve_placement(spec))
        for pg in groups:
            table = placement_group_table(pg)
            assert table["strategy"] == "PACK" and table["state"] == "CREATED"
            assert list(table["bundles"].values()) == [{"GPU": 1.0, "CPU": 1.0}] * 2
        # available_resources is refreshed periodically: poll rather than sample once.
        deadline = time.monotonic() + 10
        while ray.available_resources().get("GPU", 0) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("GPU", 0) == 0
        # The cluster is now full: a further shard fails with an error, not a hang.
        extra = dataclasses.replace(resolved.shards[0], index=7, placement_timeout_s=FULL_CLUSTER_TIMEOUT_S)
        with pytest.raises(PlacementError, match="shard 7: the Ray cluster could not place"):
            launch_shard(extra)
    finally:
        for pg in groups:
            remove_placement_group(pg)


def test_pipeline_parallel_counts_in_the_bundle(ray_cluster, make_settings):
    settings = gpu_settings(
        make_settings, fleet__num_shards=1, generation__vllm_cfg__tensor_parallel_size=2,
        generation__vllm_cfg__pipeline_parallel_size=2,
    )
    (spec,) = resolve_generation(settings, cluster_resources()).shards
    assert len(spec.bundles) == 4


def test_a_fleet_larger_than_the_cluster_fails_before_any_engine_starts(ray_cluster, make_settings):
    settings = gpu_settings(make_settings, fleet__num_shards=3, generation__vllm_cfg__tensor_parallel_size=2)
    with pytest.raises(PlacementError, match=r"needs 6 GPU \(3 shards x tensor_parallel_size 2"):
        resolve_generation(settings, cluster_resources())


def test_unknown_backend_fails_before_any_engine_starts(ray_cluster, make_settings):
    with pytest.raises(ConfigError, match="sglang"):
        resolve_generation(make_settings(generation__backend="sglang"), cluster_resources())
