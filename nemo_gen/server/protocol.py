"""OpenAI requests into fleet calls, fleet results into OpenAI responses — on vLLM's own protocol
models (``vllm.entrypoints.openai.*``, ``vllm.entrypoints.serve.engine.protocol``), so the
schemas are vLLM's and nothing here restates them.

A request is validated by vLLM's model, then every field it sets is either acted on or refused
by name (``ApiError`` 400 with ``param``): a field vLLM knows but nemo_gen does not act on
(``presence_penalty``, ``tools``, ``echo``...) is refused unless its value asks for nothing (the
default, or a neutral value such as a zero penalty), and so is a field neither knows. What is
acted on maps to the fleet's sampling keywords (``SAMPLING``): ``max_tokens`` /
``max_completion_tokens`` -> ``max_new_tokens``, ``stop`` -> ``stop_strings``, and ``n``,
``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop_token_ids``, ``ignore_eos``,
``bad_words`` as they are. A field left out takes the generation config's default (the
operator's), not OpenAI's 16 tokens.

Logprobs: the engines return the sampled token's logprob only, so ``logprobs: 0`` (completions)
and ``logprobs: true`` with ``top_logprobs: 0`` (chat) are served; asking for top-k
alternatives is refused rather than answered with the sampled token alone.

Every body carries a ``nemo_gen`` object (``weight_version``, ``shard``, ``weight_versions``)
and so does every choice (its own shard, version and spans).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, UsageInfo
from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.exceptions import VLLMClientError, VLLMValidationError

from nemo_gen.core.detokenize import IncrementalText
from nemo_gen.shard.batch import add_span

# OpenAI (and vLLM-extension) request fields -> the fleet's sampling keywords.
SAMPLING = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop_strings",
    "stop_token_ids": "stop_token_ids",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "bad_words": "bad_words",
    "n": "n",
}
# Fields acted on besides sampling. request_id names the response; user / session_id pick the session;
# timeout_s (nemo-gen's) is the request's deadline (a stream's: between two tokens).
_COMMON = {"model", "stream", "stream_options", "user", "session_id", "request_id", "return_token_ids", "logprobs",
           "timeout_s"}
COMPLETION_FIELDS = frozenset(_COMMON | set(SAMPLING) - {"max_completion_tokens"} | {"prompt"})
CHAT_FIELDS = frozenset(_COMMON | set(SAMPLING) | {"messages", "top_logprobs"})
# Values of fields nemo_gen does not act on that ask for nothing (besides the field's default).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "min_p": (0, 0.0), "min_tokens": (0,), "echo": (False,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none", "auto"), "parallel_tool_calls": (True, False),
    "add_generation_prompt": (True,), "skip_special_tokens": (True,), "include_reasoning": (True,),
    "best_of": (1,), "prompt_logprobs": (0,), "priority": (0,), "length_penalty": (1, 1.0),
}
_MESSAGE_KEYS = {"role", "content", "name"}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``message``, the request field it is about."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "RequestTooLargeError",
             500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s  # a 503 for load: the Retry-After header

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=sanitize_message(self.message), type=self.TYPES.get(self.status, "Error"),
                         param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()


def bad(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param)


def validation_error(exc: ValidationError) -> ApiError:
    """vLLM's model refused the body: 400 naming the first bad field (as vLLM's handler does)."""
    errors = exc.errors()
    param = None
    for err in errors:
        ctx = (err.get("ctx") or {}).get("error")
        if isinstance(ctx, VLLMValidationError):
            param = ctx.parameter
            break
    if param is None and errors:
        param = clean_loc_for_param(tuple(errors[0].get("loc") or ())) or None
    first = errors[0] if errors else {}
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return bad(f"{param}: {message}" if param else message, param)


@dataclass
class Call:
    """One OpenAI request as the fleet sees it: the prompts, the sampling keywords to pass
    (only what the request set), and how to answer."""

    prompts: list[Any]  # str | list[int] | list of chat messages
    sampling: dict[str, Any]
    session_id: str | None
    stream: bool
    include_usage: bool
    logprobs: bool
    token_ids: bool
    n: int
    request_id: str | None
    sent: frozenset[str]  # the request's own fields (errors name them as sent)
    timeout_s: float | None = None  # the request's deadline; None: the fleet's (fleet.request_timeout_s)

    @property
    def samples(self) -> int:
        """What the request asks the fleet for at once: prompts x n."""
        return len(self.prompts) * self.n


def _check_fields(body: Mapping[str, Any], model_cls: type, acted_on: frozenset[str]) -> None:
    fields = model_cls.model_fields
    for key, value in body.items():
        if key in acted_on:
            continue
        if key not in fields:
            raise bad(f"{key}: unknown field", key)
        info = fields[key]
        default = None if info.default_factory is not None else info.default
        if value is None or value == default or value in _NEUTRAL.get(key, ()):
            continue
        raise bad(f"{key}: not supported by nemo-gen serve (got {value!r})", key)


def _parse(model_cls: type, body: Any, acted_on: frozenset[str]):
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object", None)
    try:
        req = model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None
    except VLLMClientError as exc:  # raised as it is by some of vLLM's validators
        param = getattr(exc, "parameter", None)
        message = str(exc).split(" (parameter=", 1)[0]
        raise bad(f"{param}: {message}" if param else message, param) from None
    _check_fields(body, model_cls, acted_on)
    return req


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for field, key in SAMPLING.items():
        value = body.get(field)
        if value is None:
            continue
        if field == "stop":
            value = [value] if isinstance(value, str) else list(value)
            if not value:
                continue
        if field == "stop_token_ids" and not value:
            continue
        if field == "bad_words" and not value:
            continue
        if field == "n" and value == 1:
            continue  # one sample is what the fleet does anyway
        out[key] = value
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        out["max_new_tokens"] = body["max_completion_tokens"]
    return out


def _session(body: Mapping[str, Any], header: str | None) -> str | None:
    return header or body.get("session_id") or body.get("user") or None


def timeout_of(body: Mapping[str, Any], header: str | None) -> float | None:
    """The request's deadline in seconds: the body's ``timeout_s``, else the header's; None: unset."""
    value: Any = body.get("timeout_s")
    param = "timeout_s"
    if value is None and header is not None:
        value, param = header, "x-nemo-gen-timeout-s"
        try:
            value = float(value)
        except ValueError:
            raise bad(f"{param}: a number of seconds, got {header!r}", param) from None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value != value:
        raise bad(f"{param}: a positive number of seconds, got {value!r}", param)
    return float(value)


