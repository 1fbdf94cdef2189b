"""A fake ``ShardDriver`` for the fleet-logic tier: shards that live in this process and die,
hang or slow down on command, so routing, re-routing, spare promotion, quarantine and refit
settling are tested in milliseconds. It has the real driver's shape (the fleet cannot tell
them apart) and answers the way a real shard does: a dead shard's calls fail with
``ShardDiedError``, a hung one's never answer, a slow one's answer late. The same paths are
tested on real vLLM engines in tests/engine/.

    driver = FakeDriver()
    fleet = fake_fleet(settings, driver)
    driver.set_dead(fleet.handle(1).name)      # the watch fires, requests re-route
    driver.set_hung(name) / driver.set_slow(name, 0.5)
    driver.set_token_s(name, 0.05)             # a token every 50 ms (batches, awaitables, streams)
    driver.set_busy(name, 2)                   # its next 2 generate calls are refused: vLLM's queue is full
    driver.clock = fake_clock                  # the shards' time (token_s, probes' step ages)
    CountingDriver().counts                    # every driver call the fleet made, by method

A shard generating with ``token_s`` makes its tokens one by one on ``driver.clock`` and stops
when its call is cancelled (``tokens_made`` says how far each request got); its probes answer
by the real engine's liveness rule (``nemo_gen.core.liveness``) from its last token's age.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait as wait_futures, FIRST_COMPLETED
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from nemo_gen.core.liveness import busy_answer
from nemo_gen.core.manifest import chunk_of, needs_whole
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard.batch import add_span
from nemo_gen.fleet.driver import Call, DriverTimeouts, Outcome, ShardDriver, classify
from nemo_gen.shard.actor import LAYOUT_UNKNOWN, ShardHandle, ShardSpec

VOCAB = 97  # fake token ids stay below the tiny tokenizer's vocabulary


@dataclass
class FakeShard:
    """What a shard actor would hold."""

    name: str
    slot: int | None
    weight_version: int | None
    restarts: int = 0
    dead: str | None = None  # why, once dead
    actor_dead: bool = True  # the actor died (not only its engine)
    hung: threading.Event = field(default_factory=threading.Event)  # set: never answers
    slow_s: float = 0.0  # before answering; for a stream, before its first token
    token_s: float = 0.0  # a stream's time between tokens
    stopped: bool = False
    refuse_refit: str | None = None  # a data failure while reading the staged weights
    fail_load: str | None = None  # a failure while loading them
    layout: Any = None  # the layout number of the last weight-sync update it loaded
    generated: int = 0  # requests served
    streams: list["FakeStream"] = field(default_factory=list)  # every stream it was asked for
    watchers: list[Future] = field(default_factory=list)
    busy: int = 0  # its next this-many generate calls are refused (vLLM's queue is full)
    refused: int = 0  # generate calls it refused
    running: int = 0  # requests it is generating now (token_s > 0)
    tokens_made: dict[int, int] = field(default_factory=dict)  # request index -> tokens made so far
    steps: int = 0  # tokens made while busy (the engine's steps since it became busy)
    last_step_at: float = 0.0  # on the driver's clock
    keeps_stats: bool = False  # its engine keeps vLLM's stats (engine_kwargs' disable_log_stats false)

    def vllm_rows(self) -> list[dict[str, Any]]:
        """vLLM's stats as ``Engine.vllm_metrics`` gives them: none unless the engine keeps them."""
        if not self.keeps_stats:
            return []
        labels = {"engine": "0", "model_name": "fake"}
        return [{"name": "vllm:num_requests_running", "labels": labels, "kind": "gauge", "value": self.running},
                {"name": "vllm:request_success", "labels": labels, "kind": "counter", "value": self.generated},
                {"name": "vllm:time_to_first_token_seconds", "labels": labels, "kind": "histogram",
                 "count": self.generated, "sum": 0.01 * self.generated,
                 "buckets": {"0.1": self.generated, "+Inf": self.generated}}]

    def info(self) -> dict[str, Any]:
        return {"slot": self.slot, "weight_version": self.weight_version, "restarts": self.restarts,
                "actor_pid": None, "engine_pids": [], "node_id": "fake", "dtype": "float32", "fleet": "fake"}


