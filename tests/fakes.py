"""A fake ``ShardDriver`` for the fleet-logic tier: it hosts real shards (``nemo_gen.shard.rules.Shard``,
the rules the Ray actor runs) in this process, each over a ``FakeEngine`` that dies, hangs or slows down on
command, so routing, re-routing, spare promotion, quarantine and refit settling are tested in milliseconds
against the shard's own rules, not a copy of them. It has the real driver's shape (the fleet cannot tell
them apart) and answers the way a real shard does: a dead shard's calls fail with ``ShardDiedError``, a
hung one's never answer, a slow one's answer late. The same paths are tested on real vLLM engines in
tests/engine/.

    driver = FakeDriver()
    fleet = fake_fleet(settings, driver)
    driver.set_dead(fleet.handle(1).name)      # the watch fires, requests re-route
    driver.set_hung(name) / driver.set_slow(name, 0.5)
    driver.set_token_s(name, 0.05)             # a token every 50 ms (batches, awaitables, streams)
    driver.set_busy(name, 2)                   # its next 2 generate calls are refused: vLLM's queue is full
    driver.clock = fake_clock                  # the shards' time (token_s, probes' step ages)
    driver.shard(handle)                       # its FakeEngine (faults, counters); .rules: its real Shard
    CountingDriver().counts                    # every driver call the fleet made, by method

Every argument and answer that crosses the fake actor boundary is checked to hold no dict (``dicts_in``:
the wire's frozen messages only, vLLM's own payloads aside); a crossing dict fails the call and, at
``close``, the test (``wire_violations``).

Like a Ray async actor, every shard's calls run on one event loop (the driver's own thread), so a
probe answers while a batch generates. A shard generating with ``token_s`` makes its tokens one by one
on ``driver.clock`` and stops when its call is cancelled (``tokens_made`` says how far each request
got); its probes answer by the real engine's liveness rule (``nemo_gen.core.liveness``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import enum
import threading
import time
from concurrent.futures import Future, wait as wait_futures, FIRST_COMPLETED
from typing import Any, Callable, Iterable, Mapping

from nemo_gen.core import wire
from nemo_gen.core.liveness import busy_answer
from nemo_gen.core.wire import (
    CheckRefit, EngineManifest, InFlight, LoadRefit, RequestResult, SampleDelta, SampleResult, Sampling, ShardInfo, StepGaps, StreamDeltas,
    StreamEnd, SyncRequest, Unfinished,
)
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard.batch import add_span
from nemo_gen.shard.gate import Gate
from nemo_gen.fleet.driver import Call, DriverTimeouts, Outcome, ShardDriver
from nemo_gen.fleet.faults import classify, failure_of, unanswered
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.shard.progress import checkpoint
from nemo_gen.shard.rules import Host, Shard

VOCAB = 97  # fake token ids stay below the tiny tokenizer's vocabulary

# Calls whose answer is vLLM's own, not the fleet's protocol (the wire's docstring names them).
VLLM_OWNED_ANSWERS = frozenset({"vllm_metrics"})


def dicts_in(value: Any, where: str = "") -> list[str]:
    """Where a dict (any mapping) sits in ``value``: walked through lists, tuples, sets and
    dataclass fields, except the fields that carry vLLM's own payloads (``wire.VLLM_OWNED``)."""
    if isinstance(value, Mapping):
        return [where or "the value itself"]
    if isinstance(value, (str, bytes, int, float, bool, enum.Enum)) or value is None:
        return []
    if isinstance(value, (list, tuple, set, frozenset)):
        return [p for i, item in enumerate(value) for p in dicts_in(item, f"{where}[{i}]")]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [p for f in dataclasses.fields(value) if (type(value), f.name) not in wire.VLLM_OWNED
                for p in dicts_in(getattr(value, f.name), f"{where}.{type(value).__name__}.{f.name}")]
    return []


