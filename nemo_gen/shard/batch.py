"""One request of a batch as the sync engine's step loop follows it: for each of its ``n``
samples, the tokens it has been told of (``Piece``s: every step's for a stream; for a batch, the
final output, or what a cut read from the engine) with the weight version each was sampled
under.

The engine runs a request as one vLLM request (n samples share one prefill). A refit that lands
while it runs (``refit.in_flight``: ``keep`` past ``refit.max_staleness``, or ``abort``) may cut
it: resumed, vLLM preempts it and it goes on under the same request, its KV recomputed on the
new weights (``swap.Swap``); not resumed (``refit.resume_aborted`` off), it is aborted and
``Track`` closes its partial result. Either way the result's ``weight_versions`` spans cover
every token of every sample in generation order. Plain data: no vLLM types beyond the
completion outputs it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from nemo_gen.core.migration import add_span
from nemo_gen.core.results import GenerationRequest
from nemo_gen.core.wire import RequestResult, SampleResult, pairs


def sampled_by(version: int | None) -> Callable[[Any], list[tuple[Any, int]]]:
    """``Track.observe``'s ``spans_of`` for a step's delta outputs: every new token from ``version``."""
    return lambda comp: [(version, len(comp.token_ids))]


def spans_between(starts: list[tuple[Any, int]], lo: int, hi: int) -> list[tuple[Any, int]]:
    """Tokens ``lo`` to ``hi`` of a sample by label, from where each label began (vLLM's
    ``weight_version_starts``: (label, first token) in generation order; none: no label known)."""
    out: list[tuple[Any, int]] = []
    for i, (label, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else hi
        count = min(end, hi) - max(start, lo)
        if count > 0:
            out.append((label, count))
    covered = sum(n for _, n in out)
    if covered < hi - lo:  # tokens before the first label (none was reported for them)
        out.insert(0, (None, hi - lo - covered))
    return out


@dataclass
class Piece:
    """Tokens one sample made in one stretch: a step's delta, a final output, or what a request
    that a refit cuts had made so far. ``spans``: ([version, count] in generation order) over
    ``token_ids``; ``logprobs``: vLLM's per-token entries (or None)."""

    token_ids: list[int]
    logprobs: Any
    text: str
    spans: list[tuple[Any, int]]
    finish_reason: str | None


def top_entries(logprobs: Any) -> list[dict[int, float]]:
    """vLLM's per-token logprob entries as {token id: logprob}: the sampled token and the top
    alternatives the request asked for (``SamplingParams.logprobs``)."""
    return [{int(t): float(lp.logprob) for t, lp in entry.items()} for entry in logprobs or ()]


def prompt_entries(prompt_logprobs: Any) -> list[dict[int, float] | None] | None:
    """vLLM's ``RequestOutput.prompt_logprobs`` the same way (the first token's is None)."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else {int(t): float(lp.logprob) for t, lp in entry.items()}
            for entry in prompt_logprobs]


def prompt_result(entries: list[dict[int, float] | None] | None) -> tuple[Any, ...] | None:
    """``prompt_entries`` as the wire's ``RequestResult.prompt_logprobs``."""
    return None if entries is None else tuple(None if e is None else pairs(e) for e in entries)


@dataclass
class SampleTrack:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    spans: list[list[Any]] = field(default_factory=list)
    finish_reason: str | None = None
    top: list[dict[int, float]] | None = None  # each token's alternatives, when the request asked for them
    decoded: bool = True  # the engine decodes its text; else the result's text is None (the caller decodes)

    def add(self, piece: Piece) -> None:
        for version, count in piece.spans:
            add_span(self.spans, version, count)
        self.tokens += piece.token_ids
        if piece.logprobs:
            self.logprobs += [float(lp[tok].logprob) for tok, lp in zip(piece.token_ids, piece.logprobs)]
            if self.top is not None:
                self.top += top_entries(piece.logprobs)
        self.text += piece.text
        if piece.finish_reason is not None:
            self.finish_reason = piece.finish_reason

    def as_result(self) -> SampleResult:
        return SampleResult(self.tokens, self.logprobs, self.text if self.decoded else None, self.finish_reason,
                            tuple((v, n) for v, n in self.spans),
                            None if self.top is None else tuple(pairs(t) for t in self.top))


