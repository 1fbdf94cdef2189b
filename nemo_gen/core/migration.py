"""Migration: a request whose shard is lost goes on elsewhere from the tokens it had made.

``fleet.migration`` on: while a request runs, the driver holds its tokens so far
(``Checkpoints``: each sample's tokens, logprobs and weight-version spans, filled from the
shard's ``RequestProgress`` answers). When its shard is lost (dead, condemned by its probes,
drained), ``Migrations.lost`` turns the request into one continuation per unfinished sample: a
request of prompt + kept tokens, one sample, ``continues`` fewer tokens to make, which the
engine it lands on prefills and goes on from. Its answer is joined to what was kept
(``Migrations.answered``): every earlier token keeps its logprob and version span, and the
result says where it moved (``Moved``: from-shard, at-token). A loss that kept no token is a
plain re-route, which counts against ``fleet.max_reroutes``; one that kept tokens does not.

Greedy decoding makes the same tokens as an uninterrupted run (the continuation's prefill
recomputes the same context). Sampled decoding keeps the tokens made before the move; those
after it are a fresh draw (a seeded request's generator starts again at its sample's seed on the
new engine), so they match an uninterrupted run's only in distribution. Pure logic: no engine types.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from nemo_gen.core.results import GenerationRequest, MoveCause, Moved
from nemo_gen.core.wire_generation import RequestProgress, RequestResult, SampleProgress, SampleResult, Sampling


class MigrationMode(enum.StrEnum):
    """``fleet.migration.mode``."""

    OFF = "off"  # a lost shard's requests start again from their prompts (fleet.max_reroutes)
    ON = "on"  # the driver checkpoints running requests; a lost shard's go on from their tokens


def span_prefix(spans: Sequence[Sequence[Any]], count: int) -> list[list[Any]]:
    """The first ``count`` tokens' spans of ``spans`` ([version, tokens] in generation order)."""
    out: list[list[Any]] = []
    for version, n in spans:
        add_span(out, version, min(n, count))
        count -= min(n, count)
    return out


def add_span(spans: list[list[Any]], version: int | None, count: int) -> None:
    """Extend ``spans`` ([version, tokens] in generation order) by ``count`` tokens of ``version``."""
    if count <= 0:
        return
    if spans and spans[-1][0] == version:
        spans[-1][1] += count
    else:
        spans.append([version, count])


def add_spans(spans: list[list[Any]], more: Iterable[Sequence[Any]]) -> None:
    for version, n in more:
        add_span(spans, version, n)


@dataclass
class Kept:
    """One sample's tokens as the driver knows them: ids, logprobs, version spans; its finish
    reason once a checkpoint saw it finish."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[Any]] = field(default_factory=list)
    finish_reason: str | None = None

    def apply(self, progress: SampleProgress) -> None:
        """A checkpoint's tokens from ``progress.start`` on (they replace what was known past it).
        A checkpoint past what is known (a gap) is skipped: the next one, asked from what is known, fills it."""
        start = progress.start
        if start > len(self.token_ids):
            return
        ids, lps = progress.token_ids, progress.logprobs
        count = min(len(ids), len(lps)) if lps else len(ids)  # read while the engine stepped: the shorter
        self.token_ids[start:] = ids[:count]
        self.logprobs[start:] = lps[:count]
        self.spans = span_prefix(self.spans, start)
        add_spans(self.spans, span_prefix(progress.weight_versions, count))
        if progress.finish_reason is not None and count == len(ids):
            self.finish_reason = progress.finish_reason

    def extend(self, more: "Kept | SampleResult") -> None:
        """``more``'s tokens after these (a continuation's checkpoint or its answer)."""
        spans = more.spans if isinstance(more, Kept) else more.weight_versions
        self.token_ids = self.token_ids + list(more.token_ids)
        self.logprobs = self.logprobs + list(more.logprobs)
        add_spans(self.spans, spans)
        self.finish_reason = more.finish_reason

    def as_result(self) -> SampleResult:
        return SampleResult(list(self.token_ids), list(self.logprobs), None, self.finish_reason or "abort",
                            tuple((v, n) for v, n in self.spans))


class Checkpoints:
    """What the driver knows of each running request's tokens, by its key (``GenerationRequest.key``)."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Kept]] = {}

    def known(self, keys: Iterable[str]) -> tuple[tuple[str, int], ...]:
        """(key, tokens known of its least advanced sample): what a progress call asks past."""
        return tuple((k, min((len(s.token_ids) for s in self._kept.get(k, ())), default=0)) for k in keys)

    def apply(self, progress: Iterable[RequestProgress]) -> None:
        for req in progress:
            samples = self._kept.setdefault(req.key, [])
            for p in req.samples:
                while len(samples) <= p.sample:
                    samples.append(Kept())
                samples[p.sample].apply(p)

    def tokens(self) -> dict[str, list[list[int]]]:
        """Each key's samples' token ids known now (a copy)."""
        return {k: [list(s.token_ids) for s in samples] for k, samples in self._kept.items()}

    def take(self, key: str | None) -> list[Kept]:
        """What is known of ``key``'s samples, forgotten here (its request moves on)."""
        return [] if key is None else self._kept.pop(key, [])


