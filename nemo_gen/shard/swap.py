"""The in-flight weight swap (a refit with ``in_flight`` ``keep`` or ``abort``): ``begin``
freezes the running requests (they keep their KV cache) and closes the gate to new ones, the
caller loads the new weights, ``end`` cuts what the mode says, labels later steps with the new
version, resumes and opens the gate.

``Swap`` is the sync engine's: its batch is cut and resumed as ``nemo_gen.shard.batch`` says
(a ``Running`` batch of ``Track``s the step thread shares). ``AsyncSwap`` is the async engine's:
its requests are frozen by vLLM's own pause and, where the mode says, preempted so that their KV
is recomputed on the new weights. On both, vLLM labels each step's outputs with the version
that sampled them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

from nemo_gen.core.modes import RefitMode
from nemo_gen.shard import vllm_compat
from nemo_gen.shard.batch import Running, Track
from nemo_gen.shard.engine_base import Weights
from nemo_gen.shard.gate import Gate


class Swap:
    """The sync engine's swap. ``llm``: its ``vllm.LLM``; ``core``: its instrumented core client;
    ``batch``: the running batch, shared with the step thread."""

    def __init__(self, llm: Any, core: vllm_compat.CoreClient, gate: Gate, weights: Weights, batch: Running):
        self._llm, self._core, self._gate, self._weights, self._batch = llm, core, gate, weights, batch
        self._pause: concurrent.futures.Future[Any] | None = None  # the pause, until its resume

    async def begin(self) -> None:
        """The pause is sent, not waited for: the engine core takes its messages in order, so the
        load sent next runs while it is paused and no step runs on half-loaded weights, whether a
        batch runs or is about to start."""
        await self._gate.claim()
        self._pause = self._core.send_utility("pause_scheduler", "keep", False)

    async def end(self, version: int | None, mode: RefitMode, resume_aborted: bool, max_staleness: int | None,
                  recompute_kv: bool, failed: str | None) -> None:
        """``BaseEngine.end_swap``. A plain ``keep`` cuts nothing, so it waits for nothing here:
        the new version's label and the resume go to the core back to back, and the batch's
        stall is the load and one trip to the core. Cutting needs every output sampled before
        the pause counted first."""
        batch, pause = self._batch, self._pause
        if pause is None:  # (the engine's end_swap follows its begin_swap: a bug otherwise)
            raise RuntimeError("a swap ended that did not begin")
        pending = [pause]
        try:
            if failed is not None:
                self._weights.poisoned = failed
            if batch.generating and (failed is not None or mode is RefitMode.ABORT or max_staleness is not None):
                await asyncio.wrap_future(pause)
                await self._settled()
                if batch.generating:
                    recompute_kv = self._cut(version, mode, resume_aborted, max_staleness) or recompute_kv
            if version is not None:
                self._weights.version = version
                pending.append(self._core.send_utility("set_weight_version", self._weights.label(version)))
            if recompute_kv and failed is None:
                pending.append(self._core.send_utility("reset_prefix_cache", True, False))
            pending.append(self._core.send_utility("resume_scheduler"))
            if batch.generating:  # after a cut the step thread may wait for output no request makes
                self._core.wake()
            await asyncio.gather(*(asyncio.wrap_future(f) for f in pending))
        finally:
            self._pause = None
            await self._gate.release()

    async def _settled(self) -> None:
        """Until the step thread has counted every output sampled before the pause: the pause's
        answer comes after all of them; once the thread waits again with nothing queued, each
        has been counted (or the batch is over)."""
        while not self._core.settled() and self._batch.generating:
            await asyncio.sleep(0.005)  # a 2-core machine: polling must not starve the engine

    def _cut(self, version: int | None, mode: RefitMode, resume_aborted: bool, max_staleness: int | None) -> bool:
        """Cut what the mode says — every running request (``abort``), or those with more than
        ``max_staleness`` tokens from older weights (``keep``). Runs while the step thread is
        parked: no engine state moves under us. Resumed (``resume_aborted``): True, and the
        caller has vLLM preempt the running requests, which go on from their tokens with their
        KV recomputed on the new weights — one call for the batch, as on the async engine
        (aborting and re-adding each sample would cost the refit a Python call per sample). So
        past ``max_staleness`` the whole batch is recomputed, not only the requests past it;
        every token keeps the version that sampled it. Not resumed: each cut request is aborted
        and its partial result closed."""
        engine = self._llm.llm_engine
        tracks = self._batch.tracks_now()
        if self._weights.poisoned is not None:
            engine.abort_request([i for t in tracks for i in t.internal_ids()], internal=True)
            return False
        new = self._weights.version if version is None else version
        cut = [t for t in tracks if mode is RefitMode.ABORT or (max_staleness is not None and self._stale(t, new) > max_staleness)]
        if cut and resume_aborted:
            return True
        for t in cut:
            t.absorb(vllm_compat.pieces_so_far(self._llm, t, self._weights.version_of) if t.final_only else {})
            engine.abort_request(t.internal_ids(), internal=True)
            self._batch.drop(t)
            t.abandon()
        if cut:
            self._batch.stepped()  # a streamed request's reader learns of the cut (an abandoned sample ends)
        return False

    def _stale(self, track: Track, current: int | None) -> int:
        """The most tokens a running sample of ``track`` has from versions other than ``current``:
        a final-only track's from vLLM's output processor, a stream's from what it was told."""
        if not track.final_only:
            return track.stale_tokens(current)
        return vllm_compat.stale_tokens(self._llm, track, current, self._weights.version_of)


class AsyncSwap:
    """The async engine's swap. ``running``: the ids of its requests running now (shared with it)."""

    def __init__(self, llm: Any, gate: Gate, weights: Weights, running: set[str]):
        self._llm, self._gate, self._weights, self._running = llm, gate, weights, running

    async def begin(self) -> None:
        """vLLM's ``pause_scheduler`` in ``keep`` mode, awaited (the step under way finishes, no
        other starts): the load is sent from other tasks of this loop, which could otherwise
        overtake the pause."""
        await self._gate.claim()
        await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def end(self, version: int | None, mode: RefitMode, resume_aborted: bool, max_staleness: int | None,
                  recompute_kv: bool, failed: str | None) -> None:
        """A cut that resumes is vLLM's preemption: ``reset_prefix_cache(reset_running_requests=True)``
        sends every running request back to the queue with the tokens it has, and on resume its
        KV is recomputed from prompt + those tokens on the new weights — what the sync engine's
        cut does. vLLM preempts all running requests at once, so a ``max_staleness`` cut
        recomputes every request's KV when any is past the bound (a cost, not a change: every
        token keeps the version that sampled it). A cut that does not resume (``abort`` without
        ``resume_aborted``) aborts them: their results end with "abort"."""
        core = self._llm.engine_core
        try:
            running = sorted(self._running)
            # Every token a frozen request has was sampled before this swap: all are stale.
            cut = running if mode is RefitMode.ABORT else [
                rid for rid in running if max_staleness is not None and max(
                    (vllm_compat.made_so_far(s) for s in vllm_compat.sample_states(self._llm, rid).values()),
                    default=0) > max_staleness]
            if failed is not None:
                self._weights.poisoned = failed
                cut = running
            if cut and (failed is not None or not resume_aborted):
                await self._llm.abort(cut)
            elif cut:
                recompute_kv = True
            if version is not None:
                self._weights.version = version
                await core.set_weight_version_async(self._weights.label(version))
            if recompute_kv and failed is None:
                await core.reset_prefix_cache_async(True, False)
            await core.resume_scheduler_async()
        finally:
            await self._gate.release()