class FakeEngine:
    """An engine (``nemo_gen.shard.engine_protocol.EngineLike``) behind the real admission gate
    (``nemo_gen.shard.gate.Gate``), with the faults a test sets on it, and
    what it did (``generated``, ``running``, ``tokens_made``, ``refused``, ``streams``). ``rules``: the
    real ``Shard`` hosting it (its version, slot and layout are the shard's)."""

    max_model_len = 256
    dtype = "float32"
    load_s = 0.0

    def __init__(self, name: str, version: int | None, manifest: dict, clock: Callable[[], float],
                 keeps_stats: bool = False):
        self.name = name
        self.version = version  # what it serves (``set_version``, ``end_swap``)
        self._manifest = manifest
        self._clock = clock
        self.keeps_stats = keeps_stats  # its engine keeps vLLM's stats (engine_kwargs' disable_log_stats false)
        self.rules: Shard | None = None
        self.dead: str | None = None  # why, once dead
        self.actor_dead = True  # the actor died (not only its engine)
        self.hung = threading.Event()  # set: never answers
        self.slow_s = 0.0  # before answering; for a stream, before its first token
        self.token_s = 0.0  # time between tokens
        self.stopped = False
        self.refuse_refit: str | None = None  # a data failure while reading the staged weights
        self.fail_load: str | None = None  # a failure while loading them
        self.poisoned: str | None = None  # a load broke off under a swap: weights half-loaded
        self.generated = 0  # requests served
        self.streams: list[FakeStream] = []  # every stream it was asked for
        self.watchers: list[Future] = []
        self.busy = 0  # its next this-many generate calls are refused (vLLM's queue is full)
        self.refused = 0  # generate calls it refused
        self.running = 0  # requests it is generating now (token_s > 0)
        self.tokens_made: dict[int, int] = {}  # request index -> tokens made so far
        self.live: dict[str, list[Any]] = {}  # a keyed request's [request, samples, tokens made]: its checkpoints
        self.steps = 0  # tokens made while busy (the engine's steps since it became busy)
        self.last_step_at = 0.0  # on the driver's clock
        self.rpcs: list[str] = []  # the control RPCs its workers got
        self.pids: list[int] = []  # its "processes" (none: a test may give it some)
        self.crash_on: int | None = None  # a token id its EngineCore dies of (a poison pill)
        self.crash_exit = 1  # that core's exit code (1: an error in its step; -9: killed from outside)
        self.exit_code: int | None = None  # its core's, once it died
        self.crashes = 0  # times its core died of a request
        # The real admission gate (``nemo_gen.shard.gate``): a drain holds it, a swap claims it.
        self.gate = Gate()
        self._frozen = False  # the running batch waits (a swap: vLLM's paused scheduler)

    # -- the shard's state, as its rules hold it ----------------------------------------------------

    @property
    def weight_version(self) -> int | None:
        return self.rules.weight_version if self.rules else self.version

    @property
    def slot(self) -> int | None:
        return self.rules.slot if self.rules else None

    @property
    def layout(self) -> Any:
        return self.rules.sync.layout if self.rules and self.rules.sync else None

    def gone(self) -> ShardDiedError | None:
        if self.dead or self.stopped:
            return ShardDiedError(-1 if self.slot is None else self.slot, f"ActorDiedError: {self.dead or 'stopped'}")
        return None

    # -- EngineLike -------------------------------------------------------------------------------

    @property
    def generating(self) -> bool:
        return self.running > 0

    @property
    def steps_made(self) -> int:
        return self.steps

    def child_pids(self) -> list[int]:
        return list(self.pids)

    async def core_exit(self, wait_s: float) -> int | None:
        return self.exit_code

    def _crash_if_poisoned(self, requests: list) -> None:
        """A request holding ``crash_on`` kills the EngineCore under the live actor, as an
        out-of-vocabulary id kills a vLLM engine without a tokenizer: vLLM's EngineDeadError."""
        if self.crash_on is not None and any(self.crash_on in r.prompt_token_ids for r in requests):
            from vllm.v1.engine.exceptions import EngineDeadError

            self.crashes += 1
            self.dead, self.actor_dead, self.exit_code = "EngineCore exited", False, self.crash_exit
            raise EngineDeadError()

    def _refuse(self) -> None:
        if self.busy > 0:
            from vllm.exceptions import QueueOverflowError

            self.busy -= 1
            self.refused += 1
            raise QueueOverflowError()

    async def generate(self, requests: list, sampling: Sampling) -> list[RequestResult]:
        self._refuse()
        self._crash_if_poisoned(requests)
        async with self.gate.serving():  # waits while a refit holds the gate, as the real engine's
            n = sampling.max_new_tokens
            version = self.version
            for req in requests:
                if req.key is not None:
                    self.live[req.key] = [req, 1 if req.continues is not None else sampling.n, 0]
            try:
                if self.token_s:
                    await self._make_tokens(requests, n)
            finally:
                for req in requests:
                    self.live.pop(req.key, None)
            results = []
            for req in requests:
                c = req.continues or 0  # a migrated sample: one sample, the tokens after its kept ones
                samples = tuple(SampleResult([fake_token(req, k, c + i) for i in range(n - c)], [0.0] * (n - c), "",
                                             "length", ((version, n - c),))
                                for k in range(1 if req.continues is not None else sampling.n))
                results.append(RequestResult(req.index, samples))
            self.generated += len(requests)
            return results

    async def _make_tokens(self, batch: list, n: int) -> None:
        """One token per ``token_s`` of the clock for each request of the batch, as an engine
        steps; a cancelled call stops at once (the engine aborts it), a dead shard fails."""
        if self.running == 0:
            self.steps, self.last_step_at = 0, self._clock()
        self.running += len(batch)
        try:
            next_at = self._clock() + self.token_s
            for i in range(n):
                while self._clock() < next_at or self._frozen:
                    if self.gone():
                        break
                    await asyncio.sleep(0.001)
                if (gone := self.gone()) is not None:
                    raise gone
                for req in batch:
                    self.tokens_made[req.index] = i + 1
                    if req.key in self.live:
                        self.live[req.key][2] = i + 1
                if all(i + 1 >= n - (req.continues or 0) for req in batch):
                    break
                self.steps += 1
                self.last_step_at = self._clock()
                next_at += self.token_s
        finally:
            self.running -= len(batch)

    async def stream(self, req: Any, sampling: Sampling):
        """One token per item for every sample (the first after ``slow_s``, the next ``token_s``
        apart), each stamped with the version the engine serves as it is made (a refit landing
        mid-stream shows), then the result."""
        self._refuse()
        self._crash_if_poisoned([req])
        async with self.gate.serving():
            c = req.continues or 0  # a migrated sample: one sample, the tokens after its kept ones
            tokens, samples = sampling.max_new_tokens - c, 1 if req.continues is not None else sampling.n
            made: list[list[int]] = [[] for _ in range(samples)]
            spans: list[list[list[Any]]] = [[] for _ in range(samples)]
            for i in range(tokens):
                await asyncio.sleep(self.slow_s if i == 0 else self.token_s)
                while self._frozen:
                    await asyncio.sleep(0.002)
                if (gone := self.gone()) is not None:
                    raise gone
                deltas = []
                finish = "length" if i == tokens - 1 else None
                for k in range(samples):
                    made[k].append(fake_token(req, k, c + i))
                    add_span(spans[k], self.version, 1)
                    deltas.append(SampleDelta(k, [made[k][-1]], "", [0.0], ((self.version, 1),), finish))
                yield StreamDeltas(tuple(deltas))
            self.generated += 1
            yield RequestResult(req.index, tuple(
                SampleResult(made[k], [0.0] * tokens, "", "length", tuple((v, n) for v, n in spans[k]))
                for k in range(samples)))

    def progress(self, known: dict[str, int]) -> tuple[wire.RequestProgress, ...]:
        """The real engine's checkpoints (``nemo_gen.shard.progress``) of the tokens it made so far."""
        def reader(req: Any, samples: int, made: int):
            c = req.continues or 0
            return lambda start: [([fake_token(req, k, c + i) for i in range(start, made)], [0.0] * (made - start),
                                   ((self.version, made),), None) for k in range(samples)]

        return checkpoint(known, ((key, reader(*entry)) for key, entry in list(self.live.items())))

    async def probe(self, sampling: Sampling, token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]:
        """The real engine's rules: held for a refit, skipped; half-loaded, failed; busy: its last
        step's age (``nemo_gen.core.liveness``); idle: its one real token."""
        if self.gate.held:
            return {"ok": True, "skipped": "refit or control call in progress"}
        if self.poisoned is not None:
            return {"ok": False, "error": f"weights half-loaded: {self.poisoned}"}
        if self.running:
            return busy_answer(self._clock() - self.last_step_at, self.steps, stall_s, warmup_s)
        return {"ok": True}

    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        self.rpcs.append(method)
        if method == "nemo_gen_check_staged":
            if self.refuse_refit:
                raise ValueError(self.refuse_refit)
            return [1]
        if method in ("nemo_gen_load_staged", "nemo_gen_weight_update", "update_weights"):
            if self.fail_load:
                raise RuntimeError(self.fail_load)
            return [0.001]
        if method == "nemo_gen_expected_manifest":
            return [{"tensors": dict(self._manifest), "optional": [], "available": args[0] == "policy", "shared": []}]
        if method in ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                      "finish_weight_update", "shutdown_weight_transfer_engine"):
            return [None]
        raise AssertionError(f"the fake engine has no RPC {method!r}")

    def exclusive(self):
        return self.gate.exclusive()

    async def hold(self) -> None:
        await self.gate.hold()

    async def release(self) -> None:
        await self.gate.release()

    async def set_version(self, version: int | None) -> None:
        self.version = version

    async def begin_swap(self) -> None:
        await self.gate.claim()  # as the real swap (``nemo_gen.shard.swap``): new requests wait
        self._frozen = True

    async def end_swap(self, version: int | None, in_flight: InFlight, failed: str | None = None) -> None:
        if failed is not None:
            self.poisoned = failed
        if version is not None:
            self.version = version
        self._frozen = False
        await self.gate.release()

    def vllm_metrics(self) -> list[dict[str, Any]]:
        """vLLM's stats as ``Engine.vllm_metrics`` gives them: none unless the engine keeps them."""
        if not self.keeps_stats:
            return []
        labels = {"engine": "0", "model_name": "fake"}
        return [{"name": "vllm:num_requests_running", "labels": labels, "kind": "gauge", "value": self.running},
                {"name": "vllm:request_success", "labels": labels, "kind": "counter", "value": self.generated},
                {"name": "vllm:time_to_first_token_seconds", "labels": labels, "kind": "histogram",
                 "count": self.generated, "sum": 0.01 * self.generated,
                 "buckets": {"0.1": self.generated, "+Inf": self.generated}}]

    def unfinished(self) -> Unfinished:
        return Unfinished()

    def step_gaps(self, reset: bool) -> StepGaps:
        return StepGaps(0.0)

    def shutdown(self, grace_s: float) -> None:
        self.stopped = True


