"""The fleet's one way to its shards: every call to a shard goes through ``ShardDriver``, written
once over a small transport (``nemo_gen.fleet.transport``: Ray's, ``transport_ray``, or one in
process, ``transport_local``, which the fast tier runs this same logic over).

``ShardDriver`` places, starts, calls, watches and stops shard actors. Each method has a
typed result, every deadline comes from the settings (``DriverTimeouts``), and one function,
``classify`` (``nemo_gen.fleet.faults``), maps what the transport and vLLM raise into ``nemo_gen.errors`` by the fault model
(``nemo_gen.core.retry``): *dead* (the actor, its engine or its node is gone, a control call
went unanswered) becomes ``ShardDiedError``; *busy* (the shard refused admission for now)
``ShardBusy``; *slow* and *data* (the actor said no: a bad manifest, a bad request) are raised
as they are. A call waiting on several shards waits once, for all of them, never once each.

A refit's ``weight_sync`` calls to a shard on this node go over the shard's direct line
(``nemo_gen.shard.control_channel``, ``refit.control_channel``), which costs a socket round trip
instead of a Ray call each way (bench/results/2026-12-03/cpu-refit_call.md); the driver opens one per shard on first use, drops it
when it breaks or a call outlives its deadline, and the transport carries every call it cannot.
The line answers a failed call with the wire's ``Failure``, kind and all, as the transport's path does.

Non-blocking calls (generate, watch, probe) return a ``Call`` that the fleet's loops wait on
together; ``result`` classifies its outcome. A streamed generate (``generate_stream``) returns a
``Stream``: its items as the shard yields them. The fleet logic above this module never sees a
Ray object.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable, Mapping, TypeVar

from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import (
    AdapterLoad, AdapterModules, AdapterRemove, CheckRefit, EngineManifest, Failure, FailureKind, LoadRefit, RefitMessage, Sampling, ShardInfo,
    SyncRequest,
)
from nemo_gen.core.ipc_zmq import IpcZmqRefit
from nemo_gen.core.sleep import ResetPrefixCache, SleepOrder, WakeOrder
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard.control_channel import Channel, ChannelBroken, FrameUnread
from nemo_gen.fleet.faults import classify, failure_of, root_cause, unanswered
from nemo_gen.fleet.handles import ShardHandle, ShardSpec, slot_from_name
from nemo_gen.fleet.transport import ItemStream, Pending, Ref, ShardTransport, Unanswered
from nemo_gen.settings import NemoGenSettings

log = logging.getLogger(__name__)

# progress(shard_index, event, detail): "loading" | "ready" | "failed"
ProgressFn = Callable[[int, str, dict[str, Any]], None]


# What a fan-out carries: a refit message, NeMo-RL's IPC refit, or a sleep call (``_METHODS``).
FanOutMessage = RefitMessage | IpcZmqRefit | SleepOrder | WakeOrder | ResetPrefixCache
# A fan-out's keys (a ``Member``, a slot, a name: whatever the caller tells its shards by) and targets.
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass(frozen=True)
class DriverTimeouts:
    """Deadlines of the calls the driver makes (built from settings by ``driver_timeouts`` below)."""

    control_s: float  # info / assign: a live actor answers at once
    stop_s: float  # a clean engine stop before the actor is killed
    engine_grace_s: float  # within it, the engine's processes' time to exit before vLLM kills them
    refit_s: float  # each refit phase on a shard (the workers enforce it; the driver adds a margin)


# The shard actor's method for each refit message (``fan_out``): the message's type names the call.
_METHODS: dict[type, str] = {CheckRefit: "check_refit", LoadRefit: "load_refit", SyncRequest: "weight_sync",
                             AdapterModules: "adapter_call", AdapterLoad: "adapter_call", AdapterRemove: "adapter_call",
                             SleepOrder: "sleep", WakeOrder: "wake", ResetPrefixCache: "reset_prefix_cache",
                             IpcZmqRefit: "load_refit"}


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
    """A call in flight on one shard (``ref``: the transport's, e.g. Ray's ObjectRef)."""

    handle: ShardHandle
    what: str
    ref: Ref


# A streamed generate in flight (the transport's: a Ray streaming generator, or one in process).
Stream = ItemStream


class ShardDriver:
    """Every call the fleet makes on a shard, over ``transport`` (Ray unless given); see the module doc."""

    def __init__(self, timeouts: DriverTimeouts, channels: bool = True, transport: ShardTransport | None = None):
        self.timeouts = timeouts
        if transport is None:
            from nemo_gen.fleet.transport_ray import RayTransport

            transport = RayTransport()
        self.transport: ShardTransport = transport
        # refit.control_channel: weight_sync calls to a shard on this host go over its direct
        # line (nemo_gen.shard.control_channel); actor name -> the line, None where there is none.
        self.channels = channels
        self._channels: dict[str, Channel | None] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    def launch(self, spec: ShardSpec) -> ShardHandle:
        """Place, create and start one shard (``transport.launch``)."""
        return self.transport.launch(spec)

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
            ref = self.transport.call(handle.actor, "shutdown", self.timeouts.engine_grace_s)
            pids.update(self.transport.get(ref, self.timeouts.stop_s))
        except Exception:  # already dead or wedged: killing the actor below is what remains
            pass
        self.transport.kill(handle)
        return sorted(pids)

    def kill(self, handle: ShardHandle) -> None:
        """Kill the shard's actor without asking it first (it may be dead, hung or stopped) and
        free its placement group. The raylet tears the actor's process group down with it."""
        self._drop_channel(handle)
        self.transport.kill(handle)

    def find(self, fleet: str, namespace: str) -> list[ShardHandle]:
        """Every live actor of fleet ``fleet`` (shards, replacements, spares), found by name
        prefix. A handle's ``index`` is the slot it serves (``info.slot``; None for a spare)."""
        found = {f.name: f for f in self.transport.find(fleet, namespace)}
        answers = self._all(found, "info", lambda f: self.transport.call(f.actor, "info"))
        handles = []
        for name, where in found.items():
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
            handles.append(ShardHandle(index=info.slot, name=name, actor=where.actor,
                                       placement_group=where.placement_group, info=info))
        return handles

    # -- blocking calls ------------------------------------------------------------------------

    def _call(self, handle: ShardHandle, method: str, *args: Any, timeout_s: float) -> Any:
        """``method(*args)`` on the shard, waited for up to ``timeout_s``; its error classified."""
        return self._get(handle, method, self.transport.call(handle.actor, method, *args), timeout_s)

    def _get(self, handle: ShardHandle, what: str, ref: Ref, timeout_s: float) -> Any:
        try:
            return self.transport.get(ref, timeout_s)
        except Exception as exc:
            raise classify(handle, exc, what, timeout_s) from None

    def _all(self, targets: Mapping[K, T], what: str, call: Callable[[T], Ref]) -> dict[K, Any]:
        """``call(target)`` on every target at once and one wait of ``fleet.control_timeout_s``
        for all of them: key -> the answer, or the classified error (never a wait per target)."""
        refs = {key: call(target) for key, target in targets.items()}
        self.transport.wait(list(refs.values()), self.timeouts.control_s)
        out: dict[K, Any] = {}
        for key, ref in refs.items():
            try:
                out[key] = self.transport.get(ref, 0)
            except Exception as exc:
                out[key] = classify(None, exc, what, self.timeouts.control_s)
        return out

    def infos(self, handles: Mapping[K, ShardHandle]) -> dict[K, ShardInfo | BaseException]:
        """``info`` of every handle at once (refreshing each ``handle.info`` that answered): key ->
        its info, or the error its call ended with."""
        out = self._all(handles, "info", lambda h: self.transport.call(h.actor, "info"))
        for key, info in out.items():
            if not isinstance(info, BaseException):
                handles[key].info = info
        return out

    def info(self, handle: ShardHandle) -> ShardInfo:
        """The actor's own account (PIDs, weight version, slot); refreshes ``handle.info``."""
        handle.info = self._call(handle, "info", timeout_s=self.timeouts.control_s)
        return handle.info

    def assign(self, handle: ShardHandle, slot: int, restarts: int) -> ShardInfo:
        """Make the actor serve ``slot`` (a replacement, a promoted spare)."""
        handle.index = slot
        handle.info = self._call(handle, "assign", slot, restarts, timeout_s=self.timeouts.control_s)
        return handle.info

    def vllm_metrics(self, handle: ShardHandle) -> list[dict[str, Any]]:
        """vLLM's own stats of the shard's engine (``Shard.vllm_metrics``)."""
        metrics: list[dict[str, Any]] = self._call(handle, "vllm_metrics", timeout_s=self.timeouts.control_s)
        return metrics

    def expected_manifest(self, handle: ShardHandle, target: WeightTarget) -> EngineManifest:
        manifest: EngineManifest = self._call(handle, "expected_manifest", target, timeout_s=self.timeouts.refit_s)
        return manifest

    def fan_out(self, handles: Mapping[K, ShardHandle], message: FanOutMessage | Mapping[K, FanOutMessage],
                margin_s: float) -> dict[K, Outcome]:
        """Send a refit ``message`` (``CheckRefit``, ``LoadRefit``, a weight-sync step or an
        adapter call; the same for all, or one per key) to every handle at once; key -> Outcome.
        The workers enforce the refit deadline; ``margin_s`` on top covers a frozen actor that
        never answers, and the whole call waits that long once, for every shard together. A
        weight-sync step goes over a shard's direct line where it has one
        (``refit.control_channel``), else over the transport; a call its line could not read
        goes over the transport."""
        per_key = message if isinstance(message, Mapping) else {k: message for k in handles}
        wait = self.timeouts.refit_s + margin_s
        deadline = time.monotonic() + wait
        direct: dict[K, Channel] = {}

        def send(key: K) -> Ref:
            msg = per_key[key]
            return self.transport.call(handles[key].actor, _METHODS[type(msg)], msg)

        for key, handle in handles.items():
            line = self._channel(handle) if isinstance(per_key[key], SyncRequest) else None
            if line is not None and line.lock.acquire(blocking=False):
                try:
                    line.send((per_key[key],))
                    direct[key] = line
                except ChannelBroken:  # nothing reached the actor: the transport carries the call
                    line.lock.release()
                    self._drop_channel(handle)
                except Exception:  # not picklable without Ray's cloudpickle; nothing was sent
                    line.lock.release()
        out: dict[K, Outcome] = {}
        try:
            refs = {k: send(k) for k in handles if k not in direct}
            for key, line in direct.items():
                try:
                    ok, value = line.receive(deadline - time.monotonic())
                    # the line answers a raised exception as the wire's Failure, kind and all
                    out[key] = Outcome(value=value) if ok else Outcome(failure=value)
                except FrameUnread as exc:  # the actor could not read the call: it never ran
                    log.info("shard %s could not read a weight_sync call over its line (%s); sent over the "
                             "transport", handles[key].name, exc)
                    self._drop_channel(handles[key])
                    refs[key] = send(key)
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
        # one wait for all of them: a frozen shard costs the deadline once, not once each
        self.transport.wait(list(refs.values()), max(0.0, deadline - time.monotonic()))
        for key, ref in refs.items():
            try:
                out[key] = Outcome(value=self.transport.get(ref, 0))
            except Unanswered:
                self.transport.cancel(ref)  # best effort: a frozen actor may never see it
                out[key] = Outcome(failure=unanswered(_METHODS[type(per_key[key])], wait))
            except Exception as exc:
                out[key] = Outcome(failure=failure_of(exc))
        return out

    def _channel(self, handle: ShardHandle) -> Channel | None:
        """The shard's direct line, opened on first use; None when switched off, when the actor
        runs on another node, or when it cannot be had (then the transport carries every call)."""
        if not self.channels:
            return None
        if handle.name not in self._channels:
            self._channels[handle.name] = self.open_channel(handle)
        return self._channels[handle.name]

    def open_channel(self, handle: ShardHandle) -> Channel | None:
        """Ask the actor where its line is and connect, if it runs on this node."""
        try:
            where = self.transport.get(self.transport.call(handle.actor, "control_channel", self.timeouts.control_s),
                                       self.timeouts.control_s)
            if where.node_ip == self.transport.local_ip():
                return Channel(where.address, where.key, self.timeouts.control_s)
        except Exception as exc:  # no line: the transport carries the calls, which report a dead actor
            log.info("shard %s: no direct line (%s); its refit calls go over the transport", handle.name,
                     root_cause(exc))
        return None

    def lines(self) -> set[str]:
        """Names of the shard actors this driver has an open direct line to."""
        return {name for name, line in self._channels.items() if line is not None}

    def _drop_channel(self, handle: ShardHandle) -> None:
        line = self._channels.get(handle.name)
        self._channels[handle.name] = None  # not reopened: the transport carries this actor's calls from now on
        if line is not None:
            line.close()

    # -- calls in flight -----------------------------------------------------------------------

    def start_generate(self, handle: ShardHandle, batch: list[GenerationRequest], params: Sampling) -> Call:
        return Call(handle, "generate", self.transport.call(handle.actor, "generate", batch, params))

    def start_watch(self, handle: ShardHandle, interval_s: float) -> Call:
        return Call(handle, "watch", self.transport.call(handle.actor, "watch", interval_s))

    def start_probe(self, handle: ShardHandle, sampling: Sampling, tokens: list[int], timeout_s: float,
                    warmup_s: float) -> Call:
        return Call(handle, "probe", self.transport.call(handle.actor, "probe", sampling, tokens, timeout_s, warmup_s))

    def start_progress(self, handle: ShardHandle, known: tuple[tuple[str, int], ...]) -> Call:
        """The shard's running requests' tokens past ``known`` (``ShardActor.progress``: fleet.migration)."""
        return Call(handle, "progress", self.transport.call(handle.actor, "progress", known))

    def wait(self, calls: Iterable[Call], timeout_s: float) -> list[Call]:
        """The calls among ``calls`` that are done, waiting up to ``timeout_s`` for the first."""
        by_ref = {c.ref: c for c in calls}
        return [by_ref[r] for r in self.transport.wait(list(by_ref), timeout_s, first=True)]

    def result(self, call: Call, timeout_s: float = 0.0) -> Any:
        """A finished call's value; ShardDiedError when the shard is gone, a data error as raised."""
        return self._get(call.handle, call.what, call.ref, timeout_s or self.timeouts.control_s)

    def cancel(self, call: Call) -> None:
        self.transport.cancel(call.ref)

    def generate_async(self, handle: ShardHandle, batch: list[GenerationRequest], params: Sampling) -> Pending:
        """One generate call as an awaitable (the per-request path of ``generate_async``)."""
        return Pending(self.transport, self.transport.call(handle.actor, "generate", batch, params))

    def generate_stream(self, handle: ShardHandle, request: GenerationRequest, params: Sampling) -> Stream:
        """One request, streamed as the shard generates it (``ShardHost.generate_stream``)."""
        return self.transport.stream(handle.actor, request, params)

    def classify(self, handle: ShardHandle, exc: BaseException, what: str) -> BaseException:
        return classify(handle, exc, what)


def driver_timeouts(settings: NemoGenSettings) -> DriverTimeouts:
    """Deadlines of the driver's calls on shard actors (built here, beside the driver: the
    settings side never imports the fleet)."""
    return DriverTimeouts(
        control_s=settings.fleet.control_timeout_s,
        stop_s=settings.fleet.stop_timeout_s,
        engine_grace_s=settings.fleet.engine_stop_grace_s,
        refit_s=settings.refit.timeout_s,
    )


def shard_driver(settings: NemoGenSettings) -> ShardDriver:
    """The Ray driver for a fleet of these settings."""
    return ShardDriver(driver_timeouts(settings), channels=settings.refit.control_channel)