def _stream_options(body: Mapping[str, Any]) -> bool:
    opts = body.get("stream_options") or {}
    if not body.get("stream") and opts:
        raise bad("stream_options: only with stream: true", "stream_options")
    if opts.get("continuous_usage_stats"):
        raise bad("stream_options.continuous_usage_stats: not supported by nemo-gen serve",
                  "stream_options.continuous_usage_stats")
    return bool(opts.get("include_usage"))


def parse_completion(body: Any, session_header: str | None = None, timeout_header: str | None = None) -> Call:
    req = _parse(CompletionRequest, body, COMPLETION_FIELDS)
    prompt = req.prompt
    if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
        raise bad("prompt: a prompt is required (a string, a list of strings, token ids, or lists of token ids)",
                  "prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if any((isinstance(p, (str, list)) and len(p) == 0) for p in prompts):
        raise bad("prompt: an empty prompt", "prompt")
    if req.logprobs is not None and req.logprobs > 0:
        raise bad(f"logprobs: the engines return the sampled token's logprob only; use logprobs=0 "
                  f"(got {req.logprobs})", "logprobs")
    return Call(prompts=prompts, sampling=_sampling(body), session_id=_session(body, session_header),
                stream=bool(req.stream), include_usage=_stream_options(body), logprobs=req.logprobs is not None,
                token_ids=bool(req.return_token_ids), n=int(req.n or 1), request_id=body.get("request_id"),
                sent=frozenset(body), timeout_s=timeout_of(body, timeout_header))


def _content_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content[{j}]: only text parts are supported", f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content: text is required", f"messages[{i}].content")


