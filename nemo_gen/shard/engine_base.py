"""What the sync and the async engine (``nemo_gen.shard.engine_sync``, ``engine_async``) share:
the weights they serve (``Weights``: the version, the labels the engine core stamps on outputs
for it, whether a failed swap left them half-loaded), and ``BaseEngine`` — the admission gate,
the step clock, control RPCs, the liveness probe, and the engine's processes and stats — over
the few methods each engine fills in.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import itertools
import os
import time
from typing import Any, AsyncContextManager, AsyncGenerator

import psutil

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.retry import describe, kind_of
from nemo_gen.core.stream_pace import stream_interval_s
from nemo_gen.core.wire import FailureKind, InFlight, RequestResult, Sampling, StepGaps, StreamDeltas, Unfinished
from nemo_gen.errors import ShardDiedError
from nemo_gen.shard import vllm_compat
from nemo_gen.shard.gate import Gate
from nemo_gen.shard.step_clock import StepClock


class Weights:
    """The weight version an engine serves. Every generated token is counted under the version
    that sampled it: the engine core stamps each step's outputs with a label (it starts as
    "default"; ``label`` makes the one for a new version), and ``version_of`` reads it back.
    Prompts are prefix-cached under a salt of the version, so after a version change no new
    request reuses KV computed by older weights. ``poisoned``: why the weights can no longer be
    trusted (a swap's load broke off)."""

    def __init__(self, version: int | None):
        self.version = version
        self._labels: dict[str, int | None] = {"default": version}
        self.poisoned: str | None = None

    def label(self, version: int | None) -> str:
        label = repr(version)
        self._labels[label] = version
        return label

    def version_of(self, label: Any) -> int | None:
        """The version an output label stands for (no label: the current version)."""
        return self._labels.get(label, self.version)

    @property
    def salt(self) -> str:
        return f"nemo-gen-w{self.version}"

    def check(self) -> None:
        """A request must not run, or return, on weights a failed swap left half-loaded."""
        if self.poisoned is not None:
            raise ShardDiedError(-1, f"weights half-loaded: {self.poisoned}")


def error_result(req: GenerationRequest, exc: BaseException) -> RequestResult:
    """The result of a request vLLM refused."""
    return RequestResult.failed(req.index, f"RequestError: {exc}")


class BaseEngine(abc.ABC):
    """A started vLLM engine (``nemo_gen.shard.engine.Engine.start`` makes one). Subclasses fill in
    how requests run (``_generate``, ``_stream``, ``_busy_probe``), control calls
    (``_collective_rpc``), ``set_version``, the swap (``self.swap``) and ``shutdown``."""

    async_engine: bool

    def __init__(self, llm: Any, load_s: float, version: int | None):
        self._llm = llm
        self.load_s = load_s
        self.weights = Weights(version)
        self.streams = 0  # streams open now (their items' interval grows with them: stream_interval_s)
        # The LoRA adapter ids the engine holds and the weight version they were loaded on
        # (``nemo_gen.shard.adapters``): a request naming another is refused by name.
        self.adapters_held: tuple[frozenset[int], int | None] = (frozenset(), None)
        # Refit needs the engine to itself: no request may run on half-loaded weights.
        self.gate = Gate()
        self.clock = StepClock()
        self._rpc_lock = asyncio.Lock()  # one control message at a time on the engine's queue
        self._rpc_active = 0
        self._ids = itertools.count()
        self.swap: Any = None  # set by the subclass: begin_swap / end_swap
        config = self._front().model_config
        self.max_model_len = config.max_model_len
        self.dtype = str(config.dtype).removeprefix("torch.")

    # -- filled in by each engine ---------------------------------------------------------------

    @abc.abstractmethod
    def _front(self) -> Any:
        """vLLM's engine object with the output processor, model config and stats."""
        ...

    @abc.abstractmethod
    async def _generate(self, requests: list[GenerationRequest], params: Any) -> list[RequestResult]:
        ...

    @abc.abstractmethod
    def _stream(self, req: GenerationRequest, params: Any) -> AsyncGenerator[StreamDeltas | RequestResult, None]:
        ...

    @abc.abstractmethod
    def _busy_probe(self, stall_s: float, warmup_s: float) -> dict[str, Any] | None:
        """A probe's answer from the engine's progress while it is busy; None: try a real token."""
        ...

    @abc.abstractmethod
    async def _collective_rpc(self, method: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        ...

    @abc.abstractmethod
    async def set_version(self, version: int | None) -> None:
        ...

    @abc.abstractmethod
    def progress(self, known: dict[str, int]) -> tuple[Any, ...]:
        """Checkpoints of the running requests the driver keyed (``nemo_gen.shard.progress``)."""
        ...

    @abc.abstractmethod
    def shutdown(self, grace_s: float) -> None:
        ...

    @property
    @abc.abstractmethod
    def generating(self) -> bool:
        ...

    # -- shared ------------------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self.weights.version

    @property
    def steps_made(self) -> int:
        """The engine's progress while ``generating``: the sync batch's steps, or the async
        engine's outputs since it was last idle."""
        return self.clock.steps

    @property
    def last_step_at(self) -> float:
        return self.clock.last_step_at

    async def generate(self, requests: list[GenerationRequest], sampling: Sampling) -> list[RequestResult]:
        """One result per request, in order. A request vLLM rejects gets an ``error`` result;
        the others still run. Their text is left to the caller (``nemo_gen.fleet.decode``): a
        batch's results are read whole, so decoding each once there costs a fraction of
        decoding every token here as it comes."""
        params = vllm_compat.sampling_params(sampling, text=False)
        async with self.gate.serving():
            return await self._generate(requests, params)

    async def stream(self, req: GenerationRequest, sampling: Sampling) -> AsyncGenerator[StreamDeltas | RequestResult, None]:
        """One request as it is generated (``nemo_gen.shard.streaming``): ``StreamDeltas``
        items, per sample the tokens since the last item with the versions that sampled them,
        then the ``RequestResult``, what ``generate`` returns for it. Steps made while the reader
        was busy come merged in one item. A refit under ``keep``/``abort`` may cut and resume
        the request mid-stream: the stream goes on, under the new version. Closing the iterator
        early aborts the request in the engine."""
        params = vllm_compat.output_kind(vllm_compat.sampling_params(sampling), final_only=False)
        async with self.gate.serving():
            inner = self._stream(req, params)
            self.streams += 1  # their items come further apart (nemo_gen.core.stream_pace)
            try:
                async with contextlib.aclosing(inner):
                    async for item in inner:
                        yield item
                        if isinstance(item, StreamDeltas):  # what the engine makes meanwhile waits, merged
                            await asyncio.sleep(stream_interval_s(self.streams))
            finally:
                self.streams -= 1

    def exclusive(self) -> AsyncContextManager[None]:
        """Wait for in-flight requests to finish and hold new ones back until the block ends."""
        return self.gate.exclusive()

    async def hold(self) -> None:
        """``exclusive`` for a refit driven call by call from outside (vLLM's weight-sync
        protocol): requests wait from here until ``release``."""
        await self.gate.hold()

    async def release(self) -> None:
        await self.gate.release()

    async def begin_swap(self) -> None:
        """Freeze the running requests (they keep their KV cache) so weights can be loaded under
        them; new requests wait until ``end_swap`` (``nemo_gen.shard.swap``)."""
        await self.swap.begin()

    async def end_swap(self, version: int | None, in_flight: InFlight, failed: str | None = None) -> None:
        """The weights are ``version`` now (unchanged when None): cut what the mode says —
        every running request (``abort``), or those with more than ``max_staleness`` tokens
        from older weights (``keep``) — resume, let new requests in. ``recompute_kv`` (NeMo-RL's
        ``recompute_kv_cache_after_weight_updates``): every running request's KV is recomputed
        on the new weights as it resumes, and the prefix cache is emptied. ``failed``: the load
        broke off, the weights are half-loaded: every running request is aborted and fails (the
        fleet re-routes it), and so does every later one."""
        await self.swap.end(version, in_flight.mode, in_flight.resume_aborted, in_flight.max_staleness,
                            in_flight.recompute_kv, failed)

    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """``collective_rpc`` on every worker of this engine (metadata only, never tensors)."""
        self._rpc_active += 1
        try:
            return await self._collective_rpc(method, args, timeout)
        finally:
            self._rpc_active -= 1

    async def sleep(self, level: int) -> None:
        """vLLM's sleep (the engine started with enable_sleep_mode; its requests were drained, so
        "wait" has nothing to wait for). The prefix cache goes first, as NeMo-RL's sleep does:
        cached blocks would point into a KV cache the sleep drops."""
        if self.async_engine:
            await self._llm.reset_prefix_cache()
            await self._llm.sleep(level=level, mode="wait")
        else:
            await asyncio.to_thread(self._llm.reset_prefix_cache)
            await asyncio.to_thread(self._llm.sleep, level, "wait")

    async def reset_prefix_cache(self) -> bool:
        if self.async_engine:
            return bool(await self._llm.reset_prefix_cache())
        return bool(await asyncio.to_thread(self._llm.reset_prefix_cache))

    async def wake(self, tags: list[str]) -> None:
        if self.async_engine:
            await self._llm.wake_up(tags=tags)
        else:
            await asyncio.to_thread(self._llm.wake_up, tags)

    def step_gaps(self, reset: bool) -> StepGaps:
        """The longest time the engine went without finishing a step (sync engine) since the
        last reset, and each longer stretch as (start, end) monotonic seconds (``StepClock.gaps``)."""
        return self.clock.gaps(reset)

    async def probe(self, sampling: Sampling, token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]:
        """Is the engine generating? Idle: generate one real token. Busy (a batch on the sync
        engine, which runs one at a time; requests on the async one): it is alive if it made a
        step (sync) or an output (async) within ``stall_s`` — or within ``warmup_s`` before its
        first one (a prefill) — however long its requests run: busy and slow are not dead.
        During a refit or control RPC the answer is ``skipped`` (the engine is held on purpose)."""
        if self.gate.held or self._rpc_active:
            return {"ok": True, "skipped": "refit or control call in progress"}
        if self.weights.poisoned is not None:
            return {"ok": False, "error": f"weights half-loaded: {self.weights.poisoned}"}
        if (answer := self._busy_probe(stall_s, warmup_s)) is not None:
            return answer
        t0 = time.monotonic()
        try:
            (out,) = await self.generate([GenerationRequest(index=0, prompt_token_ids=token_ids)], sampling)
        except Exception as exc:
            if kind_of(exc) is FailureKind.BUSY:  # its queue is full: a frontend that answers is alive
                return {"ok": True, "busy": True, "refused": describe(exc)}
            raise
        if out.error:
            return {"ok": False, "error": out.error}
        return {"ok": True, "seconds": time.monotonic() - t0}

    def unfinished(self) -> Unfinished:
        """vLLM's own account of the requests this engine holds (its output processor's state,
        which an abort removes at once): (engine request id, tokens generated so far)."""
        return vllm_compat.unfinished(self._front())

    def vllm_metrics(self) -> list[dict[str, Any]]:
        """vLLM's own stats of this engine (its Prometheus series: prefix-cache queries and hits,
        time to first token, running requests, ...) as plain dicts; empty unless stats are on
        (``generation.vllm_cfg.enable_vllm_metrics_logger``)."""
        return vllm_compat.metrics(self._front())

    async def core_exit(self, wait_s: float) -> int | None:
        """How the EngineCore process ended: its exit code (negative: the signal that killed it),
        waiting up to ``wait_s`` for it to end; None while it runs, or when vLLM keeps no process
        of it. Read from vLLM's own process handles (``vllm_compat.core_exit_codes``)."""
        deadline = time.monotonic() + wait_s
        while True:
            ended = [c for c in vllm_compat.core_exit_codes(self._front()) if c is not None]
            if ended or time.monotonic() >= deadline:
                return ended[0] if ended else None
            await asyncio.sleep(0.05)

    def child_pids(self) -> list[int]:
        """PIDs of the processes vLLM started for this engine (EngineCore, workers), not the
        helpers that start them (``engine_start.helper_pids``)."""
        from nemo_gen.shard.engine_start import helper_pids

        try:
            children = psutil.Process(os.getpid()).children(recursive=True)
        except psutil.Error:
            return []
        helpers = helper_pids()
        return sorted(p.pid for p in children if p.pid not in helpers)
