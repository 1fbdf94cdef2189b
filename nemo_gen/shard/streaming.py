"""What a streamed request carries from the engine to the router, as plain data.

A stream (``Engine.stream``, ``ShardActor.generate_stream``) is a sequence of items
``{"deltas": [delta, ...]}`` and then one ``{"result": ...}``: the same result dict a
``generate`` call returns, so the streamed tokens and the finished result cannot disagree. A
delta is one sample's progress since the previous item:

    {"sample": k, "token_ids": [...], "text": "...", "logprobs": [...],
     "weight_versions": [[version, count], ...], "finish_reason": None | "length" | ...}

its ``weight_versions`` the spans of those tokens only. ``Cursor`` cuts deltas out of a request's
``Track`` (``nemo_gen.shard.batch``) — a sample that a refit cut and resumed on new weights goes
on in the same track, so its stream goes on too, under the new version. ``merge`` joins the
deltas of steps a slow reader let pile up into one per sample.
"""

from __future__ import annotations

from typing import Any, Iterable

from nemo_gen.shard.batch import Track, add_span


def span_slice(spans: Iterable[Any], start: int, end: int) -> list[list[Any]]:
    """The (version, count) spans of tokens ``start:end`` of a sample whose spans are ``spans``."""
    out: list[list[Any]] = []
    at = 0
    for version, count in spans:
        lo, hi = max(start, at), min(end, at + count)
        add_span(out, version, hi - lo)
        at += count
    return out


class Cursor:
    """What of a track's samples a stream has sent; ``deltas()`` returns what came since."""

    def __init__(self, track: Track):
        self.track = track
        self._sent = [(0, 0, False) for _ in track.samples]  # tokens, text characters, finished

    def deltas(self) -> list[dict[str, Any]]:
        out = []
        for k, s in enumerate(self.track.samples):
            tokens, chars, finished = self._sent[k]
            done = s.finish_reason is not None
            if finished or (len(s.tokens) == tokens and len(s.text) == chars and not done):
                continue
            out.append({"sample": k, "token_ids": s.tokens[tokens:], "text": s.text[chars:],
                        "logprobs": s.logprobs[tokens:], "weight_versions": span_slice(s.spans, tokens, len(s.tokens)),
                        "finish_reason": s.finish_reason})
            self._sent[k] = (len(s.tokens), len(s.text), done)
        return out


def merge(deltas: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of the same sample joined in order, one per sample (in order of first appearance)."""
    by_sample: dict[int, dict[str, Any]] = {}
    for d in deltas:
        m = by_sample.get(d["sample"])
        if m is None:
            by_sample[d["sample"]] = {**d, "token_ids": list(d["token_ids"]), "logprobs": list(d["logprobs"]),
                                      "weight_versions": [list(s) for s in d["weight_versions"]]}
            continue
        m["token_ids"] += d["token_ids"]
        m["logprobs"] += d["logprobs"]
        m["text"] += d["text"]
        for version, count in d["weight_versions"]:
            add_span(m["weight_versions"], version, count)
        m["finish_reason"] = d["finish_reason"] or m["finish_reason"]
    return list(by_sample.values())