def parse_chat(body: Any, session_header: str | None = None, timeout_header: str | None = None) -> Call:
    req = _parse(ChatCompletionRequest, body, CHAT_FIELDS)
    if not req.messages:
        raise bad("messages: at least one message is required", "messages")
    messages = []
    for i, msg in enumerate(body["messages"]):
        if not isinstance(msg, dict):
            raise bad(f"messages[{i}]: a message is an object with role and content", f"messages[{i}]")
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise bad(f"messages[{i}].{extra[0]}: not supported by nemo-gen serve", f"messages[{i}].{extra[0]}")
        messages.append({"role": str(msg.get("role")), "content": _content_text(i, msg.get("content"))})
    if req.top_logprobs:
        raise bad(f"top_logprobs: the engines return the sampled token's logprob only; use top_logprobs=0 "
                  f"(got {req.top_logprobs})", "top_logprobs")
    return Call(prompts=[messages], sampling=_sampling(body), session_id=_session(body, session_header),
                stream=bool(req.stream), include_usage=_stream_options(body), logprobs=bool(req.logprobs),
                token_ids=bool(req.return_token_ids), n=int(req.n or 1), request_id=body.get("request_id"),
                sent=frozenset(body), timeout_s=timeout_of(body, timeout_header))


# --------------------------------------------------------------------------------------------
# errors the fleet raises or returns, in the request's own words

_REQUEST_FIELD = {"max_new_tokens": "max_tokens", "stop_strings": "stop"}


def field_for(message: str, call: Call, prompt_field: str) -> str | None:
    """The request field a fleet ``RequestError`` message is about (its first word is the
    sampling keyword, or it is about the prompt)."""
    head = message.split(":", 1)[-1].strip() if message.startswith("RequestError") else message
    word = head.split(" ", 1)[0].strip("'\"`[],")
    if word in SAMPLING.values():
        name = _REQUEST_FIELD.get(word, word)
        if word == "max_new_tokens" and "max_completion_tokens" in call.sent:
            name = "max_completion_tokens"
        return name
    if "unknown sampling keyword" in head:
        for field, key in SAMPLING.items():
            if f"'{key}'" in head:
                return field
    if head.startswith("prompt") or "chat template" in head or "max_model_len" in head:
        return prompt_field
    return None


def request_error(message: str, call: Call, prompt_field: str) -> ApiError:
    param = field_for(message, call, prompt_field)
    text = message.removeprefix("RequestError: ")
    word = text.split(" ", 1)[0]
    if param and word in SAMPLING.values() and word != param:
        text = f"{param} (the fleet's {word}){text[len(word):]}"
    return bad(text, param)


# --------------------------------------------------------------------------------------------
# results out


def samples_of(result: Any) -> list[Any]:
    """The result's samples (``n`` of them); a fleet without ``n`` support: the result itself."""
    return list(getattr(result, "samples", None) or []) or [result]


def spans_of(item: Any) -> list[list[Any]]:
    return [[v, n] for v, n in (getattr(item, "weight_versions", None) or [])]


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
    return out


def _choice_provenance(result: Any, sample: Any) -> dict[str, Any]:
    spans = spans_of(sample) or spans_of(result)
    return {"shard": result.shard, "weight_version": spans[-1][0] if spans else result.weight_version,
            "weight_versions": spans}


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


def _completion_logprobs(detok: Detokenizer, sample: Any, pieces: list[str] | None) -> CompletionLogProbs:
    tokens = [detok.token(t) for t in sample.token_ids]
    lps = [float(x) for x in sample.logprobs]
    offsets, at = [], 0
    for piece in pieces if pieces is not None else detok.pieces(sample.token_ids, sample.text or ""):
        offsets.append(at)
        at += len(piece)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=lps, tokens=tokens,
                              top_logprobs=[{tok: lp} for tok, lp in zip(tokens, lps)])


