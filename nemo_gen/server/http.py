"""The HTTP plumbing under the routes: the ``Gate`` middleware (API key, version header, HTTP
metrics), request bodies read against their bound, a route's work cancelled when its client
disconnects, and any exception as an OpenAI-shaped error response (``error_for``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from typing import Any, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse
from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect

from nemo_gen.core.wire import exception_line
from nemo_gen.errors import DataError, EngineCrashError, FleetAsleep, FleetBusy, InfraError, NemoGenError, RequestError, RequestTimeout, ShardRetired, StaleShard
from nemo_gen.server import protocol
from nemo_gen.server.metrics import ServerMetrics
from nemo_gen.server.protocol import ApiError

VERSION_HEADER = "x-nemo-gen-weight-version"
SHARD_HEADER = "x-nemo-gen-shard"
SESSION_HEADER = "x-session-id"
TIMEOUT_HEADER = "x-nemo-gen-timeout-s"
# Bodies up to this size are parsed on the loop (a few ms at most); larger ones off it.
_PARSE_ON_LOOP_BYTES = 64 * 1024
# Open without a key: a load balancer's health check and a Prometheus scraper.
OPEN_PATHS = ("/health", "/metrics")


def version_text(version: int | None) -> str:
    return "none" if version is None else str(version)


def error_for(exc: BaseException) -> ApiError:
    """Any exception as an OpenAI-shaped error (the message says what, never how)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestError):
        return protocol.bad(str(exc), None)
    if isinstance(exc, DataError):
        return protocol.bad(f"{type(exc).__name__}: {exc}", getattr(exc, "field", None))
    if isinstance(exc, RequestTimeout):
        return ApiError(504, f"RequestTimeout: {exc}")
    if isinstance(exc, FleetAsleep):  # a state, not a load: named as such
        return ApiError(503, f"FleetAsleep: {exc}", retry_after_s=int(round(exc.retry_after_s)))
    if isinstance(exc, FleetBusy):
        return ApiError(503, f"FleetBusy: {exc}", retry_after_s=int(round(exc.retry_after_s)))
    if isinstance(exc, EngineCrashError):  # the request may have killed it: sending it again would kill another
        return ApiError(500, f"EngineCrashError: {exc}", retry=False)
    if isinstance(exc, (InfraError, ShardRetired, StaleShard)):
        return ApiError(503, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, NemoGenError):
        return ApiError(503, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, TimeoutError):
        return ApiError(504, f"TimeoutError: {exc}")
    return ApiError(500, f"internal error: {internal_line(exc)}")


# Ray's frame around a remote error: ANSI colours, and the actor's pid, node IP and ids.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RAY_IDS = re.compile(r"\s*\((?:pid|ip|actor_id|node_id|worker_id)=[^)]*\)|\b(?:pid|ip|actor_id|node_id|worker_id)=\S+")


def internal_line(exc: BaseException) -> str:
    """An unexpected failure as a client may read it: the type and last line of the exception
    at its root (the actor-side one a Ray error wraps), with no traceback, no ANSI colours and
    none of Ray's process or node identifiers (those go to the server's log)."""
    line = exception_line(getattr(exc, "cause", None) or exc)
    return _RAY_IDS.sub("", _ANSI.sub("", line)).strip()


def error_response(error: ApiError, version: int | None) -> JSONResponse:
    headers = {VERSION_HEADER: version_text(version)}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(error.retry_after_s)
    if error.retry is False:
        headers["x-should-retry"] = "false"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class Gate:
    """Pure-ASGI middleware (no per-request task, no buffering of streams): the API key, the
    version header on every response that does not set its own, the HTTP metrics."""

    def __init__(self, app: Any, api_key: str | None, version: Callable[[], int | None], metrics: ServerMetrics):
        self.app = app
        self.key = hashlib.sha256(api_key.encode()).digest() if api_key else None
        self.version = version
        self.metrics = metrics

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and secrets.compare_digest(
                    hashlib.sha256(token.strip().encode()).digest(), self.key)
        return False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = self.metrics.route(path)
        started = time.perf_counter()
        status = {"code": 500}

        async def send_with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers") or [])
                if not any(k == VERSION_HEADER.encode() for k, _ in headers):
                    headers.append((VERSION_HEADER.encode(), version_text(self.version()).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            if self.key is not None and scope.get("method") != "OPTIONS" and path not in OPEN_PATHS \
                    and not self._authorized(scope):
                error = ApiError(401, "a valid API key is required: Authorization: Bearer <server.api_key>")
                await error_response(error, self.version())(scope, receive, send_with_header)
                return
            await self.app(scope, receive, send_with_header)
        finally:
            self.metrics.observe(route, status["code"], time.perf_counter() - started)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The body, read against ``max_bytes`` (413 past it, before it is read whole) and parsed
    (off the loop when large; nesting too deep for the parser is a 400, not a 500)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(size, max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks) or b"null"
    try:
        return json.loads(raw) if len(raw) <= _PARSE_ON_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise protocol.bad(f"the request body is not valid JSON: {exc}", None) from None
    except RecursionError:
        raise protocol.bad("the request body is nested too deeply to parse", None) from None


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(413, f"the request body has {'at least ' if size > max_bytes else ''}{size} bytes, more than "
                         f"server.max_body_bytes={max_bytes}")


async def cancelled_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """``work`` (a route's, its body already read), cancelled when the client disconnects first —
    its requests are aborted on their engines. A streamed response is the stream's to watch once
    it is returned (Starlette's StreamingResponse listens for the disconnect itself)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server itself is stopping
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # every request of it aborted on its engine
    raise ClientGone()


class ClientGone(Exception):
    """The client disconnected before its answer: nothing is left to send it."""
