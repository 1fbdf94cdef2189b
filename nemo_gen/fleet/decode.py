"""Shard replies out as the caller's objects: a ``GenerationResult`` from a shard's answer, and a
stream's ``Delta``s from its ``StreamDeltas`` items.

Owns the output side of the router: each sample's text (the engine's own, or decoded here: a
batch's samples always — the shards leave their text to the router, whose process decodes each
sample once instead of the engine's every token — and a stream's where the engines have no
tokenizer), its weight-version spans (a reply without them was sampled wholly
under the version the shard reported), and a stream's text piece by piece so the pieces add up
to the text its final result carries. Which shard answers is ``router.py``'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable

from nemo_gen.core.digest import span_digests

from nemo_gen.core.detokenize import IncrementalText, completion_text
from nemo_gen.core.results import Delta, GenerationRequest, GenerationResult, Sample
from nemo_gen.core.wire import RequestResult, SampleDelta, SampleResult, TokenLogprobs


def _no_digest(version: int | None) -> str | None:
    return None


def decode_result(req: GenerationRequest, raw: RequestResult, shard: int, version: int | None,
                  tokenizer: Any | None, engines_decode: bool = True,
                  digest_of: Callable[[int | None], str | None] = _no_digest) -> GenerationResult:
    """The result of ``req`` from its shard's answer ``raw``; ``tokenizer`` decodes the text of
    each sample the engine did not decode (its text is None), or of every sample where the
    engines have no tokenizer (``engines_decode`` False). ``digest_of``: each version's weight
    digest, stamped beside its spans."""
    if raw.error:
        return GenerationResult.failed(req, raw.error, shard=shard)
    if not raw.samples:
        return GenerationResult.failed(req, "RuntimeError: the shard answered no sample", shard=shard)
    samples = [decode_sample(s, version, tokenizer, engines_decode, req.prompt_token_ids, digest_of)
               for s in raw.samples]
    first = samples[0]
    return GenerationResult(
        index=req.index, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids), text=first.text,
        token_ids=first.token_ids, logprobs=first.logprobs, finish_reason=first.finish_reason, shard=shard,
        weight_version=first.weight_versions[-1][0] if first.weight_versions else version,
        weight_versions=first.weight_versions, weight_digests=first.weight_digests, samples=samples,
        top_logprobs=first.top_logprobs,
        prompt_logprobs=None if raw.prompt_logprobs is None else [
            None if entry is None else as_dict(entry) for entry in raw.prompt_logprobs],
    )


def as_dict(entry: TokenLogprobs) -> dict[int, float]:
    """One token's (token id, logprob) pairs as the caller's {token id: logprob}."""
    return dict(entry)


def decode_sample(raw: SampleResult, version: int | None, tokenizer: Any | None,
                  engines_decode: bool = True, prompt_ids: Sequence[int] = (),
                  digest_of: Callable[[int | None], str | None] = _no_digest) -> Sample:
    text = raw.text
    if (text is None or not engines_decode) and raw.token_ids and tokenizer is not None:
        text = completion_text(tokenizer, prompt_ids, raw.token_ids)
    spans = [(v, n) for v, n in raw.weight_versions or [(version, len(raw.token_ids))]]
    top = None if raw.top_logprobs is None else [as_dict(entry) for entry in raw.top_logprobs]
    return Sample(text=text or "", token_ids=list(raw.token_ids), logprobs=list(raw.logprobs),
                  finish_reason=raw.finish_reason, weight_versions=spans,
                  weight_digests=span_digests(spans, digest_of), top_logprobs=top)


class StreamDecoder:
    """One stream try's deltas: each sample's text decoded as its tokens come (``SampleText``)."""

    def __init__(self, tokenizer: Any | None, digest_of: Callable[[int | None], str | None] = _no_digest):
        self.tokenizer = tokenizer
        self.digest_of = digest_of
        self.texts: dict[int, SampleText] = {}

    def delta(self, raw: SampleDelta, shard: int) -> Delta:
        text = self.texts.setdefault(raw.sample, SampleText(self.tokenizer))
        spans = [(v, n) for v, n in raw.weight_versions]
        return Delta(sample=raw.sample, token_ids=list(raw.token_ids), text=text.add(raw),
                     logprobs=list(raw.logprobs), weight_versions=spans,
                     finish_reason=raw.finish_reason, shard=shard, weight_digests=span_digests(spans, self.digest_of))


class SampleText:
    """A streamed sample's text piece by piece: the engine's own, or — engines without a
    tokenizer — decoded here as its tokens come (``IncrementalText``: linear, not a decode of all
    tokens so far per delta); the last delta gets whatever the whole decode adds at the end."""

    def __init__(self, tokenizer: Any | None):
        self.tokenizer = tokenizer
        self.text = IncrementalText(tokenizer) if tokenizer is not None else None
        self.sent = ""

    def add(self, raw: SampleDelta) -> str:
        if self.text is None:
            self.sent += raw.text
            return raw.text
        piece = self.text.add(raw.token_ids)
        if raw.finish_reason is not None:  # the whole text, as the result will carry it
            whole = self.tokenizer.decode(self.text.ids, skip_special_tokens=True)
            piece = whole[len(self.sent):] if whole.startswith(self.sent) else piece
        self.sent += piece
        return piece
