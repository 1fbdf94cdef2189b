"""Starting one shard on Ray: reserve its placement group (or ``PlacementError`` at the deadline),
create its named, detached ``ShardActor``, wait for its engine to start (or ``EngineStartError``),
and tear down whatever was created when a step fails. The unit both the library
(``ShardDriver.launch``) and the Prefect task call; part of the driver's seam to Ray.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_gen.errors import EngineStartError, PlacementError
from nemo_gen.fleet.faults import root_cause
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.shard.actor import ShardActor


def launch_shard(spec: ShardSpec) -> ShardHandle:
    """Place, create and start one shard: the unit both the library and the Prefect task call.
    Blocking; raises PlacementError / EngineStartError.
    Anything it created is torn down again when a step fails."""
    pg = reserve_placement(spec)
    first = spec.bundles[0]
    world = len(spec.bundles)
    options = dict(
        name=spec.actor_name,
        namespace=spec.namespace,
        lifetime="detached",
        max_restarts=0,  # recovery is ours (refit before serving), not Ray's silent restart
        num_cpus=first.get("CPU", 0),
        # On GPU with several ranks vLLM's Ray executor schedules one worker per bundle GPU.
        num_gpus=first.get("GPU", 0) if world == 1 else 0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        ),
        runtime_env={"env_vars": spec.engine_env},
    )
    actor = None
    try:
        actor = ShardActor.options(**options).remote(
            spec.index, spec.engine_kwargs, spec.async_engine, spec.weight_version,
            None if spec.spare else spec.index, spec.fleet, spec.engine_core_start,
        )
        info = ray.get(actor.start.remote(), timeout=spec.engine_start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        teardown(actor, pg)
        raise EngineStartError(
            spec.index, f"not ready within fleet.engine_start_timeout_s={spec.engine_start_timeout_s:g}s"
        ) from None
    except ValueError as exc:  # a duplicate actor name: a fleet of that name is already up
        teardown(None, pg)
        raise EngineStartError(spec.index, f"{exc} (another fleet named {spec.fleet!r} is running?)") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        teardown(actor, pg)
        raise EngineStartError(spec.index, root_cause(exc)) from None
    return ShardHandle(index=spec.index, name=spec.actor_name, actor=actor, placement_group=pg, info=info)


def reserve_placement(spec: ShardSpec):
    """Reserve the shard's placement group, or raise PlacementError at the deadline (Ray
    itself would wait forever for resources that never come)."""
    pg = placement_group(
        spec.bundles, strategy=spec.strategy, name=f"{spec.actor_name}-pg", lifetime="detached",
        _soft_target_node_id=spec.node_hint,
    )
    try:
        ray.get(pg.ready(), timeout=spec.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        available = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}
        raise PlacementError(
            f"shard {spec.index}: the Ray cluster could not place bundles {spec.bundles} "
            f"({spec.strategy}) within fleet.placement_timeout_s={spec.placement_timeout_s:g}s; "
            f"available now: {available}"
        ) from None
    return pg


def teardown(actor: Any, pg: Any) -> None:
    """Kill ``actor`` and free placement group ``pg``, either of which may be None or gone."""
    if actor is not None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass  # already gone
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:
            pass
