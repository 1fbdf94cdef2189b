"""A shard: one Ray actor hosting one vLLM engine, and how to place, start and stop it.

``launch_shard`` is the unit both the library and the Prefect task call: reserve the shard's
placement group (or fail with ``PlacementError`` instead of hanging), create the detached,
named actor with the engine's environment, wait for the engine to load (or fail with
``EngineStartError``), and hand back a picklable ``ShardHandle``. Anything it created is torn
down again when a step fails.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_gen.core.results import GenerationRequest
from nemo_gen.errors import EngineStartError, PlacementError, ShardDiedError


@dataclass(frozen=True)
class ShardSpec:
    """Everything needed to start shard ``index``; built by ``resolve_generation``."""

    fleet: str
    namespace: str
    index: int
    bundles: list[dict[str, float]]
    strategy: str
    engine_kwargs: dict[str, Any]
    engine_env: dict[str, str]
    async_engine: bool
    device: str
    weight_version: int | None
    placement_timeout_s: float
    engine_start_timeout_s: float

    @property
    def actor_name(self) -> str:
        return f"{self.fleet}-shard-{self.index}"


@dataclass
class ShardHandle:
    """A running shard as the driver sees it. Picklable (it crosses Prefect/Ray task results)."""

    index: int
    name: str
    actor: Any
    placement_group: Any
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def actor_pid(self) -> int | None:
        return self.info.get("actor_pid")

    @property
    def engine_pids(self) -> list[int]:
        return list(self.info.get("engine_pids", []))


@ray.remote
class ShardActor:
    """Hosts one engine. Async actor: info/pids answer while a generate call is running."""

    def __init__(self, index: int, engine_kwargs: dict[str, Any], async_engine: bool, weight_version: int | None):
        self.index = index
        self._kwargs = engine_kwargs
        self._async = async_engine
        self.weight_version = weight_version
        self.engine = None

    async def start(self) -> dict[str, Any]:
        from nemo_gen.fleet.engine import Engine

        if self.engine is None:
            self.engine = await Engine.start(self._kwargs, self._async)
        return self.info()

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "index": self.index,
            "actor_pid": os.getpid(),
            "engine_pids": engine.child_pids() if engine else [],
            "node_id": ray.get_runtime_context().get_node_id(),
            "weight_version": self.weight_version,
            "max_model_len": engine.max_model_len if engine else None,
            "dtype": engine.dtype if engine else None,
            "load_s": engine.load_s if engine else None,
            "async_engine": self._async,
        }

    async def generate(self, requests: list[GenerationRequest], sampling: dict[str, Any]) -> dict[str, Any]:
        # The version is read when the work starts: every result is stamped with the weights
        # that produced it.
        version = self.weight_version
        t0 = time.perf_counter()
        results = await self.engine.generate(requests, sampling)
        return {
            "shard": self.index,
            "weight_version": version,
            "results": results,
            "seconds": time.perf_counter() - t0,
        }

    async def expected_manifest(self, target: str = "policy") -> dict[str, Any]:
        (manifest, *_) = await self.engine.rpc("nemo_gen_expected_manifest", target)
        return manifest

    async def digest(self, target: str = "policy") -> float:
        (value, *_) = await self.engine.rpc("nemo_gen_digest", target)
        return value

    async def check_refit(self, path: str, total: int, entries: list, timeout_s: float) -> int:
        """Phase 1: every worker can read the staged tensors. Changes nothing."""
        seen = await self.engine.rpc("nemo_gen_check_staged", path, total, entries, timeout=timeout_s)
        return min(seen)

    async def load_refit(self, path: str, total: int, groups: list, version: int, timeout_s: float) -> float:
        """Phase 2: load each (target, entries) group, then serve as ``version``. Requests are
        held back for the duration; on failure the shard keeps no claim to any version."""
        t0 = time.perf_counter()
        async with self.engine.exclusive():
            self.weight_version = None  # half-loaded weights must never be stamped as a version
            for target, entries in groups:
                await self.engine.rpc("nemo_gen_load_staged", path, total, entries, target, timeout=timeout_s)
            self.weight_version = version
        return time.perf_counter() - t0

    def shutdown(self) -> list[int]:
        """Stop the engine's processes; returns the PIDs that were running, for the caller to check."""
        if self.engine is None:
            return []
        pids = self.engine.child_pids()
        self.engine.shutdown()
        self.engine = None
        return pids


