"""Placement planning: bundles per shard, totals, and clear errors when the cluster is short."""

from __future__ import annotations

import pytest

from nemo_gen.core.placement import (
    ClusterResources,
    check_fits,
    plan_fleet_placement,
)
from nemo_gen.errors import ConfigError, PlacementError


def test_gpu_plan_has_one_pack_group_per_shard_with_tp_times_pp_bundles() -> None:
    plan = plan_fleet_placement(2, 2, 2, "gpu", 4.0, None)
    assert len(plan.shards) == 2
    assert [s.shard for s in plan.shards] == [0, 1]
    for shard in plan.shards:
        assert shard.strategy == "PACK"
        assert list(shard.bundles) == [{"GPU": 1.0, "CPU": 4.0}] * 4
    assert plan.workers_per_shard == 4 and plan.total_bundles == 8
    assert plan.totals == {"GPU": 8.0, "CPU": 32.0}


def test_cpu_plan_bundles_only_cpu() -> None:
    plan = plan_fleet_placement(3, 1, 1, "cpu", 1.5, None)
    assert [list(s.bundles) for s in plan.shards] == [[{"CPU": 1.5}]] * 3
    assert plan.totals == {"CPU": 4.5}


def test_gpu_with_zero_cpus_omits_cpu() -> None:
    plan = plan_fleet_placement(1, 1, 1, "gpu", 0, None)
    assert list(plan.shards[0].bundles) == [{"GPU": 1.0}]