@dataclass
class Track:
    req: GenerationRequest
    params: Any  # vLLM SamplingParams of the request (n samples)
    max_tokens: int  # what the caller asked for, per sample
    samples: list[SampleTrack]
    # The engine requests it is made of now: output id -> (internal id, the sample it carries, or
    # None for the original request, whose outputs name their sample by index).
    parts: dict[str, tuple[str, int | None]] = field(default_factory=dict)
    result: RequestResult | None = None
    # Its engine requests report only their final outputs (an unstreamed batch): what a running
    # part has made is in the engine's request state until then, not here.
    final_only: bool = False
    prompt_logprobs: list[Any] | None = None  # the prompt's, when the request asked for them

    @classmethod
    def start(cls, req: GenerationRequest, params: Any, rid: str, internal_id: str,
              final_only: bool = False) -> "Track":
        n = max(1, int(getattr(params, "n", 1) or 1))
        top, decoded = bool(getattr(params, "logprobs", 0)), bool(getattr(params, "detokenize", True))
        return cls(req, params, params.max_tokens,
                   [SampleTrack(top=[] if top else None, decoded=decoded) for _ in range(n)],
                   {rid: (internal_id, None)}, final_only=final_only)

    def observe(self, rid: str, out: Any, spans_of: Callable[[Any], list[tuple[Any, int]]]) -> bool:
        """An output of part ``rid`` (a step's delta, or a final output); ``spans_of(completion)``:
        its tokens' versions. True when the whole request is finished."""
        _, sample = self.parts[rid]
        if self.prompt_logprobs is None and getattr(out, "prompt_logprobs", None) is not None:
            self.prompt_logprobs = prompt_entries(out.prompt_logprobs)
        for comp in out.outputs:
            piece = Piece(list(comp.token_ids), comp.logprobs, comp.text or "", spans_of(comp), comp.finish_reason)
            self.samples[comp.index if sample is None else sample].add(piece)
        if out.finished:
            del self.parts[rid]
            if not self.parts:
                self._close()
                return True
        return False

    def internal_ids(self) -> list[str]:
        return [internal for internal, _ in self.parts.values()]

    def abandon(self) -> RequestResult:
        """Cut and not resumed: the partial result; unfinished samples end with "abort"."""
        self.parts = {}
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = "abort"
        return self._close()

    def absorb(self, pieces: dict[int, Piece]) -> None:
        """What each running sample had made (``pieces`` by sample), read from the engine as a
        cut stops its part: the part's final output never comes."""
        for i, piece in pieces.items():
            self.samples[i].add(piece)

    def stale_tokens(self, current: int | None, pieces: dict[int, Piece] | None = None) -> int:
        """The most tokens any sample has from a version other than ``current`` (with
        ``pieces``: what running final-only parts have made so far, not yet absorbed)."""
        pieces = pieces or {}

        def stale(spans: Iterable[Sequence[Any]]) -> int:
            return sum(count for version, count in spans if version != current)

        return max(stale(s.spans) + stale(pieces[i].spans if i in pieces else ()) for i, s in enumerate(self.samples))

    def _close(self) -> RequestResult:
        for s in self.samples:
            s.finish_reason = s.finish_reason or "abort"
        self.result = RequestResult(self.req.index, tuple(s.as_result() for s in self.samples), None,
                                    prompt_result(self.prompt_logprobs))
        return self.result


class Running:
    """The sync engine's running batch, as its step thread and a swap's cut share it: whether a
    batch runs, its requests by the id their outputs carry (a request may be several engine
    requests), and ``on_step``: a streamed request's callback after each step and after a cut."""

    def __init__(self) -> None:
        self.generating = False
        self.tracks: dict[str, Track] = {}
        self.on_step: Callable[[], None] | None = None

    def tracks_now(self) -> list[Track]:
        """Each running request once."""
        return list({id(t): t for t in self.tracks.values()}.values())

    def drop(self, track: Track) -> None:
        """``track``'s engine requests are no longer followed (cut)."""
        for rid in list(track.parts):
            del self.tracks[rid]

    def stepped(self) -> None:
        if self.on_step is not None:
            self.on_step()

    def clear(self) -> None:
        self.tracks = {}
        self.on_step = None
