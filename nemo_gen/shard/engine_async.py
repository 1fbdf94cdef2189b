"""The async engine: vLLM's ``AsyncLLM`` (``vllm_cfg.async_engine``), which serves concurrent
requests natively. Each request is one ``AsyncLLM.generate``: a batch's requests report only
their final output (per-step outputs cost the front end a ``RequestOutput`` and a wake-up per
request per step: bench/results/2026-12-07/gpu-rollout.md), a stream's every step's new tokens.
The core's steps are the engine's evidence of progress (the step clock counts each step's
outputs as the output handler takes them), and every token is counted under the version whose
label vLLM gave it. An in-flight refit pauses vLLM's scheduler and, where the mode says,
preempts or aborts the running requests (``swap.AsyncSwap``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncGenerator, Callable

from nemo_gen.core.results import GenerationRequest
from nemo_gen.shard import vllm_compat
from nemo_gen.core.wire import RequestProgress, RequestResult, StreamDeltas
from nemo_gen.shard.batch import Track, prompt_entries, prompt_result, spans_between
from nemo_gen.shard.engine_base import BaseEngine, error_result
from nemo_gen.shard.progress import SampleState, checkpoint, for_request, sampled_logprobs
from nemo_gen.shard.swap import AsyncSwap
from nemo_gen.shard.streaming import Cursor
from nemo_gen.vllm_ext.lora import lora_request_of


class AsyncEngine(BaseEngine):
    async_engine = True

    def __init__(self, llm: Any, load_s: float, version: int | None):
        super().__init__(llm, load_s, version)
        self.running: set[str] = set()  # its requests, by the id they were added with
        # Each keyed request's latest output per sample, for its checkpoints (``progress``).
        self._live: dict[str, tuple[str, dict[int, Any]]] = {}  # key -> (its engine id, latest outputs)
        self.swap = AsyncSwap(llm, self.gate, self.weights, self.running)
        vllm_compat.on_core_outputs(llm, self._stepped)

    def _stepped(self) -> None:
        if self.clock.active:  # progress of requests running now (a probe's evidence)
            self.clock.output()

    def _front(self) -> Any:
        return self._llm

    @property
    def generating(self) -> bool:
        """Any request is running."""
        return self.clock.active > 0

    async def set_version(self, version: int | None) -> None:
        """The engine serves ``version`` from now on; its core is told (vLLM's
        ``set_weight_version``) so that every later step's outputs carry its label. Awaited, so
        that no request added from this loop can overtake it."""
        self.weights.version = version
        await self._llm.engine_core.set_weight_version_async(self.weights.label(version))

    async def _collective_rpc(self, method: str, args: tuple[Any, ...], timeout: float | None) -> list[Any]:
        async with self._rpc_lock:
            answers: list[Any] = await self._llm.collective_rpc(method, timeout=timeout, args=args)
            return answers

    def _busy_probe(self, stall_s: float, warmup_s: float) -> dict[str, Any] | None:
        if self.clock.active:
            answer = self.clock.evidence(stall_s, warmup_s)
            if answer["ok"]:
                return answer
            # No output for that long: a real token says whether the engine still steps.
        return None

    async def _generate(self, requests: list[GenerationRequest], params: Any) -> list[RequestResult]:
        vllm_compat.output_kind(params, final_only=True)
        return list(await asyncio.gather(*(self._one(r, params) for r in requests)))

    def _version_spans(self, comp: Any) -> list[tuple[int | None, int]]:
        return vllm_compat.label_spans(comp, self.weights.version_of)

    def progress(self, known: dict[str, int]) -> tuple[RequestProgress, ...]:
        """Checkpoints of the running keyed requests (``nemo_gen.shard.progress``): each running
        sample from vLLM's output-processor state (what it holds whatever outputs the request
        asked for), a finished one from its latest output."""
        def reader(rid: str, latest: dict[int, Any]) -> Callable[[int], list[SampleState]]:
            def read(start: int) -> list[SampleState]:
                states = vllm_compat.sample_states(self._llm, rid)
                out: list[SampleState] = []
                for i in range(max([*states, *latest], default=-1) + 1):
                    if (state := states.get(i)) is not None:
                        ids = state.detokenizer.output_token_ids[start:]
                        lps = sampled_logprobs(ids, (state.logprobs_processor.logprobs or [])[start:])
                        out.append((ids, lps, vllm_compat.state_spans(state, self.weights.version_of), None))
                    elif (c := latest.get(i)) is not None:
                        ids = list(c.token_ids[start:])
                        out.append((ids, sampled_logprobs(ids, (c.logprobs or [])[start:]), self._version_spans(c),
                                    c.finish_reason))
                    else:
                        out.append(([], [], (), None))
                return out
            return read

        return checkpoint(known, ((key, reader(rid, latest)) for key, (rid, latest) in list(self._live.items())))

    async def _one(self, req: GenerationRequest, params: Any) -> RequestResult:
        request_id = f"nemo-gen-{next(self._ids)}"
        latest: dict[int, Any] = {}
        prompt_lps = None
        params = for_request(params, req)
        self.weights.check()
        self.running.add(request_id)
        if req.key is not None:
            self._live[req.key] = (request_id, latest)
        try:
            with self.clock.running():
                prompt = vllm_compat.tokens_prompt(req.prompt_token_ids, self.weights.salt)
                async for out in self._llm.generate(prompt, params, request_id,
                                                    lora_request=lora_request_of(params, self)):
                    # Final outputs only (``_generate``): with n > 1 the final output carries every
                    # sample; an abort's carries what each had made. Keep each sample's latest state.
                    for comp in out.outputs:
                        latest[comp.index] = comp
                    prompt_lps = out.prompt_logprobs if out.prompt_logprobs is not None else prompt_lps
        except (ValueError, TypeError) as exc:
            return error_result(req, exc)
        finally:
            self.running.discard(request_id)
            if req.key is not None:
                self._live.pop(req.key, None)
        self.weights.check()
        # Each token under the version that sampled it: a refit under keep or abort may land
        # while the request runs, and vLLM's final output carries its spans of labels.
        top = bool(params.logprobs)
        samples = tuple(vllm_compat.sample_result(latest[i], self._version_spans(latest[i]), top, params.detokenize)
                        for i in sorted(latest))
        prompt = prompt_result(prompt_entries(prompt_lps)) if params.prompt_logprobs is not None else None
        return RequestResult(req.index, samples, None, prompt)

    async def _stream(self, req: GenerationRequest, params: Any) -> AsyncGenerator[StreamDeltas | RequestResult, None]:
        rid = f"nemo-gen-{next(self._ids)}"
        params = for_request(params, req)
        track = Track.start(req, params, rid, rid)
        cursor = Cursor(track)
        self.weights.check()
        outputs = self._llm.generate(vllm_compat.tokens_prompt(req.prompt_token_ids, self.weights.salt), params, rid,
                                     lora_request=lora_request_of(params, self))
        made: dict[int, int] = {}  # tokens told so far, by sample

        def spans_of(comp: Any) -> list[tuple[int | None, int]]:
            # A delta's tokens by the label of the step that sampled each (a refit under keep or
            # abort lands between two steps of a running request).
            lo = made.get(comp.index, 0)
            made[comp.index] = hi = lo + len(comp.token_ids)
            starts = vllm_compat.label_starts(comp)  # the last one: vLLM's spans over the whole sample
            if starts is None:
                starts = vllm_compat.running_starts(self._llm, rid, comp.index)
            return [(self.weights.version_of(label), n) for label, n in spans_between(starts, lo, hi)]

        self.running.add(rid)
        try:
            with self.clock.running():
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        track.observe(rid, out, spans_of)
                        if deltas := cursor.deltas():
                            yield StreamDeltas(tuple(deltas))
        except (ValueError, TypeError) as exc:  # vLLM refused the request
            yield error_result(req, exc)
            return
        finally:
            self.running.discard(rid)
        self.weights.check()
        if track.result is None:
            raise RuntimeError(f"vLLM's output for request {req.index} ended before it finished")
        yield track.result

    def shutdown(self, grace_s: float) -> None:
        """Stop the engine's processes now, rather than whenever garbage collection runs: vLLM
        signals them, gives them ``grace_s`` to exit, then kills what is left."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown(timeout=grace_s)
