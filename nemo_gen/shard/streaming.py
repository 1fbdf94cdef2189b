"""What a streamed request carries from the engine to the router, as plain data.

A stream (``Engine.stream``, ``ShardHost.generate_stream``) is a sequence of ``StreamDeltas``
items and then one ``RequestResult`` (``nemo_gen.core.wire``): the same result a ``generate``
call returns, so the streamed tokens and the finished result cannot disagree. A delta
(``SampleDelta``) is one sample's progress since the previous item, its ``weight_versions`` the
spans of those tokens only. ``Cursor`` cuts deltas out of a request's
``Track`` (``nemo_gen.shard.batch``) — a sample that a refit cut and resumed on new weights goes
on in the same track, so its stream goes on too, under the new version. ``merge`` joins the
deltas of steps a slow reader let pile up into one per sample.
"""

from __future__ import annotations

from typing import Any, Iterable

from nemo_gen.core.wire import SampleDelta
from nemo_gen.core.migration import add_span
from nemo_gen.shard.batch import Track


def span_slice(spans: Iterable[Any], start: int, end: int) -> tuple[tuple[Any, int], ...]:
    """The (version, count) spans of tokens ``start:end`` of a sample whose spans are ``spans``."""
    out: list[list[Any]] = []
    at = 0
    for version, count in spans:
        lo, hi = max(start, at), min(end, at + count)
        add_span(out, version, hi - lo)
        at += count
    return tuple((v, n) for v, n in out)


class Cursor:
    """What of a track's samples a stream has sent; ``deltas()`` returns what came since."""

    def __init__(self, track: Track):
        self.track = track
        self._sent = [(0, 0, False) for _ in track.samples]  # tokens, text characters, finished

    def deltas(self) -> list[SampleDelta]:
        out = []
        for k, s in enumerate(self.track.samples):
            tokens, chars, finished = self._sent[k]
            done = s.finish_reason is not None
            if finished or (len(s.tokens) == tokens and len(s.text) == chars and not done):
                continue
            out.append(SampleDelta(k, s.tokens[tokens:], s.text[chars:], s.logprobs[tokens:],
                                   span_slice(s.spans, tokens, len(s.tokens)), s.finish_reason))
            self._sent[k] = (len(s.tokens), len(s.text), done)
        return out


def merge(deltas: Iterable[SampleDelta]) -> list[SampleDelta]:
    """Deltas of the same sample joined in order, one per sample (in order of first appearance)."""
    by_sample: dict[int, list[SampleDelta]] = {}
    for d in deltas:
        by_sample.setdefault(d.sample, []).append(d)
    out = []
    for sample, parts in by_sample.items():
        if len(parts) == 1:
            out.append(parts[0])
            continue
        spans: list[list[Any]] = []
        for d in parts:
            for version, count in d.weight_versions:
                add_span(spans, version, count)
        finish = None
        for d in parts:
            finish = d.finish_reason or finish
        out.append(SampleDelta(sample, [t for d in parts for t in d.token_ids], "".join(d.text for d in parts),
                               [lp for d in parts for lp in d.logprobs], tuple((v, n) for v, n in spans), finish))
    return out
