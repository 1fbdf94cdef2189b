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
from ray.util import get_node_ip_address
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
    # The actor's name; unset: "<fleet>-shard-<index>". Replacements and spares get their own
    # (a dead actor's name is not free the moment it dies), and attach finds them all by prefix.
    name: str | None = None
    spare: bool = False  # a warm spare: loaded and refit, but serves no slot until promoted
    node_hint: str | None = None  # preferred node (hex ID) when the cluster has several

    @property
    def actor_name(self) -> str:
        return self.name or f"{self.fleet}-shard-{self.index}"


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

    def __init__(
        self,
        index: int,
        engine_kwargs: dict[str, Any],
        async_engine: bool,
        weight_version: int | None,
        slot: int | None = None,
        fleet: str = "",
    ):
        self.index = index
        self.slot = slot  # the fleet position it serves; None while a spare
        self.fleet = fleet
        self._kwargs = engine_kwargs
        self._async = async_engine
        self.weight_version = weight_version
        self.weight_source: str | None = None  # the checkpoint the current version came from
        self.restarts = 0  # restarts of the slot it serves, as of its installation
        self.engine = None
        self._engine_pids: list[int] = []
        self._sync_was: tuple[int | None, str | None] = (weight_version, None)  # before a weight-sync start

    async def start(self) -> dict[str, Any]:
        import asyncio

        from nemo_gen.fleet.engine import Engine
        from nemo_gen.fleet.gpu_memory import engine_start_lock

        if self.engine is None:
            # Engines sharing a GPU start one at a time: vLLM sizes its KV cache from the
            # device's free memory (no-op on CPU).
            lock = await asyncio.to_thread(engine_start_lock().acquire)
            try:
                self.engine = await Engine.start(self._kwargs, self._async)
            finally:
                lock.release()
            self._engine_pids = self.engine.child_pids()
        return self.info()

    def assign(self, slot: int, restarts: int = 0) -> dict[str, Any]:
        """Serve ``slot`` (a promoted spare, a replacement) and remember the slot's restart
        count, so a later attach continues the restart budget instead of resetting it."""
        self.slot = slot
        self.restarts = restarts
        return self.info()

    async def watch(self, interval_s: float) -> str:
        """Returns, with the reason, when one of the engine's processes exits (the actor lives
        on: the EngineCore was killed). If the actor itself dies, the driver's pending call
        fails at once — either way the driver learns within ``interval_s``."""
        import asyncio

        import psutil

        procs = []
        for pid in self._engine_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                return f"engine process {pid} was gone before the watch began"
        while True:
            for proc in procs:
                try:
                    dead = proc.status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    dead = True
                if dead:
                    return f"engine process {proc.pid} exited"
            await asyncio.sleep(interval_s)

    async def probe(self, sampling: dict[str, Any], token_ids: list[int], stall_s: float) -> dict[str, Any]:
        """A real generation of one token (or, while a batch runs, proof of a recent step)."""
        if self.engine is None:
            return {"ok": False, "error": "no engine"}
        return await self.engine.probe(sampling, token_ids, stall_s)

    def info(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "index": self.index,
            "slot": self.slot,
            "fleet": self.fleet,
            "weight_source": self.weight_source,
            "restarts": self.restarts,
            "actor_pid": os.getpid(),
            "engine_pids": engine.child_pids() if engine else [],
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": get_node_ip_address(),
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
            "shard": self.slot,
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

    async def load_stats(self) -> list[dict[str, Any]]:
        """Per worker: how its last refit load went (path, seconds, kernel repack seconds)."""
        return await self.engine.rpc("nemo_gen_load_stats")

    async def check_refit(self, path: str, total: int, entries: list, timeout_s: float) -> int:
        """Phase 1: every worker can read the staged tensors. Changes nothing."""
        seen = await self.engine.rpc("nemo_gen_check_staged", path, total, entries, timeout=timeout_s)
        return min(seen)

    async def load_refit(
        self, path: str, total: int, groups: list, version: int, timeout_s: float, source: str | None = None
    ) -> float:
        """Phase 2: load each (target, entries) group, then serve as ``version``. Requests are
        held back for the duration; on failure the shard keeps no claim to any version."""
        t0 = time.perf_counter()
        async with self.engine.exclusive():
            self.weight_version = None  # half-loaded weights must never be stamped as a version
            self.weight_source = None
            for target, entries in groups:
                await self.engine.rpc("nemo_gen_load_staged", path, total, entries, target, timeout=timeout_s)
            self.weight_version = version
            self.weight_source = source
        return time.perf_counter() - t0

    async def weight_sync(self, step: str, payload: Any = None, timeout_s: float = 600.0) -> None:
        """One step of vLLM's weight-sync protocol on this engine's workers, with the shard's
        refit rules around it: from ``start`` until ``finish`` or ``abort`` requests are held
        back and the shard claims no version (its weights may be half-loaded); ``finish``
        stamps ``payload`` as the version; ``abort`` ends the workers' session and restores the
        old version only when ``payload`` says nothing was loaded."""
        rpc = {"init": "init_weight_transfer_engine", "start": "start_weight_update",
               "start_draft": "start_draft_weight_update", "update": "update_weights",
               "finish": "finish_weight_update", "shutdown": "shutdown_weight_transfer_engine"}
        if step in ("start", "start_draft"):
            await self.engine.hold()
            self._sync_was = (self.weight_version, self.weight_source)
            self.weight_version, self.weight_source = None, None
            try:
                await self.engine.rpc(rpc[step], timeout=timeout_s)
            except BaseException:
                self.weight_version, self.weight_source = self._sync_was  # nothing was loaded
                await self.engine.release()
                raise
        elif step == "abort":
            try:  # end the workers' session (a layerwise reload puts unloaded layers back)
                await self.engine.rpc(rpc["finish"], timeout=timeout_s)
            except Exception:
                payload = False  # the workers' state is unknown: claim no version
            finally:
                if payload:  # nothing reached the weights
                    self.weight_version, self.weight_source = self._sync_was
                await self.engine.release()
        elif step == "finish":
            try:
                await self.engine.rpc(rpc[step], timeout=timeout_s)
                self.weight_version = payload
            finally:
                await self.engine.release()
        elif step in rpc:
            await self.engine.rpc(rpc[step], *(() if payload is None else (payload,)), timeout=timeout_s)
        else:
            raise ValueError(f"unknown weight-sync step {step!r}")

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
        spec.bundles,
        strategy=spec.strategy,
        name=f"{spec.actor_name}-pg",
        lifetime="detached",
        _soft_target_node_id=spec.node_hint,
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
            spec.index,
            spec.engine_kwargs,
            spec.async_engine,
            spec.weight_version,
            None if spec.spare else spec.index,
            spec.fleet,
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


def find_fleet_actors(fleet: str, namespace: str) -> list[ShardHandle]:
    """Every live actor of fleet ``fleet`` (shards, replacements, spares), found by name prefix.
    A handle's ``index`` is the slot it serves (``info["slot"]``; None for a spare)."""
    from ray.util import get_placement_group, list_named_actors

    prefixes = (f"{fleet}-shard-", f"{fleet}-spare-")
    names = [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(prefixes)
    ]
    handles = []
    for name in names:
        try:
            actor = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue  # died between the listing and the call
        try:
            info = ray.get(actor.info.remote(), timeout=30)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            # Alive but not answering (hung, stopped) or dying: kept by the slot its name
            # gives, so recovery kills it instead of leaving it to hold the slot's resources.
            slot = _slot_from_name(fleet, name)
            if slot is None:
                continue
            info = {"slot": slot, "weight_version": None, "unresponsive": root_cause(exc)}
        if info.get("fleet", fleet) != fleet:
            continue  # another fleet whose name starts with ours
        try:
            pg = get_placement_group(f"{name}-pg")
        except ValueError:
            pg = None
        handles.append(ShardHandle(index=info.get("slot"), name=name, actor=actor, placement_group=pg, info=info))
    return handles


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


def _slot_from_name(fleet: str, name: str) -> int | None:
    """``<fleet>-shard-<i>`` and its replacements ``<fleet>-shard-<i>-r<n>`` serve slot i."""
    rest = name[len(f"{fleet}-shard-"):] if name.startswith(f"{fleet}-shard-") else ""
    head = rest.split("-r", 1)[0]
    return int(head) if head.isdigit() else None


def stop_actor(handle: ShardHandle) -> None:
    """Kill the shard's actor without asking it first (it may be dead, hung or stopped) and
    free its placement group. The raylet tears the actor's process group down with it."""
    _teardown(handle.actor, handle.placement_group)


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