def test_bundles_are_independent_dicts() -> None:
    plan = plan_fleet_placement(2, 2, 1, "cpu", 1, None)
    plan.shards[0].bundles[0]["CPU"] = 99  # type: ignore[index]
    assert plan.shards[0].bundles[1] == {"CPU": 1.0}
    assert plan.shards[1].bundles[0] == {"CPU": 1.0}


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((0, 1, 1, "cpu", 1.0), "fleet.num_shards"),
        ((1, 0, 1, "cpu", 1.0), "generation.vllm_cfg.tensor_parallel_size"),
        ((1, 1, -2, "cpu", 1.0), "generation.vllm_cfg.pipeline_parallel_size"),
        ((1, 1, 1, "tpu", 1.0), "fleet.device"),
        ((1, 1, 1, "cpu", 0.0), "fleet.cpus_per_worker"),
        ((1, 1, 1, "gpu", -1.0), "fleet.cpus_per_worker"),
    ],
)
def test_invalid_config_names_the_field(args: tuple, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        plan_fleet_placement(*args, cluster=None)
    assert info.value.field == field
    assert str(info.value).startswith(field)


def test_gpu_shortfall_message_spells_out_the_arithmetic() -> None:
    cluster = ClusterResources(total={"GPU": 4, "CPU": 64})
    with pytest.raises(PlacementError) as info:
        plan_fleet_placement(2, 2, 2, "gpu", 1.0, cluster)
    assert str(info.value) == (
        "fleet needs 8 GPU (2 shards x tensor_parallel_size 2 x pipeline_parallel_size 2) "
        "but the Ray cluster has 4 GPU"
    )


def test_every_shortfall_is_reported_at_once() -> None:
    cluster = ClusterResources(total={"CPU": 2})
    with pytest.raises(PlacementError) as info:
        plan_fleet_placement(1, 2, 1, "gpu", 2.0, cluster)
    message = str(info.value)
    assert "fleet needs 2 GPU (1 shard x tensor_parallel_size 2" in message
    assert "but the Ray cluster has 0 GPU" in message
    assert (
        "4 CPU (1 shard x tensor_parallel_size 2 x pipeline_parallel_size 1 x 2 CPU per worker)"
    ) in message
    assert "but the Ray cluster has 2 CPU" in message


def test_fits_when_totals_and_nodes_allow() -> None:
    cluster = ClusterResources.from_nodes([{"GPU": 4, "CPU": 16}, {"GPU": 4, "CPU": 16}])
    assert cluster.total == {"GPU": 8.0, "CPU": 32.0}
    plan = plan_fleet_placement(2, 2, 2, "gpu", 4.0, cluster)
    assert plan.totals == {"GPU": 8.0, "CPU": 32.0} == cluster.total  # exactly full
    assert check_fits(plan, cluster) is None
    # one CPU more per worker and the same cluster no longer holds it
    with pytest.raises(PlacementError, match="but the Ray cluster has 32 CPU"):
        check_fits(plan_fleet_placement(2, 2, 2, "gpu", 5.0), cluster)


def test_pack_is_soft_a_shard_may_span_nodes() -> None:
    # Each shard needs 4 GPUs; no node has 4, but bundles fit across nodes.
    cluster = ClusterResources.from_nodes([{"GPU": 2, "CPU": 8}] * 4)
    plan = plan_fleet_placement(2, 4, 1, "gpu", 1.0, cluster)
    assert [len(s.bundles) for s in plan.shards] == [4, 4] and plan.total_bundles == 8
    # the nodes' 8 GPUs hold 8 one-GPU bundles; a ninth does not fit anywhere
    with pytest.raises(PlacementError, match="fleet needs 9 GPU"):
        plan_fleet_placement(3, 3, 1, "gpu", 1.0, cluster)


def test_bundle_larger_than_every_node_is_an_error() -> None:
    cluster = ClusterResources.from_nodes([{"GPU": 1, "CPU": 2}, {"GPU": 1, "CPU": 2}])
    with pytest.raises(PlacementError, match=r"larger than every node") as info:
        plan_fleet_placement(1, 2, 1, "gpu", 4.0, cluster)
    assert "{'GPU': 1.0, 'CPU': 4.0}" in str(info.value)


def test_totals_fit_but_nodes_cannot_hold_whole_bundles() -> None:
    # 6 CPUs in total, but split 3 + 3: each node holds one 2-CPU bundle, not three between them.
    cluster = ClusterResources.from_nodes([{"CPU": 3}, {"CPU": 3}])
    with pytest.raises(PlacementError, match=r"can hold only 2 \(per node: \[1, 1\]\)"):
        plan_fleet_placement(3, 1, 1, "cpu", 2.0, cluster)
    plan_fleet_placement(2, 1, 1, "cpu", 2.0, cluster)  # 2 bundles do fit


def test_from_ray_nodes_skips_dead_nodes() -> None:
    cluster = ClusterResources.from_ray_nodes(
        [
            {"Alive": True, "Resources": {"CPU": 2.0, "node:10.0.0.1": 1.0}},
            {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},
        ]
    )
    assert cluster.total == {"CPU": 2.0, "node:10.0.0.1": 1.0}
    assert len(cluster.nodes) == 1
    with pytest.raises(PlacementError, match="has 0 GPU"):
        plan_fleet_placement(1, 1, 1, "gpu", 1.0, cluster)


def test_fractional_resources_do_not_fail_on_rounding() -> None:
    # 3 x 0.1 is 0.30000000000000004 in floating point, a hair above the node's 0.3.
    cluster = ClusterResources.from_nodes([{"CPU": 0.3}])
    plan = plan_fleet_placement(3, 1, 1, "cpu", 0.1, cluster)
    assert plan.total_bundles == 3
    # the tolerance hides rounding, not a real shortfall: a fourth bundle does not fit
    with pytest.raises(PlacementError, match="fleet needs 0.4 CPU"):
        plan_fleet_placement(4, 1, 1, "cpu", 0.1, cluster)


def test_spread_shards_one_per_node_then_round_robin():
    from nemo_gen.core.placement import ClusterResources, spread_shards

    plan = plan_fleet_placement(3, 1, 1, "cpu", 1.0, None)
    cluster = ClusterResources.from_nodes([{"CPU": 2}, {"CPU": 2}], ["head", "node2"])
    assert spread_shards(plan, cluster) == {0: "head", 1: "node2", 2: "head"}
    # A node that can hold no whole shard gets none; a single node needs no hints.
    tp2 = plan_fleet_placement(2, 2, 1, "cpu", 1.0, None)
    uneven = ClusterResources.from_nodes([{"CPU": 1}, {"CPU": 4}], ["small", "big"])
    assert spread_shards(tp2, uneven) == {0: "big", 1: "big"}
    assert spread_shards(plan, ClusterResources.from_nodes([{"CPU": 8}], ["only"])) == {}
    assert spread_shards(plan, ClusterResources.from_nodes([{"CPU": 2}, {"CPU": 2}])) == {}


def test_spread_shards_prefers_the_node_with_most_room():
    from nemo_gen.core.placement import ClusterResources, spread_shards

    plan = plan_fleet_placement(4, 1, 1, "gpu", 0, None)
    cluster = ClusterResources.from_nodes([{"GPU": 1}, {"GPU": 3}], ["a", "b"])
    assert spread_shards(plan, cluster) == {0: "b", 1: "b", 2: "a", 3: "b"}
