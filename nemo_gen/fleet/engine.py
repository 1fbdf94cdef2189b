"""One vLLM engine inside a shard actor: start it, generate with per-request errors, stop it.

This is the only module that imports vLLM. Both of vLLM's engines are hidden behind one
``async`` surface: the sync ``vllm.LLM`` (best batch throughput) runs in a worker thread under a
lock, the ``AsyncLLM`` (``vllm_cfg.async_engine``) serves concurrent requests natively.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import os
import threading
import time
import uuid
from typing import Any, AsyncIterator, Callable

import psutil

from nemo_gen.core.liveness import busy_answer
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.retry import describe, kind_of
from nemo_gen.errors import ShardDiedError
from nemo_gen.fleet.batch import Piece, Track, prompt_entries, sampled_by, spans_between, top_entries
from nemo_gen.fleet.streaming import Cursor, merge


def sampling_params(s: dict[str, Any]):
    """vLLM ``SamplingParams`` from a resolved sampling dict (``nemo_gen.core.sampling``)."""
    from vllm import SamplingParams

    top_k = s.get("top_k")
    structured = None
    if s.get("structured_outputs"):
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(**s["structured_outputs"])
    return SamplingParams(
        max_tokens=s["max_new_tokens"],
        n=s.get("n") or 1,
        temperature=float(s["temperature"]),
        top_p=float(s["top_p"]),
        top_k=-1 if top_k is None else top_k,
        stop=list(s["stop_strings"]) if s.get("stop_strings") else None,
        stop_token_ids=list(s["stop_token_ids"]) if s.get("stop_token_ids") else None,
        bad_words=list(s["bad_words"]) if s.get("bad_words") else None,
        seed=s.get("seed"),
        ignore_eos=bool(s.get("ignore_eos") or False),
        # logprobs=0: the logprob of the sampled token only, which is what RL losses need.
        logprobs=s.get("logprobs") or 0,
        prompt_logprobs=s.get("prompt_logprobs"),
        structured_outputs=structured,
    )


# Stretches without a step longer than this are kept (step_gaps): a decode step takes ~1 ms here.
_GAP_S = 0.005

# A stream hands out what its request made at most this often (the first token at once): steps in
# between are merged into one item. Each item costs the shard actor and the driver CPU (a Ray
# object, a chunk): one per decode step (~2 ms here) made a lone 300-token stream take 730-950 ms
# against 490-540 ms unstreamed on 2 cores; one per 10 ms, 640-690 ms.
STREAM_INTERVAL_S = 0.01

# One greedy token: the warm-up generation of a fresh engine.
_WARMUP = {"max_new_tokens": 1, "temperature": 0.0, "top_p": 1.0, "top_k": None, "stop_strings": None,
           "stop_token_ids": None, "seed": None, "ignore_eos": True}


def _freeze_heap() -> None:
    """Exempt every object alive now (the imports of vLLM, torch, Ray: ~660k here) from the
    garbage collector's scans, as vLLM's own API server does once it is up (``freeze_gc_heap``).
    The engine's output processing in this process allocates per request per step, so full
    collections come every batch, and each one walked that whole heap: 0.7-0.9 s of a 4 s batch of
    512 requests on a CPU engine, frozen 0.14-0.21 s (bench/front_end.py); on an H200, where this
    process's output processing is what bounds a batch, 1.5 s of a bare vLLM's 4 s batch
    (bench/results/2026-12-02-h200-b.md). Objects made later are collected as usual."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


def _sample_dict(comp, spans: list[tuple[int | None, int]], top: bool = False) -> dict[str, Any]:
    """One finished (cumulative) completion output as a sample of a result; ``spans``: its
    tokens by the version that sampled them; ``top``: with each token's alternatives."""
    token_ids = list(comp.token_ids)
    logprobs = [float(lp[tok].logprob) for tok, lp in zip(token_ids, comp.logprobs)] if comp.logprobs else []
    out = {"token_ids": token_ids, "text": comp.text if comp.text is not None else None, "logprobs": logprobs,
           "finish_reason": comp.finish_reason, "weight_versions": spans}
    if top:
        out["top_logprobs"] = top_entries(comp.logprobs)
    return out


def _samples_of(processor: Any, internal: str) -> tuple[Any, list[str]]:
    """The sync engine's request ``internal`` as vLLM's output processor runs it: (its
    ParentRequest, or None for n = 1; the ids of its samples' requests, "{i}_{parent id}" for n > 1)."""
    parent = processor.parent_requests.get(internal)
    return parent, [internal] if parent is None else [f"{i}_{internal}" for i in range(parent.n)]


def _error_dict(req: GenerationRequest, exc: BaseException) -> dict[str, Any]:
    return {"index": req.index, "error": f"RequestError: {exc}"}


