"""The FastAPI app: OpenAI's routes over a ``GenerationFleet``.

    GET  /v1/models               the one model the fleet serves
    POST /v1/completions          prompt(s): a string, strings, token ids, lists of token ids
    POST /v1/chat/completions     messages, rendered with the tokenizer's chat template by the fleet
    GET  /health                  200 while a shard serves, else 503
    GET  /metrics                 Prometheus text: fleet series, per-shard vLLM series, HTTP series (no call to a shard)
    POST /nemo_gen/refit          only with server.allow_refit: a checkpoint directory -> fleet.refit

Every request goes through ``fleet.generate_async`` — the fleet's router — so the health ledger,
re-routing of a lost shard's requests and the weight-version rules hold as they do for library
callers. Every response carries the header ``x-nemo-gen-weight-version`` (the version that
produced it; elsewhere the fleet's current one) and, for generations, ``x-nemo-gen-shard``; every
body a ``nemo_gen`` object. The session (shard affinity) is the ``x-session-id`` header, else the
body's ``session_id`` (vLLM's field), else ``user``.

Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 naming the
bad field, 401 for a missing or wrong key (``server.api_key``), 404 for another model or route,
413 for a body over ``server.max_body_bytes``, 503 while no shard serves, 503 with
``Retry-After`` for load (``server.max_in_flight`` reached, ``FleetBusy``), 504 when the request's
deadline passes (``timeout_s`` in the body or the ``x-nemo-gen-timeout-s`` header, else
``fleet.request_timeout_s``), 500 otherwise — the message says what failed, never a stack trace
(that goes to the log).

The event loop stays free for every request (``/health`` among them): bodies are read against
their bound and large ones parsed off the loop, prompts are tokenized and chat templates rendered
off it (``Router.requests_async``), and responses are built off it. A client that disconnects
before its answer is sent cancels its requests on their engines (as vLLM's ``with_cancellation``
does), streamed or not.

Streaming (``stream: true``) is real token streaming through ``fleet.generate_stream`` (engine ->
shard actor's Ray streaming generator -> router): chunks leave as the engine makes tokens
(``protocol.StreamFormat``). The response begins once every prompt of the request has its first
token, so until then a failure is an ordinary error response with its status (400, 503...) and
the headers carry the version and shard of those first tokens; a shard lost before its first
token is re-routed by the router, unseen. Once the stream has begun, a failure — a shard lost
mid-stream — ends it with an error event (``data: {"error": ...}``, which the openai client raises
as ``APIError``) naming the shard, then ``[DONE]``: never a silent truncation. A client that
disconnects cancels its requests on their shards.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import secrets
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelList
from vllm.entrypoints.serve.utils.api_utils import listen_for_disconnect
from vllm.utils import random_uuid

from nemo_gen.core.attempts import Admission
from nemo_gen.core.fleet_health import SERVING_STATES
from nemo_gen.core.manifest import RefitError
from nemo_gen.core.results import Delta
from nemo_gen.errors import (DataError, FleetBusy, InfraError, NemoGenError, RequestError, RequestTimeout,
                             ShardDiedError, ShardRetired, StaleShard)
from nemo_gen.server import protocol
from nemo_gen.server.metrics import ServerMetrics
from nemo_gen.server.protocol import ApiError, Call

log = logging.getLogger(__name__)

VERSION_HEADER = "x-nemo-gen-weight-version"
SHARD_HEADER = "x-nemo-gen-shard"
SESSION_HEADER = "x-session-id"
TIMEOUT_HEADER = "x-nemo-gen-timeout-s"
# Bodies up to this size are parsed on the loop (a few ms at most); larger ones off it.
_PARSE_ON_LOOP_BYTES = 64 * 1024
# Open without a key: a load balancer's health check and a Prometheus scraper.
OPEN_PATHS = ("/health", "/metrics")


def _version_text(version: int | None) -> str:
    return "none" if version is None else str(version)


class FleetApi:
    """The routes' logic over one fleet (duck-typed: ``generate_async``, ``weight_version``,
    ``health``, ``settings``, ``refit``; ``metrics`` / ``monitor.vllm_stats`` when the fleet has them:
    ``nemo_gen.server.metrics``)."""

    def __init__(self, fleet: Any, settings: Any, tokenizer: Any):
        self.fleet = fleet
        self.settings = settings
        self.model = settings.model_name()
        self.model_aliases = {self.model, str(settings.model_dir())}
        self.detok = protocol.Detokenizer(tokenizer)
        params = inspect.signature(fleet.generate_async).parameters
        self._sessions = "session_id" in params  # the fleet routes sessions (issue 12, item 3)
        server = settings.server
        self.inflight = Admission(server.max_in_flight, server.retry_after_s, setting="server.max_in_flight",
                                  holder="the server")
        self.max_prompt_chars = server.max_prompt_chars
        resolved = getattr(fleet, "resolved", None)
        self.max_model_len = getattr(resolved, "max_model_len", None) or settings.generation.vllm_cfg.max_model_len

    # -- generation -----------------------------------------------------------------------------

    def _check_model(self, body: Any) -> None:
        name = body.get("model") if isinstance(body, dict) else None
        if name not in (None, "") and name not in self.model_aliases:
            raise ApiError(404, f"model: the model {name!r} does not exist; this server serves {self.model!r}", "model")

    def _kwargs(self, call: Call) -> dict[str, Any]:
        kwargs = dict(call.sampling)
        if call.session_id is not None and self._sessions:
            kwargs["session_id"] = call.session_id
        if call.timeout_s is not None:
            kwargs["timeout_s"] = call.timeout_s
        return kwargs

    def _check(self, call: Call, prompt_field: str) -> None:
        """What is refused before any work, as vLLM's server refuses it: a prompt over
        ``server.max_prompt_chars`` (before tokenizing it), ``max_tokens`` past the context, and
        a request asking for more samples than ``server.max_in_flight`` could ever hold."""
        for prompt in call.prompts:
            chars = _chars(prompt)
            if chars > self.max_prompt_chars:
                raise protocol.bad(f"{prompt_field}: the prompt has {chars} characters, more than "
                                   f"server.max_prompt_chars={self.max_prompt_chars}", prompt_field)
        max_new = call.sampling.get("max_new_tokens")
        if max_new is not None and self.max_model_len and max_new > self.max_model_len:
            param = "max_completion_tokens" if "max_completion_tokens" in call.sent else "max_tokens"
            raise protocol.bad(f"{param}={max_new} cannot be greater than max_model_len={self.max_model_len}. "
                               "Please request fewer output tokens.", param)
        if call.samples > (self.inflight.limit or call.samples):
            raise protocol.bad(f"n: {len(call.prompts)} prompt(s) x n={call.n} is {call.samples} samples, more than "
                               f"this server ever holds at once (server.max_in_flight={self.inflight.limit})", "n")

    async def _one(self, call: Call, prompt: Any, prompt_field: str) -> Any:
        try:
            result = await self.fleet.generate_async(prompt, **self._kwargs(call))
        except RequestError as exc:
            raise protocol.request_error(str(exc), call, prompt_field) from None
        return _checked(result, call, prompt_field)

    async def generate(self, call: Call, prompt_field: str) -> list[Any]:
        with self.inflight.admitted(call.samples):
            tasks = [asyncio.ensure_future(self._one(call, p, prompt_field)) for p in call.prompts]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)  # each has aborted its request
                raise

    async def completions(self, body: Any, session: str | None, timeout: str | None = None) -> Response:
        self.inflight.check_room()
        self._check_model(body)
        call = protocol.parse_completion(body, session, timeout)
        self._check(call, "prompt")
        response_id = call.request_id or f"cmpl-{random_uuid()}"
        if call.stream:
            return await self._stream(call, "prompt", protocol.StreamFormat(call, self.model, self.detok, response_id,
                                                                            chat=False))
        results = await self.generate(call, "prompt")
        body = await asyncio.to_thread(protocol.completion_response, call, self.model, results, self.detok,
                                       response_id)
        return _answer(results, body)

    async def chat(self, body: Any, session: str | None, timeout: str | None = None) -> Response:
        self.inflight.check_room()
        self._check_model(body)
        call = protocol.parse_chat(body, session, timeout)
        self._check(call, "messages")
        response_id = call.request_id or f"chatcmpl-{random_uuid()}"
        if call.stream:
            return await self._stream(call, "messages", protocol.StreamFormat(call, self.model, self.detok, response_id,
                                                                              chat=True))
        results = await self.generate(call, "messages")
        body = await asyncio.to_thread(protocol.chat_response, call, self.model, results, self.detok, response_id)
        return _answer(results, body)

    async def _stream(self, call: Call, prompt_field: str, fmt: protocol.StreamFormat) -> Response:
        """Every prompt's ``fleet.generate_stream`` at once; the response starts when each has its
        first token (until then a failure is an error response), then relays what comes. The
        request holds its place in ``server.max_in_flight`` until the stream ends."""
        self.inflight.admit(call.samples)
        relay = _Relay(self.fleet, call, self._kwargs(call), prompt_field,
                       on_close=lambda: self.inflight.release(call.samples))
        try:
            firsts = await relay.first_events()
        except BaseException:
            await relay.close()
            raise
        versions = [v for v in (_first_version(e) for _, e in firsts) if v is not None]
        shards = {e.shard for _, e in firsts}
        headers = {VERSION_HEADER: _version_text(min(versions) if versions else None), "cache-control": "no-cache"}
        if len(shards) == 1 and None not in shards:
            headers[SHARD_HEADER] = str(next(iter(shards)))
        return StreamingResponse(relay.events(fmt, firsts), media_type="text/event-stream", headers=headers)

    # -- the rest -------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.model, root=str(self.settings.model_dir()), owned_by="nemo-gen",
                         max_model_len=self.settings.generation.vllm_cfg.max_model_len)
        return {**ModelList(data=[card]).model_dump(exclude_none=True), "nemo_gen": self._current()}

    def _current(self) -> dict[str, Any]:
        return {"weight_version": self.fleet.weight_version, "shard": None}

    def health(self) -> tuple[int, dict[str, Any]]:
        counts = {str(state.value): n for state, n in self.fleet.health.counts_by_state().items() if n}
        serving = sum(n for state, n in self.fleet.health.counts_by_state().items() if state in SERVING_STATES)
        version = self.fleet.weight_version
        body = {"status": "ok", "serving_shards": serving, "shards": counts, "nemo_gen": self._current()}
        if getattr(self.fleet, "closed", False):
            return 503, ApiError(503, "the fleet is shut down").body() | {"nemo_gen": self._current()}
        if serving == 0 or version is None:
            why = "no shard is serving" if serving == 0 else "no weights yet (fleet.mode=train, not refit)"
            return 503, ApiError(503, f"{why}; shards: {counts}").body() | {"nemo_gen": self._current()}
        return 200, body

    async def refit(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or not isinstance(body.get("checkpoint"), str) or not body["checkpoint"]:
            raise protocol.bad("checkpoint: a checkpoint directory (a string) is required", "checkpoint")
        unknown = sorted(set(body) - {"checkpoint", "version", "in_flight"})
        if unknown:
            raise protocol.bad(f"{unknown[0]}: unknown field", unknown[0])
        version = body.get("version")
        if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
            raise protocol.bad("version: an integer or null", "version")
        kwargs: dict[str, Any] = {"version": version}
        if body.get("in_flight") is not None:
            kwargs["in_flight"] = body["in_flight"]
        try:
            report = await asyncio.to_thread(self.fleet.refit, body["checkpoint"], **kwargs)
        except (RefitError, DataError, ValueError) as exc:
            param = "in_flight" if "in_flight" in str(exc) else "version" if "version" in str(exc) else "checkpoint"
            raise protocol.bad(str(exc), param) from None
        return {**report.to_json(), "nemo_gen": self._current()}


def _chars(prompt: Any) -> int:
    """A prompt's characters: a string's, or a chat's messages' content together (token ids: 0)."""
    if isinstance(prompt, str):
        return len(prompt)
    if prompt and isinstance(prompt[0], dict):
        return sum(len(m.get("content") or "") for m in prompt)
    return 0


def _checked(result: Any, call: Call, prompt_field: str) -> Any:
    """A finished result, or the ApiError its error is (400 for the request's own fault, 504 past
    its deadline)."""
    if result.error:
        if result.error.startswith("RequestError") or result.error.startswith("ValueError"):
            raise protocol.request_error(result.error, call, prompt_field)
        if result.error.startswith("RequestTimeout"):
            raise ApiError(504, result.error)
        raise ApiError(500, f"generation failed on shard {result.shard}: {result.error}")
    return result


def _answer(results: list[Any], body: Any) -> Response:
    prov = protocol.provenance(results)
    headers = {VERSION_HEADER: _version_text(prov["weight_version"])}
    if prov["shard"] is not None:
        headers[SHARD_HEADER] = str(prov["shard"])
    return Response(body.model_dump_json(exclude_none=True), media_type="application/json", headers=headers)


def _first_version(event: Any) -> int | None:
    spans = event.weight_versions
    return spans[0][0] if spans else getattr(event, "weight_version", None)


class _Relay:
    """One streamed request's prompts, each ``fleet.generate_stream`` pumped by a task into one
    queue as (prompt, event): a ``Delta``, the finished result, or what the stream raised."""

    def __init__(self, fleet: Any, call: Call, kwargs: dict[str, Any], prompt_field: str,
                 on_close: Callable[[], None] | None = None):
        self.call, self.prompt_field = call, prompt_field
        self.queue: asyncio.Queue = asyncio.Queue()
        self._on_close = on_close
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
        return event if isinstance(event, Delta) else _checked(event, self.call, self.prompt_field)

    async def first_events(self) -> list[tuple[int, Any]]:
        """Everything up to each prompt's first delta (or its result); raises what failed first."""
        seen: set[int] = set()
        events = []
        while len(seen) < len(self.tasks):
            i, event = await self.queue.get()
            events.append((i, self._check(event)))
            seen.add(i)
        return events

    async def events(self, fmt: protocol.StreamFormat, firsts: list[tuple[int, Any]]) -> AsyncIterator[str]:
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
                    yield fmt.delta(i, event)
                else:
                    results[i] = event
            for chunk in fmt.end([results[i] for i in range(len(self.tasks))]):
                yield chunk
        except Exception as exc:  # the response has started: an event is the only way left to say so
            yield _stream_error(exc, shards)
            yield protocol.sse("[DONE]")
        finally:
            await self.close()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def _stream_error(exc: BaseException, shards: dict[int, int | None]) -> str:
    """The error event that ends a stream which had begun, naming the shard."""
    shard = exc.shard if isinstance(exc, ShardDiedError) else next(iter(set(shards.values())), None)
    if isinstance(exc, ShardDiedError):
        log.warning("a stream broke off: %s", exc)
        error = ApiError(503, f"the stream broke off: {exc}")
    else:
        log.error("a stream from shard %s failed after it began: %s: %s", shard, type(exc).__name__, exc)
        error = error_for(exc)
        error = ApiError(error.status, f"the stream from shard {shard} failed: {error.message}", error.param)
    return protocol.sse(error.body() | {"nemo_gen": {"shard": shard}})


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
    if isinstance(exc, FleetBusy):
        return ApiError(503, f"FleetBusy: {exc}", retry_after_s=int(round(exc.retry_after_s)))
    if isinstance(exc, (InfraError, ShardRetired, StaleShard)):
        return ApiError(503, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, NemoGenError):
        return ApiError(503, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, TimeoutError):
        return ApiError(504, f"TimeoutError: {exc}")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def _error_response(error: ApiError, version: int | None) -> JSONResponse:
    headers = {VERSION_HEADER: _version_text(version)}
    if error.retry_after_s is not None:
        headers["retry-after"] = str(error.retry_after_s)
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
                    headers.append((VERSION_HEADER.encode(), _version_text(self.version()).encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            if self.key is not None and scope.get("method") != "OPTIONS" and path not in OPEN_PATHS \
                    and not self._authorized(scope):
                error = ApiError(401, "a valid API key is required: Authorization: Bearer <server.api_key>")
                await _error_response(error, self.version())(scope, receive, send_with_header)
                return
            await self.app(scope, receive, send_with_header)
        finally:
            self.metrics.observe(route, status["code"], time.perf_counter() - started)


async def _json(request: Request, max_bytes: int) -> Any:
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


async def _cancelled_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
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
    raise _ClientGone()


class _ClientGone(Exception):
    """The client disconnected before its answer: nothing is left to send it."""


def build_app(fleet: Any, settings: Any, tokenizer: Any) -> Any:
    """The ASGI app (FastAPI inside ``Gate``) serving ``fleet``."""
    api = FleetApi(fleet, settings, tokenizer)
    metrics = ServerMetrics(fleet)
    app = FastAPI(title="nemo-gen", docs_url=None, redoc_url=None, openapi_url=None)
    version = lambda: fleet.weight_version  # noqa: E731

    def route(fn: Callable[..., Awaitable[Any]]):
        async def handler(request: Request) -> Response:
            try:
                out = await fn(request)
            except _ClientGone:
                log.info("%s %s: the client disconnected; its requests were cancelled", request.method, request.url.path)
                return Response(status_code=499)  # never sent: the client is gone
            except Exception as exc:
                error = error_for(exc)
                if error.status >= 500 and not isinstance(exc, (ApiError, NemoGenError, TimeoutError)):
                    log.exception("%s %s failed", request.method, request.url.path)
                return _error_response(error, version())
            return out if isinstance(out, Response) else JSONResponse(out)
        handler.__name__ = fn.__name__
        return handler

    def session(request: Request) -> str | None:
        return request.headers.get(SESSION_HEADER) or None

    max_bytes = settings.server.max_body_bytes

    async def completions(request: Request):
        api.inflight.check_room()  # full: refused before the body is even read
        body = await _json(request, max_bytes)
        return await _cancelled_on_disconnect(
            request, api.completions(body, session(request), request.headers.get(TIMEOUT_HEADER)))

    async def chat(request: Request):
        api.inflight.check_room()
        body = await _json(request, max_bytes)
        return await _cancelled_on_disconnect(
            request, api.chat(body, session(request), request.headers.get(TIMEOUT_HEADER)))

    async def models(request: Request):
        return api.models()

    async def health(request: Request):
        code, body = api.health()
        return JSONResponse(body, status_code=code)

    async def prometheus(request: Request):
        text = await asyncio.to_thread(metrics.render)
        return Response(text, media_type=metrics.CONTENT_TYPE)

    async def refit(request: Request):
        return await api.refit(await _json(request, max_bytes))

    app.add_route("/v1/completions", route(completions), methods=["POST"])
    app.add_route("/v1/chat/completions", route(chat), methods=["POST"])
    app.add_route("/v1/models", route(models), methods=["GET"])
    app.add_route("/health", route(health), methods=["GET"])
    app.add_route("/metrics", route(prometheus), methods=["GET"])
    if settings.server.allow_refit:
        app.add_route("/nemo_gen/refit", route(refit), methods=["POST"])

    async def not_found(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        error = ApiError(exc.status_code, what.get(exc.status_code, str(exc.detail)))
        return _error_response(error, version())

    app.add_exception_handler(StarletteHTTPException, not_found)
    key = settings.server.api_key.get_secret_value() if settings.server.api_key else None
    return Gate(app, key, version, metrics)
