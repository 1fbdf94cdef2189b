"""Fleet results into OpenAI responses, on vLLM's protocol models: whole bodies
(``completion_response``, ``chat_response``) and streams (``StreamFormat``), with logprobs, token
ids, and the ``nemo_gen`` provenance object every body and every choice carries (``weight_version``,
``shard``, ``weight_versions``). Requests in: ``nemo_gen.server.protocol``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Iterator, Sequence

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import UsageInfo
from vllm.logprobs import Logprob

from nemo_gen.core.detokenize import IncrementalText
from nemo_gen.core.migration import add_span
from nemo_gen.server.protocol import Call



def samples_of(result: Any) -> list[Any]:
    """The result's samples (``n`` of them); a fleet without ``n`` support: the result itself."""
    return list(getattr(result, "samples", None) or []) or [result]


def spans_of(item: Any) -> list[list[Any]]:
    return [[v, n] for v, n in (getattr(item, "weight_versions", None) or [])]


def digests_of(item: Any) -> list[str | None]:
    """The weight digest beside each of ``spans_of(item)`` (None: not digested)."""
    spans, digests = spans_of(item), list(getattr(item, "weight_digests", None) or [])
    return digests if len(digests) == len(spans) else [None] * len(spans)


def provenance(results: Sequence[Any]) -> dict[str, Any]:
    """The body's ``nemo_gen`` object: the weight version that produced the response (the oldest
    of its results, when several prompts were served under different versions), the shard (None
    when several served it), and the version spans (one prompt)."""
    versions = [r.weight_version for r in results]
    known = [v for v in versions if v is not None]
    shards = {r.shard for r in results}
    out = {"weight_version": min(known) if known else None,
           "shard": next(iter(shards)) if len(shards) == 1 else None}
    if len(results) == 1:
        out["weight_versions"] = spans_of(results[0])
        out["weight_digests"] = digests_of(results[0])
        if moves := getattr(results[0], "migrations", None):  # it went on elsewhere when a shard was lost
            out["migrations"] = [{"from_shard": m.from_shard, "at_token": m.at_token, "sample": m.sample,
                                  "cause": str(m.cause)} for m in moves]
    adapters = {(r.adapter, r.adapter_version) for r in results if getattr(r, "adapter", None) is not None}
    if adapters:  # a LoRA adapter's request (the ``model`` field): its name and version
        out["adapter"], out["adapter_version"] = min(adapters)
    return out


def _choice_provenance(result: Any, sample: Any) -> dict[str, Any]:
    item = sample if spans_of(sample) else result
    spans = spans_of(item)
    return {"shard": result.shard, "weight_version": spans[-1][0] if spans else result.weight_version,
            "weight_versions": spans, "weight_digests": digests_of(item)}


def _usage(results: Sequence[Any]) -> UsageInfo:
    prompt = sum(len(r.prompt_token_ids) for r in results)
    completion = sum(len(s.token_ids) for r in results for s in samples_of(r))
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


class Detokenizer:
    """Token strings and text pieces from the fleet's tokenizer (the driver's copy)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def pieces(self, token_ids: Sequence[int], text: str) -> list[str]:
        """One text piece per token, in order, that join to exactly ``text`` (the engine's text:
        stop strings already cut). A token that completes no character gets ""; whatever the
        pieces cannot place goes to the last piece. Linear in the tokens (``IncrementalText``)."""
        ids = list(token_ids)
        if not ids:
            return [text] if text else []
        decoded, pieces, sent, placing = IncrementalText(self.tokenizer), [], 0, True
        for token in ids:
            piece = decoded.add([token])
            if not placing:
                piece = ""
            elif text.startswith(piece, sent):
                sent += len(piece)
            else:  # the engine's text parts from the tokens' here (a stop string cut it): the rest at the end
                common = 0
                while common < len(piece) and sent + common < len(text) and piece[common] == text[sent + common]:
                    common += 1
                piece, sent, placing = piece[:common], sent + common, False
            pieces.append(piece)
        pieces[-1] += text[sent:]
        return pieces


def _tops(entries: Sequence[dict[int, float]] | None, count: int, k: int) -> list[list[tuple[int, float]]]:
    """Each token's first ``k`` alternatives as the engine listed them (the sampled token first,
    then by rank: what vLLM's server shows); none asked (``k`` 0) or none kept: empty lists."""
    if not k or not entries:
        return [[] for _ in range(count)]
    return [list(entry.items())[:k] for entry in entries]


