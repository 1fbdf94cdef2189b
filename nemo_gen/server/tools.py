"""Tool calls and reasoning on chat completions, on vLLM's own pieces.

What vLLM's chat server does, done the same way over the fleet:

- the parsers are vLLM's: ``ParserManager.get_parser`` composes ``server.tool_call_parser`` (a
  ``ToolParserManager`` name) and ``server.reasoning_parser`` (a ``ReasoningParserManager`` name),
  and checks them against the tokenizer when the server starts;
- a request is refused as vLLM's renderer refuses it: ``tool_choice`` ``auto`` / ``required`` /
  a named function without a tool-call parser is a 400 naming ``tool_choice``; vLLM's request
  model checks the rest (an unknown function name in ``tool_choice``, malformed ``tools``);
- ``required`` and a named function are constrained by the parser's ``adjust_request``
  (``nemo_gen.chat.constrain``, which a library session constrains through too): the
  parser's structural tag (Hermes: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, the
  arguments pinned to the tool's schema when the tool is ``strict`` or ``server.tool_strict_level``
  says so), or for parsers without one a JSON schema from the tools
  (``get_json_schema_from_tools``), becomes the request's structured outputs, which the engines
  decode under (the fleet's ``structured_outputs`` sampling key). The one change to vLLM's
  grammar: runs of whitespace in it are bounded (``server.tool_call_whitespace``), so even a
  random model closes its call;
- the prompt is rendered with the tools by vLLM's ``safe_apply_chat_template`` over the
  tokenizer's own chat template, the messages' tool-call arguments made objects first
  (``_postprocess_messages``), then tokenized as the fleet tokenizes a chat (the template wrote
  the special tokens);
- answers are split by ``Parser.parse`` (whole: ``nemo_gen.chat.answers.parse_answer``, which a
  library session answers through too) or ``Parser.parse_delta`` (streamed, one parser per
  choice) into ``content``, ``reasoning`` (vLLM 0.32's field) and ``tool_calls``;
  ``finish_reason`` is ``tool_calls`` when vLLM's would be, and ``parallel_tool_calls: false``
  keeps the first call only (``maybe_filter_parallel_tool_calls``).
"""

from __future__ import annotations

from typing import Any, Sequence

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatMessage,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls
from vllm.exceptions import VLLMValidationError

from nemo_gen.chat.answers import ChatParsers, parse_answer
from nemo_gen.chat.constrain import adjusted, constraint
from nemo_gen.chat.render import render_chat_text
from nemo_gen.errors import RequestError
from nemo_gen.server.protocol import bad


class ChatTools(ChatParsers):
    """The server's parsers (from its settings: ``nemo_gen.chat.answers.ChatParsers``), the
    tokenizer they and the template run on, and the bound on a constrained call's whitespace."""

    def __init__(self, server_settings: Any, tokenizer: Any):
        super().__init__(server_settings.tool_call_parser, server_settings.reasoning_parser, tokenizer,
                         server_settings.tool_strict_level, server_settings.tool_call_whitespace)

    def turn(self, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> "ChatTurn":
        """The request checked and adjusted as vLLM's renderer does it (400 naming the field)."""
        choice = req.tool_choice
        if choice not in (None, "none") and not self.auto:
            what = f'function "{choice.function.name}"' if isinstance(choice, ChatCompletionNamedToolChoiceParam) \
                else f'"{choice}"'
            raise bad(f"tool_choice: tool_choice={what} needs a tool-call parser; set server.tool_call_parser "
                      "(a vLLM ToolParserManager name, e.g. hermes)", "tool_choice")
        try:
            req, constrained = adjusted(self, req)
        except (VLLMValidationError, ValueError) as exc:
            param = getattr(exc, "parameter", None) or "tools"
            raise bad(f"{param}: {exc}", param) from None
        return ChatTurn(self, req, messages, constrained=constrained)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: list[Any] | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                add_special_tokens: bool = False) -> list[int]:
    """A chat's token ids as the chat route makes them: vLLM's template application over the
    tokenizer's chat template (``nemo_gen.chat.render.render_chat_text``), then tokenized as the
    fleet tokenizes a chat (the template wrote the special tokens)."""
    text = render_text(tokenizer, messages, [t.model_dump(exclude_none=True) for t in tools] if tools else None,
                       add_generation_prompt, continue_final_message)
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def render_text(tokenizer: Any, messages: list[dict[str, Any]], tool_dicts: list[dict[str, Any]] | None,
                add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """``render_chat_text`` with its refusals as 400s naming the field."""
    try:
        return render_chat_text(tokenizer, messages, tool_dicts, add_generation_prompt, continue_final_message)
    except RequestError as exc:
        raise bad(str(exc), "messages") from None
    except VLLMValidationError as exc:
        param = getattr(exc, "parameter", None) or "messages"
        raise bad(f"{param}: {exc}", param) from None


class ChatTurn:
    """One chat request with tools or a reasoning parser: its prompt, its sampling constraint,
    and its answers parsed."""

    def __init__(self, tools: ChatTools, req: ChatCompletionRequest, messages: list[dict[str, Any]],
                 constrained: bool = False):
        self.tools, self.req, self.messages = tools, req, messages
        self.constrained = constrained  # the parser set the request's grammar (a forced or strict call)
        self.named = isinstance(req.tool_choice, ChatCompletionNamedToolChoiceParam)

    @property
    def parses(self) -> bool:
        return self.tools.parser_cls is not None

    def structured_outputs(self) -> dict[str, Any] | None:
        """The fleet's ``structured_outputs`` keyword: the request's own, or the forced call's schema."""
        return constraint(self.req, self.constrained, self.tools.whitespace)

    def render(self) -> list[int]:
        """The prompt's token ids: the messages and tools through the tokenizer's chat template."""
        return render_chat(self.tools.tokenizer, self.messages, self.req.tools)

    def message(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """An answer as the assistant's message and its finish reason, as vLLM's full generator makes them."""
        return parse_answer(self.tools, self.req, text, token_ids, finish_reason)

    def stream(self, prompt_token_ids: list[int] | None) -> "StreamedTurn":
        return StreamedTurn(self, prompt_token_ids)


class StreamedTurn:
    """One streamed choice's parser state (vLLM's parsers are stateful: one per choice)."""

    def __init__(self, turn: ChatTurn, prompt_token_ids: list[int] | None):
        self.turn = turn
        self.prompt_token_ids = prompt_token_ids
        self.parser = turn.tools.parser(turn.req.tools) if turn.parses else None
        self.called = False

    def delta(self, text: str, token_ids: Sequence[int], finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """A delta's message (None: nothing to say yet) and the choice's finish reason."""
        if self.parser is None:
            return DeltaMessage(content=text), finish_reason
        message = self.parser.parse_delta(delta_text=text, delta_token_ids=list(token_ids), request=self.turn.req,
                                          prompt_token_ids=self.prompt_token_ids, finished=finish_reason is not None)
        if message is not None and message.tool_calls:
            self.called = True
            message = maybe_filter_parallel_tool_calls(message, self.turn.req)
        if message is not None and not self.turn.req.include_reasoning:
            message.reasoning = None
        if self.called and not self.turn.named and finish_reason == "stop":
            finish_reason = "tool_calls"
        return message, finish_reason

