"""Text from token ids one token at a time, in linear time: what each new token adds.

Decoding every prefix whole is quadratic in the tokens (a few thousand took seconds). Here each
token is decoded with the few tokens before it as context, as vLLM's incremental detokenizer
does: ``prefix`` marks where the context starts, ``read`` where the text handed out so far
ends; a token whose text is not complete yet (a partial UTF-8 character decodes to U+FFFD)
waits for the next. ``tokenizer`` is anything with Hugging Face's ``decode(ids,
skip_special_tokens=...)``.
"""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalText:
    def __init__(self, tokenizer: Any):
        self._decode = tokenizer.decode
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens complete (possibly "")."""
        self.ids.extend(token_ids)
        ids = self.ids
        before = self._decode(ids[self._prefix:self._read], skip_special_tokens=True) if self._read > self._prefix \
            else ""
        upto: str = self._decode(ids[self._prefix:], skip_special_tokens=True)
        if len(upto) <= len(before) or upto.endswith("\ufffd") or not upto.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return upto[len(before):]


#: Prompt tokens decoded before a completion as its context (vLLM's incremental detokenizer
#: starts from the prompt's last few tokens the same way): a SentencePiece tokenizer drops the
#: space that begins a text, not one that follows other tokens.
CONTEXT_TOKENS = 5


def completion_text(tokenizer: Any, prompt_ids: Sequence[int], ids: Sequence[int]) -> str:
    """A finished completion's text as vLLM's engine decodes it token by token, in two whole
    decodes: after the prompt's last tokens as context, and without the tokens at the end whose
    text is not complete (a partial UTF-8 character, U+FFFD), which the engine never hands out."""
    ctx, ids = list(prompt_ids[-CONTEXT_TOKENS:]), list(ids)
    before = tokenizer.decode(ctx, skip_special_tokens=True) if ctx else ""
    end = len(ids)
    whole: str = tokenizer.decode(ctx + ids, skip_special_tokens=True)
    while end and whole.endswith("\ufffd"):
        end -= 1
        whole = tokenizer.decode(ctx + ids[:end], skip_special_tokens=True)
    if whole.startswith(before):
        return whole[len(before):]
    # The context's own last character was completed by the completion: decode it alone.
    text: str = tokenizer.decode(ids[:end], skip_special_tokens=True)
    return text
