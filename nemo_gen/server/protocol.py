"""OpenAI requests into fleet calls — on vLLM's own protocol models (``vllm.entrypoints.openai.*``,
``vllm.entrypoints.serve.engine.protocol``), so the schemas are vLLM's and nothing here restates
them. Results out: ``nemo_gen.server.responses``; tools and reasoning: ``nemo_gen.server.tools``.

A request is validated by vLLM's model, then every field it sets is either acted on or refused
by name (``ApiError`` 400 with ``param``): a field vLLM knows but nemo_gen does not act on
(``presence_penalty``, ``echo``...) is refused unless its value asks for nothing (the default,
or a neutral value such as a zero penalty), and so is a field neither knows. What is acted on
maps to the fleet's sampling keywords (``SAMPLING``): ``max_tokens`` / ``max_completion_tokens``
-> ``max_new_tokens``, ``stop`` -> ``stop_strings``, and ``n``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop_token_ids``, ``ignore_eos``, ``bad_words`` as they are; vLLM's
``structured_outputs`` (and a forced tool call's schema) -> ``structured_outputs``. A field left
out takes the generation config's default (the operator's), not OpenAI's 16 tokens.

A chat request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and messages with
``tool_calls`` / ``tool_call_id`` are kept on the ``Call`` (``request``, ``messages``) for
``nemo_gen.server.tools``, which renders such a prompt itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.exceptions import VLLMClientError, VLLMValidationError

from nemo_gen.chat.constrain import structured_of


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
# structured_outputs / response_format constrain decoding; prompt_logprobs asks for the prompt's.
# min_version / max_staleness (nemo-gen's): the weights the request must run on, passed to the
# fleet, which refuses what it cannot honour naming the field (nemo_gen.core.request_policy).
POLICY = ("min_version", "max_staleness")
_COMMON = {"model", "stream", "stream_options", "user", "session_id", "request_id", "return_token_ids", "logprobs",
           "timeout_s", "structured_outputs", "response_format", "prompt_logprobs", *POLICY}
COMPLETION_FIELDS = frozenset(_COMMON | set(SAMPLING) - {"max_completion_tokens"} | {"prompt"})
CHAT_FIELDS = frozenset(_COMMON | set(SAMPLING) | {"messages", "top_logprobs", "tools", "tool_choice",
                                                    "parallel_tool_calls", "include_reasoning"})
# The most alternatives per token a request may ask for (OpenAI's bound; the engines' max_logprobs).
MAX_TOP_LOGPROBS = 20
# Longest session key (``x-session-id``, ``session_id``, ``user``): the router remembers each key it
# sees (an LRU of many thousands), so the key's length is memory held. A longer one is refused
# rather than hashed, so a client learns its key is not what it thinks (a UUID is 36 characters).
MAX_SESSION_KEY_CHARS = 256
# Values of fields nemo_gen does not act on that ask for nothing (besides the field's default).
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logit_bias": ({},), "min_p": (0, 0.0), "min_tokens": (0,), "echo": (False,), "suffix": ("",),
    "add_generation_prompt": (True,), "skip_special_tokens": (True,),
    "best_of": (1,), "priority": (0,), "length_penalty": (1, 1.0),
}
_MESSAGE_KEYS = {"role", "content", "name"}
# Keys of a message in a tool-using conversation: the server renders such a chat itself (tools.py).
_TOOL_MESSAGE_KEYS = {"tool_calls", "tool_call_id", "reasoning", "reasoning_content"}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP ``status``, ``message``, the request field it is about."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 409: "ConflictError", 413: "RequestTooLargeError", 429: "RateLimitError",
             500: "InternalServerError", 503: "ServiceUnavailableError", 504: "TimeoutError"}

    def __init__(self, status: int, message: str, param: str | None = None, retry_after_s: int | None = None,
                 retry: bool | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s  # a 503 for load: the Retry-After header
        self.retry = retry  # False: ``x-should-retry: false`` (the openai client's own header)

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
        loc = tuple(errors[0].get("loc") or ())
        param = _message_param(loc) or clean_loc_for_param(loc) or None
    first = errors[0] if errors else {}
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return bad(f"{param}: {message}" if param else message, param)


def _message_param(loc: tuple[Any, ...]) -> str | None:
    """A bad message's field as ``messages[i].key`` (the location also names the union member
    types pydantic tried, which mean nothing to a client)."""
    if len(loc) < 2 or loc[0] != "messages" or not isinstance(loc[1], int):
        return None
    key = next((k for k in loc[2:] if k in _MESSAGE_KEYS | _TOOL_MESSAGE_KEYS), None)
    return f"messages[{loc[1]}]" + (f".{key}" if key else "")


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
    top_logprobs: int = 0  # alternatives shown per generated token (chat top_logprobs, completions logprobs)
    prompt_logprobs: int | None = None  # the prompt's logprobs, this many alternatives per token
    request: Any = None  # vLLM's request model (tools, tool_choice...)
    tooled: bool = False  # a chat with tools or tool messages: the server renders its prompt (tools.py)
    turn: Any = None  # tools.ChatTurn: parsers for the answers (tools or a reasoning parser)
    adapter: str | None = None  # the LoRA adapter the request's ``model`` names (None: the base model)

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
        error = validation_error(exc)
        head = (error.param or "").split(".")[0].split("[")[0]
        if error.param and head not in model_cls.model_fields and "messages" in model_cls.model_fields:
            # vLLM validates messages on their own (a location without the field): name the field
            error = bad(f"messages: {error.message.split(': ', 1)[-1]}", "messages")
        raise error from None
    except VLLMClientError as exc:  # raised as it is by some of vLLM's validators
        param = getattr(exc, "parameter", None)
        message = str(exc).split(" (parameter=", 1)[0]
        raise bad(f"{param}: {message}" if param else message, param) from None
    _check_fields(body, model_cls, acted_on)
    return req


def _sampling(body: Mapping[str, Any], req: Any = None, top_logprobs: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if req is not None:
        if req.stream and req.prompt_logprobs is not None:
            raise bad("prompt_logprobs: not available with stream: true", "prompt_logprobs")
        if (structured := structured_of(req)) is not None:
            out["structured_outputs"] = structured
        if top_logprobs:
            out["logprobs"] = top_logprobs
        if req.prompt_logprobs is not None:
            if not 0 <= req.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise bad(f"prompt_logprobs: between 0 and {MAX_TOP_LOGPROBS} alternatives per prompt token, "
                          f"got {req.prompt_logprobs}", "prompt_logprobs")
            out["prompt_logprobs"] = req.prompt_logprobs
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
    out.update((field, body[field]) for field in POLICY if body.get(field) is not None)
    return out


def _session(body: Mapping[str, Any], header: str | None) -> str | None:
    """The request's session key; each field that could carry one is bounded, the unused ones too."""
    for value, field in ((header, "x-session-id"), (body.get("session_id"), "session_id"), (body.get("user"), "user")):
        if isinstance(value, str) and len(value) > MAX_SESSION_KEY_CHARS:
            raise bad(f"{field}: a session key has at most {MAX_SESSION_KEY_CHARS} characters, got {len(value)}",
                      field)
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
    top = _top_logprobs(req, req.logprobs or 0, "logprobs")
    return Call(prompts=prompts, sampling=_sampling(body, req, top), session_id=_session(body, session_header),
                stream=bool(req.stream), include_usage=_stream_options(body), logprobs=req.logprobs is not None,
                token_ids=bool(req.return_token_ids), n=int(req.n or 1), request_id=body.get("request_id"),
                sent=frozenset(body), timeout_s=timeout_of(body, timeout_header), top_logprobs=top,
                prompt_logprobs=req.prompt_logprobs, request=req)


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