# What a fake shard answers for each refit message (the real driver's ``_METHODS``).
_REFIT_CALLS = {CheckRefit: "check_refit", LoadRefit: "load_refit", SyncRequest: "weight_sync"}


class FakeDriver:
    """See the module doc. ``manifest``: what every engine says its weights are."""

    def __init__(self, manifest: dict[str, tuple[tuple[int, ...], str]] | None = None,
                 timeouts: DriverTimeouts = DriverTimeouts(control_s=0.5, stop_s=0.5, engine_grace_s=0.1, refit_s=1.0)):
        self.timeouts = timeouts
        self.manifest = manifest or {"w": ((4, 4), "float32"), "b": ((4,), "float32")}
        self.shards: dict[str, FakeEngine] = {}
        self.launched: list[ShardSpec] = []
        self.launch_failures: list[BaseException | None] = []  # the next launches: raise this, or (None) start
        self.remote_calls: list[tuple[str, str, Any]] = []  # (actor, method, message) of each fanned-out call
        self.wire_violations: list[str] = []  # dicts that crossed the actor boundary (``crosses``)
        self._lock = threading.Lock()
        self.clock = time.monotonic  # the shards' time: token_s, the probes' step ages
        # The shards' event loop, as a Ray async actor has one: calls on a shard interleave there.
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="fake-shards", daemon=True)
        self._thread.start()

    # -- what a test does to shards ----------------------------------------------------------------

    def set_dead(self, name: str, reason: str = "engine process 4242 exited", actor: bool = True) -> None:
        """The shard dies: its calls fail, its watch fires (``actor`` False: only the engine)."""
        engine = self.shards[name]
        engine.dead, engine.actor_dead = reason, actor
        for watcher in engine.watchers:
            if not watcher.done():
                if actor:
                    watcher.set_exception(ShardDiedError(-1, f"ActorDiedError: {reason}"))
                else:
                    watcher.set_result(reason)

    def set_hung(self, name: str, hung: bool = True) -> None:
        """The shard stops answering (a SIGSTOPped engine); ``hung=False`` lets it go on."""
        engine = self.shards[name]
        if hung:
            engine.hung.set()
        else:
            engine.hung.clear()

    def set_slow(self, name: str, seconds: float) -> None:
        self.shards[name].slow_s = seconds

    def set_token_s(self, name: str, seconds: float) -> None:
        self.shards[name].token_s = seconds

    def set_busy(self, name: str, calls: int = 1_000_000) -> None:
        """The shard refuses its next ``calls`` generate calls: vLLM's QueueOverflowError (503)."""
        self.shards[name].busy = calls

    def shard(self, handle: ShardHandle) -> FakeEngine:
        return self.shards[handle.name]

    def rules(self, handle: ShardHandle) -> Shard:
        """The real ``Shard`` the fake actor hosts."""
        return self.shards[handle.name].rules

    def close(self) -> None:
        for engine in self.shards.values():
            engine.hung.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        assert not self.wire_violations, self.wire_violations

    # -- the driver's shape --------------------------------------------------------------------------

    def crosses(self, method: str, what: str, value: Any) -> None:
        """``value`` crosses the actor boundary: fail on any dict in it (and note it for ``close``)."""
        found = [] if what == "answer" and method in VLLM_OWNED_ANSWERS else dicts_in(value)
        if found:
            message = f"a dict crossed the actor boundary in {method}'s {what}: at {', '.join(found)}"
            self.wire_violations.append(message)
            raise AssertionError(message)

    def _serve(self, engine: FakeEngine, method: str, *args: Any) -> Future:
        """Run the shard's ``method(*args)`` (a coroutine, or a plain value) on the shards' loop as the
        actor would: failing if dead, never while hung, late if slow; its arguments and answer hold
        no dict. Cancelling the future cancels the call there."""
        self.crosses(method, "arguments", args)

        async def run():
            while engine.hung.is_set() and not engine.dead:
                await asyncio.sleep(0.01)
            if engine.slow_s:
                await asyncio.sleep(engine.slow_s)
            if (gone := engine.gone()) is not None:
                raise gone
            out = getattr(engine.rules, method)(*args)
            out = await out if asyncio.iscoroutine(out) else out
            self.crosses(method, "answer", out)
            return out
        return asyncio.run_coroutine_threadsafe(run(), self.loop)

    def _blocking(self, handle: ShardHandle, what: str, *args: Any, timeout_s: float):
        future = self._serve(self.shards[handle.name], what, *args)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise ShardDiedError(-1 if handle.index is None else handle.index,
                                 f"{what} did not answer within {timeout_s:g}s") from None

    def launch(self, spec: ShardSpec) -> ShardHandle:
        with self._lock:
            self.launched.append(spec)
            failure = self.launch_failures.pop(0) if self.launch_failures else None
        if failure is not None:
            raise failure
        engine = FakeEngine(spec.actor_name, spec.weight_version, self.manifest, lambda: self.clock(),
                            keeps_stats=not spec.engine_kwargs.get("disable_log_stats", True))
        engine.rules = Shard(spec.index, spec.weight_version, None if spec.spare else spec.index, spec.fleet,
                             spec.async_engine, Host(node_id="fake"))
        info = engine.rules.attach(engine, "fake")
        self.crosses("start", "answer", info)
        self.shards[engine.name] = engine
        return ShardHandle(index=spec.index, name=engine.name, actor=None, placement_group=None, info=info)

    # The real all-or-none parallel start, over the fake launch/stop.
    launch_all = ShardDriver.launch_all

    def stop(self, handle: ShardHandle) -> list[int]:
        self.kill(handle)
        return []

    def kill(self, handle: ShardHandle) -> None:
        engine = self.shards[handle.name]
        engine.stopped = True
        engine.hung.clear()

    def find(self, fleet: str, namespace: str) -> list[ShardHandle]:
        found = [ShardHandle(index=e.slot, name=e.name, actor=None, placement_group=None, info=e.rules.info())
                 for e in self.shards.values() if not e.dead and not e.stopped]
        self.crosses("info", "answer", [h.info for h in found])
        return found

    def infos(self, handles: Mapping[Any, ShardHandle]) -> dict[Any, ShardInfo | BaseException]:
        """The real driver's shape: every ``info`` at once, one deadline for all of them."""
        futures = {k: self._serve(self.shards[h.name], "info") for k, h in handles.items()}
        wait_futures(list(futures.values()), timeout=self.timeouts.control_s)
        out: dict[Any, Any] = {}
        for key, future in futures.items():
            handle = handles[key]
            if not future.done():
                future.cancel()
                out[key] = ShardDiedError(-1 if handle.index is None else handle.index,
                                          f"info did not answer within {self.timeouts.control_s:g}s")
            elif future.exception() is not None:
                out[key] = future.exception()
            else:
                out[key] = handle.info = future.result()
        return out

    def info(self, handle: ShardHandle) -> ShardInfo:
        handle.info = self._blocking(handle, "info", timeout_s=self.timeouts.control_s)
        return handle.info

    def assign(self, handle: ShardHandle, slot: int, restarts: int) -> ShardInfo:
        handle.index = slot
        handle.info = self._blocking(handle, "assign", slot, restarts, timeout_s=self.timeouts.control_s)
        return handle.info

    def vllm_metrics(self, handle: ShardHandle) -> list[dict[str, Any]]:
        return self._blocking(handle, "vllm_metrics", timeout_s=self.timeouts.control_s)

    def expected_manifest(self, handle: ShardHandle, target: str) -> EngineManifest:
        return self._blocking(handle, "expected_manifest", target, timeout_s=self.timeouts.refit_s)

    def fan_out(self, handles: Mapping[Any, ShardHandle], message: Any, margin_s: float) -> dict[Any, Outcome]:
        """The real driver's shape: each shard's refit message runs on its real ``Shard``; one
        deadline for all of them."""
        per_key = message if isinstance(message, Mapping) else {k: message for k in handles}
        futures = {}
        for key, handle in handles.items():
            msg = per_key[key]
            method = _REFIT_CALLS[type(msg)]
            self.remote_calls.append((handle.name, method, msg))
            futures[key] = self._serve(self.shards[handle.name], method, msg)
        wait = self.timeouts.refit_s + margin_s
        wait_futures(list(futures.values()), timeout=wait)
        out = {}
        for key, future in futures.items():
            if not future.done():
                future.cancel()
                out[key] = Outcome(failure=unanswered(_REFIT_CALLS[type(per_key[key])], wait))
            elif future.exception() is not None:
                out[key] = Outcome(failure=failure_of(future.exception()))
            else:
                out[key] = Outcome(value=future.result())
        return out

    def start_generate(self, handle: ShardHandle, batch: list, params: Sampling) -> Call:
        return Call(handle, "generate", self._serve(self.shards[handle.name], "generate", batch, params))

    def start_watch(self, handle: ShardHandle, interval_s: float) -> Call:
        engine = self.shards[handle.name]
        future: Future = Future()
        engine.watchers.append(future)
        if engine.dead:
            self.set_dead(engine.name, engine.dead, engine.actor_dead)
        return Call(handle, "watch", future)

    def start_progress(self, handle: ShardHandle, known: tuple[tuple[str, int], ...]) -> Call:
        return Call(handle, "progress", self._serve(self.shards[handle.name], "progress", known))

    def start_probe(self, handle: ShardHandle, sampling: Sampling, tokens: list[int], timeout_s: float,
                    warmup_s: float) -> Call:
        return Call(handle, "probe", self._serve(self.shards[handle.name], "probe", sampling, tokens, timeout_s,
                                                 warmup_s))

    def wait(self, calls: Iterable[Call], timeout_s: float) -> list[Call]:
        calls = list(calls)
        if not calls:
            return []
        wait_futures([c.ref for c in calls], timeout=timeout_s, return_when=FIRST_COMPLETED)
        return [c for c in calls if c.ref.done()]

    def result(self, call: Call, timeout_s: float = 0.0) -> Any:
        try:
            return call.ref.result(timeout=timeout_s or self.timeouts.control_s)
        except TimeoutError:
            raise ShardDiedError(-1, f"{call.what} did not answer") from None
        except Exception as exc:  # the real driver's one mapping, as its ``result`` applies it
            raise classify(call.handle, exc, call.what) from None

    def cancel(self, call: Call) -> None:
        call.ref.cancel()  # cancels the shard's task: its engine stops generating for it

    def generate_async(self, handle: ShardHandle, batch: list, params: Sampling) -> "FakePending":
        return FakePending(self.start_generate(handle, batch, params).ref)

    def generate_stream(self, handle: ShardHandle, request: Any, params: Sampling) -> "FakeStream":
        engine = self.shards[handle.name]
        self.crosses("generate_stream", "arguments", (request, params))
        stream = FakeStream(engine, engine.rules.generate_stream(request, params), self.loop,
                            lambda item: self.crosses("generate_stream", "item", item))
        engine.streams.append(stream)
        return stream

    def classify(self, handle: ShardHandle, exc: BaseException, what: str) -> BaseException:
        return classify(handle, exc, what)


