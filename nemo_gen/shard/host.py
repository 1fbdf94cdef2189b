"""The shell of one shard, whatever carries its calls: the one entry the driver calls (``call``: a
name from ``SHARD_CALLS`` and the wire's arguments), and what the shell adds to the rules
(``nemo_gen.shard.rules.Shard``): ``info`` with its direct line's count, the streamed generate,
the direct line itself, a stop. ``nemo_gen.shard.actor.ShardActor`` is this class under Ray, plus
what needs the actor's own process (the forkserver, the engine's start, the death watch);
``nemo_gen.fleet.transport_local`` hosts it in process for the fast tier (NeMo-RL's Impl and
``class Actor(Impl)``: one class on both sides of the transport, no method forwarded by hand).

To add a shard call: write it on ``Shard`` (or here, if it needs the shell) and add its name to
``SHARD_CALLS``; the driver reaches it as ``transport.call(actor, name, *args)``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import ChannelAddress, ShardInfo
from nemo_gen.core.wire_generation import Sampling, StreamDeltas, StreamEnd
from nemo_gen.shard.rules import Shard

# What the driver may call, by name: the shell's own methods first, then the rules'.
SHARD_CALLS = frozenset({
    "info", "assign", "watch", "control_channel", "shutdown",  # the shell's
    "probe", "generate", "vllm_metrics", "unfinished", "step_gaps", "expected_manifest", "digest",
    "load_stats", "check_refit", "load_refit", "weight_sync", "adapter_call",  # the rules' (Shard)
    "progress",  # the tokens made since the last answer (migration's checkpoints)
    "sleep", "wake", "reset_prefix_cache",  # the rules' sleep mode (nemo_gen.shard.sleep_rules)
})


class ShardHost:
    """See the module doc. ``shard``: the rules it hosts."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self._channel: Any = None  # its direct line (control_channel.ChannelServer), once asked

    async def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the shell or, where the shell has no such method, on its rules."""
        if method not in SHARD_CALLS:
            raise AttributeError(f"shard {self.shard.index} has no call {method!r} "
                                 "(nemo_gen.shard.host.SHARD_CALLS names them)")
        target = getattr(self, method, None) or getattr(self.shard, method)
        out = target(*args)
        return await out if asyncio.iscoroutine(out) else out

    def info(self) -> ShardInfo:
        return self.shard.info(direct_calls=self._channel.calls if self._channel else 0)

    def assign(self, slot: int, restarts: int = 0) -> ShardInfo:
        self.shard.assign(slot, restarts)
        return self.info()

    async def watch(self, interval_s: float) -> str:
        """Returns, with the reason, when the shard's engine dies under a living shell. A shard in
        this process has no processes of its own to watch: it answers when its caller ends it."""
        await asyncio.Event().wait()
        return "unreachable"

    async def generate_stream(self, request: GenerationRequest,
                              sampling: Sampling) -> AsyncIterator[StreamDeltas | StreamEnd]:
        """``Shard.generate_stream``, item by item; closing it aborts the request in the engine
        (under Ray: a streaming generator, ended by ``ray.cancel``)."""
        async with contextlib.aclosing(self.shard.generate_stream(request, sampling)) as items:  # type: ignore[type-var]
            async for item in items:
                yield item

    async def control_channel(self, timeout_s: float) -> ChannelAddress:
        """Where a driver on this node reaches ``weight_sync`` without the transport
        (``nemo_gen.shard.control_channel``), and this node's IP, to tell whether it is its own.
        ``timeout_s`` (``fleet.control_timeout_s``) bounds each connection's handshake."""
        from nemo_gen.shard.control_channel import ChannelServer

        if self._channel is None:
            self._channel = ChannelServer(self.shard.weight_sync, asyncio.get_running_loop(), timeout_s)
        return ChannelAddress(self._channel.address, self._channel.key, self.shard.host.node_ip or "")

    def shutdown(self, grace_s: float) -> list[int]:
        """Stop the engine's processes (``grace_s`` to exit before vLLM kills them); returns the
        PIDs that were running, for the caller to check."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        engine = self.shard.detach()
        if engine is None:
            return []
        pids = engine.child_pids()
        engine.shutdown(grace_s)
        return pids