def chat_message(i: int, msg: Any) -> dict[str, Any]:
    """One chat message as the chat template gets it: text content, and a tool-using
    conversation's keys as they came (vLLM's request model has checked their shape)."""
    if not isinstance(msg, dict):
        raise bad(f"messages[{i}]: a message is an object with role and content", f"messages[{i}]")
    extra = sorted(set(msg) - _MESSAGE_KEYS - _TOOL_MESSAGE_KEYS)
    if extra:
        raise bad(f"messages[{i}].{extra[0]}: not supported by nemo-gen serve", f"messages[{i}].{extra[0]}")
    content = msg.get("content")
    out = {"role": str(msg.get("role")),
           "content": None if content is None and msg.get("tool_calls") else _content_text(i, content)}
    out.update({k: msg[k] for k in _TOOL_MESSAGE_KEYS & set(msg) if msg[k] is not None})
    return out


def parse_chat(body: Any, session_header: str | None = None, timeout_header: str | None = None) -> Call:
    req = _parse(ChatCompletionRequest, body, CHAT_FIELDS)
    if not req.messages:
        raise bad("messages: at least one message is required", "messages")
    messages = [chat_message(i, msg) for i, msg in enumerate(body["messages"])]
    top = _top_logprobs(req, req.top_logprobs or 0, "top_logprobs") if req.logprobs else 0
    tooled = bool(req.tools) or any(set(m) - _MESSAGE_KEYS for m in messages)
    return Call(prompts=[messages], sampling=_sampling(body, req, top), session_id=_session(body, session_header),
                stream=bool(req.stream), include_usage=_stream_options(body), logprobs=bool(req.logprobs),
                token_ids=bool(req.return_token_ids), n=int(req.n or 1), request_id=body.get("request_id"),
                sent=frozenset(body), timeout_s=timeout_of(body, timeout_header), top_logprobs=top,
                prompt_logprobs=req.prompt_logprobs, request=req, tooled=tooled)


