"""Every place the engines (``nemo_gen.shard.engine_sync``, ``engine_async``) touch vLLM beyond
its documented ``LLM``/``AsyncLLM`` calls: building an engine and its sampling parameters, the
sync engine's core client (a send lock, marked output waits, utility calls sent without waiting,
a wake-up), and reading the output processor's request state (a cut's partial outputs, staleness,
the requests held, stats). When vLLM changes one of these, this is the module that follows it;
tests/tooling/test_structure.py's list of private accesses names it alone for the engines.

vLLM is imported inside the functions: this module is imported where vLLM is not installed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from typing import Any, Callable

from nemo_gen.core.wire import SampleResult, Sampling, Unfinished, pairs
from nemo_gen.shard.batch import Piece, Track, top_entries
from nemo_gen.vllm_ext.lora import EXTRA_KEY

VersionOf = Callable[[Any], "int | None"]  # an output label -> the weight version it stands for


def sampling_params(s: Sampling, text: bool = True) -> Any:
    """vLLM ``SamplingParams`` from the wire's ``Sampling`` (resolved by ``nemo_gen.core.sampling``).
    ``text``: the engine decodes each sample's text as it goes; False leaves that to the caller
    (``nemo_gen.fleet.decode``), unless stop strings need it. Where the engine decodes, vLLM's
    front end does it per token in the shard's process (with logprobs, each logprob entry's token
    too); the router decodes a finished sample once (measured: bench/results/2026-12-06/cpu-front-end-text.md)."""
    from vllm import SamplingParams

    structured = None
    if s.structured_outputs is not None:  # a grammar to decode under (the server's forced tool calls)
        from vllm.sampling_params import StructuredOutputsParams

        structured = StructuredOutputsParams(**s.structured_outputs.as_kwargs())
    return SamplingParams(
        max_tokens=s.max_new_tokens,
        n=s.n,
        temperature=float(s.temperature),
        top_p=float(s.top_p),
        top_k=-1 if s.top_k is None else s.top_k,
        stop=list(s.stop_strings) if s.stop_strings else None,
        stop_token_ids=list(s.stop_token_ids) if s.stop_token_ids else None,
        bad_words=list(s.bad_words) if s.bad_words else None,
        seed=s.seed,
        ignore_eos=s.ignore_eos,
        detokenize=text or bool(s.stop_strings),  # vLLM matches stop strings on the decoded text
        # logprobs=0: the logprob of the sampled token only, which is what RL losses need.
        logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs,
        structured_outputs=structured,
        extra_args={EXTRA_KEY: list(s.adapter)} if s.adapter else None,  # the request's LoRA adapter
    )


def output_kind(params: Any, final_only: bool) -> Any:
    """``params`` set to report each request's final output only, or every step's new tokens."""
    from vllm.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.DELTA
    return params


def tokens_prompt(prompt_ids: list[int], salt: str) -> Any:
    """A prompt of token ids, prefix-cached under ``salt`` (its weight version)."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=salt)


async def build(kwargs: dict[str, Any], async_engine: bool) -> Any:
    """vLLM's ``AsyncLLM`` or, started in a worker thread, its sync ``LLM``."""
    if async_engine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
    from vllm import LLM

    return await asyncio.to_thread(LLM, **kwargs)


def freeze_heap() -> None:
    """Exempt every object alive now (the imports of vLLM, torch, Ray) from the garbage
    collector's scans, as vLLM's own API server does once it is up (``freeze_gc_heap``). The
    engine's output processing in this process allocates per request per step, so full
    collections come every batch, and each one would walk that whole heap (bench/front_end.py
    measures it; bench/results/2026-12-02/h200-b.md). Objects made later are collected as usual."""
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()


def on_core_outputs(llm: Any, callback: Callable[[], None]) -> None:
    """``callback()`` each time ``AsyncLLM``'s output handler takes a step's request outputs from
    its engine core: one call a step, however many requests it carries. The async engine's
    evidence of progress, since its batches ask vLLM for each request's final output only."""
    core = llm.engine_core
    get = core.get_output_async

    async def stamped_get() -> Any:
        outputs = await get()
        if outputs.outputs:
            callback()
        return outputs

    core.get_output_async = stamped_get