@dataclass
class Migration:
    """One request on the move: each sample's kept tokens, the continuations in flight (key ->
    sample), where it moved."""

    request: GenerationRequest
    samples: list[Kept]
    moves: list[Moved] = field(default_factory=list)
    running: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class Migrations:
    """The requests of one call that moved. ``max_tokens``, ``n``: the call's sampling."""

    def __init__(self, sampling: Sampling):
        self.max_tokens = sampling.max_new_tokens
        self.n = sampling.n
        self._by_index: dict[int, Migration] = {}
        self._serial = itertools.count()

    @staticmethod
    def keyed(requests: Iterable[GenerationRequest], call: str) -> list[GenerationRequest]:
        """``requests`` each with a key of its own (``call``: the call's name, unique in the fleet)."""
        return [dataclasses.replace(r, key=f"{call}:{r.index}") for r in requests]

    def moves(self, index: int) -> list[Moved]:
        m = self._by_index.get(index)
        return [] if m is None else list(m.moves)

    def lost(self, req: GenerationRequest, shard: int, kept: list[Kept],
             cause: MoveCause = MoveCause.LOST) -> list[GenerationRequest] | None:
        """``req``'s shard was lost (or drained: ``cause``) after it had made ``kept`` (by sample;
        ``Checkpoints.take``): the requests that carry it on from those tokens, or None when it
        kept none (then it is sent again as it is, a re-route that counts unless drained)."""
        if req.continues is None:
            if not any(k.token_ids for k in kept):
                return None
            samples = kept + [Kept() for _ in range(self.n - len(kept))]
            m = self._by_index[req.index] = Migration(req, samples)
            going = [i for i, k in enumerate(samples) if not self._done(k)]
            m.moves += [Moved(shard, len(samples[i].token_ids), i, cause) for i in going]
            return [self._continuation(m, i) for i in going]
        m = self._by_index[req.index]
        key = req.key or ""
        sample = m.running.pop(key)
        more = kept[0] if kept else Kept()
        if not more.token_ids and more.finish_reason is None:
            m.running[key] = sample
            return None  # nothing new: the same continuation is sent again, a re-route that counts
        m.samples[sample].extend(more)
        if not self._done(m.samples[sample]):
            m.moves.append(Moved(shard, len(m.samples[sample].token_ids), sample, cause))
            return [self._continuation(m, sample)]
        return []

    def _done(self, kept: Kept) -> bool:
        if kept.finish_reason is None and len(kept.token_ids) >= self.max_tokens:
            kept.finish_reason = "length"
        return kept.finish_reason is not None

    def _continuation(self, m: Migration, sample: int) -> GenerationRequest:
        kept = m.samples[sample]
        key = f"{m.request.key}/{sample}.{next(self._serial)}"
        m.running[key] = sample
        return GenerationRequest(index=m.request.index, prompt_token_ids=list(m.request.prompt_token_ids) + kept.token_ids,
                                 prompt=None, key=key, continues=len(kept.token_ids), sample=sample)

    def pending(self, index: int) -> bool:
        m = self._by_index.get(index)
        return m is not None and bool(m.running)

    def answered(self, req: GenerationRequest, raw: RequestResult) -> RequestResult | None:
        """A shard's answer for ``req``: the request's whole result (a continuation's joined to
        what its request kept), or None while other samples of it still run."""
        if req.continues is None:
            return raw
        m = self._by_index[req.index]
        sample = m.running.pop(req.key or "")
        if raw.error or not raw.samples:
            m.error = m.error or raw.error or "RuntimeError: the shard answered no sample"
        else:
            m.samples[sample].extend(raw.samples[0])
        if m.running:
            return None
        if m.error:
            return RequestResult.failed(req.index, m.error)
        return RequestResult(req.index, tuple(k.as_result() for k in m.samples))

    def whole(self, index: int) -> RequestResult | None:
        """The result of request ``index`` once no sample of it runs (every sample finished by its
        checkpoints: a loss left nothing to carry on); None while one runs or it never moved."""
        m = self._by_index.get(index)
        if m is None or m.running:
            return None
        return RequestResult(index, tuple(k.as_result() for k in m.samples))

    def request(self, req: GenerationRequest) -> GenerationRequest:
        """The caller's request that ``req`` (maybe a continuation of it) stands for."""
        m = self._by_index.get(req.index)
        return req if m is None or req.continues is None else m.request