class FakeDriver:
    """See the module doc. ``manifest``: what every engine says its weights are."""

    def __init__(self, manifest: dict[str, tuple[tuple[int, ...], str]] | None = None,
                 timeouts: DriverTimeouts = DriverTimeouts(control_s=0.5, stop_s=0.5, engine_grace_s=0.1, refit_s=1.0)):
        self.timeouts = timeouts
        self.manifest = manifest or {"w": ((4, 4), "float32"), "b": ((4,), "float32")}
        self.shards: dict[str, FakeShard] = {}
        self.launched: list[ShardSpec] = []
        self.launch_failures: list[BaseException | None] = []  # the next launches: raise this, or (None) start
        self.remote_calls: list[tuple[str, str, tuple]] = []  # (actor, method, args) of each fanned-out call
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="fake-shard")
        self._lock = threading.Lock()
        self.clock = time.monotonic  # the shards' time: token_s, the probes' step ages

    # -- what a test does to shards ----------------------------------------------------------------

    def set_dead(self, name: str, reason: str = "engine process 4242 exited", actor: bool = True) -> None:
        """The shard dies: its calls fail, its watch fires (``actor`` False: only the engine)."""
        shard = self.shards[name]
        shard.dead, shard.actor_dead = reason, actor
        for watcher in shard.watchers:
            if not watcher.done():
                if actor:
                    watcher.set_exception(ShardDiedError(-1, f"ActorDiedError: {reason}"))
                else:
                    watcher.set_result(reason)

    def set_hung(self, name: str, hung: bool = True) -> None:
        """The shard stops answering (a SIGSTOPped engine); ``hung=False`` lets it go on."""
        shard = self.shards[name]
        if hung:
            shard.hung.set()
        else:
            shard.hung.clear()

    def set_slow(self, name: str, seconds: float) -> None:
        self.shards[name].slow_s = seconds

    def set_token_s(self, name: str, seconds: float) -> None:
        self.shards[name].token_s = seconds

    def set_busy(self, name: str, calls: int = 1_000_000) -> None:
        """The shard refuses its next ``calls`` generate calls: vLLM's QueueOverflowError (503)."""
        self.shards[name].busy = calls

    def shard(self, handle: ShardHandle) -> FakeShard:
        return self.shards[handle.name]

    def close(self) -> None:
        for shard in self.shards.values():
            shard.hung.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the driver's shape --------------------------------------------------------------------------

    def _serve(self, shard: FakeShard, fn):
        """Run ``fn`` as the shard would: failing if dead, never while hung, late if slow."""
        def run():
            while shard.hung.is_set() and not shard.dead:
                time.sleep(0.01)
            if shard.slow_s:
                time.sleep(shard.slow_s)
            if shard.dead or shard.stopped:
                raise ShardDiedError(-1 if shard.slot is None else shard.slot, f"ActorDiedError: {shard.dead or 'stopped'}")
            return fn()
        return self._pool.submit(run)

    def _blocking(self, handle: ShardHandle, what: str, fn, timeout_s: float):
        future = self._serve(self.shards[handle.name], fn)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise ShardDiedError(-1 if handle.index is None else handle.index,
                                 f"{what} did not answer within {timeout_s:g}s") from None

    def launch(self, spec: ShardSpec) -> ShardHandle:
        with self._lock:
            self.launched.append(spec)
            failure = self.launch_failures.pop(0) if self.launch_failures else None
        if failure is not None:
            raise failure
        shard = FakeShard(spec.actor_name, None if spec.spare else spec.index, spec.weight_version,
                          keeps_stats=not spec.engine_kwargs.get("disable_log_stats", True))
        self.shards[shard.name] = shard
        return ShardHandle(index=spec.index, name=shard.name, actor=None, placement_group=None, info=shard.info())

    # The real all-or-none parallel start, over the fake launch/stop.
    launch_all = ShardDriver.launch_all

    def stop(self, handle: ShardHandle) -> list[int]:
        self.kill(handle)
        return []

    def kill(self, handle: ShardHandle) -> None:
        shard = self.shards[handle.name]
        shard.stopped = True
        shard.hung.clear()

    def find(self, fleet: str, namespace: str) -> list[ShardHandle]:
        return [ShardHandle(index=s.slot, name=s.name, actor=None, placement_group=None, info=s.info())
                for s in self.shards.values() if not s.dead and not s.stopped]

    def infos(self, handles: Mapping[Any, ShardHandle]) -> dict[Any, Any]:
        """The real driver's shape: every ``info`` at once, one deadline for all of them."""
        futures = {k: self._serve(self.shards[h.name], self.shards[h.name].info) for k, h in handles.items()}
        wait_futures(list(futures.values()), timeout=self.timeouts.control_s)
        out: dict[Any, Any] = {}
        for key, future in futures.items():
            handle = handles[key]
            if not future.done():
                out[key] = ShardDiedError(-1 if handle.index is None else handle.index,
                                          f"info did not answer within {self.timeouts.control_s:g}s")
            elif future.exception() is not None:
                out[key] = future.exception()
            else:
                out[key] = handle.info = future.result()
        return out

    def info(self, handle: ShardHandle) -> dict[str, Any]:
        shard = self.shards[handle.name]
        handle.info = self._blocking(handle, "info", shard.info, self.timeouts.control_s)
        return handle.info

    def assign(self, handle: ShardHandle, slot: int, restarts: int) -> dict[str, Any]:
        shard = self.shards[handle.name]
        handle.index = slot

        def assign():
            shard.slot, shard.restarts = slot, restarts
            return shard.info()

        handle.info = self._blocking(handle, "assign", assign, self.timeouts.control_s)
        return handle.info

    def vllm_metrics(self, handle: ShardHandle) -> list[dict[str, Any]]:
        shard = self.shards[handle.name]
        return self._blocking(handle, "vllm_metrics", shard.vllm_rows, self.timeouts.control_s)

    def expected_manifest(self, handle: ShardHandle, target: str) -> dict[str, Any]:
        manifest = {"tensors": dict(self.manifest), "optional": [], "available": target == "policy", "shared": []}
        return self._blocking(handle, "expected_manifest", lambda: manifest, self.timeouts.refit_s)

    def fan_out(self, handles: Mapping[Any, ShardHandle], method: str, args: tuple | Mapping[Any, tuple],
                margin_s: float) -> dict[Any, Outcome]:
        per_key = args if isinstance(args, Mapping) else {k: args for k in handles}
        futures = {k: self._serve(self.shards[h.name], lambda h=h, a=per_key[k]: self._remote(h, method, a))
                   for k, h in handles.items()}
        out = {}
        for key, future in futures.items():
            try:
                out[key] = Outcome(value=future.result(timeout=self.timeouts.refit_s + margin_s))
            except TimeoutError:
                out[key] = Outcome(error=f"GetTimeoutError: {method} did not answer", infra=True)
            except ShardDiedError as exc:
                out[key] = Outcome(error=exc.detail, infra=True)
            except Exception as exc:
                out[key] = Outcome(error=f"{type(exc).__name__}: {exc}", infra=False)
        return out

    @staticmethod
    def _load(shard: FakeShard, version: int) -> None:
        """A load of weights: ``version`` once it succeeds, no version while it runs or if it fails."""
        shard.weight_version = None  # half-loaded weights never carry a version
        if shard.fail_load:
            raise RuntimeError(shard.fail_load)
        shard.weight_version = version

    def _remote(self, handle: ShardHandle, method: str, args: tuple) -> Any:
        self.remote_calls.append((handle.name, method, args))
        shard = self.shards[handle.name]
        if method == "check_refit":
            if shard.refuse_refit:
                raise ValueError(shard.refuse_refit)
            return 1
        if method == "load_refit":
            self._load(shard, args[3])
            return 0.001
        if method == "weight_sync":  # the shard actor's rules (nemo_gen.shard.actor.ShardActor.weight_sync)
            step, payload = args[0], args[1]
            update = chunk_of(step, payload)
            if update is not None and needs_whole(update, shard.layout):
                return {LAYOUT_UNKNOWN: True}
            if step in ("init", "shutdown"):
                shard.layout = None
            elif step == "finish":
                shard.weight_version = payload
            elif step == "apply":
                shard.layout = None
                self._load(shard, payload["version"])
                shard.layout = update.get("layout") if update is not None else None
            elif step == "update":
                shard.layout = update.get("layout") if update is not None else None
            return None
        raise AssertionError(f"the fake shard has no {method!r}")

    def _generate(self, shard: FakeShard, batch: list, params: dict[str, Any],
                  cancelled: threading.Event | None = None) -> dict[str, Any]:
        if shard.busy > 0:
            from vllm.exceptions import QueueOverflowError

            shard.busy -= 1
            shard.refused += 1
            raise QueueOverflowError()
        n = params.get("max_new_tokens") or 4
        version = shard.weight_version
        if shard.token_s:
            self._make_tokens(shard, batch, n, cancelled or threading.Event())
        results = []
        for req in batch:
            samples = [{"token_ids": [fake_token(req, k, i) for i in range(n)], "text": "", "logprobs": [0.0] * n,
                        "finish_reason": "length", "weight_versions": [(version, n)]}
                       for k in range(params.get("n") or 1)]
            results.append({"index": req.index, **samples[0], "samples": samples, "error": None})
        shard.generated += len(batch)
        return {"shard": shard.slot, "weight_version": version, "results": results, "seconds": 0.0}

    def _make_tokens(self, shard: FakeShard, batch: list, n: int, cancelled: threading.Event) -> None:
        """One token per ``token_s`` of ``self.clock`` for each request of the batch, as an engine
        steps; a cancelled call stops at once (the engine aborts it), a dead shard fails."""
        with self._lock:
            if shard.running == 0:
                shard.steps, shard.last_step_at = 0, self.clock()
            shard.running += len(batch)
        try:
            next_at = self.clock() + shard.token_s
            for i in range(n):
                while self.clock() < next_at:
                    if cancelled.is_set() or shard.dead or shard.stopped:
                        break
                    time.sleep(0.001)
                if cancelled.is_set():
                    raise CancelledByCaller()
                if shard.dead or shard.stopped:
                    raise ShardDiedError(-1 if shard.slot is None else shard.slot, f"ActorDiedError: {shard.dead or 'stopped'}")
                for req in batch:
                    shard.tokens_made[req.index] = i + 1
                shard.steps += 1
                shard.last_step_at = self.clock()
                next_at += shard.token_s
        finally:
            with self._lock:
                shard.running -= len(batch)

    def start_generate(self, handle: ShardHandle, batch: list, params: dict[str, Any]) -> Call:
        shard, cancelled = self.shards[handle.name], threading.Event()
        future = self._serve(shard, lambda: self._generate(shard, batch, params, cancelled))
        future.cancelled_by_caller = cancelled  # type: ignore[attr-defined]
        return Call(handle, "generate", future)

    def start_watch(self, handle: ShardHandle, interval_s: float) -> Call:
        shard = self.shards[handle.name]
        future: Future = Future()
        shard.watchers.append(future)
        if shard.dead:
            self.set_dead(shard.name, shard.dead, shard.actor_dead)
        return Call(handle, "watch", future)

    def start_probe(self, handle: ShardHandle, sampling: dict[str, Any], tokens: list[int], timeout_s: float,
                    warmup_s: float) -> Call:
        shard = self.shards[handle.name]

        def answer():  # the real engine's rule while it is busy; idle: its one real token
            if shard.running:
                return busy_answer(self.clock() - shard.last_step_at, shard.steps, timeout_s, warmup_s)
            return {"ok": True}

        return Call(handle, "probe", self._serve(shard, answer))

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

    def cancel(self, call: Call) -> None:
        call.ref.cancel()
        getattr(call.ref, "cancelled_by_caller", threading.Event()).set()

    def generate_async(self, handle: ShardHandle, batch: list, params: dict[str, Any]) -> "FakePending":
        return FakePending(self.start_generate(handle, batch, params).ref)

    def generate_stream(self, handle: ShardHandle, request: Any, params: dict[str, Any]) -> "FakeStream":
        shard = self.shards[handle.name]
        stream = FakeStream(shard, request, params)
        shard.streams.append(stream)
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


