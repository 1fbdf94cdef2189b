"""``DeltaQueue``: what a streamed response has received from the fleet and not yet sent its
client, in arrival order, with each choice's undelivered deltas merged into one as they come (as
vLLM's ``RequestOutputCollector`` merges the outputs a slow reader has not taken). A reader that
falls behind costs the tokens it has not read, not an object per engine step; it gets them, when
it reads again, as one delta per choice.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nemo_gen.core.results import Delta

# A choice's merged text is kept as pieces and joined every this many (and when taken): joining
# on every step would copy the whole text each time, keeping every piece an object per step.
_JOIN_EVERY = 64


class _Pending:
    """One queued event: a delta (being merged into while it waits: ``texts``) or anything else."""

    __slots__ = ("prompt", "event", "texts", "owned")

    def __init__(self, prompt: int, event: Any):
        self.prompt, self.event = prompt, event
        self.texts: list[str] | None = None  # set once a second delta is merged in
        self.owned = False  # ``event`` is a copy of the first delta this queue may extend

    def merge(self, later: Delta) -> None:
        if not self.owned:  # the caller's delta is never changed: extend a copy
            first = self.event
            self.event = Delta(first.sample, list(first.token_ids), "", list(first.logprobs),
                               list(first.weight_versions), first.finish_reason, first.shard,
                               list(first.weight_digests))
            self.texts, self.owned = [first.text], True
        merged = self.event
        merged.token_ids.extend(later.token_ids)
        merged.logprobs.extend(later.logprobs)
        digests = later.weight_digests if len(later.weight_digests) == len(later.weight_versions) else None
        for i, (version, count) in enumerate(later.weight_versions):
            if merged.weight_versions and merged.weight_versions[-1][0] == version:
                merged.weight_versions[-1] = (version, merged.weight_versions[-1][1] + count)
            elif count:
                merged.weight_versions.append((version, count))
                if len(merged.weight_digests) == len(merged.weight_versions) - 1:  # kept beside them
                    merged.weight_digests.append(digests[i] if digests is not None else None)
        merged.finish_reason = later.finish_reason or merged.finish_reason
        merged.shard = later.shard
        if later.text:
            texts = self.texts
            assert texts is not None  # set above, with the copy
            texts.append(later.text)
            if len(texts) >= _JOIN_EVERY:
                texts[:] = ["".join(texts)]

    def taken(self) -> tuple[int, Any]:
        if self.texts is not None:
            self.event.text = "".join(self.texts)
        return self.prompt, self.event


class DeltaQueue:
    """(prompt, event) pairs: ``put`` one, ``take`` the oldest. A ``Delta`` for a choice — (prompt,
    its ``sample``) — that still has one waiting is merged into it (token ids, logprobs, text and
    version spans joined in order; the finish reason and shard of the latest kept). Any other
    event (a prompt's result, an error) waits in its place, and a later delta of its prompt
    queues after it."""

    def __init__(self) -> None:
        self._items: deque[_Pending] = deque()
        self._open: dict[int, dict[int, _Pending]] = {}  # prompt -> sample -> its delta still queued

    def put(self, prompt: int, event: Any) -> None:
        if not isinstance(event, Delta):
            self._open.pop(prompt, None)
            self._items.append(_Pending(prompt, event))
            return
        waiting = self._open.setdefault(prompt, {})
        pending = waiting.get(event.sample)
        if pending is not None:
            pending.merge(event)
            return
        pending = waiting[event.sample] = _Pending(prompt, event)
        self._items.append(pending)

    def take(self) -> tuple[int, Any]:
        """The oldest (prompt, event); ``IndexError`` when none waits."""
        pending = self._items.popleft()
        if isinstance(pending.event, Delta):
            waiting = self._open.get(pending.prompt)
            if waiting is not None and waiting.get(pending.event.sample) is pending:
                del waiting[pending.event.sample]
        return pending.taken()

    def __len__(self) -> int:
        return len(self._items)
