"""Prompts in, ``GenerationRequest``s out: what a call's prompts become before any shard sees them.

Owns the driver-side input processing the router runs first: a string is tokenized with the
tokenizer's special tokens, token ids pass as they are, chat messages are checked and rendered
with the tokenizer's chat template (a generation prompt added), and a prompt longer than the
model's context is answered with an error result before it costs a round trip. Also the
``session_id`` argument of a batch spread over its prompts, and the call's resolved sampling
dict as the wire's ``Sampling`` (``sampling_of``). Routing is ``router.py``'s; turning
shard replies into results is ``decode.py``'s.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from nemo_gen.core.results import GenerationRequest, GenerationResult, out_of_vocab, too_long_error
from nemo_gen.core.wire import Sampling
from nemo_gen.errors import RequestError
from nemo_gen.vllm_ext.lora import EXTRA_KEY

# A string, token ids, or chat messages ({"role": ..., "content": ...}, rendered here).
Prompt = str | Sequence[int] | Sequence[Mapping[str, Any]]


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt) and all(
        isinstance(m, Mapping) for m in prompt)


# Prompts up to this many characters (or token ids) in all are made into requests on the
# caller's event loop (tens of microseconds with a fast tokenizer): a thread hop per request cost
# an HTTP server more CPU than the tokenizing. Chats (a template to render) and more go off it.
ON_LOOP_CHARS = 4096


def on_loop(prompts: Sequence[Prompt]) -> bool:
    """Whether ``prompts`` are cheap enough to make into requests on an event loop: strings and
    token-id lists of at most ``ON_LOOP_CHARS`` characters and ids in all, no chat."""
    if isinstance(prompts, (str, bytes)):
        return True  # refused at once by build_requests
    size = 0
    for prompt in prompts:
        if not isinstance(prompt, (str, list, tuple)) or (prompt and not isinstance(prompt[0], (str, int))):
            return False  # a chat (messages), or something build_requests will name
        size += len(prompt)
        if size > ON_LOOP_CHARS:
            return False
    return True


def build_requests(prompts: Sequence[Prompt], tokenizer: Any, max_model_len: int, vocab_size: int | None = None
                   ) -> tuple[list[GenerationRequest], dict[int, GenerationResult]]:
    """Tokenize on the driver; too-long prompts (and chats without a template) become error
    results right away: (the requests to send, index -> its error result). An id outside the
    model's vocabulary (``vocab_size``) is a ``RequestError`` naming the prompt and position, and
    nothing of the call is sent: such an id kills an engine that has no tokenizer to check it."""
    if isinstance(prompts, (str, bytes)):
        raise RequestError("prompts must be a list of strings or token-id lists, not one string")
    requests, rejected = [], {}
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
            req = GenerationRequest(index=i, prompt_token_ids=list(ids), prompt=prompt)
        elif is_chat(prompt):
            req = chat_request(i, prompt, tokenizer)
            if isinstance(req, GenerationResult):
                rejected[i] = req
                continue
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            req = GenerationRequest(index=i, prompt_token_ids=list(prompt), prompt=None)
        else:
            raise RequestError(
                f"prompt {i} must be a string, a list of token ids or a list of chat messages", index=i)
        error = too_long_error(len(req.prompt_token_ids), max_model_len) if max_model_len else None
        if error:
            rejected[i] = GenerationResult.failed(req, error)
            continue
        if (bad := out_of_vocab(i, req.prompt_token_ids, vocab_size)) is not None:  # what is sent
            raise RequestError(bad, index=i)
        requests.append(req)
    return requests, rejected


def chat_request(i: int, messages: Sequence[Mapping[str, Any]], tokenizer: Any
                 ) -> GenerationRequest | GenerationResult:
    """Chat messages rendered with the tokenizer's chat template (a generation prompt added);
    an error result when the tokenizer has no template."""
    for m in messages:
        if not (isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RequestError(f"prompt {i}: a chat message needs a string 'role' and 'content', got {dict(m)!r}",
                               index=i)
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if not getattr(tokenizer, "chat_template", None):
        return GenerationResult.failed(
            GenerationRequest(index=i, prompt_token_ids=[]),
            "RequestError: this prompt is a chat, but the tokenizer (model.tokenizer, or the model's own) "
            "has no chat template")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself: the text is not tokenized with them again.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return GenerationRequest(index=i, prompt_token_ids=list(ids), prompt=text)


def sessions_of(session_id: str | Sequence[str | None] | None, n: int) -> dict[int, str | None]:
    """A batch's ``session_id`` (one for all, or one or None per prompt) as prompt index -> session."""
    if session_id is None or isinstance(session_id, str):
        return {i: session_id for i in range(n)}
    if len(session_id) != n:
        raise RequestError(f"session_id has {len(session_id)} entries for {n} prompts (give one, or one per prompt)")
    return dict(enumerate(session_id))


def sampling_of(params: Mapping[str, Any]) -> Sampling:
    """A call's resolved sampling (``nemo_gen.core.sampling.resolve_sampling``, with the chosen
    LoRA adapter under ``EXTRA_KEY``: ``nemo_gen.fleet.adapters``) as the shard takes it."""
    return Sampling.of(params, params.get(EXTRA_KEY))
