"""A shard's rules, with no Ray in them: one ``Shard`` holds one engine (``EngineLike``) and
answers the fleet's wire (``nemo_gen.core.wire``) — what it says about itself, which weight
version stamps each result, how busy refusals and its engine's own crash leave it, and the
refit rules: half-loaded
weights never carry a version, a drain holds requests back while a keep/abort swaps weights
under the running batch, and a weight-sync session (``SyncSession``) either ends at its new
version, or back at the old one only when nothing was loaded.

``nemo_gen.shard.actor.ShardActor`` is the Ray shell around it (NeMo-RL's Impl plus a thin
``ray.remote`` class; Ray Serve's ``ReplicaActor`` around ``ReplicaBase``); the fake tier
(``tests/fakes.py``) hosts the same class over a fake engine, so the fast tests run these rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Mapping

from nemo_gen.core.ipc_zmq import IpcZmqRefit
from nemo_gen.core.manifest import needs_whole
from nemo_gen.core.modes import WeightTarget
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.retry import describe, ended_on_its_own, kind_of
from nemo_gen.core.sleep import AWAKE
from nemo_gen.core.wire import (
    AdapterCall, AdapterState, ApplyTimings, EngineManifest, CheckRefit, FailureKind, GenerateReply, InFlight, LoadRefit, LoadStats, ProbeReply,
    ProbeStatus, RequestProgress, Sampling, ShardInfo, StepGaps, StreamDeltas, StreamEnd, SyncAbort, SyncApply, SyncFinish, SyncInit,
    SyncReply, SyncRequest, SyncShutdown, SyncStart, SyncStartDraft, SyncUpdate, Unfinished,
)
from nemo_gen.errors import EngineCrashError, ShardBusy
from nemo_gen.shard.adapters import adapter_call
from nemo_gen.shard.engine_protocol import EngineLike
from nemo_gen.shard.sleep_rules import SleepRules

# vLLM's weight-sync RPCs on the workers, by step (``apply`` is nemo_gen's one-call form).
_RPC = {SyncInit: "init_weight_transfer_engine", SyncStart: "start_weight_update",
        SyncStartDraft: "start_draft_weight_update", SyncUpdate: "update_weights",
        SyncFinish: "finish_weight_update", SyncShutdown: "shutdown_weight_transfer_engine"}

# How long a shard waits, after vLLM reports its EngineCore dead, for that process's exit code:
# an EngineCore that fails in its step sends its death first, then shuts its workers down and exits.
CORE_EXIT_WAIT_S = 10.0
# After those calls answered, before the engine's death is reported: their answers cross Ray and
# the router's poll first (milliseconds; a loaded machine may hold a thread back longer).
ANSWER_MARGIN_S = 1.0


def _engine_died(exc: BaseException) -> bool:
    """vLLM said its EngineCore is dead (``EngineDeadError``, or an error raised from one)."""
    return any(c.__name__ == "EngineDeadError" for e in (exc, exc.__cause__) if e is not None
               for c in type(e).__mro__)


@dataclass(frozen=True)
class Host:
    """Where the shard runs (its shell knows: a Ray actor's process and node)."""

    actor_pid: int | None = None
    node_id: str | None = None
    node_ip: str | None = None


@dataclass(frozen=True)
class Claim:
    """The weight version a shard stamps its results with, and the checkpoint it came from.
    None while weights load: half-loaded weights never carry a version."""

    version: int | None
    source: str | None = None


NO_CLAIM = Claim(None, None)


class SyncSession:
    """A weight-sync session on one shard: how running requests meet it (``in_flight``, from
    its start), what the shard claimed before it (restored only when nothing was loaded), and
    the layout number its workers loaded last (outlives sessions: a chunk in that layout's short
    form can be loaded without its metadata)."""

    def __init__(self, engine: EngineLike):
        self.engine = engine
        self.in_flight: InFlight | None = None  # set from begin to end
        self.was: Claim = NO_CLAIM
        self.layout: Any = None

    @property
    def open(self) -> bool:
        return self.in_flight is not None

    async def begin(self, in_flight: InFlight, claim: Claim) -> None:
        """Hold requests back (``drain``) or freeze the running batch (``keep``/``abort``)."""
        self.in_flight = in_flight
        if in_flight.drain:
            await self.engine.hold()
        else:
            await self.engine.begin_swap()
        self.was = claim

    async def end(self, version: int | None, failed: str | None = None) -> None:
        """Let requests flow again; the engine serves ``version`` (what it had when None)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        if in_flight.drain:
            if version is not None:
                await self.engine.set_version(version)
            await self.engine.release()
        else:
            await self.engine.end_swap(version, in_flight, failed=failed)


class Shard(SleepRules):
    """One shard = one vLLM engine, as ``vllm serve`` would run it, serving slot ``slot`` of
    fleet ``fleet`` (``slot`` None: a warm spare). Built before its engine starts (``attach``),
    so it answers ``info`` while the engine loads."""

    claim: Claim  # (the sleep rules' mixin leaves it untyped: this module imports that one)

    def __init__(self, index: int, weight_version: int | None, slot: int | None = None, fleet: str = "",
                 async_engine: bool = False, host: Host = Host()):
        self.index = index
        self.slot = slot
        self.fleet = fleet
        self.async_engine = async_engine
        self.host = host
        self.claim = Claim(weight_version)
        self.restarts = 0  # restarts of the slot it serves, as of its installation
        self.engine: EngineLike | None = None
        self.engine_core_start: str | None = None
        self.sync: SyncSession | None = None
        self.calls = 0  # generate calls in the engine now (``calls_answered``)
        self.sleep_state = AWAKE  # ``sleep`` / ``wake`` (nemo_gen.core.sleep): asleep, it admits nothing

    # -- life ------------------------------------------------------------------------------------

    def attach(self, engine: EngineLike, engine_core_start: str | None = None) -> ShardInfo:
        self.engine = engine
        self.engine_core_start = engine_core_start
        self.sync = SyncSession(engine)
        return self.info()

    def detach(self) -> EngineLike | None:
        engine, self.engine, self.sync = self.engine, None, None
        return engine

    @property
    def weight_version(self) -> int | None:
        return self.claim.version

    def info(self, direct_calls: int = 0) -> ShardInfo:
        engine = self.engine
        return ShardInfo(
            slot=self.slot, weight_version=self.claim.version, index=self.index, fleet=self.fleet,
            weight_source=self.claim.source, restarts=self.restarts, actor_pid=self.host.actor_pid,
            engine_pids=tuple(engine.child_pids()) if engine else (), node_id=self.host.node_id,
            node_ip=self.host.node_ip, max_model_len=engine.max_model_len if engine else None,
            dtype=engine.dtype if engine else None, load_s=engine.load_s if engine else None,
            async_engine=self.async_engine, engine_core_start=self.engine_core_start, direct_calls=direct_calls,
            generating=bool(engine and engine.generating), batch_steps=engine.steps_made if engine else 0,
            sleep_level=None if self.sleep_state.awake or self.sleep_state.level is None else int(self.sleep_state.level),
            sleep_resident=tuple(sorted(self.sleep_state.resident)),
        )

    def assign(self, slot: int, restarts: int = 0) -> ShardInfo:
        """Serve ``slot`` (a promoted spare, a replacement) and remember the slot's restart
        count, so a later attach continues the restart budget instead of resetting it."""
        self.slot = slot
        self.restarts = restarts
        return self.info()

    # -- generation ------------------------------------------------------------------------------

    def _engine(self) -> EngineLike:
        if self.engine is None:
            raise RuntimeError("the shard's engine is not running")
        return self.engine

    async def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> GenerateReply:
        # The version is read when the work starts: every result is stamped with the weights
        # that produced it.
        version = self.claim.version
        t0 = time.perf_counter()
        async with self._admission():
            results = await self._engine().generate(requests, sampling)
        return GenerateReply(self.slot, version, tuple(results), time.perf_counter() - t0)

    async def generate_stream(self, request: GenerationRequest,
                              sampling: Sampling) -> AsyncIterator[StreamDeltas | StreamEnd]:
        """One request as it is generated: ``StreamDeltas`` items, then one ``StreamEnd``
        stamped as ``generate`` stamps its reply (``nemo_gen.shard.streaming``). Closing it
        early aborts the request in the engine."""
        version = self.claim.version
        t0 = time.perf_counter()
        async with self._admission():
            async with contextlib.aclosing(self._engine().stream(request, sampling)) as items:
                async for item in items:
                    if isinstance(item, StreamDeltas):
                        yield item
                    else:
                        yield StreamEnd(item, self.slot, version, time.perf_counter() - t0)

    def progress(self, known: tuple[tuple[str, int], ...]) -> tuple[RequestProgress, ...]:
        """Checkpoints of the running requests named in ``known`` ((key, tokens the driver knows)):
        what each made since (``fleet.migration``). No engine: none."""
        return () if self.engine is None else self.engine.progress(dict(known))

    @contextlib.asynccontextmanager
    async def _admission(self) -> AsyncIterator[None]:
        """The engine's refusal of a request for now (vLLM's full queue: busy, never dead)
        leaves the shard as ``ShardBusy``: vLLM's own admission errors do not survive pickling.
        Its EngineCore's death leaves it as ``EngineCrashError`` when the core ended on its own
        (``nemo_gen.core.retry.ended_on_its_own``: the requests it ran may be the cause, and the
        router sends them to no other engine); killed from outside, or its end unknown within
        ``CORE_EXIT_WAIT_S``, the death is an ordinary one and its requests are re-routed."""
        slot = -1 if self.slot is None else self.slot
        if not self.sleep_state.awake:  # (the router refuses first; one already on its way lands here)
            raise ShardBusy(slot, f"the shard is {self.sleep_state.label()}")
        self.calls += 1
        try:
            yield
        except Exception as exc:
            if kind_of(exc) is FailureKind.BUSY and not isinstance(exc, ShardBusy):
                raise ShardBusy(slot, describe(exc)) from None
            if self.engine is not None and _engine_died(exc):
                code = await self.engine.core_exit(CORE_EXIT_WAIT_S)
                if ended_on_its_own(code):
                    raise EngineCrashError(slot, f"its EngineCore exited with code {code} while it ran this request "
                                                 "(an error in its step: see the shard's log); the request may be "
                                                 "the cause and was sent to no other engine") from None
            raise
        finally:
            self.calls -= 1

    async def calls_answered(self) -> None:
        """Wait, up to ``CORE_EXIT_WAIT_S``, until no generate call is in the engine, then
        ``ANSWER_MARGIN_S`` more for their answers to reach the router: an engine's death is
        reported (the actor's ``watch``) after the calls it ended have said how. An idle engine's
        death is reported at once: no call's answer can be overtaken."""
        if not self.calls:
            return
        deadline = time.monotonic() + CORE_EXIT_WAIT_S
        while self.calls and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(ANSWER_MARGIN_S)

    async def probe(self, sampling: Sampling, token_ids: list[int], stall_s: float,
                    warmup_s: float) -> ProbeReply:
        """A real generation of one token (or, while a batch runs, proof of a recent step)."""
        if self.engine is None:
            return ProbeReply(ProbeStatus.FAILED, "no engine")
        if not self.sleep_state.awake:  # its scheduler is paused: a token would never come
            return ProbeReply(ProbeStatus.SKIPPED, f"the shard is {self.sleep_state.label()}")
        return probe_reply(await self.engine.probe(sampling, token_ids, stall_s, warmup_s))

    # -- a checkpoint refit ----------------------------------------------------------------------

    async def check_refit(self, msg: CheckRefit) -> int:
        """Phase 1: every worker can read the staged tensors, and their digests are the trainer's
        (a mismatch refuses, naming the first tensor that differs). Changes nothing."""
        if not self.sleep_state.weights_resident:  # (the fleet wakes them first: NeMo-RL's order)
            raise RuntimeError(f"the shard is {self.sleep_state.label()}: its weights must be woken "
                               "(wake tags=['weights']) before a refit")
        seen = await self._engine().rpc("nemo_gen_check_staged", msg.path, msg.total, list(msg.entries),
                                        list(msg.digests), timeout=msg.timeout_s)
        fewest: int = min(seen)
        return fewest

    async def load_refit(self, msg: LoadRefit | IpcZmqRefit) -> float:
        """Phase 2: load each (target, entries) group, then serve as ``msg.version``. ``drain``
        holds requests back until the running ones finish; ``keep`` / ``abort`` swap the weights
        under the running batch. On failure the shard keeps no claim to any version."""
        engine = self._engine()
        t0 = time.perf_counter()

        async def load() -> None:
            self.claim = NO_CLAIM  # half-loaded weights must never be stamped as a version
            if isinstance(msg, IpcZmqRefit):  # NeMo-RL's stream: its workers receive it (vllm_ext.ipc_zmq)
                await engine.rpc("nemo_gen_update_weights_via_ipc_zmq", list(msg.entries), msg.timeout_s, msg.address)
                return
            for target, entries in msg.groups:
                await engine.rpc("nemo_gen_load_staged", msg.path, msg.total, entries, target, timeout=msg.timeout_s)

        if msg.in_flight.drain or not self.sleep_state.awake:  # (asleep: nothing runs, its scheduler is paused)
            async with engine.exclusive():
                await load()
                await engine.set_version(msg.version)
        else:
            await engine.begin_swap()
            try:
                await load()
            except BaseException as exc:
                await engine.end_swap(None, msg.in_flight, failed=f"refit to version {msg.version} failed: {exc}")
                raise
            await engine.end_swap(msg.version, msg.in_flight)
        self.claim = Claim(msg.version, getattr(msg, "source", None))
        return time.perf_counter() - t0

    # -- LoRA adapters --------------------------------------------------------------------------

    async def adapter_call(self, call: AdapterCall) -> AdapterState:
        """A LoRA adapter call on this shard's engine (``nemo_gen.shard.adapters``)."""
        return await adapter_call(self._engine(), call)

    # -- vLLM's weight-sync protocol -------------------------------------------------------------

    async def weight_sync(self, req: SyncRequest) -> SyncReply:
        """One step of vLLM's weight-sync protocol on this engine's workers, with the shard's
        refit rules around it: from a start until finish or abort the session holds requests
        back or freezes the batch, and the shard claims no version (its weights may be
        half-loaded). Finish serves its version; abort ends the workers' session and restores
        the old claim only when nothing was loaded. Apply: start, one chunk and finish in one
        RPC into the engine. A chunk in a layout's short form that the workers did not load
        last is answered ``layout_unknown``, nothing touched."""
        engine, sync = self._engine(), self.sync
        assert sync is not None
        entered = time.perf_counter()
        update, payload, timeout = req.chunk(), req.payload, req.timeout_s
        if update is not None and needs_whole(update, sync.layout):
            return SyncReply(layout_unknown=True)
        if isinstance(payload, SyncApply):
            return SyncReply(timings=await self._apply(payload, timeout, entered))
        if isinstance(payload, (SyncInit, SyncShutdown)):
            sync.layout = None  # a new transfer engine, or none: no views are open
            args = (dict(payload.init_info),) if isinstance(payload, SyncInit) else ()
            await engine.rpc(_RPC[type(payload)], *args, timeout=timeout)
        elif isinstance(payload, (SyncStart, SyncStartDraft)):
            await self._begin(payload.in_flight)
            try:
                await engine.rpc(_RPC[type(payload)], timeout=timeout)
            except BaseException:
                self.claim = sync.was  # nothing was loaded
                await sync.end(None)
                raise
        elif isinstance(payload, SyncUpdate):
            sync.layout = None
            await engine.rpc(_RPC[SyncUpdate], dict(payload.update_info), timeout=timeout)
            sync.layout = payload.update_info.get("layout")
        elif isinstance(payload, SyncFinish):
            try:
                await engine.rpc(_RPC[SyncFinish], timeout=timeout)
            except BaseException as exc:
                await sync.end(None, failed=f"finishing the weight update failed: {exc}")
                raise
            self.claim = Claim(payload.version)
            await sync.end(payload.version)
        elif isinstance(payload, SyncAbort):
            nothing_loaded = payload.nothing_loaded
            try:  # end the workers' session (a layerwise reload puts unloaded layers back)
                await engine.rpc(_RPC[SyncFinish], timeout=timeout)
            except Exception:
                nothing_loaded = False  # the workers' state is unknown: claim no version
            finally:
                if nothing_loaded:  # nothing reached the weights
                    self.claim = sync.was
                await sync.end(None, failed=None if nothing_loaded else "the weight update was aborted after loading")
        else:  # SyncRequest checks its payload's type: this is a step added to the wire and not here
            raise TypeError(f"no rule for weight-sync step {req.step.value!r}")
        return SyncReply()

    async def _begin(self, in_flight: InFlight) -> None:
        assert self.sync is not None
        await self.sync.begin(in_flight, self.claim)
        self.claim = NO_CLAIM

    async def _apply(self, payload: SyncApply, timeout: float, entered: float) -> ApplyTimings:
        engine, sync = self._engine(), self.sync
        assert sync is not None
        t0 = time.perf_counter()
        await self._begin(payload.in_flight)
        try:
            t1 = time.perf_counter()
            workers = await engine.rpc("nemo_gen_weight_update", dict(payload.update_info), payload.target,
                                       timeout=timeout)
            t2 = time.perf_counter()
        except BaseException as exc:
            sync.layout = None
            await sync.end(None, failed=f"the weight update failed while loading: {exc}")
            raise
        sync.layout = payload.update_info.get("layout")
        self.claim = Claim(payload.version)
        await sync.end(payload.version)
        left = time.perf_counter()
        return ApplyTimings(actor_s=left - t0, engine_rpc_s=t2 - t1, worker_s=max(workers), entered_at=entered,
                            left_at=left)

    # -- the rest --------------------------------------------------------------------------------

    async def expected_manifest(self, target: WeightTarget = WeightTarget.POLICY) -> EngineManifest:
        (manifest, *_) = await self._engine().rpc("nemo_gen_expected_manifest", target)
        return EngineManifest.of(manifest)

    async def digest(self, target: WeightTarget = WeightTarget.POLICY) -> float:
        (value, *_) = await self._engine().rpc("nemo_gen_digest", target)
        return float(value)

    async def load_stats(self) -> list[LoadStats]:
        """Per worker: how its last refit load went (path, seconds, kernel repack seconds)."""
        return [LoadStats.of(stats) for stats in await self._engine().rpc("nemo_gen_load_stats")]

    def vllm_metrics(self) -> list[dict[str, Any]]:
        return self.engine.vllm_metrics() if self.engine else []

    def unfinished(self) -> Unfinished:
        return self.engine.unfinished() if self.engine else Unfinished()

    def step_gaps(self, reset: bool = False) -> StepGaps:
        return self._engine().step_gaps(reset)


def probe_reply(answer: Mapping[str, Any]) -> ProbeReply:
    """The engine's probe answer (``Engine.probe``, ``nemo_gen.core.liveness``) on the wire."""
    if answer.get("skipped"):
        return ProbeReply(ProbeStatus.SKIPPED, str(answer["skipped"]))
    if not answer.get("ok"):
        return ProbeReply(ProbeStatus.FAILED, answer.get("error") or "probe failed")
    if answer.get("busy"):
        return ProbeReply(ProbeStatus.BUSY, answer.get("refused"), step_age_s=answer.get("step_age_s"))
    return ProbeReply(ProbeStatus.OK, seconds=answer.get("seconds"))
