"""The one seam between the fleet and Ray: every call to a shard actor goes through here (and
through ``nemo_gen.fleet.launch``, which places and starts one).

``ShardDriver`` places, starts, calls, watches and stops shard actors. Each method has a
typed result, every deadline comes from the settings (``DriverTimeouts``), and one function,
``classify`` (``nemo_gen.fleet.faults``), maps what Ray and vLLM raise into ``nemo_gen.errors`` by the fault model
(``nemo_gen.core.retry``): *dead* (the actor, its engine or its node is gone, a control call
went unanswered) becomes ``ShardDiedError``; *busy* (the shard refused admission for now)
``ShardBusy``; *slow* and *data* (the actor said no: a bad manifest, a bad request) are raised
as they are. A call waiting on several shards waits once, for all of them, never once each.

A refit's ``weight_sync`` calls to a shard on this node go over the shard's direct line
(``nemo_gen.shard.control_channel``, ``refit.control_channel``), which costs a socket round trip
instead of a Ray call each way (bench/results/2026-12-03/cpu-refit_call.md); the driver opens one per shard on first use, drops it
when it breaks or a call outlives its deadline, and Ray carries every call it cannot.

Non-blocking calls (generate, watch, probe) return a ``Call`` that the fleet's loops wait on
together; ``result`` classifies its outcome. A streamed generate (``generate_stream``) returns a
``Stream``: its items as the shard's Ray streaming generator yields them. The fleet logic
above this module never sees a Ray object, so ``tests/fakes.py`` can stand in for Ray with a ``FakeDriver`` of the same
shape (shards that die, hang or slow down on command).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import ray
from ray.util import get_node_ip_address

from nemo_gen.core.wire import (
    AdapterLoad, AdapterModules, AdapterRemove, CheckRefit, EngineManifest, Failure, FailureKind, LoadRefit, RefitMessage, Sampling, ShardInfo,
    StreamDeltas, StreamEnd, SyncRequest,
)
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard.control_channel import Channel, ChannelBroken, FrameUnread
from nemo_gen.fleet.faults import classify, failure_of, root_cause, unanswered
from nemo_gen.fleet.handles import ShardHandle, ShardSpec, slot_from_name
from nemo_gen.fleet.launch import launch_shard, teardown

log = logging.getLogger(__name__)

# progress(shard_index, event, detail): "loading" | "ready" | "failed"
ProgressFn = Callable[[int, str, dict[str, Any]], None]


@dataclass(frozen=True)
class DriverTimeouts:
    """Deadlines of the calls the driver makes (built from settings by ``nemo_gen.config.policies``)."""

    control_s: float  # info / assign: a live actor answers at once
    stop_s: float  # a clean engine stop before the actor is killed
    engine_grace_s: float  # within it, the engine's processes' time to exit before vLLM kills them
    refit_s: float  # each refit phase on a shard (the workers enforce it; the driver adds a margin)


# The shard actor's method for each refit message (``fan_out``): the message's type names the call.
_METHODS: dict[type, str] = {CheckRefit: "check_refit", LoadRefit: "load_refit", SyncRequest: "weight_sync",
                             AdapterModules: "adapter_call", AdapterLoad: "adapter_call", AdapterRemove: "adapter_call"}


@dataclass(frozen=True)
class Outcome:
    """What one shard answered to a fanned-out call: a value, or how it failed."""

    value: Any = None
    failure: Failure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def error(self) -> str | None:
        """The failure as the ledger writes it ("Type: message"); None when it answered."""
        return None if self.failure is None else str(self.failure)

    @property
    def infra(self) -> bool:
        """The failure is the shard's loss, silence or refusal for now, not a verdict on the input."""
        return self.failure is not None and self.failure.infra


@dataclass(frozen=True, eq=False)  # identity: each call is its own dict key
class Call:
    """A call in flight on one shard actor (``ref``: Ray's ObjectRef)."""

    handle: ShardHandle
    what: str
    ref: Any


