"""The transport in process (``nemo_gen.fleet.transport.ShardTransport``): each shard is the same
shell the Ray actor is (``nemo_gen.shard.host.ShardHost`` around a real ``Shard``) over the engine
``engines(spec)`` builds, and every shard's calls run on one event loop in a thread of its own, as
a Ray async actor's calls do on its loop (a probe answers while a batch generates). A call is a
concurrent future. The fast tier runs the real driver over it with fake engines (tests/fakes.py),
so fan-out, deadlines, outcome mapping and the direct line run there without Ray.

Subclasses add what a Ray actor's process would do to a call (``serve``: die, hang, answer late).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any, AsyncIterator, Callable

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire_generation import Sampling, StreamDeltas, StreamEnd
from nemo_gen.errors import ShardDiedError
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.fleet.transport import Found, Ref, Unanswered
from nemo_gen.shard.engine_protocol import EngineLike
from nemo_gen.shard.host import ShardHost
from nemo_gen.shard.rules import Host, Shard

Item = StreamDeltas | StreamEnd


class LocalStream:
    """A streamed generate on a shard in process, with ``ItemStream``'s shape: the shell's
    ``generate_stream`` runs on the shards' loop from the moment it is asked for, to its end
    whether read or not (as a Ray streaming generator's actor task does); ``cancel()`` ends it
    there. ``check(item)``: what each item must pass as it leaves the shard."""

    def __init__(self, items: AsyncIterator[Item], loop: asyncio.AbstractEventLoop,
                 check: Callable[[Any], None] = lambda item: None):
        self._loop, self._check = loop, check
        self.cancelled = False
        self.sent = 0  # items read
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._task = asyncio.run_coroutine_threadsafe(self._produce(items), loop)

    async def _produce(self, items: AsyncIterator[Item]) -> None:
        try:
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for item in items:
                    self._check(item)  # it crosses the actor boundary
                    self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except BaseException as exc:  # what the call raised (cancelled included) is its reader's
            self._queue.put_nowait(("error", exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _next(self) -> Item | None:
        kind, value = await self._queue.get()
        if kind == "error":
            raise value
        if kind == "end":
            return None
        self.sent += 1
        item: Item = value
        return item

    async def next(self) -> Item | None:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._next(), self._loop))

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()  # the shard's task is cancelled: the engine's stream closes


class InProcessTransport:
    """See the module doc. ``engines(spec)``: the engine a shard of that spec runs."""

    def __init__(self, engines: Callable[[ShardSpec], EngineLike], node_ip: str = "127.0.0.1"):
        self.engines = engines
        self.node_ip = node_ip
        self.hosts: dict[str, ShardHost] = {}  # actor name -> its shell; gone once killed
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="in-process-shards", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    def host(self, spec: ShardSpec, engine: EngineLike, engine_core_start: str = "in-process") -> ShardHandle:
        """Host a shard of ``spec`` over ``engine``, started: its handle (``actor``: its name)."""
        shard = Shard(spec.index, spec.weight_version, None if spec.spare else spec.index, spec.fleet,
                      spec.async_engine, Host(node_id="in-process", node_ip=self.node_ip))
        info = shard.attach(engine, engine_core_start)
        self.hosts[spec.actor_name] = ShardHost(shard)
        return ShardHandle(index=spec.index, name=spec.actor_name, actor=spec.actor_name, placement_group=None,
                           info=info)

    # -- ShardTransport ---------------------------------------------------------------------------

    def launch(self, spec: ShardSpec) -> ShardHandle:
        return self.host(spec, self.engines(spec))

    def find(self, fleet: str, namespace: str) -> list[Found]:
        prefixes = (f"{fleet}-shard-", f"{fleet}-spare-")
        return [Found(name, name) for name in list(self.hosts) if name.startswith(prefixes)]

    def shell(self, actor: Any) -> ShardHost:
        """The shell a call reaches; ``ShardDiedError`` once it was killed (Ray's dead actor)."""
        host = self.hosts.get(actor)
        if host is None:
            raise ShardDiedError(-1, f"ActorDiedError: {actor} was killed")
        return host

    async def serve(self, actor: Any, method: str, args: tuple[Any, ...]) -> Any:
        """One call on the shards' loop (a subclass adds the faults a process has)."""
        return await self.shell(actor).call(method, *args)

    def call(self, actor: Any, method: str, *args: Any) -> Ref:
        return asyncio.run_coroutine_threadsafe(self.serve(actor, method, args), self.loop)

    def stream(self, actor: Any, request: GenerationRequest, sampling: Sampling) -> LocalStream:
        return LocalStream(self.shell(actor).generate_stream(request, sampling), self.loop)

    def wait(self, refs: list[Ref], timeout_s: float, first: bool = False) -> list[Ref]:
        if not refs:
            return []
        when = concurrent.futures.FIRST_COMPLETED if first else concurrent.futures.ALL_COMPLETED
        concurrent.futures.wait(refs, timeout=timeout_s, return_when=when)
        return [ref for ref in refs if ref.done()]

    def get(self, ref: Ref, timeout_s: float) -> Any:
        # Waited on, then read: a TimeoutError the shard itself raised is its answer, not ours.
        concurrent.futures.wait([ref], timeout=max(0.0, timeout_s))
        if not ref.done():
            raise Unanswered(f"no answer within {timeout_s:g}s")
        return ref.result()

    def future(self, ref: Ref) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = ref
        return future

    def cancel(self, ref: Ref) -> None:
        ref.cancel()  # cancels the shard's task on the loop: its engine stops generating for it

    def kill(self, handle: ShardHandle) -> None:
        self.hosts.pop(handle.name, None)

    def local_ip(self) -> str | None:
        return self.node_ip