class Engine:
    """A started vLLM engine. Construct with ``await Engine.start(kwargs, async_engine, version)``.

    ``version`` is the weight version the engine holds (the shard actor sets it after each
    refit): every generated token is counted under the version that sampled it, and prompts are
    prefix-cached under a salt of their version, so after a version change no new request reuses
    KV computed by older weights. A refit with ``in_flight`` ``keep`` or ``abort`` swaps the
    weights while requests run (``begin_swap`` / ``end_swap``): the sync engine's batch is cut
    and resumed as ``nemo_gen.fleet.batch`` says; the async engine's requests are frozen by vLLM's
    own pause and, where the mode says, preempted so that their KV is recomputed on the new
    weights. On both, vLLM labels each step's outputs with the version that sampled them."""

    def __init__(self, llm: Any, async_engine: bool, load_s: float, version: int | None):
        self._llm = llm
        self.async_engine = async_engine
        self.load_s = load_s
        # The weight version, and the label the engine core stamps on each step's outputs for it:
        # the core starts as "default"; ``set_version`` sends it a new one.
        self._version = version
        self._labels: dict[str, int | None] = {"default": version}
        self._step_label: str | None = None  # the label of the outputs the step thread got last
        self._pause: concurrent.futures.Future | None = None  # a swap's pause, until its resume
        self._lock = asyncio.Lock()  # the sync LLM is not re-entrant
        self._rpc_lock = asyncio.Lock()
        # Refit needs the engine to itself: no request may run on half-loaded weights.
        self._inflight = 0
        self._idle = asyncio.Condition()
        self._exclusive = False
        self._ids = itertools.count()
        # Liveness evidence for probes: when the (sync) engine is busy with a batch, the time
        # of its last completed step says whether it is generating or wedged.
        self._generating = False
        self._rpc_active = 0
        self.last_step_at = time.monotonic()
        # The async engine's evidence of progress: its requests running now, and whether any
        # output came since it was last idle (the time of the last is ``last_step_at``).
        self._async_active = 0
        self._async_outputs = 0
        self._async_running: set[str] = set()  # the async engine's requests, by the id they were added with
        # Steps completed in the running batch: its first (the prefill of the whole batch, and
        # on a fresh engine kernel selection for new shapes) can take far longer than a decode
        # step without the engine being wedged.
        self.batch_steps = 0
        # The longest time without a finished step since the last reset (a refit's stall on
        # generation, as bench/refit_inflight.py measures it), and when the last step finished.
        self.max_step_gap = 0.0
        self._last_step_end: float | None = None
        # Stretches without a finished step longer than _GAP_S, as (start, end) on the machine's
        # monotonic clock, so a benchmark can tell which ones a refit caused.
        self._gaps: collections.deque[tuple[float, float]] = collections.deque(maxlen=4096)
        # In-flight refit of the sync engine: the running batch's requests by engine id, whether a
        # swap is under way, and why the weights can no longer be trusted (a failed swap).
        self._tracks: dict[str, Track] = {}
        self._swapping = False
        self._poisoned: str | None = None
        self._parked = threading.Event()  # the step thread waits in get_output
        # A streamed request's batch: called after each step (and a swap's cut) with its tracks;
        # set: the batch's reader is gone, the step thread aborts it after the current step.
        self._on_step: Callable[[], None] | None = None
        self._stop = threading.Event()
        self._orphans: set[asyncio.Future] = set()  # batches whose stream was closed, still stopping
        if not async_engine:
            self._instrument_core()
        self.max_model_len = self._model_config().max_model_len
        self.dtype = str(self._model_config().dtype).removeprefix("torch.")

    @classmethod
    async def start(cls, kwargs: dict[str, Any], async_engine: bool, version: int | None,
                    started: float | None = None) -> "Engine":
        """``started``: when the caller began starting it (``time.monotonic()``), if before this
        call: ``load_s`` counts from there (the shard imports vLLM before it calls this)."""
        t0 = time.monotonic() if started is None else started
        if async_engine:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        else:
            from vllm import LLM

            llm = await asyncio.to_thread(LLM, **kwargs)
        engine = cls(llm, async_engine, time.monotonic() - t0, version)
        # One token before the engine counts as up: its first step (kernel selection for the
        # decode shapes) is paid here, not by the first probe, which would time out on it.
        (out,) = await engine.generate([GenerationRequest(index=0, prompt_token_ids=[1, 1])], _WARMUP)
        if out.get("error"):
            raise RuntimeError(f"the engine's warm-up generation failed: {out['error']}")
        _freeze_heap()
        engine.load_s = time.monotonic() - t0
        return engine

    def _model_config(self):
        if self.async_engine:
            return self._llm.model_config
        return self._llm.llm_engine.model_config

    def _instrument_core(self) -> None:
        """Two guards on the sync engine's core client: its input socket is used by the step
        thread (aborts on stop strings) and by a swap's control calls, so sends take a lock (zmq
        sockets are not thread-safe); and the step thread marks when it waits for output, which
        is how a swap that cuts requests knows every output sampled before the pause has been
        counted; it also keeps the version label of each step's outputs for the step loop."""
        core = self._llm.llm_engine.engine_core
        send, get, lock, parked = core._send_input, core.get_output, threading.Lock(), self._parked

        def locked_send(*args, **kwargs):
            with lock:
                return send(*args, **kwargs)

        def marked_get():
            parked.set()
            try:
                outputs = get()
            finally:
                parked.clear()
            self._step_label = outputs.weight_version
            return outputs

        core._send_input, core.get_output = locked_send, marked_get

    @property
    def generating(self) -> bool:
        """Requests are running: the sync engine's batch, or any of the async engine's."""
        return self._async_active > 0 if self.async_engine else self._generating

    @property
    def steps_made(self) -> int:
        """The engine's progress while ``generating``: the sync batch's steps, or the async
        engine's outputs since it was last idle."""
        return self._async_outputs if self.async_engine else self.batch_steps

    @property
    def version(self) -> int | None:
        return self._version

    async def set_version(self, version: int | None) -> None:
        """The engine serves ``version`` from now on. Its core is told (vLLM's
        ``set_weight_version``), so that the outputs of every later step carry its label:
        messages reach the core in order, so each step after this one is counted under
        ``version``. The sync engine's label is sent, not waited for (its requests are added
        after it, by the step thread); the async engine's is awaited, so that no request added
        from this loop can overtake it."""
        self._version = version
        if self.async_engine:
            await self._llm.engine_core.set_weight_version_async(self._label(version))
        else:
            self._send_label(version)

    def _label(self, version: int | None) -> str:
        label = repr(version)
        self._labels[label] = version
        return label

    def _send_label(self, version: int | None) -> concurrent.futures.Future:
        """Tell the sync engine's core to label later steps' outputs with ``version``."""
        return self._send_utility("set_weight_version", self._label(version))

    def _version_of(self, label: str | None) -> int | None:
        """The version an output label stands for (no label: the engine's current version)."""
        return self._labels.get(label, self._version)

    @property
    def _salt(self) -> str:
        return f"nemo-gen-w{self.version}"

    async def generate(self, requests: list[GenerationRequest], sampling: dict[str, Any]) -> list[dict]:
        """One result dict per request, in order. A request vLLM rejects gets an ``error`` entry;
        the others still run."""
        params = sampling_params(sampling)
        async with self._serving():
            if self.async_engine:
                return list(await asyncio.gather(*(self._generate_async(r, params) for r in requests)))
            return await self._batch(requests, params)

    async def _batch(self, requests: list[GenerationRequest], params: Any,
                     on_step: Callable[[list[Track]], None] | None = None,
                     stop: threading.Event | None = None) -> list[dict]:
        """One batch on the sync engine (one at a time). ``on_step(tracks)`` runs after each step;
        ``stop`` set: the batch is aborted after the current step (its unfinished samples end
        with "abort")."""
        async with self._lock:
            # Busy from here on: a probe judges liveness by the age of the last step, and
            # the batch's own enqueueing must not count against it.
            self._generating = True
            self.last_step_at = time.monotonic()
            self._stop = stop or threading.Event()
            work = asyncio.ensure_future(asyncio.to_thread(self._generate_sync, requests, params, on_step))
            try:
                return await asyncio.shield(work)
            except asyncio.CancelledError:
                # The caller gave up (a cancelled request, a passed deadline): the step thread
                # aborts the batch after its current step, and the engine is held until it has
                # let go of it, so no other batch steps the engine beside it.
                self._stop.set()
                while not work.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(work)
                raise
            finally:
                self._generating = False
                self._tracks = {}
                self._on_step = None

    async def stream(self, req: GenerationRequest, sampling: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """One request as it is generated (``nemo_gen.fleet.streaming``): ``{"deltas": [...]}``
        items, per sample the tokens since the last item with the versions that sampled them,
        then ``{"result": ...}``, what ``generate`` returns for it. Steps made while the reader
        was busy come merged in one item. On the sync engine a refit under ``keep``/``abort``
        may cut and resume the request mid-stream: the stream goes on, under the new version.
        Closing the iterator early aborts the request in the engine."""
        from vllm.sampling_params import RequestOutputKind

        params = sampling_params(sampling)
        params.output_kind = RequestOutputKind.DELTA
        async with self._serving():
            inner = self._stream_async(req, params) if self.async_engine else self._stream_sync(req, params)
            async with contextlib.aclosing(inner):
                async for item in inner:
                    yield item
                    if "deltas" in item:  # what the engine makes meanwhile waits, merged
                        await asyncio.sleep(STREAM_INTERVAL_S)

    async def _stream_async(self, req: GenerationRequest, params: Any) -> AsyncIterator[dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        rid = f"nemo-gen-{next(self._ids)}"
        track = Track.start(req, params, rid, rid)
        cursor = Cursor(track)
        self._check_weights()
        outputs = self._llm.generate(TokensPrompt(prompt_token_ids=req.prompt_token_ids, cache_salt=self._salt),
                                     params, rid)
        made: dict[int, int] = {}  # tokens told so far, by sample

        def spans_of(comp) -> list[tuple[int | None, int]]:
            # A delta's tokens by the label of the step that sampled each (a refit under keep or
            # abort lands between two steps of a running request).
            lo = made.get(comp.index, 0)
            made[comp.index] = hi = lo + len(comp.token_ids)
            if comp.weight_versions is not None:  # the last one: vLLM's spans over the whole sample
                starts = [(s.version, s.start) for s in comp.weight_versions]
            else:
                state = self._sample_states(rid).get(comp.index)
                starts = list(state.weight_version_starts) if state is not None else []
            return [(self._version_of(label), n) for label, n in spans_between(starts, lo, hi)]

        self._async_running.add(rid)
        try:
            with self._progress():
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        self._progressed()
                        track.observe(rid, out, spans_of)
                        if deltas := cursor.deltas():
                            yield {"deltas": deltas}
        except (ValueError, TypeError) as exc:  # vLLM refused the request
            yield {"result": _error_dict(req, exc)}
            return
        finally:
            self._async_running.discard(rid)
        self._check_weights()
        if track.result is None:
            raise RuntimeError(f"vLLM's output for request {req.index} ended before it finished")
        yield {"result": track.result}

    async def _stream_sync(self, req: GenerationRequest, params: Any) -> AsyncIterator[dict[str, Any]]:
        loop, queue, stop = asyncio.get_running_loop(), asyncio.Queue(), threading.Event()
        cursors: list[Cursor] = []

        def on_step(tracks: list[Track]) -> None:  # the step thread, or a swap's cut while it is parked
            if tracks and not cursors:
                cursors.append(Cursor(tracks[0]))
            if cursors and (deltas := cursors[0].deltas()):
                loop.call_soon_threadsafe(queue.put_nowait, deltas)

        batch = asyncio.ensure_future(self._batch([req], params, on_step, stop))
        try:
            # Everything a step posted is queued before the batch is done (both come through
            # call_soon_threadsafe, in order): once it is done, what is queued is all there is.
            while not (batch.done() and queue.empty()):
                items = []
                if queue.empty():
                    getter = asyncio.ensure_future(queue.get())
                    await asyncio.wait({getter, batch}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        continue
                    items.append(getter.result())
                while not queue.empty():
                    items.append(queue.get_nowait())
                yield {"deltas": merge(d for item in items for d in item)}
            (result,) = batch.result()
            yield {"result": result}
        finally:
            if not batch.done():  # the reader went away: stop generating for nobody
                stop.set()
                self._orphans.add(batch)
                batch.add_done_callback(self._orphans.discard)

    @contextlib.asynccontextmanager
    async def _serving(self):
        async with self._idle:
            await self._idle.wait_for(lambda: not self._exclusive)
            self._inflight += 1
        try:
            yield
        finally:
            async with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self):
        """Wait for in-flight requests to finish and hold new ones back until the block ends."""
        await self.hold()
        try:
            yield
        finally:
            await self.release()

    async def hold(self) -> None:
        """``exclusive`` for a refit driven call by call from outside (vLLM's weight-sync
        protocol): requests wait from here until ``release``."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self._exclusive)
            self._exclusive = True
            await self._idle.wait_for(lambda: self._inflight == 0)

    async def release(self) -> None:
        async with self._idle:
            self._exclusive = False
            self._idle.notify_all()

    # -- in-flight refit ----------------------------------------------------------------------------

    async def begin_swap(self) -> None:
        """Freeze the running requests (they keep their KV cache) so weights can be loaded under
        them; new requests wait until ``end_swap``. The sync engine's pause is sent, not waited
        for: the engine core takes its messages in order, so the load sent next runs while it is
        paused and no step runs on half-loaded weights, whether a batch runs or is about to
        start. The async engine's is awaited (vLLM's ``pause_scheduler`` in ``keep`` mode: the
        step under way finishes, no other starts): its load is sent from other tasks of this
        loop, which could otherwise overtake the pause."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self._exclusive)
            self._exclusive = True
        self._swapping = True
        if self.async_engine:
            await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:
            self._pause = self._send_utility("pause_scheduler", "keep", False)

    async def end_swap(self, version: int | None, mode: str, resume_aborted: bool,
                       max_staleness: int | None, recompute_kv: bool = False, failed: str | None = None) -> None:
        """The weights are ``version`` now (unchanged when None): cut what the mode says —
        every running request (``abort``), or those with more than ``max_staleness`` tokens
        from older weights (``keep``) — resume, let new requests in. ``recompute_kv`` (NeMo-RL's
        ``recompute_kv_cache_after_weight_updates``): every running request's KV is recomputed
        on the new weights as it resumes, and the prefix cache is emptied. ``failed``: the load
        broke off, the weights are half-loaded: every running request is aborted and fails (the
        fleet re-routes it), and so does every later one.

        A plain ``keep`` cuts nothing, so it waits for nothing here: the new version's label
        and the resume go to the core back to back, and the batch's stall is the load and one
        trip to the core. Cutting needs every output sampled before the pause counted first."""
        if self.async_engine:
            return await self._end_swap_async(version, mode, resume_aborted, max_staleness, recompute_kv, failed)
        pending = [self._pause]
        try:
            if failed is not None:
                self._poisoned = failed
            if self._generating and (failed is not None or mode == "abort" or max_staleness is not None):
                await asyncio.wrap_future(self._pause)
                await self._settled()
                if self._generating:
                    recompute_kv = self._cut(version, mode, resume_aborted, max_staleness) or recompute_kv
            if version is not None:
                self._version = version
                pending.append(self._send_label(version))
            if recompute_kv and failed is None:
                pending.append(self._send_utility("reset_prefix_cache", True, False))
            pending.append(self._send_utility("resume_scheduler"))
            if self._generating:  # after a cut the step thread may wait for output no request makes
                self._llm.llm_engine.engine_core.outputs_queue.put_nowait(_wake())
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending))
        finally:
            self._pause = None
            self._swapping = False
            await self.release()

    async def _end_swap_async(self, version: int | None, mode: str, resume_aborted: bool,
                              max_staleness: int | None, recompute_kv: bool, failed: str | None) -> None:
        """``end_swap`` on the async engine, whose requests are frozen by vLLM's pause. A cut
        that resumes is vLLM's preemption: ``reset_prefix_cache(reset_running_requests=True)``
        sends every running request back to the queue with the tokens it has, and on resume its
        KV is recomputed from prompt + those tokens on the new weights — what the sync engine's
        cut and resubmission does, in one call. vLLM preempts all running requests at once, so a
        ``max_staleness`` cut recomputes every request's KV when any is past the bound (a cost,
        not a change: every token keeps the version that sampled it). A cut that does not
        resume (``abort`` without ``resume_aborted``) aborts them: their results end with
        "abort"."""
        core = self._llm.engine_core
        try:
            running = sorted(self._async_running)
            # Every token a frozen request has was sampled before this swap: all are stale.
            cut = running if mode == "abort" else [
                rid for rid in running if max_staleness is not None and max(
                    (s.detokenizer.num_output_tokens() for s in self._sample_states(rid).values()),
                    default=0) > max_staleness]
            if failed is not None:
                self._poisoned = failed
                cut = running
            if cut and (failed is not None or not resume_aborted):
                await self._llm.abort(cut)
            elif cut:
                recompute_kv = True
            if version is not None:
                self._version = version
                await core.set_weight_version_async(self._label(version))
            if recompute_kv and failed is None:
                await core.reset_prefix_cache_async(True, False)
            await core.resume_scheduler_async()
        finally:
            self._swapping = False
            await self.release()

    async def _settled(self) -> None:
        """Until the step thread has counted every output sampled before the pause: the pause's
        answer comes after all of them; once the thread waits again with nothing queued, each
        has been counted (or the batch is over)."""
        core = self._llm.llm_engine.engine_core
        while not (self._parked.is_set() and core.outputs_queue.empty()) and self._generating:
            await asyncio.sleep(0.005)  # a 2-core machine: polling must not starve the engine

    def _cut(self, version: int | None, mode: str, resume_aborted: bool, max_staleness: int | None) -> bool:
        """Cut what the mode says — every running request (``abort``), or those with more than
        ``max_staleness`` tokens from older weights (``keep``). Runs while the step thread is
        parked: no engine state moves under us. Resumed (``resume_aborted``): True, and the
        caller has vLLM preempt the running requests, which go on from their tokens with their
        KV recomputed on the new weights — one call for the batch, as on the async engine
        (aborting and re-adding each sample cost the refit a Python call per sample). So past
        ``max_staleness`` the whole batch is recomputed, not only the requests past it; every
        token keeps the version that sampled it. Not resumed: each cut request is aborted and
        its partial result closed."""
        engine = self._llm.llm_engine
        tracks = self._running()
        if self._poisoned is not None:
            engine.abort_request([i for t in tracks for i in t.internal_ids()], internal=True)
            return False
        new = self.version if version is None else version
        cut = [t for t in tracks if mode == "abort" or (max_staleness is not None and self._stale(t, new) > max_staleness)]
        if cut and resume_aborted:
            return True
        for t in cut:
            t.absorb(self._pieces_so_far(t) if t.final_only else {})
            engine.abort_request(t.internal_ids(), internal=True)
            for rid in list(t.parts):
                del self._tracks[rid]
            t.abandon()
        if cut and self._on_step is not None:
            self._on_step()  # a streamed request's reader learns of the cut (an abandoned sample ends)
        return False

    def _stale(self, track: Track, current: int | None) -> int:
        """The most tokens a running sample of ``track`` has from versions other than ``current``:
        a final-only track's from vLLM's output processor (counts only: the step thread is
        parked), a stream's from what it was told."""
        if not track.final_only:
            return track.stale_tokens(current)
        processor = self._llm.llm_engine.output_processor
        most = 0
        for internal, _ in track.parts.values():
            for child in _samples_of(processor, internal)[1]:
                if (state := processor.request_states.get(child)) is not None:
                    most = max(most, sum(n for v, n in self._state_spans(state) if v != current))
        return most

    def _pieces_so_far(self, track: Track) -> dict[int, Piece]:
        """What each running sample of a final-only ``track`` has made since its part began, by
        sample, as vLLM's output processor holds it (the step thread is parked): a running
        engine request's state, or — one of ``n`` samples that finished — its final output,
        waiting in the parent request for its siblings."""
        processor = self._llm.llm_engine.output_processor
        pieces: dict[int, Piece] = {}
        for internal, sample in track.parts.values():
            parent, children = _samples_of(processor, internal) if sample is None else (None, [internal])
            for i, child in enumerate(children):
                state, at = processor.request_states.get(child), i if sample is None else sample
                if state is not None:
                    detok = state.detokenizer
                    pieces[at] = Piece(list(detok.output_token_ids), state.logprobs_processor.logprobs,
                                       detok.get_next_output_text(True, False), self._state_spans(state), None)
                elif parent is not None and parent.output_aggregator and parent.output_aggregator[i] is not None:
                    done = parent.output_aggregator[i]
                    pieces[at] = Piece(list(done.token_ids), done.logprobs, done.text or "", self._label_spans(done),
                                       done.finish_reason)
        return pieces

    def _label_spans(self, comp: Any) -> list[tuple[int | None, int]]:
        """A final output's tokens by the version that sampled them, from the engine core's
        labels (``version``)."""
        if comp.weight_versions is None:
            return [(self._version, len(comp.token_ids))]
        return [(self._version_of(s.version), s.end - s.start) for s in comp.weight_versions]

    def _state_spans(self, state: Any) -> list[tuple[int | None, int]]:
        """The same for a running request, from its state's version starts."""
        starts, made = state.weight_version_starts, state.detokenizer.num_output_tokens()
        if not starts:
            return [(self._version, made)] if made else []
        ends = [start for _, start in starts[1:]] + [made]
        return [(self._version_of(label), end - start) for (label, start), end in zip(starts, ends)]

    def _running(self) -> list[Track]:
        """The running batch's requests (a request may be several engine requests after a cut)."""
        return list({id(t): t for t in self._tracks.values()}.values())

    def _send_utility(self, method: str, *args: Any) -> concurrent.futures.Future:
        """Send a utility call to the sync engine's core without waiting for it (vLLM's own
        ``call_utility`` is this plus the wait): the core answers in the order it was sent, so
        calls sent back to back cost one round trip, not one each."""
        from vllm.v1.engine import EngineCoreRequestType

        core = self._llm.llm_engine.engine_core
        call_id = uuid.uuid1().int >> 64
        future: concurrent.futures.Future = concurrent.futures.Future()
        core.utility_results[call_id] = future
        core._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return future

    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """``collective_rpc`` on every worker of this engine (metadata only, never tensors)."""
        self._rpc_active += 1
        try:
            if self.async_engine:
                async with self._rpc_lock:  # one control message at a time on the engine's queue
                    return await self._llm.collective_rpc(method, timeout=timeout, args=args)
            # Beside a running batch: the core client's sends are locked (``_instrument_core``;
            # two unlocked concurrent sends deadlocked here) and control calls go one at a time.
            # A drain refit's load still waits for the batch: ``hold`` waits for it to finish.
            async with self._rpc_lock:
                return await asyncio.to_thread(self._llm.collective_rpc, method, timeout, args)
        finally:
            self._rpc_active -= 1

    @contextlib.contextmanager
    def _progress(self):
        """One request of the async engine running: its outputs are the engine's evidence of progress."""
        if self._async_active == 0:
            self._async_outputs = 0
            self.last_step_at = time.monotonic()
        self._async_active += 1
        try:
            yield
        finally:
            self._async_active -= 1

    def _progressed(self) -> None:
        self._async_outputs += 1
        self.last_step_at = time.monotonic()

    async def probe(self, sampling: dict[str, Any], token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]:
        """Is the engine generating? Idle: generate one real token. Busy (a batch on the sync
        engine, which runs one at a time; requests on the async one): it is alive if it made a
        step (sync) or an output (async) within ``stall_s`` — or within ``warmup_s`` before its
        first one (a prefill) — however long its requests run: busy and slow are not dead.
        During a refit or control RPC the answer is ``skipped`` (the engine is held on purpose)."""
        if self._exclusive or self._rpc_active:
            return {"ok": True, "skipped": "refit or control call in progress"}
        if self._poisoned is not None:
            return {"ok": False, "error": f"weights half-loaded: {self._poisoned}"}
        if not self.async_engine and self._lock.locked():
            return busy_answer(time.monotonic() - self.last_step_at, self.batch_steps, stall_s, warmup_s)
        if self.async_engine and self._async_active:
            answer = busy_answer(time.monotonic() - self.last_step_at, self._async_outputs, stall_s, warmup_s)
            if answer["ok"]:
                return answer
            # No output for that long: a real token says whether the engine still steps.
        t0 = time.monotonic()
        try:
            (out,) = await self.generate([GenerationRequest(index=0, prompt_token_ids=token_ids)], sampling)
        except Exception as exc:
            if kind_of(exc) == "busy":  # its queue is full: a frontend that answers is alive
                return {"ok": True, "busy": True, "refused": describe(exc)}
            raise
        if out.get("error"):
            return {"ok": False, "error": out["error"]}
        return {"ok": True, "seconds": time.monotonic() - t0}

    # -- the sync engine's batch ------------------------------------------------------------------

    def _enqueue(self, prompt_ids: list[int], params: Any, salt: str) -> tuple[str, str]:
        """Add one request; (the id its outputs carry, the engine's internal id: what a cut aborts
        it by and finds its state under). Straight to the engine rather than through
        ``LLM.enqueue``, which would make a stream's outputs final-only: ``params`` say which."""
        from vllm.inputs import TokensPrompt

        rid = f"nemo-gen-{next(self._ids)}"
        internal = self._llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt),
                                                    params)
        return rid, internal

    def _generate_sync(self, requests: list[GenerationRequest], params,
                       on_step: Callable[[list[Track]], None] | None = None) -> list[dict]:
        from vllm.sampling_params import RequestOutputKind

        # A stream needs every step's new tokens; a batch only each request's final output, with
        # its tokens' versions from the engine core's labels. Per-step outputs for a whole batch
        # cost the step loop 1.3 s of a 6.3 s batch on an H200 (2026-12-01-h200-pipelined.md).
        final_only = on_step is None
        params.output_kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
        self._check_weights()
        results: dict[int, dict] = {}
        tracks: list[Track] = []
        self._tracks = {}
        # enqueue one by one so vLLM's validation rejects only the bad request, not the batch.
        for req in requests:
            try:
                rid, internal = self._enqueue(req.prompt_token_ids, params, self._salt)
            except (ValueError, TypeError) as exc:
                results[req.index] = _error_dict(req, exc)
                continue
            tracks.append(track := Track.start(req, params, rid, internal, final_only=final_only))
            self._tracks[rid] = track
        if tracks:
            self._on_step = (lambda: on_step(tracks)) if on_step is not None else None
            self._run_to_completion()
            self._check_weights()
            for t in tracks:
                if t.result is None:
                    raise RuntimeError(f"vLLM returned no output for request {t.req.index}")
                results[t.req.index] = t.result
        return [results[r.index] for r in requests]

    def _run_to_completion(self) -> None:
        """``LLM.wait_for_completion`` with a heartbeat (each finished engine step is stamped,
        so a probe can tell a busy engine from a wedged one) and per-token versions: a step's
        tokens were sampled by the version its outputs are labelled with (see ``version``)."""
        engine = self._llm.llm_engine
        self.last_step_at = time.monotonic()
        self.batch_steps = 0
        while engine.has_unfinished_requests() and self._poisoned is None:
            if self._stop.is_set():  # a streamed request's reader is gone
                running = self._running()
                engine.abort_request([i for t in running for i in t.internal_ids()], internal=True)
                for t in running:
                    t.abandon()
                self._tracks = {}
                break
            outputs = engine.step()
            step = sampled_by(self._version_of(self._step_label))
            for out in outputs:
                track = self._tracks.get(out.request_id)
                if track is None:
                    continue  # cut by a swap meanwhile
                track.observe(out.request_id, out, self._label_spans if track.final_only else step)
                if out.finished:
                    self._tracks.pop(out.request_id, None)
            if self._on_step is not None:
                self._on_step()
            now = time.monotonic()
            if self._last_step_end is not None:
                gap = now - self._last_step_end
                self.max_step_gap = max(self.max_step_gap, gap)
                if gap > _GAP_S:
                    self._gaps.append((self._last_step_end, now))
            self.last_step_at = self._last_step_end = now
            self.batch_steps += 1

    def step_gaps(self, reset: bool) -> dict[str, Any]:
        """The longest time the engine went without finishing a step (sync engine) since the
        last reset, and each stretch over 5 ms as (start, end) monotonic seconds; ``reset``
        starts a new window."""
        out = {"max_step_gap_s": self.max_step_gap, "gaps": list(self._gaps)}
        if reset:
            self.max_step_gap, self._last_step_end = 0.0, None
            self._gaps.clear()
        return out

    async def _generate_async(self, req: GenerationRequest, params) -> dict:
        from vllm.inputs import TokensPrompt

        request_id = f"nemo-gen-{next(self._ids)}"
        latest: dict[int, Any] = {}
        prompt_lps = None
        self._check_weights()
        self._async_running.add(request_id)
        try:
            with self._progress():
                async for out in self._llm.generate(
                    TokensPrompt(prompt_token_ids=req.prompt_token_ids, cache_salt=self._salt), params, request_id
                ):
                    self._progressed()
                    # With n > 1 an output carries the samples that moved (one child each, unless the
                    # reader lagged and they were merged): keep each sample's latest (cumulative) state.
                    for comp in out.outputs:
                        latest[comp.index] = comp
                    prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
        except (ValueError, TypeError) as exc:
            return _error_dict(req, exc)
        finally:
            self._async_running.discard(request_id)
        self._check_weights()
        # Each token under the version that sampled it: a refit under keep or abort may land
        # while the request runs, and vLLM's final output carries its spans of labels.
        top = bool(params.logprobs)
        samples = [_sample_dict(latest[i], self._label_spans(latest[i]), top) for i in sorted(latest)]
        extra = {"prompt_logprobs": prompt_entries(prompt_lps)} if params.prompt_logprobs is not None else {}
        return {"index": req.index, **samples[0], "samples": samples, "error": None, **extra}

    def _check_weights(self) -> None:
        """A request must not run, or return, on weights a failed swap left half-loaded."""
        if self._poisoned is not None:
            raise ShardDiedError(-1, f"weights half-loaded: {self._poisoned}")

    def _sample_states(self, rid: str) -> dict[int, Any]:
        """The async engine's output-processor state of each running sample of request ``rid``
        (n > 1: one child request each), by sample index."""
        processor = self._llm.output_processor
        states = (processor.request_states.get(i) for i in processor.external_req_ids.get(rid, ()))
        return {s.request_index: s for s in states if s is not None}

    def unfinished(self) -> dict[str, int]:
        """vLLM's own account of the requests this engine holds (its output processor's state,
        which an abort removes at once): engine request id -> tokens generated so far."""
        engine = self._llm if self.async_engine else self._llm.llm_engine
        return {rid: state.detokenizer.num_output_tokens()
                for rid, state in list(engine.output_processor.request_states.items())}

    def vllm_metrics(self) -> list[dict[str, Any]]:
        """vLLM's own stats of this engine (its Prometheus series: prefix-cache queries and hits,
        time to first token, running requests, ...) as plain dicts; empty unless stats are on
        (``generation.vllm_cfg.enable_vllm_metrics_logger``)."""
        engine = self._llm if self.async_engine else self._llm.llm_engine
        if not getattr(engine, "log_stats", False):
            return []
        from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector, get_metrics_snapshot

        out = []
        for m in get_metrics_snapshot():
            row: dict[str, Any] = {"name": m.name, "labels": dict(m.labels)}
            if isinstance(m, Histogram):
                row.update(kind="histogram", count=m.count, sum=m.sum, buckets=dict(m.buckets))
            elif isinstance(m, Vector):
                row.update(kind="vector", values=list(m.values))
            elif isinstance(m, (Counter, Gauge)):
                row.update(kind="counter" if isinstance(m, Counter) else "gauge", value=m.value)
            else:
                continue
            out.append(row)
        return out

    def child_pids(self) -> list[int]:
        """PIDs of the processes vLLM started for this engine (EngineCore, workers), not the
        helpers that start them (``engine_start.helper_pids``)."""
        from nemo_gen.fleet.engine_start import helper_pids

        try:
            children = psutil.Process(os.getpid()).children(recursive=True)
        except psutil.Error:
            return []
        helpers = helper_pids()
        return sorted(p.pid for p in children if p.pid not in helpers)

    def shutdown(self, grace_s: float) -> None:
        """Stop the engine's processes now, rather than whenever garbage collection runs: vLLM
        signals them, gives them ``grace_s`` to exit, then kills what is left."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self.async_engine:
            llm.shutdown(timeout=grace_s)
        else:
            llm.llm_engine.engine_core.shutdown(timeout=grace_s)


def _wake():
    """An empty batch of engine outputs: wakes a step thread waiting for output."""
    from vllm.v1.engine import EngineCoreOutputs

    return EngineCoreOutputs()