class Stream:
    """A streamed generate call in flight on one shard (``ShardActor.generate_stream``, a Ray
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
        return await ref

    def cancel(self) -> None:
        try:
            ray.cancel(self._generator)
        except Exception:  # already finished or its actor is gone: nothing left to cancel
            pass


class Pending:
    """One call in flight on a shard, for an asyncio caller: ``future`` (asyncio) is its answer;
    ``cancel()`` ends the call on the shard itself (Ray cancels the actor's task there, and the
    engine aborts what it generates for it). Cancelling ``future`` alone would not: an asyncio
    future of a Ray call only stops the wait."""

    def __init__(self, ref: Any):
        self._ref = ref
        self.future = asyncio.wrap_future(ref.future())

    def cancel(self) -> None:
        self.future.cancel()
        try:
            ray.cancel(self._ref)
        except Exception:  # already finished or its actor is gone: nothing left to cancel
            pass


class ShardDriver:
    """Every Ray call the fleet makes on a shard actor; see the module doc."""

    def __init__(self, timeouts: DriverTimeouts, channels: bool = True):
        self.timeouts = timeouts
        # refit.control_channel: weight_sync calls to a shard on this host go over its direct
        # line (nemo_gen.shard.control_channel); actor name -> the line, None where there is none.
        self.channels = channels
        self._channels: dict[str, Channel | None] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self, spec: ShardSpec) -> ShardHandle:
        """Place, create and start one shard (``launch_shard``)."""
        return launch_shard(spec)

    def launch_all(self, specs: Iterable[ShardSpec], progress: ProgressFn | None = None) -> list[ShardHandle]:
        """Start shards in parallel. If any fails, the others are stopped and the first error
        raised: all of them or none."""
        specs = list(specs)

        def one(spec: ShardSpec) -> ShardHandle:
            if progress:
                progress(spec.index, "loading", {})
            t0 = time.monotonic()
            try:
                handle = self.launch(spec)
            except Exception as exc:
                if progress:
                    progress(spec.index, "failed", {"error": str(exc)})
                raise
            if progress:
                progress(spec.index, "ready", {**handle.info.as_dict(), "seconds": time.monotonic() - t0})
            return handle

        with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
            futures = [pool.submit(one, s) for s in specs]
            handles, errors = [], []
            for fut in futures:
                try:
                    handles.append(fut.result())
                except Exception as exc:  # collected: one failure must not leak the others' engines
                    errors.append(exc)
        if errors:
            for handle in handles:
                self.stop(handle)
            raise errors[0]
        return handles

    def stop(self, handle: ShardHandle) -> list[int]:
        """Stop the engine cleanly if the actor still answers, then kill the actor and free its
        placement group. Returns the engine PIDs known for the shard (for reap checks)."""
        pids = set(handle.engine_pids)
        self._drop_channel(handle)
        try:
            pids.update(ray.get(handle.actor.shutdown.remote(self.timeouts.engine_grace_s), timeout=self.timeouts.stop_s))
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass  # already dead or wedged: killing the actor below is what remains
        teardown(handle.actor, handle.placement_group)
        return sorted(pids)

    def kill(self, handle: ShardHandle) -> None:
        """Kill the shard's actor without asking it first (it may be dead, hung or stopped) and
        free its placement group. The raylet tears the actor's process group down with it."""
        self._drop_channel(handle)
        teardown(handle.actor, handle.placement_group)

    def find(self, fleet: str, namespace: str) -> list[ShardHandle]:
        """Every live actor of fleet ``fleet`` (shards, replacements, spares), found by name
        prefix. A handle's ``index`` is the slot it serves (``info.slot``; None for a spare)."""
        from ray.util import get_placement_group, list_named_actors

        prefixes = (f"{fleet}-shard-", f"{fleet}-spare-")
        names = [a["name"] for a in list_named_actors(all_namespaces=True)
                 if a["namespace"] == namespace and a["name"].startswith(prefixes)]
        actors = {}
        for name in names:
            try:
                actors[name] = ray.get_actor(name, namespace=namespace)
            except ValueError:
                continue  # died between the listing and the call
        answers = self._all(actors, "info", lambda actor: actor.info.remote())
        handles = []
        for name, actor in actors.items():
            info = answers[name]
            if isinstance(info, BaseException):
                # Alive but not answering (hung, stopped) or dying: kept by the slot its name
                # gives, so recovery kills it instead of leaving it to hold the slot's resources.
                if not isinstance(info, ShardDiedError):
                    raise info  # the actor answered with an error: a bug, not a lost shard
                slot = slot_from_name(fleet, name)
                if slot is None:
                    continue
                info = ShardInfo(slot=slot, weight_version=None, fleet=fleet, unresponsive=info.detail)
            if info.fleet != fleet:
                continue  # another fleet whose name starts with ours
            try:
                pg = get_placement_group(f"{name}-pg")
            except ValueError:
                pg = None
            handles.append(ShardHandle(index=info.slot, name=name, actor=actor, placement_group=pg, info=info))
        return handles

    # -- blocking calls ------------------------------------------------------------------------

    def _get(self, handle: ShardHandle, what: str, ref: Any, timeout_s: float) -> Any:
        try:
            return ray.get(ref, timeout=timeout_s)
        except Exception as exc:
            raise classify(handle, exc, what, timeout_s) from None

    def _all(self, targets: Mapping[Any, Any], what: str, call: Callable[[Any], Any]) -> dict[Any, Any]:
        """``call(target)`` on every target at once and one wait of ``fleet.control_timeout_s``
        for all of them: key -> the answer, or the classified error (never a wait per target)."""
        refs = {key: call(target) for key, target in targets.items()}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.timeouts.control_s)
        out: dict[Any, Any] = {}
        for key, ref in refs.items():
            try:
                out[key] = ray.get(ref, timeout=0)
            except Exception as exc:
                out[key] = classify(None, exc, what, self.timeouts.control_s)
        return out

    def infos(self, handles: Mapping[Any, ShardHandle]) -> dict[Any, ShardInfo | BaseException]:
        """``info`` of every handle at once (refreshing each ``handle.info`` that answered): key ->
        its info, or the error its call ended with."""
        out = self._all(handles, "info", lambda h: h.actor.info.remote())
        for key, info in out.items():
            if not isinstance(info, BaseException):
                handles[key].info = info
        return out

    def info(self, handle: ShardHandle) -> ShardInfo:
        """The actor's own account (PIDs, weight version, slot); refreshes ``handle.info``."""
        handle.info = self._get(handle, "info", handle.actor.info.remote(), self.timeouts.control_s)
        return handle.info

    def assign(self, handle: ShardHandle, slot: int, restarts: int) -> ShardInfo:
        """Make the actor serve ``slot`` (a replacement, a promoted spare)."""
        handle.index = slot
        handle.info = self._get(handle, "assign", handle.actor.assign.remote(slot, restarts), self.timeouts.control_s)
        return handle.info

    def vllm_metrics(self, handle: ShardHandle) -> list[dict[str, Any]]:
        """vLLM's own stats of the shard's engine (``ShardActor.vllm_metrics``)."""
        return self._get(handle, "vllm_metrics", handle.actor.vllm_metrics.remote(), self.timeouts.control_s)

    def expected_manifest(self, handle: ShardHandle, target: str) -> EngineManifest:
        return self._get(handle, "expected_manifest", handle.actor.expected_manifest.remote(target),
                         self.timeouts.refit_s)

    def fan_out(self, handles: Mapping[Any, ShardHandle], message: RefitMessage | Mapping[Any, RefitMessage],
                margin_s: float) -> dict[Any, Outcome]:
        """Send a refit ``message`` (``CheckRefit``, ``LoadRefit`` or a weight-sync step; the
        same for all, or one per key) to every handle at once; key -> Outcome. The workers
        enforce the refit deadline; ``margin_s`` on top covers a frozen actor that never
        answers, and the whole call waits that long once, for every shard together. A
        weight-sync step goes over a shard's direct line where it has one
        (``refit.control_channel``), else over Ray; a call its line could not read goes over Ray."""
        per_key = message if isinstance(message, Mapping) else {k: message for k in handles}
        wait = self.timeouts.refit_s + margin_s
        deadline = time.monotonic() + wait
        direct: dict[Any, Channel] = {}

        def over_ray(key: Any) -> Any:
            msg = per_key[key]
            return getattr(handles[key].actor, _METHODS[type(msg)]).remote(msg)

        for key, handle in handles.items():
            line = self._channel(handle) if isinstance(per_key[key], SyncRequest) else None
            if line is not None and line.lock.acquire(blocking=False):
                try:
                    line.send((per_key[key],))
                    direct[key] = line
                except ChannelBroken:  # nothing reached the actor: Ray carries the call
                    line.lock.release()
                    self._drop_channel(handle)
                except Exception:  # not picklable without Ray's cloudpickle; nothing was sent
                    line.lock.release()
        out: dict[Any, Outcome] = {}
        try:
            refs = {k: over_ray(k) for k in handles if k not in direct}
            for key, line in direct.items():
                try:
                    ok, value = line.receive(deadline - time.monotonic())
                    if ok:
                        out[key] = Outcome(value=value)
                    else:  # the line answers a raised exception as "Type: last line": the actor said no
                        type_name, _, detail = value.partition(": ")
                        out[key] = Outcome(failure=Failure(FailureKind.DATA, type_name, detail))
                except FrameUnread as exc:  # the actor could not read the call: it never ran
                    log.info("shard %s could not read a weight_sync call over its line (%s); sent over Ray",
                             handles[key].name, exc)
                    self._drop_channel(handles[key])
                    refs[key] = over_ray(key)
                except TimeoutError:
                    self._drop_channel(handles[key])  # its late answer must not be read as the next call's
                    out[key] = Outcome(failure=unanswered("weight_sync", wait))
                except ChannelBroken as exc:
                    self._drop_channel(handles[key])
                    out[key] = Outcome(failure=Failure(FailureKind.DEAD, "ActorDiedError",
                                                       f"the shard's line closed during weight_sync ({exc})"))
        finally:
            for line in direct.values():
                line.lock.release()
        if refs:  # one wait for all of them: a frozen shard costs the deadline once, not once each
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        for key, ref in refs.items():
            try:
                out[key] = Outcome(value=ray.get(ref, timeout=0))
            except ray.exceptions.GetTimeoutError:
                with contextlib.suppress(Exception):  # best effort: a frozen actor may never see it
                    ray.cancel(ref)
                out[key] = Outcome(failure=unanswered(_METHODS[type(per_key[key])], wait))
            except Exception as exc:
                out[key] = Outcome(failure=failure_of(exc))
        return out

    def _channel(self, handle: ShardHandle) -> Channel | None:
        """The shard's direct line, opened on first use; None when switched off, when the actor
        runs on another node, or when it cannot be had (then Ray carries every call)."""
        if not self.channels:
            return None
        if handle.name not in self._channels:
            self._channels[handle.name] = self.open_channel(handle)
        return self._channels[handle.name]

    def open_channel(self, handle: ShardHandle) -> Channel | None:
        """Ask the actor where its line is and connect, if it runs on this node."""
        try:
            where = ray.get(handle.actor.control_channel.remote(self.timeouts.control_s),
                            timeout=self.timeouts.control_s)
            if where.node_ip == get_node_ip_address():
                return Channel(where.address, where.key, self.timeouts.control_s)
        except Exception as exc:  # no line: Ray carries the calls, which report a dead actor
            log.info("shard %s: no direct line (%s); its refit calls go over Ray", handle.name, root_cause(exc))
        return None

    def lines(self) -> set[str]:
        """Names of the shard actors this driver has an open direct line to."""
        return {name for name, line in self._channels.items() if line is not None}

    def _drop_channel(self, handle: ShardHandle) -> None:
        line = self._channels.get(handle.name)
        self._channels[handle.name] = None  # not reopened: Ray carries this actor's calls from now on
        if line is not None:
            line.close()

    # -- calls in flight -----------------------------------------------------------------------

    def start_generate(self, handle: ShardHandle, batch: list, params: Sampling) -> Call:
        return Call(handle, "generate", handle.actor.generate.remote(batch, params))

    def start_watch(self, handle: ShardHandle, interval_s: float) -> Call:
        return Call(handle, "watch", handle.actor.watch.remote(interval_s))

    def start_probe(self, handle: ShardHandle, sampling: Sampling, tokens: list[int], timeout_s: float,
                    warmup_s: float) -> Call:
        return Call(handle, "probe", handle.actor.probe.remote(sampling, tokens, timeout_s, warmup_s))

    def start_progress(self, handle: ShardHandle, known: tuple[tuple[str, int], ...]) -> Call:
        """The shard's running requests' tokens past ``known`` (``ShardActor.progress``: fleet.migration)."""
        return Call(handle, "progress", handle.actor.progress.remote(known))

    def wait(self, calls: Iterable[Call], timeout_s: float) -> list[Call]:
        """The calls among ``calls`` that are done, waiting up to ``timeout_s`` for the first."""
        by_ref = {c.ref: c for c in calls}
        if not by_ref:
            return []
        ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=timeout_s)
        if ready:  # collect everything else that is done too
            ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        return [by_ref[r] for r in ready]

    def result(self, call: Call, timeout_s: float = 0.0) -> Any:
        """A finished call's value; ShardDiedError when the shard is gone, a data error as raised."""
        return self._get(call.handle, call.what, call.ref, timeout_s or self.timeouts.control_s)

    def cancel(self, call: Call) -> None:
        try:
            ray.cancel(call.ref)
        except Exception:  # already finished or its worker is gone: nothing left to cancel
            pass

    def generate_async(self, handle: ShardHandle, batch: list, params: Sampling) -> "Pending":
        """One generate call as an awaitable (the per-request path of ``generate_async``)."""
        return Pending(handle.actor.generate.remote(batch, params))

    def generate_stream(self, handle: ShardHandle, request: Any, params: Sampling) -> Stream:
        """One request, streamed as the shard generates it (``ShardActor.generate_stream``)."""
        return Stream(handle.actor.generate_stream.remote(request, params))

    def classify(self, handle: ShardHandle, exc: BaseException, what: str) -> BaseException:
        return classify(handle, exc, what)
