"""A streamed request's prompts relayed from ``fleet.generate_stream`` into server-sent events,
and a finished result checked into the ``ApiError`` its error is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Callable

from nemo_gen.core.results import Delta
from nemo_gen.errors import RequestError, ShardDiedError
from nemo_gen.server import protocol, responses
from nemo_gen.server.http import error_for
from nemo_gen.server.protocol import ApiError, Call

log = logging.getLogger(__name__)


def checked(result: Any, call: Call, prompt_field: str) -> Any:
    """A finished result, or the ApiError its error is (400 for the request's own fault, 504 past
    its deadline)."""
    if result.error:
        if result.error.startswith("RequestError") or result.error.startswith("ValueError"):
            raise protocol.request_error(result.error, call, prompt_field)
        if result.error.startswith("RequestTimeout"):
            raise ApiError(504, result.error)
        raise ApiError(500, f"generation failed on shard {result.shard}: {result.error}")
    return result


def first_version(event: Any) -> int | None:
    spans = event.weight_versions
    return spans[0][0] if spans else getattr(event, "weight_version", None)


class Relay:
    """One streamed request's prompts, each ``fleet.generate_stream`` pumped by a task into one
    queue as (prompt, event): a ``Delta``, the finished result, or what the stream raised."""

    def __init__(self, fleet: Any, call: Call, kwargs: dict[str, Any], prompt_field: str,
                 on_close: Callable[[], None] | None = None, on_results: Callable[[list[Any]], None] | None = None):
        self.call, self.prompt_field = call, prompt_field
        self.queue: asyncio.Queue = asyncio.Queue()
        self._on_close = on_close
        self._on_results = on_results  # every prompt's result, before the final chunk (what raises: an error event)
        self.tasks = [asyncio.ensure_future(self._pump(i, fleet, p, kwargs)) for i, p in enumerate(call.prompts)]

    async def _pump(self, i: int, fleet: Any, prompt: Any, kwargs: dict[str, Any]) -> None:
        try:
            async with contextlib.aclosing(fleet.generate_stream(prompt, **kwargs)) as stream:
                async for event in stream:
                    self.queue.put_nowait((i, event))
        except Exception as exc:
            self.queue.put_nowait((i, exc))

    def _check(self, event: Any) -> Any:
        if isinstance(event, RequestError):
            raise protocol.request_error(str(event), self.call, self.prompt_field)
        if isinstance(event, BaseException):
            raise event
        return event if isinstance(event, Delta) else checked(event, self.call, self.prompt_field)

    async def first_events(self) -> list[tuple[int, Any]]:
        """Everything up to each prompt's first delta (or its result); raises what failed first."""
        seen: set[int] = set()
        events = []
        while len(seen) < len(self.tasks):
            i, event = await self.queue.get()
            events.append((i, self._check(event)))
            seen.add(i)
        return events

    async def events(self, fmt: responses.StreamFormat, firsts: list[tuple[int, Any]]) -> AsyncIterator[str]:
        results: dict[int, Any] = {}
        shards: dict[int, int | None] = {}
        pending = list(firsts)
        try:
            for chunk in fmt.start():
                yield chunk
            while len(results) < len(self.tasks):
                i, event = pending.pop(0) if pending else await self.queue.get()
                event = self._check(event)
                if isinstance(event, Delta):
                    shards[i] = event.shard
                    chunk = fmt.delta(i, event)
                    if chunk:  # "": a parser holds the text back for now
                        yield chunk
                else:
                    results[i] = event
            final = [results[i] for i in range(len(self.tasks))]
            if self._on_results is not None:
                self._on_results(final)
            for chunk in fmt.end(final):
                yield chunk
        except Exception as exc:  # the response has started: an event is the only way left to say so
            yield stream_error(exc, shards)
            yield responses.sse("[DONE]")
        finally:
            await self.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def stream_error(exc: BaseException, shards: dict[int, int | None]) -> str:
    """The error event that ends a stream which had begun, naming the shard."""
    shard = exc.shard if isinstance(exc, ShardDiedError) else next(iter(set(shards.values())), None)
    if isinstance(exc, ShardDiedError):
        log.warning("a stream broke off: %s", exc)
        error = ApiError(503, f"the stream broke off: {exc}")
    else:
        log.error("a stream from shard %s failed after it began: %s: %s", shard, type(exc).__name__, exc)
        error = error_for(exc)
        error = ApiError(error.status, f"the stream from shard {shard} failed: {error.message}", error.param)
    return responses.sse(error.body() | {"nemo_gen": {"shard": shard}})
