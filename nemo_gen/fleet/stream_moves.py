"""One stream's migrations (``fleet.migration``): what its caller was handed, and what runs next.

A stream is one request of ``n`` samples. What each sample handed its reader is kept here, per
try (``kept``), so a shard lost mid-stream carries each unfinished sample on from exactly the
tokens its reader has, with no break and no repeat (``lost``; the continuations are
``nemo_gen.core.migration``'s). The continuations run one after another (``req`` is the one to
send next): each is one sample, and its deltas are handed on under that sample's index
(``delta``), so a reader of ``n`` samples sees each sample go on where it stopped. The result
comes when the last ends (``ended``): every sample's tokens, logprobs and version spans joined.
"""

from __future__ import annotations

from typing import Any

from nemo_gen.core.migration import Kept
from nemo_gen.core.results import Delta, GenerationRequest, GenerationResult, MoveCause
from nemo_gen.core.wire import StreamEnd
from nemo_gen.fleet.migrate import Decode, Moving, answers


class StreamMoves:
    """``moving``: the call's migrations (None: the stream is not migrated, it starts again or
    ends as the fault model says); ``req``: the caller's request; ``n``: its samples."""

    def __init__(self, moving: Moving | None, req: GenerationRequest, n: int):
        self.moving = moving
        self.n = n
        self._pending = moving.keyed([req]) if moving is not None else [req]

    @property
    def req(self) -> GenerationRequest:
        """The request to send on the next try: the caller's, or the next sample's continuation."""
        return self._pending[0]

    def kept(self) -> list[Kept]:
        """A try's record of what it hands the reader, by the sample index its shard reports."""
        return [Kept() for _ in range(self.n if self.req.continues is None else 1)]

    def delta(self, delta: Delta, kept: list[Kept]) -> Delta:
        """``delta`` kept, and handed on under its sample's index (a continuation runs as sample 0)."""
        kept[delta.sample].extend(delta)  # type: ignore[arg-type]  # (a Delta has a sample's fields)
        if self.req.continues is not None:
            delta.sample = self.req.sample
        return delta

    def ended(self, handle: Any, end: StreamEnd, decode: Decode) -> GenerationResult | None:
        """The try's stream ended with ``end``: the caller's result once no sample runs; None
        while a continuation is still to run (``req`` is the next)."""
        req = self._pending.pop(0)
        whole = answers(self.moving, handle, [req], [end.result], end.shard, end.weight_version, decode)
        return whole[0] if whole else None

    def lost(self, member: Any, shard: int, kept: list[Kept], cause: MoveCause, decode: Decode
             ) -> GenerationResult | None:
        """The try's shard was lost after handing the reader ``kept``: its unfinished samples go
        on from there (queued after the current one's place); the result when nothing is left to run."""
        assert self.moving is not None
        carried, again, done = self.moving.carry(member, [self.req], shard, decode, kept, cause)
        if done:
            return done[0]
        self._pending[0:1] = carried + again  # (again: nothing new kept, it is sent as it was)
        return None
