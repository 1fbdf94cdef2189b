"""A finished chat answer as the assistant's message, on vLLM's tool-call and reasoning parsers.

- ``ChatParsers``: ``server.tool_call_parser`` (a ``ToolParserManager`` name) and
  ``server.reasoning_parser`` (a ``ReasoningParserManager`` name) composed by vLLM's
  ``ParserManager.get_parser``, checked against the tokenizer when built.
- ``parse_answer``: the sampled text split by ``Parser.parse`` into ``content``, ``reasoning``
  (vLLM 0.32's field) and ``tool_calls``, and the choice's finish reason, as vLLM's full
  generator makes them: ``tool_calls`` when a call was read under ``auto`` (or ``required``
  stopped), ``parallel_tool_calls: false`` keeping the first call
  (``maybe_filter_parallel_tool_calls``), reasoning dropped under ``include_reasoning: false``.
- ``message_record``: that message as the agent sends it back — what a session records and
  compares the next turn's history with (``nemo_gen.core.trajectory.same_message``).
- ``chat_request``: vLLM's request model for a library caller's turn, so ``parse_answer`` reads
  the same fields an HTTP body gives it.

The HTTP chat routes (``nemo_gen.server.tools``) and a library session (``nemo_gen.fleet.session``)
both answer through these, so a Python agent gets the message the HTTP route returns. vLLM is
imported when used: importing the fleet does not load vLLM's server modules.
"""

from __future__ import annotations

from typing import Any, Sequence

from nemo_gen.errors import RequestError


class ChatParsers:
    """The parsers a chat's answers are read with (none set: an answer is its text)."""

    def __init__(self, tool_call_parser: str | None, reasoning_parser: str | None, tokenizer: Any,
                 tool_strict_level: str = "auto", whitespace: int | None = None):
        self.tokenizer = tokenizer
        self.whitespace = whitespace  # the bound on a forced call's whitespace runs (nemo_gen.chat.constrain)
        self.tool_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.auto = tool_call_parser is not None  # vLLM's enable_auto_tools
        self.parser_cls = None
        if tool_call_parser or reasoning_parser:
            from vllm.parser import ParserManager

            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_call_parser, reasoning_parser_name=reasoning_parser,
                enable_auto_tools=self.auto, tool_strict_level=tool_strict_level, tokenizer=tokenizer)

    @classmethod
    def from_settings(cls, server_settings: Any, tokenizer: Any) -> "ChatParsers":
        """The parsers ``server.*`` names (the HTTP front's and a library session's alike)."""
        return cls(server_settings.tool_call_parser, server_settings.reasoning_parser, tokenizer,
                   server_settings.tool_strict_level, server_settings.tool_call_whitespace)

    def parser(self, tools: Any) -> Any:
        """A fresh vLLM ``Parser`` for one choice (they keep state) over the request's ``tools``."""
        return self.parser_cls(self.tokenizer, tools)


def parse_answer(parsers: ChatParsers, req: Any, text: str, token_ids: Sequence[int],
                 finish_reason: str | None) -> tuple[Any, str | None]:
    """An answer as the assistant's ``ChatMessage`` and the choice's finish reason, as vLLM's
    full generator makes them; ``req`` is vLLM's ``ChatCompletionRequest``."""
    from vllm.entrypoints.generate.base.protocol import ToolCall
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam, ChatMessage
    from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
    from vllm.renderers.chat_utils import make_tool_call_id

    if parsers.parser_cls is None:
        return ChatMessage(role="assistant", content=text), finish_reason
    reasoning, content, calls = parsers.parser(req.tools).parse(text, req, enable_auto_tools=parsers.auto,
                                                                model_output_token_ids=list(token_ids))
    if not req.include_reasoning:
        reasoning = None
    forced = isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam) or req.tool_choice == "required"
    calls = maybe_filter_parallel_tool_calls(list(calls or []), req)
    tool_calls = [ToolCall(id=c.id or make_tool_call_id(), function=c) for c in calls]
    message = ChatMessage(role="assistant", reasoning=reasoning,
                          content=(content or "") if forced else content, tool_calls=tool_calls)
    auto_called = bool(tool_calls) and not forced and req.tool_choice in ("auto", None)
    if auto_called or (req.tool_choice == "required" and finish_reason == "stop"):
        finish_reason = "tool_calls"
    return message, finish_reason


def message_record(message: Any) -> dict[str, Any]:
    """An answer's message as the agent will send it back (what a session's next turn compares)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in message.tool_calls]
    if getattr(message, "reasoning", None):
        out["reasoning"] = message.reasoning
    return out


def chat_request(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None, **fields: Any) -> Any:
    """vLLM's ``ChatCompletionRequest`` for a library caller's turn (``fields``: ``tool_choice``,
    ``parallel_tool_calls``, ``include_reasoning``); what vLLM's model refuses is a
    ``RequestError`` naming the field."""
    from pydantic import ValidationError
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.exceptions import VLLMValidationError

    body = {"messages": list(messages), "tools": tools or None, **{k: v for k, v in fields.items() if v is not None}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except VLLMValidationError as exc:
        raise RequestError(f"{getattr(exc, 'parameter', None) or 'tools'}: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "messages"
        raise RequestError(f"{where}: {first.get('msg')}") from None