def reserve_placement(spec: ShardSpec):
    """Reserve the shard's placement group, or raise PlacementError at the deadline (Ray
    itself would wait forever for resources that never come)."""
    pg = placement_group(
        spec.bundles, strategy=spec.strategy, name=f"{spec.actor_name}-pg", lifetime="detached"
    )
    try:
        ray.get(pg.ready(), timeout=spec.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise PlacementError(
            f"shard {spec.index}: the Ray cluster could not place bundles {spec.bundles} "
            f"({spec.strategy}) within fleet.placement_timeout_s={spec.placement_timeout_s:g}s; "
            f"available now: {_available()}"
        ) from None
    return pg


def launch_shard(spec: ShardSpec) -> ShardHandle:
    """Place, create and start one shard. Blocking; raises PlacementError / EngineStartError."""
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
            spec.index, spec.engine_kwargs, spec.async_engine, spec.weight_version
        )
        info = ray.get(actor.start.remote(), timeout=spec.engine_start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        _teardown(actor, pg)
        raise EngineStartError(
            spec.index, f"not ready within fleet.engine_start_timeout_s={spec.engine_start_timeout_s:g}s"
        ) from None
    except ValueError as exc:  # a duplicate actor name: a fleet of that name is already up
        _teardown(None, pg)
        raise EngineStartError(spec.index, f"{exc} (another fleet named {spec.fleet!r} is running?)") from None
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        _teardown(actor, pg)
        raise EngineStartError(spec.index, root_cause(exc)) from None
    return ShardHandle(index=spec.index, name=spec.actor_name, actor=actor, placement_group=pg, info=info)


def find_shard(spec: ShardSpec) -> ShardHandle | None:
    """The running shard ``spec`` names (a detached actor and its placement group), or None."""
    from ray.util import get_placement_group

    try:
        actor = ray.get_actor(spec.actor_name, namespace=spec.namespace)
        info = ray.get(actor.info.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None
    try:
        pg = get_placement_group(f"{spec.actor_name}-pg")
    except ValueError:
        pg = None
    return ShardHandle(index=spec.index, name=spec.actor_name, actor=actor, placement_group=pg, info=info)


def stop_shard(handle: ShardHandle, timeout_s: float = 60.0) -> list[int]:
    """Stop the engine cleanly if the actor still answers, then kill the actor and free its
    placement group. Returns the engine PIDs known for the shard (for reap checks)."""
    pids = set(handle.engine_pids)
    try:
        pids.update(ray.get(handle.actor.shutdown.remote(), timeout=timeout_s))
    except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
        pass  # already dead or wedged: killing the actor below is what remains
    _teardown(handle.actor, handle.placement_group)
    return sorted(pids)


def call_shard(handle: ShardHandle, method: str, *args, timeout_s: float) -> Any:
    """Call an actor method and translate Ray's failures into ``ShardDiedError``."""
    try:
        return ray.get(getattr(handle.actor, method).remote(*args), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ShardDiedError(handle.index, f"{method} did not answer within {timeout_s:g}s") from None
    except ray.exceptions.RayActorError as exc:
        raise ShardDiedError(handle.index, root_cause(exc)) from None


def _teardown(actor: Any, pg: Any) -> None:
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


def _available() -> dict[str, float]:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU", "memory")}


def root_cause(exc: BaseException) -> str:
    """``Type: last line`` of what a Ray error wraps (the actor-side exception, not Ray's frame)."""
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"