# What the fleet calls on its driver: each one is a Ray call (or several) on the real one.
DRIVER_METHODS = frozenset(n for n, v in vars(ShardDriver).items() if callable(v) and not n.startswith("_"))


class CountingDriver(FakeDriver):
    """A ``FakeDriver`` that counts the calls made to it, by method (``counts``): on the real
    driver each one would be a call to a shard."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.counts: collections.Counter[str] = collections.Counter()
        self._counts_lock = threading.Lock()

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if name not in DRIVER_METHODS:
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._counts_lock:
                self.counts[name] += 1
            return value(*args, **kwargs)

        return counted


class FakePending:
    """The real ``driver.Pending``'s shape: ``future`` (asyncio), ``cancel()`` ends the call on the shard."""

    def __init__(self, future: Future):
        self._future = future
        self.future = asyncio.wrap_future(future)

    def cancel(self) -> None:
        self.future.cancel()
        self._future.cancel()


def fake_token(req: Any, k: int, i: int) -> int:
    """Token i of sample k: sample k of a request differs from the others by k (a GRPO group of
    distinct answers). A migrated sample's continuation (``continues``) makes its tokens as the
    request it continues would have (its prompt less the kept tokens): a greedy engine's rule."""
    c = req.continues or 0
    k = k if req.continues is None else req.sample
    return (sum(req.prompt_token_ids[:len(req.prompt_token_ids) - c]) + k + i) % VOCAB


