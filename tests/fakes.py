"""The fleet-logic tier's driver: the real ``ShardDriver`` over the in-process transport
(``nemo_gen.fleet.transport_local``), which hosts real shards (``nemo_gen.shard.host.ShardHost`` around
``nemo_gen.shard.rules.Shard``, what the Ray actor runs) in this process, each over a ``FakeEngine`` that
dies, hangs or slows down on command (``FakeTransport``). So routing, re-routing, spare promotion,
quarantine and refit settling are tested in milliseconds against the shard's own rules and the driver's
own fan-out, deadlines and outcome mapping, not a copy of them: a dead shard's calls fail with
``ShardDiedError``, a hung one's never answer, a slow one's answer late. The same paths are tested on
real vLLM engines in tests/engine/.

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

Like a Ray async actor, every shard's calls run on one event loop (the transport's own thread), so a
probe answers while a batch generates. A shard generating with ``token_s`` makes its tokens one by one
on ``driver.clock`` and stops when its call is cancelled (``tokens_made`` says how far each request
got); its probes answer by the real engine's liveness rule (``nemo_gen.core.liveness``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Mapping

from nemo_gen.core import wire
from nemo_gen.core.liveness import busy_answer
from nemo_gen.core.wire import (
    InFlight, RequestResult, SampleDelta, SampleResult, Sampling, StepGaps, StreamDeltas,
    StreamEnd, Unfinished,
)
from nemo_gen.errors import ShardDiedError
from nemo_gen.core.migration import add_span
from nemo_gen.shard.gate import Gate
from nemo_gen.fleet.driver import DriverTimeouts, ShardDriver
from nemo_gen.fleet.handles import ShardHandle, ShardSpec
from nemo_gen.fleet.transport import Found
from nemo_gen.fleet.transport_local import InProcessTransport, LocalStream
from nemo_gen.shard.progress import checkpoint
from nemo_gen.shard.rules import Shard

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
        self.corrupt_staged: str | None = None  # this tensor reads here with other bytes than staged
        self.fail_load: str | None = None  # a failure while loading them
        self.adapters: set[int] = set()  # the LoRA adapter ids its workers hold
        self.refuse_adapter: str | None = None  # a failure while loading an adapter
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
        self.sleeps: list[tuple[int, int]] = []  # each vLLM sleep: (level, requests running then)
        self.wakes: list[list[str]] = []  # the tags of each wake_up it got
        self.fail_sleep: str | None = None  # vLLM's sleep raises this
        self.swaps = 0  # keep / abort swaps begun (vLLM's pause_scheduler under a running batch)
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
            self._check_digests(*args)
            return [1]
        if method in ("nemo_gen_load_staged", "nemo_gen_weight_update", "update_weights",
                      "nemo_gen_update_weights_via_ipc_zmq"):
            if self.fail_load:
                raise RuntimeError(self.fail_load)
            return [0.001]
        if method == "nemo_gen_expected_manifest":
            return [{"tensors": dict(self._manifest), "optional": [], "available": args[0] == "policy", "shared": []}]
        if method == "nemo_gen_lora_modules":
            return [{"supported": ["q_proj", "v_proj"], "max_rank": 8, "capacity": 4, "held": sorted(self.adapters)}]
        if method == "nemo_gen_load_adapter":  # (path, total, entries, config, engine_id, evict)
            engine_id, evict = args[4], args[5]
            if self.refuse_adapter:
                raise ValueError(self.refuse_adapter)
            self.adapters = (self.adapters - set(evict)) | {engine_id}
            return [sorted(self.adapters)]
        if method == "nemo_gen_remove_adapters":
            self.adapters -= set(args[0])
            return [sorted(self.adapters)]
        if method in ("init_weight_transfer_engine", "start_weight_update", "start_draft_weight_update",
                      "finish_weight_update", "shutdown_weight_transfer_engine"):
            return [None]
        raise AssertionError(f"the fake engine has no RPC {method!r}")

    def _check_digests(self, path: str, total: int, entries: list, digests: list = ()) -> None:
        """The real worker's digest check (``nemo_gen_check_staged``) on the real staging file."""
        if not digests:
            return
        from nemo_gen.core.digest import first_mismatch
        from nemo_gen.vllm_ext.digest import tensor_digests
        from nemo_gen.vllm_ext.worker_ext import open_staged

        got = tensor_digests(t for _, t in open_staged(path, total, entries))
        names = [e[0] for e in entries]
        if self.corrupt_staged in names:
            got[names.index(self.corrupt_staged)] ^= 1
        problem = first_mismatch(names, list(digests), got)
        if problem:
            raise ValueError(problem)

    def exclusive(self):
        return self.gate.exclusive()

    async def hold(self) -> None:
        await self.gate.hold()

    async def release(self) -> None:
        await self.gate.release()

    async def set_version(self, version: int | None) -> None:
        self.version = version

    async def begin_swap(self) -> None:
        self.swaps += 1
        await self.gate.claim()  # as the real swap (``nemo_gen.shard.swap``): new requests wait
        self._frozen = True

    async def end_swap(self, version: int | None, in_flight: InFlight, failed: str | None = None) -> None:
        if failed is not None:
            self.poisoned = failed
        if version is not None:
            self.version = version
        self._frozen = False
        await self.gate.release()

    async def sleep(self, level: int) -> None:
        if self.fail_sleep:
            raise RuntimeError(self.fail_sleep)
        self.sleeps.append((int(level), self.running))  # (the level, requests running as it fell asleep)
        self.rpcs.append("reset_prefix_cache")

    async def wake(self, tags: list[str]) -> None:
        self.wakes.append(list(tags))

    async def reset_prefix_cache(self) -> bool:
        self.rpcs.append("reset_prefix_cache")
        return not self.running  # vLLM's answer: no reset while requests run

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