def _top_logprobs(req: Any, value: int, param: str) -> int:
    """Alternatives per token, checked; a stream carries the sampled tokens' logprobs only (the
    engines' stream deltas hold no alternatives), and no prompt logprobs (``_sampling``)."""
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise bad(f"{param}: between 0 and {MAX_TOP_LOGPROBS} alternatives per token, got {value}", param)
    if req.stream and value:
        raise bad(f"{param}: alternatives per token are not streamed by nemo-gen serve; ask without stream, "
                  f"or with {param}=0", param)
    return value


# --------------------------------------------------------------------------------------------
# errors the fleet raises or returns, in the request's own words

_REQUEST_FIELD = {"max_new_tokens": "max_tokens", "stop_strings": "stop"}


def prompt_chars(prompt: Any) -> int:
    """A prompt's characters: a string's, or a chat's messages' content and tool-call arguments
    together (token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m.get("content") or "") + _arguments_chars(m.get("tool_calls")) for m in prompt)
    return 0


def _arguments_chars(calls: Any) -> int:
    """An assistant message's tool calls' ``function.arguments``, in characters (the template renders them)."""
    total = 0
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        total += len(arguments) if isinstance(arguments, str) else len(json.dumps(arguments)) if arguments else 0
    return total


def tools_chars(tools: Any) -> int:
    """A chat's tool definitions, in characters of JSON (the chat template renders each)."""
    return sum(len(t.model_dump_json(exclude_none=True)) if hasattr(t, "model_dump_json") else len(json.dumps(t))
               for t in tools or ())


def check_prompt_chars(prompt: Any, tools: Any, limit: int, field: str) -> None:
    """400 when a prompt — a chat with its tool-call arguments and its tools — has more than
    ``limit`` (``server.max_prompt_chars``) characters, naming ``tools`` when they tip it over."""
    chars, in_tools = prompt_chars(prompt), tools_chars(tools)
    if chars + in_tools > limit:
        param = "tools" if in_tools and chars <= limit else field
        detail = f" ({in_tools} of them in tools)" if in_tools else ""
        raise bad(f"{param}: the prompt has {chars + in_tools} characters{detail}, more than "
                  f"server.max_prompt_chars={limit}", param)


def field_for(message: str, call: Call, prompt_field: str) -> str | None:
    """The request field a fleet ``RequestError`` message is about (its first word is the
    sampling keyword, or it is about the prompt)."""
    head = message.split(":", 1)[-1].strip() if message.startswith("RequestError") else message
    word = head.split(" ", 1)[0].strip("'\"`[],")
    if word.rstrip(":") in POLICY:
        return word.rstrip(":")
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
