"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (``vllm.entrypoints.serve.tokenize``):
a prompt (or a chat, rendered exactly as ``/v1/chat/completions`` renders it, tools included)
into the token ids the engines would get, and token ids back into text — with the fleet's own
tokenizer, so an agent that sends ids (a completion's ``prompt``) sends what it was shown.

Owns the server's tokenizing threads (``Tokens.run``, ``server.tokenize_threads``): these routes,
and chat rendering for tools and parsers, run there rather than on the loop's default executor,
which builds responses and renders plain chats: a burst of heavy tokenizing queues behind its own
threads, not ahead of other requests' work. The queue is bounded by ``server.max_in_flight``, which
admits every request that submits work to it; a request cancelled while queued leaves the queue.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from pydantic import ValidationError
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)

from nemo_gen.server import protocol
from nemo_gen.server.protocol import bad
from nemo_gen.server.tools import render_chat

T = TypeVar("T")

# What a /tokenize request may carry besides vLLM's fields nemo-gen does not act on (refused).
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
_CHAT_FIELDS = frozenset({"model", "messages", "add_generation_prompt", "continue_final_message",
                          "add_special_tokens", "return_token_strs", "tools"})


class Tokens:
    def __init__(self, tokenizer: Any, max_model_len: int, max_prompt_chars: int, threads: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nemo-gen-tokenize")

    def close(self) -> None:
        """The server stopped: its tokenizing threads end once idle (work already on them finishes)."""
        self.pool.shutdown(wait=False)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the tokenizing threads (queued while they are all busy)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def _validated(self, cls: type, body: Any, fields: frozenset[str]) -> Any:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", None)
        for key in body:
            if key not in fields:
                raise bad(f"{key}: not supported by nemo-gen serve's /tokenize" if key in cls.model_fields
                          else f"{key}: unknown field", key)
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise protocol.validation_error(exc) from None

    def tokenize(self, body: Any) -> dict[str, Any]:
        if isinstance(body, dict) and "messages" in body:
            req = self._validated(TokenizeChatRequest, body, _CHAT_FIELDS)
            messages = [protocol.chat_message(i, m) for i, m in enumerate(body["messages"])]
            protocol.check_prompt_chars(messages, req.tools, self.max_prompt_chars, "messages")
            ids = render_chat(self.tokenizer, messages, req.tools, add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message,
                              add_special_tokens=req.add_special_tokens)
        else:
            req = self._validated(TokenizeCompletionRequest, body, _TOKENIZE_FIELDS)
            protocol.check_prompt_chars(req.prompt, None, self.max_prompt_chars, "prompt")
            ids = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        strs = self.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids,
                                token_strs=strs).model_dump(exclude_none=True)

    def detokenize(self, body: Any) -> dict[str, Any]:
        req = self._validated(DetokenizeRequest, body, frozenset({"model", "tokens"}))
        vocab = len(self.tokenizer)
        if any(t >= vocab for t in req.tokens):
            raise bad(f"tokens: token ids are below the vocabulary's size {vocab}", "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens)).model_dump()
