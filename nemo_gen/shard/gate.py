"""The engine's admission gate: requests are served while the gate is open, and a refit closes
it. ``hold`` closes it and waits for the requests in flight to finish (a drain refit: no
request may run on half-loaded weights); ``claim`` closes it to new requests only, leaving the
running ones to an in-flight swap (``nemo_gen.shard.swap``); ``release`` opens it again.
One refit holds the gate at a time: a second waits for the first to release it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator


class Gate:
    def __init__(self) -> None:
        self._inflight = 0
        self._idle = asyncio.Condition()
        self.held = False  # closed by a refit: new requests wait

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """One request (a generate call, a stream) in flight: it waits while the gate is held."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self.held)
            self._inflight += 1
        try:
            yield
        finally:
            async with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Wait for in-flight requests to finish and hold new ones back until the block ends."""
        await self.hold()
        try:
            yield
        finally:
            await self.release()

    async def claim(self) -> None:
        """Hold new requests back from here until ``release``; those in flight go on."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self.held)
            self.held = True

    async def hold(self) -> None:
        """``claim``, then wait until no request is in flight."""
        async with self._idle:
            await self._idle.wait_for(lambda: not self.held)
            self.held = True
            await self._idle.wait_for(lambda: self._inflight == 0)

    async def release(self) -> None:
        async with self._idle:
            self.held = False
            self._idle.notify_all()
