"""One vLLM engine inside a shard actor: start it, generate with per-request errors, stop it.

This is the only module that imports vLLM. Both of vLLM's engines are hidden behind one
``async`` surface: the sync ``vllm.LLM`` (best batch throughput) runs in a worker thread under a
lock, the ``AsyncLLM`` (``vllm_cfg.async_engine``) serves concurrent requests natively.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from typing import Any

import psutil

from nemo_gen.core.results import GenerationRequest


def sampling_params(s: dict[str, Any]):
    """vLLM ``SamplingParams`` from a resolved sampling dict (``nemo_gen.core.sampling``)."""
    from vllm import SamplingParams

    top_k = s.get("top_k")
    return SamplingParams(
        max_tokens=s["max_new_tokens"],
        temperature=float(s["temperature"]),
        top_p=float(s["top_p"]),
        top_k=-1 if top_k is None else top_k,
        stop=list(s["stop_strings"]) if s.get("stop_strings") else None,
        stop_token_ids=list(s["stop_token_ids"]) if s.get("stop_token_ids") else None,
        bad_words=list(s["bad_words"]) if s.get("bad_words") else None,
        seed=s.get("seed"),
        ignore_eos=bool(s.get("ignore_eos") or False),
        # logprobs=0: the logprob of the sampled token only, which is what RL losses need.
        logprobs=0,
    )


def _result_dict(req: GenerationRequest, out) -> dict[str, Any]:
    comp = out.outputs[0]
    token_ids = list(comp.token_ids)
    logprobs: list[float] = []
    if comp.logprobs:
        for tok, lp in zip(token_ids, comp.logprobs):
            logprobs.append(float(lp[tok].logprob))
    return {
        "index": req.index,
        "token_ids": token_ids,
        "text": comp.text if comp.text is not None else None,
        "logprobs": logprobs,
        "finish_reason": comp.finish_reason,
        "error": None,
    }


def _error_dict(req: GenerationRequest, exc: BaseException) -> dict[str, Any]:
    return {"index": req.index, "error": f"RequestError: {exc}"}


class Engine:
    """A started vLLM engine. Construct with ``await Engine.start(kwargs, async_engine)``."""

    def __init__(self, llm: Any, async_engine: bool, load_s: float):
        self._llm = llm
        self.async_engine = async_engine
        self.load_s = load_s
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
        # Steps completed since start: the first ones (kernel selection, warm-up) can take far
        # longer than a normal step without the engine being wedged.
        self.steps_done = 0
        self.max_model_len = self._model_config().max_model_len
        self.dtype = str(self._model_config().dtype).removeprefix("torch.")

    @classmethod
    async def start(cls, kwargs: dict[str, Any], async_engine: bool) -> "Engine":
        t0 = time.monotonic()
        if async_engine:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        else:
            from vllm import LLM

            llm = await asyncio.to_thread(LLM, **kwargs)
        return cls(llm, async_engine, time.monotonic() - t0)

    def _model_config(self):
        if self.async_engine:
            return self._llm.model_config
        return self._llm.llm_engine.model_config

    async def generate(self, requests: list[GenerationRequest], sampling: dict[str, Any]) -> list[dict]:
        """One result dict per request, in order. A request vLLM rejects gets an ``error`` entry;
        the others still run."""
        params = sampling_params(sampling)
        async with self._serving():
            if self.async_engine:
                return list(await asyncio.gather(*(self._generate_async(r, params) for r in requests)))
            async with self._lock:
                # Busy from here on: a probe judges liveness by the age of the last step, and
                # the batch's own enqueueing must not count against it.
                self._generating = True
                self.last_step_at = time.monotonic()
                try:
                    return await asyncio.to_thread(self._generate_sync, requests, params)
                finally:
                    self._generating = False

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

    async def rpc(self, method: str, *args: Any, timeout: float | None = None) -> list[Any]:
        """``collective_rpc`` on every worker of this engine (metadata only, never tensors)."""
        self._rpc_active += 1
        try:
            if self.async_engine:
                async with self._rpc_lock:  # one control message at a time on the engine's queue
                    return await self._llm.collective_rpc(method, timeout=timeout, args=args)
            # The sync LLM is not thread-safe: RPCs and generate calls take turns (two concurrent
            # collective_rpc calls from worker threads deadlocked here).
            async with self._lock:
                return await asyncio.to_thread(self._llm.collective_rpc, method, timeout, args)
        finally:
            self._rpc_active -= 1

    async def probe(self, sampling: dict[str, Any], token_ids: list[int], stall_s: float,
                    warmup_s: float) -> dict[str, Any]:
        """Is the engine generating? Idle: generate one real token. Busy with a batch (the sync
        engine runs one at a time): it is alive if a step completed within ``stall_s`` — or
        within ``warmup_s`` while its very first step (warm-up) is still running.
        During a refit or control RPC the answer is ``skipped`` (the engine is held on purpose)."""
        if self._exclusive or self._rpc_active:
            return {"ok": True, "skipped": "refit or control call in progress"}
        if not self.async_engine and self._lock.locked():
            age = time.monotonic() - self.last_step_at
            bound = stall_s if self.steps_done else max(stall_s, warmup_s)
            if self._generating and age <= bound:
                return {"ok": True, "busy": True, "step_age_s": age}
            return {"ok": False, "error": f"engine busy and no generation step for {age:.1f}s"}
        t0 = time.monotonic()
        (out,) = await self.generate([GenerationRequest(index=0, prompt_token_ids=token_ids)], sampling)
        if out.get("error"):
            return {"ok": False, "error": out["error"]}
        return {"ok": True, "seconds": time.monotonic() - t0}

    def _generate_sync(self, requests: list[GenerationRequest], params) -> list[dict]:
        from vllm.inputs import TokensPrompt

        results: dict[int, dict] = {}
        enqueued: list[GenerationRequest] = []
        # enqueue one by one so vLLM's validation rejects only the bad request, not the batch.
        for req in requests:
            try:
                self._llm.enqueue(
                    [TokensPrompt(prompt_token_ids=req.prompt_token_ids)], params, use_tqdm=False
                )
            except (ValueError, TypeError) as exc:
                results[req.index] = _error_dict(req, exc)
                continue
            enqueued.append(req)
        if enqueued:
            outputs = self._run_to_completion()
            if len(outputs) != len(enqueued):
                raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(enqueued)} requests")
            for req, out in zip(enqueued, outputs):
                results[req.index] = _result_dict(req, out)
        return [results[r.index] for r in requests]

    def _run_to_completion(self) -> list[Any]:
        """``LLM.wait_for_completion`` with a heartbeat: each finished engine step is stamped,
        so a probe can tell a busy engine from a wedged one."""
        engine = self._llm.llm_engine
        outputs = []
        self.last_step_at = time.monotonic()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs.append(out)
            self.last_step_at = time.monotonic()
            self.steps_done += 1
        # As vLLM sorts them: by request counter, i.e. in enqueue order.
        return sorted(outputs, key=lambda o: int(o.request_id))

    async def _generate_async(self, req: GenerationRequest, params) -> dict:
        from vllm.inputs import TokensPrompt

        request_id = f"nemo-gen-{next(self._ids)}"
        final = None
        try:
            async for out in self._llm.generate(
                TokensPrompt(prompt_token_ids=req.prompt_token_ids), params, request_id
            ):
                final = out
        except (ValueError, TypeError) as exc:
            return _error_dict(req, exc)
        return _result_dict(req, final)

    def child_pids(self) -> list[int]:
        """PIDs of the processes vLLM forked for this engine (EngineCore, workers)."""
        try:
            return sorted(p.pid for p in psutil.Process(os.getpid()).children(recursive=True))
        except psutil.Error:
            return []

    def shutdown(self) -> None:
        """Stop the engine's processes now, rather than whenever garbage collection runs."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self.async_engine:
            llm.shutdown()
        else:
            llm.llm_engine.engine_core.shutdown()
