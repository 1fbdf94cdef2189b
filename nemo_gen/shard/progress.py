"""What a shard tells the driver of its running requests' tokens (``fleet.migration``), and how
a migrated sample's continuation is run.

A checkpoint (``checkpoint``) is each running sample's tokens past what the driver already
knows (``known``: key -> tokens known), with their logprobs and weight-version spans, read from
the engine's own state while it steps: the sync engine's tracks (a final-only batch's tokens are
in vLLM's output processor until the request ends, ``vllm_compat.pieces_so_far``), the async
engine's latest outputs. A continuation (``GenerationRequest.continues``) runs as one sample with
that many fewer tokens to make (``for_request``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import RequestProgress, SampleProgress
from nemo_gen.shard.streaming import span_slice

# One sample as an engine holds it, from the token the driver asked from on: (its token ids and
# their logprobs from there, the version spans of the whole sample, its finish reason).
SampleState = tuple[list[int], list[float], Iterable[Any], "str | None"]

def for_request(params: Any, req: GenerationRequest) -> Any:
    """vLLM ``SamplingParams`` for ``req``: the call's, or — a migrated sample going on — one
    sample with ``continues`` fewer tokens to make, seeded as its sample was."""
    if req.continues is None:
        return params
    own = params.clone()
    own.n = 1
    own.max_tokens = max(1, params.max_tokens - req.continues)
    if own.seed is not None:  # vLLM seeds sample k of n with seed + k: the continuation draws as its sample
        own.seed += req.sample
    return own


def sampled_logprobs(token_ids: list[int], entries: Any) -> list[float]:
    """vLLM's per-token logprob entries as the sampled tokens' logprobs."""
    return [float(lp[tok].logprob) for tok, lp in zip(token_ids, entries or ())]


def checkpoint(known: Mapping[str, int], running: Iterable[tuple[str, Callable[[int], list[SampleState]]]]
               ) -> tuple[RequestProgress, ...]:
    """Each running request the driver asked about (``known``: key -> tokens it knows) with its
    samples' tokens from there on. ``running``: (key, a reader of its samples' state now from a
    token on): only what is new is copied, so a checkpoint costs what was made since the last."""
    out = []
    for key, read in running:
        start = known.get(key)
        if start is None:
            continue
        samples = []
        for i, (ids, lps, spans, finish) in enumerate(read(start)):
            count = min(len(ids), len(lps)) if lps else len(ids)  # read while it steps: the shorter
            if count == 0 and finish is None:
                continue
            samples.append(SampleProgress(i, start, list(ids[:count]), list(lps[:count]),
                                          span_slice(spans, start, start + count),
                                          finish if count == len(ids) else None))
        if samples:
            out.append(RequestProgress(key, tuple(samples)))
    return tuple(out)
