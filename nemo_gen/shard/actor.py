"""A shard: one Ray actor hosting one vLLM engine (``ShardActor``: a shell around the plain
``Shard`` of ``nemo_gen.shard.rules``, which holds the rules). How the driver starts one and
refers to it (``ShardSpec``, ``ShardHandle``) is ``nemo_gen.fleet.handles``'; placing, calling
and stopping shards is ``nemo_gen.fleet.driver``'s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import ray
from ray.util import get_node_ip_address

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import (
    AdapterCall, AdapterState, ChannelAddress, EngineManifest, CheckRefit, GenerateReply, LoadRefit, LoadStats, ProbeReply, RequestProgress, Sampling,
    ShardInfo, StepGaps, SyncReply, SyncRequest, Unfinished,
)
from nemo_gen.shard.rules import Host, Shard

log = logging.getLogger(__name__)


@ray.remote
class ShardActor:
    """The Ray shell of one shard: builds its engine, runs the direct line and the death watch
    (what needs the actor's process), and forwards every other call to the plain ``Shard``
    (``nemo_gen.shard.rules``), which holds the rules. Async actor: info answers while a
    generate call is running."""

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
        from nemo_gen.shard import engine_start

        # First thing: the server imports vLLM for the EngineCore while this actor imports its own.
        if engine_core_start == "forkserver":
            try:
                engine_start.start_server()
            except OSError as exc:  # no server: the EngineCore is spawned (engine_core_context says so)
                log.warning("the shard's forkserver did not start: %s", exc)
        self._engine_core_start = engine_core_start
        self._kwargs = engine_kwargs
        host = Host(os.getpid(), ray.get_runtime_context().get_node_id(), get_node_ip_address())
        self.shard = Shard(index, weight_version, slot, fleet, async_engine, host)
        self._engine_pids: list[int] = []
        self._channel: Any = None  # its direct line for weight_sync (control_channel.ChannelServer), once asked

    async def start(self) -> ShardInfo:
        import asyncio

        from nemo_gen.shard.engine import Engine
        from nemo_gen.shard.engine_start import engine_core_context
        from nemo_gen.host.gpu_memory import engine_start_lock

        if self.shard.engine is None:
            # Engines sharing a GPU start one at a time: vLLM sizes its KV cache from the
            # device's free memory (no-op on CPU).
            lock = await asyncio.to_thread(engine_start_lock().acquire)
            try:
                started = time.monotonic()  # load_s includes the vLLM import the context makes
                with engine_core_context(self._engine_core_start, self._kwargs) as method:
                    engine = await Engine.start(self._kwargs, self.shard.async_engine, self.shard.weight_version,
                                                started)
                    self.shard.attach(engine, method)
            finally:
                lock.release()
            self._engine_pids = engine.child_pids()
        return self.info()

    def info(self) -> ShardInfo:
        return self.shard.info(direct_calls=self._channel.calls if self._channel else 0)

    def assign(self, slot: int, restarts: int = 0) -> ShardInfo:
        self.shard.assign(slot, restarts)
        return self.info()

    async def watch(self, interval_s: float) -> str:
        """Returns, with the reason, when one of the engine's processes exits (the actor lives
        on: the EngineCore was killed), once the generate calls it held have answered. If the actor itself dies, the driver's pending call
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
                    # The generate calls the engine held answer first: one whose EngineCore ended on
                    # its own must reach the router as EngineCrashError before this death condemns
                    # the shard (and its pending calls become the actor's death, re-routed).
                    await self.shard.calls_answered()
                    return f"engine process {proc.pid} exited"
            await asyncio.sleep(interval_s)

    async def probe(self, sampling: Sampling, token_ids: list[int], stall_s: float,
                    warmup_s: float) -> ProbeReply:
        return await self.shard.probe(sampling, token_ids, stall_s, warmup_s)

    async def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> GenerateReply:
        return await self.shard.generate(requests, sampling)

    async def generate_stream(self, request: GenerationRequest, sampling: Sampling):
        """``Shard.generate_stream`` as a Ray streaming generator (an async generator method of
        an async actor); cancelling the call (``ray.cancel``) aborts the request in the engine."""
        async with contextlib.aclosing(self.shard.generate_stream(request, sampling)) as items:
            async for item in items:
                yield item

    def progress(self, known: tuple[tuple[str, int], ...]) -> tuple[RequestProgress, ...]:
        return self.shard.progress(known)

    def vllm_metrics(self) -> list[dict[str, Any]]:
        return self.shard.vllm_metrics()

    def unfinished(self) -> Unfinished:
        return self.shard.unfinished()

    def step_gaps(self, reset: bool = False) -> StepGaps:
        return self.shard.step_gaps(reset)

    async def expected_manifest(self, target: str = "policy") -> EngineManifest:
        return await self.shard.expected_manifest(target)

    async def digest(self, target: str = "policy") -> float:
        return await self.shard.digest(target)

    async def load_stats(self) -> list[LoadStats]:
        return await self.shard.load_stats()

    async def check_refit(self, msg: CheckRefit) -> int:
        return await self.shard.check_refit(msg)

    async def load_refit(self, msg: LoadRefit) -> float:
        return await self.shard.load_refit(msg)

    async def weight_sync(self, req: SyncRequest) -> SyncReply:
        return await self.shard.weight_sync(req)

    async def adapter_call(self, call: AdapterCall) -> AdapterState:
        return await self.shard.adapter_call(call)

    async def control_channel(self, timeout_s: float) -> ChannelAddress:
        """Where a driver on this node reaches ``weight_sync`` without Ray
        (``nemo_gen.shard.control_channel``), and this node's IP, to tell whether it is its own.
        ``timeout_s`` (``fleet.control_timeout_s``) bounds each connection's handshake."""
        import asyncio

        from nemo_gen.shard.control_channel import ChannelServer

        if self._channel is None:
            self._channel = ChannelServer(self.shard.weight_sync, asyncio.get_running_loop(), timeout_s)
        return ChannelAddress(self._channel.address, self._channel.key, get_node_ip_address())

    def shutdown(self, grace_s: float) -> list[int]:
        """Stop the engine's processes (``grace_s`` to exit before vLLM kills them); returns the
        PIDs that were running, for the caller to check."""
        from nemo_gen.shard.engine_start import stop_server

        if self._channel is not None:
            self._channel.close()
            self._channel = None
        engine = self.shard.detach()
        if engine is None:
            stop_server()
            return []
        pids = engine.child_pids()
        engine.shutdown(grace_s)
        stop_server()
        return pids