class CancelledByCaller(Exception):
    """What a fake shard's call ends with once its caller cancelled it (Ray's TaskCancelledError)."""


class FakePending:
    """The real ``driver.Pending``'s shape: ``future`` (asyncio), ``cancel()`` ends the call on the shard."""

    def __init__(self, future: Future):
        self._future = future
        self.future = asyncio.wrap_future(future)

    def cancel(self) -> None:
        self.future.cancel()
        self._future.cancelled_by_caller.set()  # type: ignore[attr-defined]


def fake_token(req: Any, k: int, i: int) -> int:
    """Token i of sample k: sample k of a request differs from the others by k (a GRPO group of
    distinct answers)."""
    return (sum(req.prompt_token_ids) + k + i) % VOCAB


class FakeStream:
    """A streamed generate on a fake shard, with the real ``Stream``'s shape: one token per item
    for every sample (the first after the shard's ``slow_s``, the next ``token_s`` apart), each
    stamped with the shard's version as it is made (a refit landing mid-stream shows), then the
    result. A dead shard's stream fails at its next item; a hung one's never answers."""

    def __init__(self, shard: FakeShard, request: Any, params: dict[str, Any]):
        self.shard, self.request = shard, request
        self.tokens = params.get("max_new_tokens") or 4
        self.samples = [{"token_ids": [], "text": "", "logprobs": [], "finish_reason": None, "weight_versions": []}
                        for _ in range(params.get("n") or 1)]
        self.version, self.sent, self.cancelled = shard.weight_version, 0, False

    async def next(self) -> dict[str, Any] | None:
        shard = self.shard
        if self.sent == 0 and shard.busy > 0:
            from vllm.exceptions import QueueOverflowError

            shard.busy -= 1
            shard.refused += 1
            raise QueueOverflowError()
        await asyncio.sleep(shard.slow_s if self.sent == 0 else shard.token_s)
        while shard.hung.is_set() and not shard.dead and not self.cancelled:
            await asyncio.sleep(0.01)
        if shard.dead or shard.stopped or self.cancelled:
            raise ShardDiedError(-1 if shard.slot is None else shard.slot,
                                 f"ActorDiedError: {shard.dead or ('cancelled' if self.cancelled else 'stopped')}")
        if self.sent > self.tokens:
            return None
        if self.sent == self.tokens:
            self.sent += 1
            shard.generated += 1
            result = {"index": self.request.index, **self.samples[0], "samples": self.samples, "error": None}
            return {"result": result, "shard": shard.slot, "weight_version": self.version}
        i, version, deltas = self.sent, shard.weight_version, []
        self.sent += 1
        for k, sample in enumerate(self.samples):
            finish = "length" if i == self.tokens - 1 else None
            sample["token_ids"].append(fake_token(self.request, k, i))
            sample["logprobs"].append(0.0)
            sample["finish_reason"] = finish
            add_span(sample["weight_versions"], version, 1)
            deltas.append({"sample": k, "token_ids": [sample["token_ids"][-1]], "text": "", "logprobs": [0.0],
                           "weight_versions": [[version, 1]], "finish_reason": finish})
        return {"deltas": deltas}

    def cancel(self) -> None:
        self.cancelled = True


def fake_fleet(settings, driver: FakeDriver, watch: bool = True):
    """A ``GenerationFleet`` of ``settings`` whose shards are ``driver``'s (no Ray, no engines)."""
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import resolve_generation

    resolved = resolve_generation(settings, cluster=None)
    started = driver.launch_all(resolved.shards + resolved.spares)
    shards = [h for h in started if h.info.get("slot") is not None]
    spares = [h for h in started if h.info.get("slot") is None]
    return GenerationFleet(resolved, shards, spares=spares, driver=driver, watch=watch)



