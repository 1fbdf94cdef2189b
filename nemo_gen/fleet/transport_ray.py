"""The transport over Ray (``nemo_gen.fleet.transport.ShardTransport``): shards are named, detached
``ShardActor``s (placed and started by ``nemo_gen.fleet.launch``), a call is an ObjectRef of the
actor's one entry (``ShardHost.call``), a streamed generate a Ray streaming generator, and a wait
that runs out Ray's ``GetTimeoutError``, told to the driver as ``Unanswered``.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

import ray
from ray.exceptions import GetTimeoutError
from ray.util import get_node_ip_address

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire_generation import Sampling, StreamDeltas, StreamEnd
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.fleet.launch import launch_shard, teardown
from nemo_gen.fleet.transport import Found, Ref, Unanswered


class Stream:
    """A streamed generate call in flight on one shard actor (``ShardHost.generate_stream``, a Ray
    streaming generator): ``await next()`` is its next item, None after the last; what the call
    raised, or Ray's error for a lost actor, is raised there unclassified (the caller classifies
    it, as for ``generate_async``). ``cancel()`` ends the call on the shard."""

    def __init__(self, generator: Any):
        self._generator = generator

    async def next(self) -> StreamDeltas | StreamEnd | None:
        try:
            ref = await self._generator.__anext__()
        except StopAsyncIteration:
            return None
        try:
            # The item is in (the generator reported it; a small one comes inline): read at once,
            # without ``await ref``'s hop to Ray's thread and back through the loop, per token.
            item: StreamDeltas | StreamEnd = ray.get(ref, timeout=0)
        except GetTimeoutError:  # not local yet (a large item in another node's store)
            item = await ref
        return item

    def cancel(self) -> None:
        try:
            ray.cancel(self._generator)
        except Exception:  # already finished or its actor is gone: nothing left to cancel
            pass


class RayTransport:
    """See the module doc."""

    def launch(self, spec: ShardSpec) -> ShardHandle:
        return launch_shard(spec)

    def find(self, fleet: str, namespace: str) -> list[Found]:
        from ray.util import get_placement_group, list_named_actors

        prefixes = (f"{fleet}-shard-", f"{fleet}-spare-")
        names = [a["name"] for a in list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and a["name"].startswith(prefixes)]
        found = []
        for name in names:
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError:
                continue  # died between the listing and the call
            try:
                pg = get_placement_group(f"{name}-pg")
            except ValueError:
                pg = None
            found.append(Found(name, actor, pg))
        return found

    def call(self, actor: Any, method: str, *args: Any) -> Ref:
        return actor.call.remote(method, *args)

    def stream(self, actor: Any, request: GenerationRequest, sampling: Sampling) -> Stream:
        return Stream(actor.generate_stream.remote(request, sampling))

    def wait(self, refs: list[Ref], timeout_s: float, first: bool = False) -> list[Ref]:
        if not refs:
            return []
        ready, _ = ray.wait(refs, num_returns=1 if first else len(refs), timeout=timeout_s)
        if first and ready:  # collect everything else that is done too
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return list(ready)

    def get(self, ref: Ref, timeout_s: float) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise Unanswered(f"no answer within {timeout_s:g}s") from None

    def future(self, ref: Ref) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = ref.future()
        return future

    def cancel(self, ref: Ref) -> None:
        try:
            ray.cancel(ref)
        except Exception:  # already finished or its worker is gone: nothing left to cancel
            pass

    def kill(self, handle: ShardHandle) -> None:
        teardown(handle.actor, handle.placement_group)

    def local_ip(self) -> str | None:
        ip: str = get_node_ip_address()
        return ip