class CoreClient:
    """The sync engine's client of its EngineCore process, with two guards installed: its input
    socket is used by the step thread (aborts on stop strings) and by a swap's control calls, so
    sends take a lock (zmq sockets are not thread-safe); and the step thread marks when it waits
    for output (``parked``), which is how a swap that cuts requests knows every output sampled
    before the pause has been counted. ``on_label`` gets the version label of each step's outputs."""

    def __init__(self, llm: Any, on_label: Callable[[Any], None]):
        self._core = core = llm.llm_engine.engine_core
        self.parked = threading.Event()
        send, get, lock, parked = core._send_input, core.get_output, threading.Lock(), self.parked

        def locked_send(*args: Any, **kwargs: Any) -> Any:
            with lock:
                return send(*args, **kwargs)

        def marked_get() -> Any:
            parked.set()
            try:
                outputs = get()
            finally:
                parked.clear()
            on_label(outputs.weight_version)
            return outputs

        core._send_input, core.get_output = locked_send, marked_get

    def send_utility(self, method: str, *args: Any) -> concurrent.futures.Future[Any]:
        """A utility call to the core, not waited for (vLLM's own ``call_utility`` is this plus
        the wait): the core answers in the order it was sent, so calls sent back to back cost one
        round trip, not one each."""
        from vllm.v1.engine import EngineCoreRequestType

        core, call_id = self._core, uuid.uuid1().int >> 64
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        core.utility_results[call_id] = future
        core._send_input(EngineCoreRequestType.UTILITY, (0, call_id, method, args))
        return future

    def settled(self) -> bool:
        """The step thread waits for output and none is queued: it has counted every output."""
        return self.parked.is_set() and self._core.outputs_queue.empty()

    def wake(self) -> None:
        """An empty batch of outputs: wakes a step thread waiting for output no request makes."""
        from vllm.v1.engine import EngineCoreOutputs

        self._core.outputs_queue.put_nowait(EngineCoreOutputs())

    def shutdown(self, grace_s: float) -> None:
        self._core.shutdown(timeout=grace_s)


def add_request(llm: Any, rid: str, prompt_ids: list[int], params: Any, salt: str, lora_request: Any = None) -> str:
    """Add one request to the sync engine; the engine's internal id (what an abort names and its
    state is kept under). Straight to the engine rather than through ``LLM.enqueue``, which
    would make a stream's outputs final-only: ``params`` say which."""
    rid_added: str = llm.llm_engine.add_request(rid, tokens_prompt(prompt_ids, salt), params, lora_request=lora_request)
    return rid_added


# -- per-token versions ---------------------------------------------------------------------------


def label_spans(comp: Any, version_of: VersionOf) -> list[tuple[int | None, int]]:
    """A final output's tokens by the version that sampled them, from the engine core's labels
    (no labels: all under the current version, ``version_of(None)``)."""
    if comp.weight_versions is None:
        return [(version_of(None), len(comp.token_ids))]
    return [(version_of(s.version), s.end - s.start) for s in comp.weight_versions]


def label_starts(comp: Any) -> list[tuple[Any, int]] | None:
    """Where each label of a final output begins, (label, first token); None on a delta."""
    return None if comp.weight_versions is None else [(s.version, s.start) for s in comp.weight_versions]


def state_spans(state: Any, version_of: VersionOf) -> list[tuple[int | None, int]]:
    """A running request's tokens by version, from its output-processor state's version starts."""
    starts, made = state.weight_version_starts, state.detokenizer.num_output_tokens()
    if not starts:
        return [(version_of(None), made)] if made else []
    ends = [start for _, start in starts[1:]] + [made]
    return [(version_of(label), end - start) for (label, start), end in zip(starts, ends)]


def sample_result(comp: Any, spans: list[tuple[int | None, int]], top: bool = False,
                  decoded: bool = True) -> SampleResult:
    """One finished (cumulative) completion output as a sample of a result; ``spans``: its
    tokens by the version that sampled them; ``top``: with each token's alternatives;
    ``decoded``: the engine decoded its text (else the text is None: the caller decodes it)."""
    token_ids = list(comp.token_ids)
    logprobs = [float(lp[tok].logprob) for tok, lp in zip(token_ids, comp.logprobs)] if comp.logprobs else []
    return SampleResult(token_ids, logprobs, comp.text if decoded else None, comp.finish_reason,
                        tuple((v, n) for v, n in spans),
                        tuple(pairs(t) for t in top_entries(comp.logprobs)) if top else None)


