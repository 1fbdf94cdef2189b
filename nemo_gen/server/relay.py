"""A streamed request's prompts relayed from ``fleet.generate_stream`` into server-sent events,
and a finished result checked into the ``ApiError`` its error is.

What a stream holds — its ``server.max_in_flight`` slots, a gateway session's turn — is given back
by ``Relay.release``, synchronously, before any await, however the response ends: its end, an
error, a client that disconnects, a server that stops (``StreamResponse`` calls it in a
``finally``). An await first would never return inside the scope that a disconnect cancels. A
client that stops reading is ended when one send to it waits past ``server.stream_idle_timeout_s``,
and its requests are aborted on their engines. While the client is slow, what it has not read
waits merged per choice (``core.delta_queue``), so it costs its tokens, not one object per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from nemo_gen.core.delta_queue import DeltaQueue
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
        self.queue = DeltaQueue()  # what came and is not yet sent, each choice's deltas merged
        self._ready = asyncio.Event()  # set when the queue gets an item
        self._on_close = on_close
        self._on_results = on_results  # every prompt's result, before the final chunk (what raises: an error event)
        self.tasks = [asyncio.ensure_future(self._pump(i, fleet, p, kwargs)) for i, p in enumerate(call.prompts)]

    async def _pump(self, i: int, fleet: Any, prompt: Any, kwargs: dict[str, Any]) -> None:
        try:
            async with contextlib.aclosing(fleet.generate_stream(prompt, **kwargs)) as stream:
                async for event in stream:
                    self._put(i, event)
        except Exception as exc:
            self._put(i, exc)

    def _put(self, i: int, event: Any) -> None:
        self.queue.put(i, event)
        self._ready.set()

    async def _get(self) -> tuple[int, Any]:
        while not self.queue:
            self._ready.clear()
            await self._ready.wait()
        return self.queue.take()

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
            i, event = await self._get()
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
                i, event = pending.pop(0) if pending else await self._get()
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

    def release(self) -> None:
        """Stop the pumps (each aborts its request on its engine as it closes) and give back what
        the stream holds (``on_close``, once), at once: no await comes first, so a cancelled
        scope — a client gone, a server stopping — cannot skip it."""
        for task in self.tasks:
            task.cancel()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    async def close(self) -> None:
        self.release()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def response(self, fmt: responses.StreamFormat, firsts: list[tuple[int, Any]], headers: dict[str, str],
                 idle_s: float) -> "StreamResponse":
        return StreamResponse(self, self.events(fmt, firsts), idle_s, headers)


class StreamStalled(Exception):
    """The client took no chunk for ``server.stream_idle_timeout_s``."""


# Set in the task that serves a response this server ended on purpose (its client stopped
# reading): uvicorn's complaint that the response was left unfinished is then not an error.
_ENDED = contextvars.ContextVar("nemo_gen_stream_ended", default=False)
_UNFINISHED = "ASGI callable returned without completing response."


class _EndedOnPurpose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _UNFINISHED and _ENDED.get())


logging.getLogger("uvicorn.error").addFilter(_EndedOnPurpose())


class StreamResponse(StreamingResponse):
    """A relay's events as server-sent events: each send to the client must finish within
    ``idle_s`` (a client that stopped reading is ended there and its connection closed), and the
    relay is released however the response ends."""

    def __init__(self, relay: Relay, events: AsyncIterator[str], idle_s: float, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.relay, self.idle_s = relay, idle_s

    async def stream_response(self, send: Callable[[Any], Any]) -> None:
        async def within_deadline(message: Any) -> None:
            try:
                async with asyncio.timeout(self.idle_s):  # no task per send, unlike wait_for
                    await send(message)
            except TimeoutError:
                raise StreamStalled() from None

        await super().stream_response(within_deadline)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StreamStalled:
            # returned unfinished: uvicorn closes the connection
            _ENDED.set(True)
            log.warning("a stream's client took no chunk for %gs (server.stream_idle_timeout_s): the stream is ended "
                        "and its requests aborted", self.idle_s)
        finally:
            self.relay.release()


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