class FakeStream:
    """A streamed generate on a fake shard, with the real ``Stream``'s shape: the real
    ``Shard.generate_stream`` over its ``FakeEngine``, run on the shards' loop from the moment it
    is asked for and to its end whether read or not, as a Ray streaming generator's actor task is.
    A dead shard's stream fails at its next item; a hung one's never answers; ``cancel()`` ends
    it on the shard (its engine stops). ``sent``: the items read."""

    def __init__(self, engine: FakeEngine, items: Any, loop: asyncio.AbstractEventLoop,
                 check: Callable[[Any], None] = lambda item: None):
        self.engine, self._loop, self._check = engine, loop, check
        self.cancelled = False
        self.sent = 0
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.run_coroutine_threadsafe(self._produce(items), loop)

    async def _produce(self, items: Any) -> None:
        try:
            async with contextlib.aclosing(items):
                async for item in items:
                    self._check(item)  # it crosses the actor boundary
                    self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except BaseException as exc:  # what the call raised (cancelled included) is its reader's
            self._queue.put_nowait(("error", exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    async def _next(self) -> StreamDeltas | StreamEnd | None:
        engine = self.engine
        while engine.hung.is_set() and not engine.dead and not self.cancelled:
            await asyncio.sleep(0.01)
        if self.cancelled:
            raise ShardDiedError(-1, "ActorDiedError: cancelled")
        # The actor gone: its call fails at once. Only its engine: the shard's stream says so.
        if (gone := engine.gone()) is not None and (engine.actor_dead or engine.stopped):
            raise gone
        kind, value = await self._queue.get()
        if kind == "error":
            raise value
        if kind == "end":
            return None
        self.sent += 1
        return value

    async def next(self) -> StreamDeltas | StreamEnd | None:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._next(), self._loop))

    def cancel(self) -> None:
        self.cancelled = True
        self._task.cancel()  # the shard's task is cancelled: the engine's stream closes


def fake_fleet(settings, driver: FakeDriver, watch: bool = True):
    """A ``GenerationFleet`` of ``settings`` whose shards are ``driver``'s (no Ray, no engines)."""
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import resolve_generation

    resolved = resolve_generation(settings, cluster=None)
    started = driver.launch_all(resolved.shards + resolved.spares)
    shards = [h for h in started if h.info.slot is not None]
    spares = [h for h in started if h.info.slot is None]
    return GenerationFleet(resolved, shards, spares=spares, driver=driver, watch=watch)