def _completion_logprobs(detok: Detokenizer, sample: Any, pieces: list[str] | None, k: int = 0) -> CompletionLogProbs:
    tokens = [detok.token(t) for t in sample.token_ids]
    lps = [max(float(x), -9999.0) for x in sample.logprobs]
    offsets, at = [], 0
    for piece in pieces if pieces is not None else detok.pieces(sample.token_ids, sample.text or ""):
        offsets.append(at)
        at += len(piece)
    tops = _tops(getattr(sample, "top_logprobs", None), len(tokens), k)
    top = [({detok.token(t): max(v, -9999.0) for t, v in alts} if alts else {tok: lp})
           for tok, lp, alts in zip(tokens, lps, tops)]
    return CompletionLogProbs(text_offset=offsets, token_logprobs=lps, tokens=tokens, top_logprobs=top)


def _logprob(detok: Detokenizer, token_id: int, logprob: float) -> ChatCompletionLogProb:
    tok = detok.token(token_id)
    return ChatCompletionLogProb(token=tok, logprob=max(float(logprob), -9999.0), bytes=list(tok.encode("utf-8")))


def _chat_logprobs(detok: Detokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[dict[int, float]] | None = None, k: int = 0) -> ChatCompletionLogProbs:
    content = []
    for tid, lp, alts in zip(token_ids, logprobs, _tops(top, len(token_ids), k)):
        one = _logprob(detok, tid, lp)
        content.append(ChatCompletionLogProbsContent(token=one.token, logprob=one.logprob, bytes=one.bytes,
                                                     top_logprobs=[_logprob(detok, t, v) for t, v in alts]))
    return ChatCompletionLogProbs(content=content)


def prompt_logprobs(detok: Detokenizer, result: Any) -> list[dict[int, Logprob] | None] | None:
    """The prompt's logprobs in vLLM's shape (token id -> Logprob, the first token's None)."""
    entries = getattr(result, "prompt_logprobs", None)
    if entries is None:
        return None
    return [None if e is None else {t: Logprob(logprob=max(v, -9999.0), decoded_token=detok.token(t))
                                    for t, v in e.items()} for e in entries]


def _choices(call: Call, results: Sequence[Any]) -> Iterator[tuple[int, Any, Any]]:
    """(choice index, result, sample): prompt-major, as OpenAI numbers them."""
    for i, result in enumerate(results):
        for k, sample in enumerate(samples_of(result)):
            yield i * call.n + k, result, sample


# A response of at most this many tokens, without logprobs, tool or reasoning parsing, is built on
# the event loop (tens of microseconds); a thread hop per response (submit, wake-up, GIL hand-over)
# cost more server CPU than the building. Larger or heavier ones are built off the loop.
ON_LOOP_TOKENS = 4096


def light(call: Call, results: Sequence[Any]) -> bool:
    """Whether ``call``'s response from ``results`` is cheap enough to build on the event loop."""
    if call.logprobs or call.prompt_logprobs is not None or call.turn is not None:
        return False
    return sum(len(s.token_ids) for r in results for s in samples_of(r)) <= ON_LOOP_TOKENS


async def built(build: Callable[..., Any], call: Call, model: str, results: list[Any], *args: Any) -> Any:
    """``build``'s response: on the loop when light (``light``), else off it."""
    if light(call, results):
        return build(call, model, results, *args)
    return await asyncio.to_thread(build, call, model, results, *args)


def completion_response(call: Call, model: str, results: Sequence[Any], detok: Detokenizer,
                        response_id: str | None = None) -> CompletionResponse:
    choices = []
    for index, result, sample in _choices(call, results):
        choices.append(CompletionResponseChoice(
            index=index, text=sample.text or "", finish_reason=sample.finish_reason,
            logprobs=_completion_logprobs(detok, sample, None, call.top_logprobs) if call.logprobs else None,
            token_ids=list(sample.token_ids) if call.token_ids else None,
            prompt_token_ids=list(result.prompt_token_ids) if call.token_ids else None,
            prompt_logprobs=prompt_logprobs(detok, result),
            nemo_gen=_choice_provenance(result, sample),
        ))
    extra = {"id": response_id} if response_id else {}
    return CompletionResponse(model=model, choices=choices, usage=_usage(results), nemo_gen=provenance(results),
                              **extra)


def chat_response(call: Call, model: str, results: Sequence[Any], detok: Detokenizer,
                  response_id: str | None = None) -> ChatCompletionResponse:
    choices = []
    for index, result, sample in _choices(call, results):
        if call.turn is not None:
            message, finish_reason = call.turn.message(sample.text or "", sample.token_ids, sample.finish_reason)
        else:
            message, finish_reason = ChatMessage(role="assistant", content=sample.text or ""), sample.finish_reason
        logprobs = None
        if call.logprobs:
            logprobs = _chat_logprobs(detok, sample.token_ids, sample.logprobs, getattr(sample, "top_logprobs", None),
                                      call.top_logprobs)
        choices.append(ChatCompletionResponseChoice(
            index=index, message=message, finish_reason=finish_reason, logprobs=logprobs,
            token_ids=list(sample.token_ids) if call.token_ids else None,
            nemo_gen=_choice_provenance(result, sample),
        ))
    extra = {"id": response_id} if response_id else {}
    prompt_ids = list(results[0].prompt_token_ids) if call.token_ids else None
    return ChatCompletionResponse(model=model, choices=choices, usage=_usage(results), nemo_gen=provenance(results),
                                  prompt_token_ids=prompt_ids, prompt_logprobs=prompt_logprobs(detok, results[0]),
                                  **extra)


