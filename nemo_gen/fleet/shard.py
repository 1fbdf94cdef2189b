"""A shard: one Ray actor hosting one vLLM engine (``ShardActor``, the actor side), what it
takes to start one (``ShardSpec``) and how the driver refers to a running one
(``ShardHandle``). Placing, calling and stopping shards from the driver is
``nemo_gen.fleet.driver``'s job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util import get_node_ip_address

from nemo_gen.core.refit import chunk_of, needs_whole
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.retry import describe, kind_of
from nemo_gen.errors import ShardBusy

log = logging.getLogger(__name__)

# A weight-sync answer: the update was a layout's short form, and this engine's workers do not
# hold that layout's views; nothing was touched, the client sends the whole update.
LAYOUT_UNKNOWN = "layout_unknown"


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
    engine_core_start: str = "forkserver"  # fleet.engine_core_start

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
        engine_core_start: str = "forkserver",
    ):
        from nemo_gen.fleet import engine_start

        # First thing: the server imports vLLM for the EngineCore while this actor imports its own.
        if engine_core_start == "forkserver":
            try:
                engine_start.start_server()
            except OSError as exc:  # no server: the EngineCore is spawned (engine_core_context says so)
                log.warning("the shard's forkserver did not start: %s", exc)
        self._engine_core_start = engine_core_start
        self.engine_core_started_with: str | None = None  # what was used: a NUMA-bound engine is spawned
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
        self._sync_in_flight: dict[str, Any] = {}  # the in-flight settings of that session
        self._layout: Any = None  # the layout number of the last update its workers loaded (nemo_gen_ipc)
        self._channel: Any = None  # its direct line for weight_sync (control_channel.ChannelServer), once asked

    async def start(self) -> dict[str, Any]:
        import asyncio

        from nemo_gen.fleet.engine import Engine
        from nemo_gen.fleet.engine_start import engine_core_context
        from nemo_gen.fleet.gpu_memory import engine_start_lock

        if self.engine is None:
            # Engines sharing a GPU start one at a time: vLLM sizes its KV cache from the
            # device's free memory (no-op on CPU).
            lock = await asyncio.to_thread(engine_start_lock().acquire)
            try:
                started = time.monotonic()  # load_s includes the vLLM import the context makes
                with engine_core_context(self._engine_core_start, self._kwargs) as method:
                    self.engine_core_started_with = method
                    self.engine = await Engine.start(self._kwargs, self._async, self.weight_version, started)
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

    async def probe(self, sampling: dict[str, Any], token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]:
        """A real generation of one token (or, while a batch runs, proof of a recent step)."""
        if self.engine is None:
            return {"ok": False, "error": "no engine"}
        return await self.engine.probe(sampling, token_ids, stall_s, warmup_s)

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
            "engine_core_start": self.engine_core_started_with,
            "direct_calls": self._channel.calls if self._channel else 0,  # weight_sync calls over its direct line
            # What the engine is doing: a batch running, and its steps so far.
            "generating": bool(engine and engine.generating),
            "batch_steps": engine.steps_made if engine else 0,
        }

    async def generate(self, requests: list[GenerationRequest], sampling: dict[str, Any]) -> dict[str, Any]:
        # The version is read when the work starts: every result is stamped with the weights
        # that produced it.
        version = self.weight_version
        t0 = time.perf_counter()
        with self._admission():
            results = await self.engine.generate(requests, sampling)
        return {
            "shard": self.slot,
            "weight_version": version,
            "results": results,
            "seconds": time.perf_counter() - t0,
        }

    async def generate_stream(self, request: GenerationRequest, sampling: dict[str, Any]):
        """One request as it is generated — a Ray streaming generator (an async generator method
        of an async actor): ``{"deltas": [...]}`` items, then ``{"result", "shard",
        "weight_version", "seconds"}`` as ``generate`` answers (``nemo_gen.fleet.streaming``).
        Cancelling the call (``ray.cancel``) aborts the request in the engine."""
        version = self.weight_version
        t0 = time.perf_counter()
        with self._admission():
            async with contextlib.aclosing(self.engine.stream(request, sampling)) as items:
                async for item in items:
                    if "result" in item:
                        item = {**item, "shard": self.slot, "weight_version": version,
                                "seconds": time.perf_counter() - t0}
                    yield item

    @contextlib.contextmanager
    def _admission(self):
        """The engine's refusal of a request for now (vLLM's full queue: busy, never dead) leaves
        the actor as ``ShardBusy``: vLLM's own admission errors do not survive Ray's pickling."""
        try:
            yield
        except Exception as exc:
            if kind_of(exc) == "busy" and not isinstance(exc, ShardBusy):
                raise ShardBusy(-1 if self.slot is None else self.slot, describe(exc)) from None
            raise

    def vllm_metrics(self) -> list[dict[str, Any]]:
        """vLLM's own stats of this shard's engine (empty unless its stats are on)."""
        return self.engine.vllm_metrics() if self.engine else []

    def unfinished(self) -> dict[str, int]:
        """The engine's requests held now and the tokens each has made (``Engine.unfinished``)."""
        return self.engine.unfinished() if self.engine else {}

    def step_gaps(self, reset: bool = False) -> dict[str, Any]:
        """The engine's longest stretch without a finished step since the last reset."""
        return self.engine.step_gaps(reset)

    async def adapter_call(self, op: str, *args: Any) -> Any:
        """LoRA adapters on this shard's engine (``nemo_gen.fleet.adapters.on_shard``)."""
        from nemo_gen.fleet.adapters import on_shard

        return await on_shard(self.engine, op, *args)

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
        self, path: str, total: int, groups: list, version: int, timeout_s: float, source: str | None,
        in_flight: dict[str, Any],
    ) -> float:
        """Phase 2: load each (target, entries) group, then serve as ``version``. ``in_flight``
        (``refit.in_flight`` and its companions): ``drain`` holds requests back until the running
        ones finish; ``keep`` / ``abort`` swap the weights under the running batch (see
        ``Engine.end_swap``). On failure the shard keeps no claim to any version."""
        t0 = time.perf_counter()

        async def load():
            self.weight_version = None  # half-loaded weights must never be stamped as a version
            self.weight_source = None
            for target, entries in groups:
                await self.engine.rpc("nemo_gen_load_staged", path, total, entries, target, timeout=timeout_s)

        if in_flight["mode"] == "drain":
            async with self.engine.exclusive():
                await load()
                await self.engine.set_version(version)
        else:
            await self.engine.begin_swap()
            try:
                await load()
            except BaseException as exc:
                await self.engine.end_swap(None, **in_flight, failed=f"refit to version {version} failed: {exc}")
                raise
            await self.engine.end_swap(version, **in_flight)
        self.weight_version = version
        self.weight_source = source
        return time.perf_counter() - t0

    async def control_channel(self, timeout_s: float) -> dict[str, Any]:
        """Where a driver on this node reaches ``weight_sync`` without Ray (``address``, ``key``;
        ``nemo_gen.fleet.control_channel``), and this node's IP, to tell whether it is its own.
        ``timeout_s`` (``fleet.control_timeout_s``) bounds each connection's handshake."""
        import asyncio

        from nemo_gen.fleet.control_channel import ChannelServer

        if self._channel is None:
            self._channel = ChannelServer(self.weight_sync, asyncio.get_running_loop(), timeout_s)
        return {"address": self._channel.address, "key": self._channel.key, "node_ip": get_node_ip_address()}

    async def weight_sync(self, step: str, payload: Any = None, timeout_s: float = 600.0) -> dict[str, float] | None:
        """One step of vLLM's weight-sync protocol on this engine's workers, with the shard's
        refit rules around it: from ``start`` (``payload``: the in-flight settings) until
        ``finish`` or ``abort`` requests are held back (``drain``) or the running batch is frozen
        (``keep``/``abort``), and the shard claims no version (its weights may be half-loaded);
        ``finish`` stamps ``payload`` as the version; ``abort`` ends the workers' session and
        restores the old version only when ``payload`` says nothing was loaded. ``apply``: a
        whole one-chunk update in one call (``payload``: ``in_flight``, ``update``, ``target``,
        ``version``) — start, the chunk and finish in one RPC into the engine. A chunk in its
        short form (``layout_only``: nemo_gen_ipc's layout number alone) for a layout the
        workers did not load last is answered ``{LAYOUT_UNKNOWN: True}``, nothing touched."""
        rpc = {"init": "init_weight_transfer_engine", "start": "start_weight_update",
               "start_draft": "start_draft_weight_update", "update": "update_weights",
               "finish": "finish_weight_update", "shutdown": "shutdown_weight_transfer_engine"}
        entered = time.perf_counter()
        update = chunk_of(step, payload)
        if update is not None and needs_whole(update, self._layout):
            return {LAYOUT_UNKNOWN: True}
        if step in ("init", "shutdown"):
            self._layout = None  # a new transfer engine, or none: no views are open
        if step == "apply":
            t0 = time.perf_counter()
            await self._begin_sync(payload["in_flight"])
            try:
                t1 = time.perf_counter()
                workers = await self.engine.rpc("nemo_gen_weight_update", payload["update"], payload["target"],
                                                timeout=timeout_s)
                t2 = time.perf_counter()
            except BaseException as exc:
                self._layout = None
                await self._end_sync(None, failed=f"the weight update failed while loading: {exc}")
                raise
            self._layout = update.get("layout") if update is not None else None
            self.weight_version = payload["version"]
            await self._end_sync(payload["version"])
            # entered_at / left_at: this host's monotonic clock (perf_counter is system-wide on
            # Linux), so a caller on the same host can split its wait into the call's two legs.
            left = time.perf_counter()
            return {"actor_s": left - t0, "engine_rpc_s": t2 - t1, "worker_s": max(workers),
                    "entered_at": entered, "left_at": left}
        elif step in ("start", "start_draft"):
            await self._begin_sync(payload)
            try:
                await self.engine.rpc(rpc[step], timeout=timeout_s)
            except BaseException:
                self.weight_version, self.weight_source = self._sync_was  # nothing was loaded
                await self._end_sync(None)
                raise
        elif step == "abort":
            try:  # end the workers' session (a layerwise reload puts unloaded layers back)
                await self.engine.rpc(rpc["finish"], timeout=timeout_s)
            except Exception:
                payload = False  # the workers' state is unknown: claim no version
            finally:
                if payload:  # nothing reached the weights
                    self.weight_version, self.weight_source = self._sync_was
                await self._end_sync(None, failed=None if payload else "the weight update was aborted after loading")
        elif step == "finish":
            try:
                await self.engine.rpc(rpc[step], timeout=timeout_s)
            except BaseException as exc:
                await self._end_sync(None, failed=f"finishing the weight update failed: {exc}")
                raise
            self.weight_version = payload
            await self._end_sync(payload)
        elif step == "update":
            self._layout = None
            await self.engine.rpc(rpc[step], payload, timeout=timeout_s)
            self._layout = update.get("layout") if update is not None else None
        elif step in rpc:
            await self.engine.rpc(rpc[step], *(() if payload is None else (payload,)), timeout=timeout_s)
        else:
            raise ValueError(f"unknown weight-sync step {step!r}")

    async def _begin_sync(self, in_flight: dict[str, Any]) -> None:
        """Hold requests back (``drain``) or freeze the running batch (``keep``/``abort``) for a
        weight-sync session; the shard claims no version until it ends."""
        self._sync_in_flight = in_flight
        if in_flight["mode"] == "drain":
            await self.engine.hold()
        else:
            await self.engine.begin_swap()
        self._sync_was = (self.weight_version, self.weight_source)
        self.weight_version, self.weight_source = None, None

    async def _end_sync(self, version: int | None, failed: str | None = None) -> None:
        """Let requests flow again after a weight-sync session (the engine serves ``version``,
        or what it had when None)."""
        in_flight = self._sync_in_flight
        if in_flight["mode"] == "drain":
            if version is not None:
                await self.engine.set_version(version)
            await self.engine.release()
        else:
            await self.engine.end_swap(version, **in_flight, failed=failed)

    def shutdown(self, grace_s: float) -> list[int]:
        """Stop the engine's processes (``grace_s`` to exit before vLLM kills them); returns the
        PIDs that were running, for the caller to check."""
        from nemo_gen.fleet.engine_start import stop_server

        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.engine is None:
            stop_server()
            return []
        pids = self.engine.child_pids()
        self.engine.shutdown(grace_s)
        self.engine = None
        stop_server()
        return pids


def slot_from_name(fleet: str, name: str) -> int | None:
    """``<fleet>-shard-<i>`` and its replacements ``<fleet>-shard-<i>-r<n>`` serve slot i."""
    rest = name[len(f"{fleet}-shard-"):] if name.startswith(f"{fleet}-shard-") else ""
    head = rest.split("-r", 1)[0]
    return int(head) if head.isdigit() else None