def _chat_logprobs(detok: Detokenizer, token_ids: Sequence[int], logprobs: Sequence[float]) -> ChatCompletionLogProbs:
    content = []
    for tid, lp in zip(token_ids, logprobs):
        tok = detok.token(tid)
        content.append(ChatCompletionLogProbsContent(token=tok, logprob=float(lp), bytes=list(tok.encode("utf-8"))))
    return ChatCompletionLogProbs(content=content)


def _choices(call: Call, results: Sequence[Any]) -> Iterator[tuple[int, Any, Any]]:
    """(choice index, result, sample): prompt-major, as OpenAI numbers them."""
    for i, result in enumerate(results):
        for k, sample in enumerate(samples_of(result)):
            yield i * call.n + k, result, sample


def completion_response(call: Call, model: str, results: Sequence[Any], detok: Detokenizer,
                        response_id: str | None = None) -> CompletionResponse:
    choices = []
    for index, result, sample in _choices(call, results):
        choices.append(CompletionResponseChoice(
            index=index, text=sample.text or "", finish_reason=sample.finish_reason,
            logprobs=_completion_logprobs(detok, sample, None) if call.logprobs else None,
            token_ids=list(sample.token_ids) if call.token_ids else None,
            prompt_token_ids=list(result.prompt_token_ids) if call.token_ids else None,
            nemo_gen=_choice_provenance(result, sample),
        ))
    extra = {"id": response_id} if response_id else {}
    return CompletionResponse(model=model, choices=choices, usage=_usage(results), nemo_gen=provenance(results),
                              **extra)


def chat_response(call: Call, model: str, results: Sequence[Any], detok: Detokenizer,
                  response_id: str | None = None) -> ChatCompletionResponse:
    choices = []
    for index, result, sample in _choices(call, results):
        choices.append(ChatCompletionResponseChoice(
            index=index, message=ChatMessage(role="assistant", content=sample.text or ""),
            finish_reason=sample.finish_reason,
            logprobs=_chat_logprobs(detok, sample.token_ids, sample.logprobs) if call.logprobs else None,
            token_ids=list(sample.token_ids) if call.token_ids else None,
            nemo_gen=_choice_provenance(result, sample),
        ))
    extra = {"id": response_id} if response_id else {}
    prompt_ids = list(results[0].prompt_token_ids) if call.token_ids else None
    return ChatCompletionResponse(model=model, choices=choices, usage=_usage(results), nemo_gen=provenance(results),
                                  prompt_token_ids=prompt_ids, **extra)


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
        self.chars: dict[int, int] = {}  # choice index -> text characters sent (completion logprob offsets)

    def _chunk(self, choices: list[Any], **extra: Any) -> str:
        cls = ChatCompletionStreamResponse if self.chat else CompletionStreamResponse
        return sse(_dump(cls(id=self.id, created=self.created, model=self.model, choices=choices, **extra)))

    def start(self) -> list[str]:
        if not self.chat:
            return []
        return [self._chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
                for i in range(len(self.call.prompts) * self.call.n)]

    def delta(self, prompt: int, d: Any) -> str:
        index = prompt * self.call.n + d.sample
        spans = self.spans.setdefault(index, [])
        for version, count in d.weight_versions:
            add_span(spans, version, count)
        prov = None
        if d.finish_reason is not None:
            prov = {"shard": d.shard, "weight_version": spans[-1][0] if spans else None,
                    "weight_versions": [list(s) for s in spans]}
        ids = list(d.token_ids) if self.call.token_ids else None
        if self.chat:
            logprobs = _chat_logprobs(self.detok, d.token_ids, d.logprobs) if self.call.logprobs else None
            choice = ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(content=d.text), logprobs=logprobs,
                                                        finish_reason=d.finish_reason, token_ids=ids, nemo_gen=prov)
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