# The shard calls that carry a refit or sleep message (``ShardDriver.fan_out``): noted in ``remote_calls``.
_REFIT_CALLS = frozenset({"check_refit", "load_refit", "weight_sync", "adapter_call", "sleep", "wake", "reset_prefix_cache"})


class FakeTransport(InProcessTransport):
    """The real in-process transport, hosting each shard over a ``FakeEngine`` with the faults its
    test sets (``FakeDriver``'s ``set_*``): a dead shard's calls fail, a hung one's never answer,
    a slow one's answer late, and nothing that crosses holds a dict."""

    def __init__(self, fake: "FakeDriver"):
        super().__init__(engines=self._refuse_bare_launch, node_ip="127.0.0.1")
        self.fake = fake

    @staticmethod
    def _refuse_bare_launch(spec: ShardSpec) -> FakeEngine:
        raise AssertionError("FakeTransport.launch builds its engines itself")

    def launch(self, spec: ShardSpec) -> ShardHandle:
        fake = self.fake
        with fake._lock:
            fake.launched.append(spec)
            failure = fake.launch_failures.pop(0) if fake.launch_failures else None
        if failure is not None:
            raise failure
        engine = FakeEngine(spec.actor_name, spec.weight_version, fake.manifest, lambda: fake.clock(),
                            keeps_stats=not spec.engine_kwargs.get("disable_log_stats", True))
        handle = self.host(spec, engine, "fake")
        engine.rules = self.hosts[spec.actor_name].shard
        fake.crosses("start", "answer", handle.info)
        fake.shards[engine.name] = engine
        return handle

    def find(self, fleet: str, namespace: str) -> list[Found]:
        engines = self.fake.shards
        return [f for f in super().find(fleet, namespace) if not engines[f.name].dead and not engines[f.name].stopped]

    def call(self, actor: Any, method: str, *args: Any) -> Future:
        engine = self.fake.shards[actor]
        if method == "watch":  # fires when the test kills the shard (``set_dead``)
            future: Future = Future()
            engine.watchers.append(future)
            if engine.dead:
                self.fake.set_dead(engine.name, engine.dead, engine.actor_dead)
            return future
        self.fake.crosses(method, "arguments", args)
        if method in _REFIT_CALLS:
            self.fake.remote_calls.append((actor, method, args[0]))
        return super().call(actor, method, *args)

    async def serve(self, actor: Any, method: str, args: tuple) -> Any:
        """As the actor would: failing if dead, never while hung, late if slow."""
        engine = self.fake.shards[actor]
        while engine.hung.is_set() and not engine.dead:
            await asyncio.sleep(0.01)
        if engine.slow_s:
            await asyncio.sleep(engine.slow_s)
        if (gone := engine.gone()) is not None:
            raise gone
        out = await super().serve(actor, method, args)
        self.fake.crosses(method, "answer", out)
        return out

    def stream(self, actor: Any, request: Any, sampling: Sampling) -> "FakeStream":
        engine, fake = self.fake.shards[actor], self.fake
        fake.crosses("generate_stream", "arguments", (request, sampling))
        stream = FakeStream(engine, self.hosts[actor].generate_stream(request, sampling), self.loop,
                            lambda item: fake.crosses("generate_stream", "item", item))
        engine.streams.append(stream)
        return stream

    def kill(self, handle: ShardHandle) -> None:
        engine = self.fake.shards[handle.name]
        engine.stopped = True  # its calls fail from now on (``FakeEngine.gone``), as a killed actor's
        engine.hung.clear()


