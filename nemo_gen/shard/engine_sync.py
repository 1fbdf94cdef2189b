"""The sync engine: vLLM's ``LLM`` (best batch throughput) behind the engine's ``async`` surface.

One batch runs at a time, on a step thread: each request is added to the engine, then the
thread steps it to completion, stamping each step on the clock (a probe's evidence) and counting
every token under the version whose label the step's outputs carry. A stream is a batch of one
whose steps are posted to the reader as they come. Cancelling the caller, or closing a stream,
stops the batch after its current step. An in-flight refit cuts and resumes the batch through
``swap.Swap``, which shares the batch (``batch.Running``) with the step thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any, AsyncGenerator, Callable

from nemo_gen.core.results import GenerationRequest
from nemo_gen.shard import vllm_compat
from nemo_gen.shard.batch import Running, Track, sampled_by
from nemo_gen.core.wire import RequestProgress, RequestResult, SampleDelta, StreamDeltas
from nemo_gen.shard.engine_base import BaseEngine, error_result
from nemo_gen.shard.progress import SampleState, checkpoint, for_request, sampled_logprobs
from nemo_gen.shard.swap import Swap
from nemo_gen.shard.streaming import Cursor, merge
from nemo_gen.vllm_ext.lora import lora_request_of


class SyncEngine(BaseEngine):
    async_engine = False

    def __init__(self, llm: Any, load_s: float, version: int | None):
        super().__init__(llm, load_s, version)
        self._lock = asyncio.Lock()  # the sync LLM is not re-entrant: one batch at a time
        self._step_label: Any = None  # the label of the outputs the step thread got last
        self._core = vllm_compat.CoreClient(llm, self._on_label)
        self.batch = Running()
        # Set: the batch's reader is gone, the step thread aborts it after the current step.
        self._stop = threading.Event()
        self._orphans: set[asyncio.Future[Any]] = set()  # batches whose stream was closed, still stopping
        self.swap = Swap(llm, self._core, self.gate, self.weights, self.batch)

    def _on_label(self, label: Any) -> None:
        self._step_label = label

    def _front(self) -> Any:
        return self._llm.llm_engine

    @property
    def generating(self) -> bool:
        """A batch is running."""
        return self.batch.generating

    async def set_version(self, version: int | None) -> None:
        """The engine serves ``version`` from now on. Its core is told (vLLM's
        ``set_weight_version``), so that the outputs of every later step carry its label:
        messages reach the core in order, so each step after this one is counted under
        ``version``. The label is sent, not waited for: requests are added after it, by the step
        thread."""
        self.weights.version = version
        self._core.send_utility("set_weight_version", self.weights.label(version))

    async def _collective_rpc(self, method: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        # Beside a running batch: the core client's sends are locked (``CoreClient``; two
        # unlocked concurrent sends deadlocked) and control calls go one at a time. A drain
        # refit's load still waits for the batch: ``hold`` waits for it to finish.
        async with self._rpc_lock:
            return await asyncio.to_thread(self._llm.collective_rpc, method, timeout, args)

    def _busy_probe(self, stall_s: float, warmup_s: float) -> dict[str, Any] | None:
        return self.clock.evidence(stall_s, warmup_s) if self._lock.locked() else None

    async def _generate(self, requests: list[GenerationRequest], params: Any) -> list[RequestResult]:
        return await self._run_batch(requests, params)

    async def _run_batch(self, requests: list[GenerationRequest], params: Any,
                         on_step: Callable[[list[Track]], None] | None = None,
                         stop: threading.Event | None = None) -> list[RequestResult]:
        """One batch (one at a time). ``on_step(tracks)`` runs after each step; ``stop`` set: the
        batch is aborted after the current step (its unfinished samples end with "abort")."""
        async with self._lock:
            # Busy from here on: a probe judges liveness by the age of the last step, and
            # the batch's own enqueueing must not count against it.
            self.batch.generating = True
            self.clock.touch()
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
                self.batch.generating = False
                self.batch.clear()

    async def _stream(self, req: GenerationRequest, params: Any) -> AsyncGenerator[StreamDeltas | RequestResult, None]:
        loop, stop = asyncio.get_running_loop(), threading.Event()
        queue: asyncio.Queue[list[SampleDelta]] = asyncio.Queue()
        cursors: list[Cursor] = []

        def on_step(tracks: list[Track]) -> None:  # the step thread, or a swap's cut while it is parked
            if tracks and not cursors:
                cursors.append(Cursor(tracks[0]))
            if cursors and (deltas := cursors[0].deltas()):
                loop.call_soon_threadsafe(queue.put_nowait, deltas)

        batch = asyncio.ensure_future(self._run_batch([req], params, on_step, stop))
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
                yield StreamDeltas(tuple(merge(d for item in items for d in item)))
            (result,) = batch.result()
            yield result
        finally:
            if not batch.done():  # the reader went away: stop generating for nobody
                stop.set()
                self._orphans.add(batch)
                batch.add_done_callback(self._orphans.discard)

    # -- the step thread ---------------------------------------------------------------------------

    def _generate_sync(self, requests: list[GenerationRequest], params: Any,
                       on_step: Callable[[list[Track]], None] | None = None) -> list[RequestResult]:
        # A stream needs every step's new tokens; a batch only each request's final output, with
        # its tokens' versions from the engine core's labels: per-step outputs for a whole batch
        # cost the step loop a large share of a batch (bench/results/2026-12-01/h200-pipelined.md).
        final_only = on_step is None
        vllm_compat.output_kind(params, final_only)
        self.weights.check()
        # By the request itself: a migrated request's samples go on as requests of one index.
        results: dict[int, RequestResult] = {}
        tracks: list[Track] = []
        self.batch.tracks = {}
        # enqueue one by one so vLLM's validation rejects only the bad request, not the batch.
        for req in requests:
            rid = f"nemo-gen-{next(self._ids)}"
            own = for_request(params, req)
            try:
                internal = vllm_compat.add_request(self._llm, rid, req.prompt_token_ids, own, self.weights.salt,
                                                   lora_request=lora_request_of(own, self))
            except (ValueError, TypeError) as exc:
                results[id(req)] = error_result(req, exc)
                continue
            tracks.append(track := Track.start(req, own, rid, internal, final_only=final_only))
            self.batch.tracks[rid] = track
        if tracks:
            self.batch.on_step = (lambda: on_step(tracks)) if on_step is not None else None
            self._run_to_completion()
            self.weights.check()
            for t in tracks:
                if t.result is None:
                    raise RuntimeError(f"vLLM returned no output for request {t.req.index}")
                results[id(t.req)] = t.result
        return [results[id(r)] for r in requests]

    def _run_to_completion(self) -> None:
        """``LLM.wait_for_completion`` with a heartbeat (each finished engine step is stamped,
        so a probe can tell a busy engine from a wedged one) and per-token versions: a step's
        tokens were sampled by the version its outputs are labelled with (``Weights``)."""
        engine, batch, weights = self._llm.llm_engine, self.batch, self.weights
        self.clock.begin()
        while engine.has_unfinished_requests() and weights.poisoned is None:
            if self._stop.is_set():  # a streamed request's reader is gone
                running = batch.tracks_now()
                engine.abort_request([i for t in running for i in t.internal_ids()], internal=True)
                for t in running:
                    t.abandon()
                batch.tracks = {}
                break
            outputs = engine.step()
            step = sampled_by(weights.version_of(self._step_label))
            for out in outputs:
                track = batch.tracks.get(out.request_id)
                if track is None:
                    continue  # cut by a swap meanwhile
                track.observe(out.request_id, out, self._final_spans if track.final_only else step)
                if out.finished:
                    batch.tracks.pop(out.request_id, None)
            batch.stepped()
            self.clock.stepped()

    def progress(self, known: dict[str, int]) -> tuple[RequestProgress, ...]:
        """Checkpoints of the running batch's requests (``nemo_gen.shard.progress``), read while
        the step thread steps: each track's own tokens, then what vLLM's output processor holds
        of a final-only one. A copy of the track table first: the step thread removes from it."""
        tracks = list({id(t): t for t in list(self.batch.tracks.values())}.values())

        def reader(t: Track) -> Callable[[int], list[SampleState]]:
            def read(start: int) -> list[SampleState]:
                # A cut that did not resume leaves its tokens in the track; what runs now is the engine's.
                base = min(len(s.tokens) for s in t.samples)
                since = max(0, start - base)
                pieces = vllm_compat.pieces_so_far(self._llm, t, self.weights.version_of, since) if t.final_only else {}
                out: list[SampleState] = []
                for i, s in enumerate(t.samples):
                    p = pieces.get(i)
                    ids = s.tokens[start:] + (p.token_ids if p else [])
                    lps = s.logprobs[start:] + (sampled_logprobs(p.token_ids, p.logprobs) if p else [])
                    out.append((ids, lps, [*s.spans, *(p.spans if p else ())], s.finish_reason or (p.finish_reason if p else None)))
                return out
            return read

        return checkpoint(known, ((t.req.key, reader(t)) for t in tracks if t.req.key is not None))

    def _final_spans(self, comp: Any) -> list[tuple[int | None, int]]:
        return vllm_compat.label_spans(comp, self.weights.version_of)

    def shutdown(self, grace_s: float) -> None:
        """Stop the engine's processes now, rather than whenever garbage collection runs: vLLM
        signals them, gives them ``grace_s`` to exit, then kills what is left."""
        llm, self._llm = self._llm, None
        if llm is not None:
            self._core.shutdown(grace_s)
