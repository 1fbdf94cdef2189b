"""A shard: one Ray actor hosting one vLLM engine (``ShardActor``: the shard's shell,
``nemo_gen.shard.host.ShardHost``, under Ray, around the plain ``Shard`` of ``nemo_gen.shard.rules``,
which holds the rules). It adds only what needs the actor's own process: the forkserver, the
engine's start and the death watch; every other call reaches the shell's one entry, ``call``. How
the driver starts one and refers to it (``ShardSpec``, ``ShardHandle``) is ``nemo_gen.fleet.handles``';
placing, calling and stopping shards is ``nemo_gen.fleet.driver``'s over ``nemo_gen.fleet.transport_ray``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray.util import get_node_ip_address

from nemo_gen.core.wire import ShardInfo
from nemo_gen.shard.host import ShardHost
from nemo_gen.shard.rules import Host, Shard

log = logging.getLogger(__name__)


@ray.remote
class ShardActor(ShardHost):
    """The Ray shell of one shard: builds its engine and watches its processes; the rest is
    ``ShardHost``'s (``call``). Async actor: info answers while a generate call is running."""

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
        host = Host(os.getpid(), ray.get_runtime_context().get_node_id(), get_node_ip_address())  # type: ignore[no-untyped-call]  # (Ray's, unannotated)
        super().__init__(Shard(index, weight_version, slot, fleet, async_engine, host))
        self._engine_pids: list[int] = []

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

    def shutdown(self, grace_s: float) -> list[int]:
        """``ShardHost.shutdown``, and the actor's forkserver with it."""
        from nemo_gen.shard.engine_start import stop_server

        pids = super().shutdown(grace_s)
        stop_server()
        return pids