# -- the output processor's request state ---------------------------------------------------------


def _samples_of(processor: Any, internal: str) -> tuple[Any, list[str]]:
    """The sync engine's request ``internal`` as vLLM's output processor runs it: (its
    ParentRequest, or None for n = 1; the ids of its samples' requests, "{i}_{parent id}" for n > 1)."""
    parent = processor.parent_requests.get(internal)
    return parent, [internal] if parent is None else [f"{i}_{internal}" for i in range(parent.n)]


def stale_tokens(llm: Any, track: Track, current: int | None, version_of: VersionOf) -> int:
    """The most tokens a running sample of a final-only ``track`` on the sync engine has from
    versions other than ``current``, counted in vLLM's output processor (the step thread is parked)."""
    processor = llm.llm_engine.output_processor
    most = 0
    for internal, _ in track.parts.values():
        for child in _samples_of(processor, internal)[1]:
            if (state := processor.request_states.get(child)) is not None:
                most = max(most, sum(n for v, n in state_spans(state, version_of) if v != current))
    return most


def pieces_so_far(llm: Any, track: Track, version_of: VersionOf, since: int = 0) -> dict[int, Piece]:
    """What each running sample of a final-only ``track`` on the sync engine has made since its
    part began, by sample, as vLLM's output processor holds it (the step thread is parked): a
    running engine request's state, or — one of ``n`` samples that finished — its final output,
    waiting in the parent request for its siblings. ``since``: its ids and logprobs from that
    token of the part on (a checkpoint copies only what is new); the spans cover the whole part."""
    processor = llm.llm_engine.output_processor
    pieces: dict[int, Piece] = {}
    for internal, sample in track.parts.values():
        parent, children = _samples_of(processor, internal) if sample is None else (None, [internal])
        for i, child in enumerate(children):
            state, at = processor.request_states.get(child), i if sample is None else sample
            if state is not None:
                detok, lps = state.detokenizer, state.logprobs_processor.logprobs
                pieces[at] = Piece(detok.output_token_ids[since:], lps[since:] if lps else lps,
                                   detok.get_next_output_text(True, False) if not since else "",
                                   state_spans(state, version_of), None)
            elif parent is not None and parent.output_aggregator and parent.output_aggregator[i] is not None:
                done = parent.output_aggregator[i]
                pieces[at] = Piece(list(done.token_ids)[since:], done.logprobs[since:] if done.logprobs else done.logprobs,
                                   done.text or "", label_spans(done, version_of), done.finish_reason)
    return pieces


def sample_states(llm: Any, rid: str) -> dict[int, Any]:
    """The async engine's output-processor state of each running sample of request ``rid``
    (n > 1: one child request each), by sample index."""
    processor = llm.output_processor
    states = (processor.request_states.get(i) for i in processor.external_req_ids.get(rid, ()))
    return {s.request_index: s for s in states if s is not None}


def running_starts(llm: Any, rid: str, sample: int) -> list[tuple[Any, int]]:
    """Where each label of a running sample of the async engine's request ``rid`` begins."""
    state = sample_states(llm, rid).get(sample)
    return list(state.weight_version_starts) if state is not None else []


def made_so_far(state: Any) -> int:
    """Tokens a running request (its output-processor state) has generated."""
    made: int = state.detokenizer.num_output_tokens()
    return made


def unfinished(front: Any) -> Unfinished:
    """vLLM's own account of the requests an engine (``LLMEngine`` or ``AsyncLLM``) holds: its
    output processor's state, which an abort removes at once: (request id, tokens so far)."""
    return Unfinished(tuple((rid, made_so_far(state)) for rid, state in list(front.output_processor.request_states.items())))


def metrics(front: Any) -> list[dict[str, Any]]:
    """vLLM's own stats of an engine (its Prometheus series) as plain dicts; empty unless on."""
    if not getattr(front, "log_stats", False):
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


def core_exit_codes(front: Any) -> list[int | None]:
    """The exit codes of the engine's EngineCore processes (None: still running; negative: the
    signal that ended it), from vLLM's process manager (``CoreEngineProcManager.processes``);
    empty when it keeps none (an in-process core)."""
    client = getattr(front, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return [proc.exitcode for proc in getattr(manager, "processes", None) or ()]
