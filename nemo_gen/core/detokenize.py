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
        upto = self._decode(ids[self._prefix:], skip_special_tokens=True)
        if len(upto) <= len(before) or upto.endswith("\ufffd") or not upto.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(ids)
        return upto[len(before):]