class FakeDriver(ShardDriver):
    """The real ``ShardDriver`` over a ``FakeTransport``; see the module doc. ``manifest``: what
    every engine says its weights are."""

    def __init__(self, manifest: dict[str, tuple[tuple[int, ...], str]] | None = None,
                 timeouts: DriverTimeouts = DriverTimeouts(control_s=0.5, stop_s=0.5, engine_grace_s=0.1, refit_s=1.0)):
        self.manifest = manifest or {"w": ((4, 4), "float32"), "b": ((4,), "float32")}
        self.shards: dict[str, FakeEngine] = {}
        self.launched: list[ShardSpec] = []
        self.launch_failures: list[BaseException | None] = []  # the next launches: raise this, or (None) start
        self.remote_calls: list[tuple[str, str, Any]] = []  # (actor, method, message) of each refit call
        self.wire_violations: list[str] = []  # dicts that crossed the actor boundary (``crosses``)
        self._lock = threading.Lock()
        self.clock = time.monotonic  # the shards' time: token_s, the probes' step ages
        # No direct line unless a test opens one: its calls go over the in-process transport.
        super().__init__(timeouts, channels=False, transport=FakeTransport(self))

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The shards' event loop, as a Ray async actor has one: calls on a shard interleave there."""
        return self.transport.loop

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
        self.transport.close()
        assert not self.wire_violations, self.wire_violations

    def crosses(self, method: str, what: str, value: Any) -> None:
        """``value`` crosses the actor boundary: fail on any dict in it (and note it for ``close``)."""
        found = [] if what == "answer" and method in VLLM_OWNED_ANSWERS else dicts_in(value)
        if found:
            message = f"a dict crossed the actor boundary in {method}'s {what}: at {', '.join(found)}"
            self.wire_violations.append(message)
            raise AssertionError(message)


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


def fake_token(req: Any, k: int, i: int) -> int:
    """Token i of sample k: sample k of a request differs from the others by k (a GRPO group of
    distinct answers). A migrated sample's continuation (``continues``) makes its tokens as the
    request it continues would have (its prompt less the kept tokens): a greedy engine's rule."""
    c = req.continues or 0
    k = k if req.continues is None else req.sample
    return (sum(req.prompt_token_ids[:len(req.prompt_token_ids) - c]) + k + i) % VOCAB


class FakeStream(LocalStream):
    """A streamed generate on a fake shard: the in-process transport's stream (the shell's real
    ``generate_stream`` over its ``FakeEngine``, run to its end whether read or not), with the
    faults: a dead shard's stream fails at its next item; a hung one's never answers; ``cancel()``
    ends it on the shard (its engine stops). ``sent``: the items read."""

    def __init__(self, engine: FakeEngine, items: Any, loop: asyncio.AbstractEventLoop,
                 check: Callable[[Any], None] = lambda item: None):
        self.engine = engine
        super().__init__(items, loop, check)

    async def _next(self) -> StreamDeltas | StreamEnd | None:
        engine = self.engine
        while engine.hung.is_set() and not engine.dead and not self.cancelled:
            await asyncio.sleep(0.01)
        if self.cancelled:
            raise ShardDiedError(-1, "ActorDiedError: cancelled")
        # The actor gone: its call fails at once. Only its engine: the shard's stream says so.
        if (gone := engine.gone()) is not None and (engine.actor_dead or engine.stopped):
            raise gone
        return await super()._next()


def fake_fleet(settings, driver: FakeDriver, watch: bool = True):
    """A ``GenerationFleet`` of ``settings`` whose shards are ``driver``'s (no Ray, no engines)."""
    from nemo_gen.fleet.fleet import GenerationFleet
    from nemo_gen.fleet.resolve import resolve_generation

    resolved = resolve_generation(settings, cluster=None)
    started = driver.launch_all(resolved.shards + resolved.spares)
    shards = [h for h in started if h.info.slot is not None]
    spares = [h for h in started if h.info.slot is None]
    from nemo_gen.server import serve

    return serve(GenerationFleet(resolved, shards, spares=spares, driver=driver, watch=watch))