# --------------------------------------------------------------------------------------------
# streams: server-sent events as the fleet generates


def sse(payload: Any) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


class StreamFormat:
    """The chunks of one streamed response, made as the fleet's deltas (``Delta``) arrive.

    Completions: one chunk per delta (the tokens one engine step — or, behind a slow reader,
    several — made for one choice: their text, and logprobs / token ids when asked). Chat: a role
    chunk per choice first, then the same. A choice's last chunk carries its ``finish_reason``
    and its own ``nemo_gen`` (shard, version of its last token, ``weight_versions`` spans of all
    its tokens); the stream's final chunk (no choices; ``usage`` with
    ``stream_options.include_usage``) carries the response's ``nemo_gen``; then ``[DONE]``."""

    def __init__(self, call: Call, model: str, detok: Detokenizer, response_id: str, chat: bool):
        self.call, self.model, self.detok, self.id, self.chat = call, model, detok, response_id, chat
        self.created = int(time.time())
        self.spans: dict[int, list[list[Any]]] = {}  # choice index -> its tokens' version spans so far
        self.digests: dict[Any, str | None] = {}  # version -> the digest of its weights (deltas say)
        self.chars: dict[int, int] = {}  # choice index -> text characters sent (completion logprob offsets)
        self.turns: dict[int, Any] = {}  # choice index -> its tools.StreamedTurn (a parser per choice)

    def _chunk(self, choices: list[Any], **extra: Any) -> str:
        cls = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return sse(_dump(cls(id=self.id, created=self.created, model=self.model, choices=choices, **extra)))

    def start(self) -> list[str]:
        if not self.chat:
            return []
        return [self._chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(len(self.call.prompts) * self.call.n)]

    def _message(self, index: int, prompt: int, d: Any) -> tuple[DeltaMessage | None, str | None]:
        if self.call.turn is None:
            return DeltaMessage(content=d.text), d.finish_reason
        turn = self.turns.get(index)
        if turn is None:
            ids = self.call.prompts[prompt]
            ids = list(ids) if ids and isinstance(ids[0], int) else None
            turn = self.turns[index] = self.call.turn.stream(ids)
        return turn.delta(d.text, d.token_ids, d.finish_reason)

    def delta(self, prompt: int, d: Any) -> str:
        """The chunk of one delta ("" when a parser holds its text back and nothing else is due)."""
        index = prompt * self.call.n + d.sample
        spans = self.spans.setdefault(index, [])
        for version, count in d.weight_versions:
            add_span(spans, version, count)
        self.digests.update((v, dg) for (v, _), dg in zip(d.weight_versions, digests_of(d)) if dg is not None)
        prov = None
        if d.finish_reason is not None:
            prov = {"shard": d.shard, "weight_version": spans[-1][0] if spans else None,
                    "weight_versions": [list(s) for s in spans],
                    "weight_digests": [self.digests.get(s[0]) for s in spans]}
        ids = list(d.token_ids) if self.call.token_ids else None
        if self.chat:
            logprobs = _chat_logprobs(self.detok, d.token_ids, d.logprobs) if self.call.logprobs else None
            message, finish_reason = self._message(index, prompt, d)
            if message is None and finish_reason is None and logprobs is None and ids is None:
                return ""
            choice = ChatCompletionResponseStreamChoice(index=index, delta=message or DeltaMessage(), logprobs=logprobs,
                                                        finish_reason=finish_reason, token_ids=ids, nemo_gen=prov)
        else:
            at = self.chars.get(index, 0)
            self.chars[index] = at + len(d.text)
            logprobs = None
            if self.call.logprobs:
                tokens = [self.detok.token(t) for t in d.token_ids]
                offsets = []
                for tok in tokens:
                    offsets.append(at)
                    at += len(tok)
                lps = [float(x) for x in d.logprobs]
                logprobs = CompletionLogProbs(text_offset=offsets, token_logprobs=lps, tokens=tokens,
                                              top_logprobs=[{tok: lp} for tok, lp in zip(tokens, lps)])
            choice = CompletionResponseStreamChoice(index=index, text=d.text, logprobs=logprobs,
                                                    finish_reason=d.finish_reason, token_ids=ids, nemo_gen=prov)
        return self._chunk([choice])

    def end(self, results: Sequence[Any]) -> list[str]:
        usage = _usage(results) if self.call.include_usage else None
        return [self._chunk([], usage=usage, nemo_gen=provenance(results)), sse("[DONE]")]
