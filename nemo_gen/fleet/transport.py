"""The transport under the driver: the few primitives ``nemo_gen.fleet.driver.ShardDriver`` needs to
reach shards, and nothing of the driver's own logic (SkyRL's one engine interface on both sides of
Ray). Two implement it: ``RayTransport`` (``nemo_gen.fleet.transport_ray``: named detached actors,
ObjectRefs, ``ray.wait``) and ``InProcessTransport`` (``nemo_gen.fleet.transport_local``: the same
shard shell, ``nemo_gen.shard.host.ShardHost``, hosted in this process on an event loop of its own),
which the fast tier runs the real driver over.

Every call to a shard is ``call(actor, method, *args)``: one of ``nemo_gen.shard.host.SHARD_CALLS``
by name, with the wire's typed arguments, returning a ``Ref`` (a call in flight) that ``wait``,
``get``, ``future`` and ``cancel`` take. The transport answers in the shard's own exceptions (what
the shard raised, wrapped as the transport wraps it) and ``Unanswered`` for a wait that ran out;
the driver maps both (``nemo_gen.fleet.faults``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass
from typing import Any, Protocol

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire_generation import Sampling, StreamDeltas, StreamEnd
from nemo_gen.fleet.handles import ShardHandle, ShardSpec

# A call in flight: a Ray ObjectRef, or a concurrent future in process. Hashable either way.
Ref = Any


class Unanswered(TimeoutError):
    """A call that did not answer within the wait the driver gave it (the transport's deadline,
    not an exception the shard raised)."""


@dataclass(frozen=True)
class Found:
    """A live shard actor the transport found by its name (``find``)."""

    name: str
    actor: Any  # what ``call`` takes: a Ray actor handle, or the name in process
    placement_group: Any = None


class ItemStream(Protocol):
    """A streamed generate in flight: ``await next()`` is its next item, None after the last;
    what the call raised (or the transport's error for a lost shard) is raised there,
    unclassified. ``cancel()`` ends the call on the shard."""

    async def next(self) -> StreamDeltas | StreamEnd | None: ...

    def cancel(self) -> None: ...


class ShardTransport(Protocol):
    """What the driver needs of a way to reach shards; see the module doc."""

    def launch(self, spec: ShardSpec) -> ShardHandle:
        """Place, create and start one shard (``EngineStartError`` / ``PlacementError``)."""
        ...

    def find(self, fleet: str, namespace: str) -> list[Found]:
        """Every live shard actor whose name starts ``<fleet>-shard-`` or ``<fleet>-spare-``."""
        ...

    def call(self, actor: Any, method: str, *args: Any) -> Ref:
        """Start ``method(*args)`` on the shard (a name in ``SHARD_CALLS``); never blocks."""
        ...

    def stream(self, actor: Any, request: GenerationRequest, sampling: Sampling) -> ItemStream:
        """Start one request's streamed generate (``ShardHost.generate_stream``)."""
        ...

    def wait(self, refs: list[Ref], timeout_s: float, first: bool = False) -> list[Ref]:
        """The refs that are done after waiting up to ``timeout_s`` for all of them (``first``:
        for the first of them; then every one done by then)."""
        ...

    def get(self, ref: Ref, timeout_s: float) -> Any:
        """The call's answer, what it raised, or ``Unanswered`` after ``timeout_s``."""
        ...

    def future(self, ref: Ref) -> concurrent.futures.Future[Any]:
        """The call as a concurrent future (for an asyncio caller to wrap)."""
        ...

    def cancel(self, ref: Ref) -> None:
        """End the call on the shard, best effort (done or lost: nothing to cancel)."""
        ...

    def kill(self, handle: ShardHandle) -> None:
        """End the shard's actor without asking it, and free what it held."""
        ...

    def local_ip(self) -> str | None:
        """This process's node address: a shard whose direct line is on it can be reached there."""
        ...


class Pending:
    """One call in flight on a shard, for an asyncio caller: ``future`` (asyncio) is its answer;
    ``cancel()`` ends the call on the shard itself (the engine aborts what it generates for it).
    Cancelling ``future`` alone would not: it only stops the wait."""

    def __init__(self, transport: ShardTransport, ref: Ref):
        self._transport, self._ref = transport, ref
        self.future = asyncio.wrap_future(transport.future(ref))

    def cancel(self) -> None:
        self.future.cancel()
        self._transport.cancel(self._ref)
