"""A chat as the tokenizer's chat template writes it, through vLLM's template application.

The one renderer of chat prompts with tools for the fleet's sessions and the server's chat
routes (``nemo_gen.chat``): vLLM's ``safe_apply_chat_template`` over the tokenizer's own
template, the messages' tool-call arguments made objects first (``_postprocess_messages``), as
vLLM's renderer does.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

from nemo_gen.errors import RequestError


def render_chat_text(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False) -> str:
    """A chat as the tokenizer's chat template writes it, through vLLM's template application
    (tool-call arguments made objects first, as vLLM's renderer does). vLLM's
    ``VLLMValidationError`` passes through; no template: ``RequestError``."""
    from vllm.renderers.chat_utils import _postprocess_messages
    from vllm.renderers.hf import safe_apply_chat_template

    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages: this prompt is a chat, but the tokenizer (model.tokenizer, or the model's own) "
                           "has no chat template")
    conversation = copy.deepcopy(list(messages))
    _postprocess_messages(conversation)
    return safe_apply_chat_template(None, tokenizer, conversation, tools=tools or None,
                                    chat_template=tokenizer.chat_template, tokenize=False,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message)
